"""Expert parallelism on gloo (2 and 4 CPU processes) equals one process (fp32, 1e-5)."""

import pytest

from tests.parallel import ep_cases
from tests.parallel.launch import run
from tests.tiny_models import build_hf_model, save_hf_model


def test_qwen3_moe_ep2(qwen3_moe_dir):
    run(2, ep_cases.expert_parallel_step, qwen3_moe_dir, 2)


def test_qwen3_moe_ep2_replayed_routes_leave_a_rank_without_rows(qwen3_moe_dir):
    run(2, ep_cases.expert_parallel_step, qwen3_moe_dir, 2, True)


def test_qwen3_moe_ep2_over_four_ranks(qwen3_moe_dir):
    """Two expert groups of two ranks: expert gradients are also summed over the ranks that hold
    the same experts."""
    run(4, ep_cases.expert_parallel_step, qwen3_moe_dir, 2)


def test_qwen3_moe_ep2_expert_fsdp(qwen3_moe_dir, tmp_path):
    """``--expert-fsdp`` at EP=2 over four ranks: each pair of ranks that holds the same experts
    keeps half of their block each (FSDP2), gathered for each MoE layer's forward and backward and
    freed after them, and once for a sampling run; the same logprobs, gradients, step and dispatch
    modes as one process, also through the engine's worker. Then the general hook on a trainable
    module: its gradients are the sums over the group."""
    run(4, ep_cases.expert_fsdp_step, qwen3_moe_dir, str(tmp_path), 2)


def _saved(hf, tmp_path_factory, name):
    path = tmp_path_factory.mktemp(name) / "m"
    hf.save_pretrained(str(path))
    return str(path)


def _deepseek():
    from tests.parity.test_deepseek_v3 import CASES, build_hf

    family, kw = CASES["deepseek_yarn"]  # shared experts, sigmoid router with groups and bias
    return build_hf(family, **kw)


def _qwen3_next():
    from tests.parity.test_qwen3_next import build_hf

    return build_hf()


def _qwen4_exp():
    from tests.parity.test_qwen4_exp import build_hf

    return build_hf()


def _inkling2():
    from tests.parity.test_inkling2 import build_hf_inkling2

    return build_hf_inkling2()


# Gated DeltaNet's decay gates amplify fp32 rounding: one process's own gradients move by up to
# ~3e-6 (relative L2) when the batch is split differently, and the gate projections
# (``in_proj_ba``) by up to 1.6e-5 under EP=2; the others stay within 1e-5.
@pytest.mark.parametrize(
    "build, grad_rtol",
    [(_deepseek, 1e-5), (_qwen3_next, 3e-5), (_qwen4_exp, 3e-5), (_inkling2, 1e-5)],
    ids=["deepseek_v3", "qwen3_next", "qwen4_exp", "inkling2"],
)
def test_families_ep2(build, grad_rtol, tmp_path_factory):
    path = _saved(build(), tmp_path_factory, build.__name__[1:])
    run(2, ep_cases.expert_parallel_step, path, 2, False, grad_rtol)


def test_sharded_worker_matches_one_process(qwen3_moe_dir, tmp_path):
    """The engine's worker at EP=2: checkpoints loaded by block, a mixed training pass (several
    losses, forward-only requests, a request that fails alone), clipped AdamW, checkpoints written
    whole (weights and Adam moments equal one process's, loadable by one process), seeded sampling."""
    from tests.parallel import worker_cases

    run(2, worker_cases.sharded_worker_matches_one_process, qwen3_moe_dir, str(tmp_path), 2)


@pytest.mark.parametrize(
    "shape, world, ep, rank",
    [("inkling2-small-3l", 32, 32, 3), ("qwen3.8-flash-next-8l-ple", 32, 16, 19), ("qwen3-30b-a3b", 32, 8, 13)],
)
def test_large_layouts_hold_one_ep_th_of_the_experts(shape, world, ep, rank):
    """Inkling2 (384 experts) at EP=32, qwen4_exp (512) at EP=16 over 32 ranks (two ranks hold each
    expert), Qwen3-30B-A3B (128) at EP=8: planned on the meta device with a fake process group.
    qwen4_exp with its released n-gram table (51.2 B parameters at layer 2): each rank holds 1/EP of
    its rows (in host memory), ~6.4 GB in bf16."""
    import json
    import subprocess
    import sys

    from tests.live_server import REPO

    out = subprocess.run([sys.executable, "-m", "tests.parallel.plan_cases", shape, str(world), str(ep), str(rank)],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    got = json.loads(out.strip().splitlines()[-1])
    whole = got["whole"]
    (total,) = {e for _, _, e in whole["expert_blocks"]}
    n = total // ep
    assert got["expert_blocks"] == [[(rank % ep) * n, n, total]]
    assert got["expert_bytes"] * ep == whole["expert_bytes"]
    assert got["lora32_expert_bytes"] * ep == whole["lora32_expert_bytes"]
    assert got["dense_bytes"] == whole["dense_bytes"]  # dense weights are replicated (no TP yet)
    assert got["ngram_bytes"] * ep == whole["ngram_bytes"]
    assert [r * ep for r in got["ngram_rows"]] == whole["ngram_rows"]
    if shape.startswith("qwen3.8"):
        assert whole["ngram_bytes"] > 100e9 and got["ngram_bytes"] < 7e9, whole["ngram_bytes"]


def test_qwen3_tp2(qwen3_dir):
    """Tensor parallelism: heads and MLP width split over two ranks running the same sequences."""
    run(2, ep_cases.expert_parallel_step, qwen3_dir, 1, False, 1e-5, 2)


def test_qwen3_tp2_static_decode(qwen3_dir):
    """The static (CUDA-graph) decoder under tensor parallelism: the split projections' collectives
    run in its step, the LM head's vocabulary parts are gathered before the draw."""
    from tests.parallel import worker_cases

    run(2, worker_cases.static_decode_matches_one_process, qwen3_dir, 2)


def test_qwen3_moe_ep2_static_decode(qwen3_moe_dir):
    """The static decoder under expert parallelism: every rank runs the same sequences, each its
    own experts on the rows routed to them (the "replicated" dispatch: static shapes, nothing read
    back, so the step can be captured), an all-reduce sums the shares; expert LoRA of mixed
    adapters included."""
    from tests.parallel import worker_cases

    run(2, worker_cases.static_decode_matches_one_process, qwen3_moe_dir, 1, 2)


def test_qwen3_tp2_dp2(tmp_path_factory):
    """Two TP groups of two ranks running different sequences; the LM head tied to the embedding
    (the embedding stays whole, the head reads this rank's rows of it)."""
    tied = save_hf_model(build_hf_model("qwen3", tie_word_embeddings=True), tmp_path_factory.mktemp("qwen3_tied"))
    run(4, ep_cases.expert_parallel_step, str(tied), 1, False, 1e-5, 2)


def test_qwen3_moe_tp2(qwen3_moe_dir):
    """TP on an MoE model: attention split, experts whole on every rank."""
    run(2, ep_cases.expert_parallel_step, qwen3_moe_dir, 1, False, 1e-5, 2)


def test_sharded_worker_tp2_matches_one_process(qwen3_moe_dir, tmp_path):
    """The same at TP=2 (attention split, experts whole on both ranks)."""
    from tests.parallel import worker_cases

    run(2, worker_cases.sharded_worker_matches_one_process, qwen3_moe_dir, str(tmp_path), 1, 2)


def test_qwen3_moe_ep2_tp2(qwen3_moe_dir):
    """EP borrowing TP: two ranks split the heads and each dispatches half of the tokens."""
    run(2, ep_cases.expert_parallel_step, qwen3_moe_dir, 2, False, 1e-5, 2)


def test_qwen3_moe_ep4_tp2(qwen3_moe_dir):
    """An expert group of two TP groups (four ranks, two experts each), R3 replay included."""
    run(4, ep_cases.expert_parallel_step, qwen3_moe_dir, 4, True, 1e-5, 2)


def _olmo3():
    from tests.parity.test_olmo3 import build_hf

    return build_hf()


def test_olmo3_tp2(tmp_path_factory):
    """Olmo 3 under TP: its RMSNorm over the whole q and k projections sums over the split width."""
    run(2, ep_cases.expert_parallel_step, _saved(_olmo3(), tmp_path_factory, "olmo3"), 1, False, 1e-5, 2)


@pytest.mark.parametrize("case", ["deepseek_plain", "glm4_moe_lite"])
def test_mla_tp2(case, tmp_path_factory):
    """MLA under TP: q_b/kv_b split by heads behind latents computed whole (their output gradient
    summed over the group: every head reads the shared rotary key); shared experts split.
    ``deepseek_plain`` has no query latent (q_proj split like any column-parallel projection);
    GLM-4.7-Flash (``glm4_moe_lite``) has one."""
    from tests.parity.test_deepseek_v3 import CASES, build_hf

    family, kw = CASES[case]
    path = _saved(build_hf(family, **kw), tmp_path_factory, f"{case}_tp")
    run(2, ep_cases.expert_parallel_step, path, 1, False, 1e-5, 2)


def test_qwen3_next_tp2(tmp_path_factory):
    """Qwen3-Next under TP: Gated DeltaNet split by key heads (projections, convolution channels,
    decay parameters), gated attention by heads, shared expert split, routed experts whole.
    Gradients within 1e-4: the decay gates amplify the split products' fp32 rounding (seen: up to
    3.4e-5 on one factor, 2.4e-5 on the global norm; a missing reduction shows as > 1e-1)."""
    run(2, ep_cases.expert_parallel_step, _saved(_qwen3_next(), tmp_path_factory, "qwen3_next_tp"), 1, False, 1e-4, 2)


def test_qwen4_exp_tp2(tmp_path_factory):
    """qwen4_exp under TP: Gated DeltaNet's separate [q | k | v] projection and convolution split in
    three pieces per rank (checkpoints reassemble the pieces), gated attention with the QSA indexer
    (replicated) by heads, the n-gram memory replicated. Gradients within 1e-4 as for Qwen3-Next."""
    run(2, ep_cases.expert_parallel_step, _saved(_qwen4_exp(), tmp_path_factory, "qwen4_tp"), 1, False, 1e-4, 2)


@pytest.fixture(scope="module")
def inkling2_tp_dir(tmp_path_factory):
    """The parity tests' tiny Inkling2 with two KV heads on its sliding-window layers (it has one,
    which TP=2 cannot split): global layers 4 heads / 2 KV heads of 16, sliding ones 4 / 2 of 8."""
    from unittest import mock

    from tests.parity import test_inkling2

    with mock.patch.dict(test_inkling2.TINY, swa_num_key_value_heads=2):
        return _saved(_inkling2(), tmp_path_factory, "inkling2_tp")


def test_inkling2_tp2(inkling2_tp_dir, tmp_path):
    """Inkling2 under TP=2: the relative attention split by heads (q/k/v/gate and o, with the
    relative-state and sink projections, L2-clip scales, K/V short convolutions and the global
    layers' tap projections), the residual-side short convolutions fed the rows before each rank's
    slice, the padded LM head split over its token rows; then the engine's worker, seeded sampling
    included, against one process."""
    run(2, ep_cases.inkling2_tp, inkling2_tp_dir, str(tmp_path), 1)


def test_inkling2_ep2_tp2_over_four_ranks(inkling2_tp_dir, tmp_path):
    """EP=2 × TP=2 over four ranks (two TP groups running different sequences, each rank
    dispatching its own rows to the experts; decode and sampling dispatch modes), then the
    convolutions' history at TP=4."""
    run(4, ep_cases.inkling2_tp, inkling2_tp_dir, str(tmp_path), 2)


def test_inkling2_tp_refuses_heads_it_cannot_split(tmp_path):
    """The parity config's sliding-window layers have one KV head: ``ember serve`` and the sharder
    both refuse TP=2, naming it."""
    import json
    from types import SimpleNamespace

    from ember.cli import _check_layout
    from ember.core.config import load_config
    from ember.core.loading import build_empty
    from ember.dist.mesh import Layout
    from ember.dist.tensor_parallel import shard_linears
    from tests.parity.test_inkling2 import TINY

    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "inkling2_text"}))
    with pytest.raises(ValueError, match="must divide the 1 sliding-window key/value heads of 'ink'"):
        _check_layout({"ink": SimpleNamespace(path=tmp_path)}, 2, 1, 2)
    with pytest.raises(ValueError, match=r"must divide the 1 key/value heads of model\.layers\.1\.self_attn \(a sliding"):
        shard_linears(build_empty(load_config(tmp_path)), SimpleNamespace(layout=Layout(2, 0, tp=2), tp_group=None))


def test_vocab_parallel_logprobs():
    """The chunked logprob pass over a vocabulary split in two (softcap, per-row temperatures, two
    adapters' head LoRA; both backwards) equals the whole head in fp64, and so do a sampler's logits."""
    from tests.parallel import vocab_cases

    run(2, vocab_cases.vocab_parallel_logprobs)
