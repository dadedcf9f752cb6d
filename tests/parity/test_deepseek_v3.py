"""DeepSeek-V3 and GLM-4.7-Flash (``glm4_moe_lite``) equal transformers 5.23: per-token logprobs
(fp32), the experts the ``noaux_tc`` router picks, LoRA logprobs and gradients against PEFT, the
module layout of the released configs, and checkpoints with MTP layers."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.common import TINY_DEEPSEEK_V3, TINY_GLM4_MOE_LITE, TINY_MLA
from ember.core.adapters import LoraConfig
from ember.core.batch import pack
from ember.core.config import config_from_hf
from ember.core.layers.attention import PackedAttention
from ember.core.loading import build_empty, load_model
from ember.core.models.base import ForwardContext, RoutingRecord
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput
from tests.lora_helpers import peft_grads_as_ember, peft_model_like, randomise
from tests.parity.test_families import ember_logprobs, hf_logprobs
from tests.tiny_models import random_sequences

BASE = {**TINY_MLA, "initializer_range": 0.2}

CASES = {
    # YaRN with mscale != mscale_all_dim (cos/sin factor and softmax scale), q latent, 4 groups of
    # which 2 are kept, two shared experts
    "deepseek_yarn": ("deepseek_v3", TINY_DEEPSEEK_V3),
    # no q latent (q_proj), rope without interleave, unnormalised top-k weights
    "deepseek_plain": (
        "deepseek_v3",
        {
            "q_lora_rank": None,
            "rope_interleave": False,
            "n_group": 2,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.5,
        },
    ),
    # GLM-4.7-Flash: dense layers from mlp_layer_types, one group, theta 1e6
    "glm4_moe_lite": ("glm4_moe_lite", TINY_GLM4_MOE_LITE),
}


def build_hf(family: str, seed: int = 0, **overrides):
    """A random tiny transformers model; norms and the router's correction bias randomised too."""
    import transformers as tf

    torch.manual_seed(seed)
    cls = {"deepseek_v3": tf.DeepseekV3Config, "glm4_moe_lite": tf.Glm4MoeLiteConfig}[family]
    cfg = cls(**{**BASE, **overrides})
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.5 * torch.randn(cfg.n_routed_experts))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (transformers model, saved folder)."""
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for case, (family, kw) in CASES.items():
        hf = build_hf(family, **kw)
        hf.save_pretrained(str(root / case))
        out[case] = (hf, root / case)
    return out


SEQ_LENS = [17, 70, 5, 40]


@pytest.mark.parametrize("case", CASES)
def test_logprobs_match_transformers(case, models):
    hf, path = models[case]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    seqs = random_sequences(hf.config.vocab_size, SEQ_LENS, seed=1)
    for s, got in zip(seqs, ember_logprobs(worker, seqs)):
        ref = hf_logprobs(hf, s)
        assert ref.std() > 0.1
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)


def _hf_routing(hf, seqs):
    """Per MoE layer: the experts transformers' router picks ([T, k], sequences concatenated) and
    the plain top-k of the sigmoid scores (no bias, no groups)."""
    picked, plain, hooks = {}, {}, []
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):

            def hook(mod, args, out, i=i):
                logits, _, idx = out
                picked.setdefault(i, []).append(idx)
                plain.setdefault(i, []).append(logits.sigmoid().topk(mod.top_k, dim=-1)[1])

            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        for s in seqs:
            hf(torch.tensor([s]))
    for h in hooks:
        h.remove()
    return {i: torch.cat(v) for i, v in picked.items()}, {i: torch.cat(v) for i, v in plain.items()}


@pytest.mark.parametrize("case", CASES)
def test_router_picks_the_experts_transformers_picks(case, models):
    hf, path = models[case]
    model = load_model(path, "cpu", torch.float32)
    seqs = random_sequences(hf.config.vocab_size, SEQ_LENS, seed=2)
    batch = pack(seqs, [0] * len(seqs), "cpu")
    attn = PackedAttention(batch.doc_lengths, torch.device("cpu"))
    record = RoutingRecord(record={})
    ctx = ForwardContext(
        batch.positions, lambda i, q, k, v, s, sc: attn(q, k, v, s, sc), seq_lens=batch.doc_lengths, routing=record
    )
    with torch.no_grad():
        model.hidden_states(batch.input_ids, ctx)
    picked, plain = _hf_routing(hf, seqs)
    assert sorted(record.record) == sorted(picked)
    for layer, ref in picked.items():
        assert torch.equal(record.record[layer].sort(-1)[0], ref.sort(-1)[0]), layer
        # the check is meaningful: the correction bias (and group limit) change the choice
        assert not torch.equal(plain[layer].sort(-1)[0], ref.sort(-1)[0])


def peft_lora_check(hf, path, monkeypatch, rank: int = 4, seed: int = 5) -> dict[str, float]:
    """Train-step logprobs and LoRA gradients of Ember vs a PEFT model with the same factors;
    returns each factor's relative gradient error."""
    # PEFT reads the names gate_proj/up_proj/down_proj of an MoE model_type as transformers-4
    # per-expert targets and rewrites them onto the fused experts; the dense and shared-expert
    # MLPs named so would lose their adapters. Build the reference exactly as configured instead.
    monkeypatch.setattr(
        "peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers", lambda *a, **k: None
    )
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=rank, alpha=8.0, seed=seed))
    adapter = worker.adapter(slot)
    randomise(adapter, seed=11)
    peft = peft_model_like(copy.deepcopy(hf), adapter)
    seqs = random_sequences(hf.config.vocab_size, [12, 31, 7], seed=3)
    g = torch.Generator().manual_seed(7)
    weights = [torch.rand(len(s) - 1, generator=g) for s in seqs]
    datums = [
        Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:]), "weights": w.numpy()}) for s, w in zip(seqs, weights)
    ]
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "cross_entropy")])
    loss_ref = 0.0
    for s, w, lp in zip(seqs, weights, out.logprobs):
        logits = peft(torch.tensor([s[:-1]])).logits[0]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.from_numpy(lp), ref.detach(), atol=1e-4, rtol=0)
        loss_ref = loss_ref - (w * ref).sum()
    loss_ref.backward()
    ref_grads = peft_grads_as_ember(peft, adapter)
    mine = adapter.grads()
    assert set(ref_grads) == set(mine)
    return {k: float((mine[k] - ref).norm() / ref.norm().clamp_min(1e-12)) for k, ref in ref_grads.items()}


@pytest.mark.parametrize("case", CASES)
def test_lora_logprobs_and_gradients_match_peft(case, models, monkeypatch):
    hf, path = models[case]
    errors = peft_lora_check(hf, path, monkeypatch)
    names = set(errors)
    # every kind of target is adapted: MLA projections, dense MLP, shared and routed experts, head
    q = ("q_a_proj", "q_b_proj") if hf.config.q_lora_rank is not None else ("self_attn.q_proj",)
    for part in (
        *q,
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "shared_experts.gate_proj",
        "experts.gate_up_proj",
        "experts.down_proj",
        "lm_head",
    ):
        assert any(part in n for n in names), part
    assert any(".mlp.gate_proj" in n for n in names)  # the dense layer
    assert not any(".gate." in n or "correction_bias" in n for n in names)  # router frozen
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])


def test_mtp_layers_are_ignored_and_router_bias_stays_fp32(models, tmp_path):
    hf, path = models["deepseek_yarn"]
    folder = tmp_path / "with_mtp"
    folder.mkdir()
    (folder / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    n = hf.config.num_hidden_layers
    # an MTP layer as released checkpoints store it: index num_hidden_layers, per-expert weights
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    tensors[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.randn(4 * 28, 24)
    for e in range(8):
        for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            tensors[f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    model = load_model(folder, "cpu", torch.bfloat16)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16

    worker = Worker.from_pretrained(folder, "cpu", torch.float32)
    seqs = random_sequences(hf.config.vocab_size, [23], seed=4)
    torch.testing.assert_close(ember_logprobs(worker, seqs)[0].double(), hf_logprobs(hf, seqs[0]), atol=1e-4, rtol=0)


RELEASED = {
    # DeepSeek-V3's released config.json keys (legacy rope_scaling, YaRN ×40)
    "deepseek_v3": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "rope_theta": 10000,
        "max_position_embeddings": 163840,
    },
    # transformers' Glm4MoeLiteConfig defaults are GLM-4.7-Flash's shape (spec §4.1 table)
    "glm4_moe_lite": {},
}


@pytest.mark.parametrize("family", RELEASED)
def test_released_configs_build_transformers_layout(family):
    """Full-size configs (on the meta device): Ember's parameters are transformers' state dict,
    name for name and shape for shape, and the MoE settings map as the released models use them."""
    import transformers as tf

    cls = {"deepseek_v3": tf.DeepseekV3Config, "glm4_moe_lite": tf.Glm4MoeLiteConfig}[family]
    hf_cfg = cls(**RELEASED[family])
    with torch.device("meta"):
        hf = tf.AutoModelForCausalLM.from_config(hf_cfg)
    ref = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    raw = json.loads(hf_cfg.to_json_string())
    cfg = config_from_hf(raw)
    ours = {k: tuple(v.shape) for k, v in build_empty(cfg).named_parameters()}
    assert ours == ref
    moe = cfg.moe
    assert moe.scoring == "sigmoid"
    if family == "deepseek_v3":
        assert (moe.num_experts, moe.top_k, moe.routed_scaling_factor) == (256, 8, 2.5)
        assert moe.dense_layers == frozenset({0, 1, 2})
    else:
        assert (moe.num_experts, moe.top_k, moe.routed_scaling_factor) == (64, 4, 1.8)
        assert moe.dense_layers == frozenset({0})
    assert moe.shared_intermediate_size == moe.intermediate_size


# PEFT warns that the patterns match no *module*; they do match the expert parameters (shapes below)
@pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match")
def test_normalize_moe_lora_matches_peft_rank_pattern(models, monkeypatch):
    """``normalize_moe_lora``: routed experts get rank r/top_k and scale alpha/(r/top_k) (spec §3.9).
    Reference: PEFT with ``rank_pattern`` giving the experts rank r/top_k (its scale is then
    lora_alpha / that rank)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    from ember.core.peft_format import adapter_to_peft

    monkeypatch.setattr(
        "peft.utils.transformers_weight_conversion.convert_peft_config_for_transformers", lambda *a, **k: None
    )
    hf, path = models["deepseek_yarn"]  # top-k 3
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    with pytest.raises(ValueError, match="rank 4 must be a multiple of the router top-k 3"):
        worker.create_adapter(LoraConfig(rank=4, normalize_moe_lora=True))
    slot = worker.create_adapter(LoraConfig(rank=6, alpha=8.0, seed=5, normalize_moe_lora=True))
    adapter = worker.adapter(slot)
    assert adapter.weights["model.layers.1.mlp.experts.gate_up_proj"].A.shape == (8, 2, 64)
    assert adapter.weights["model.layers.1.mlp.shared_experts.gate_proj"].A.shape == (6, 64)
    assert adapter.weights["model.layers.1.self_attn.q_b_proj"].A.shape == (6, 32)
    randomise(adapter, seed=11)

    tensors, cfg = adapter_to_peft(adapter, "peft")
    peft_cfg = PeftLoraConfig(
        r=6,
        lora_alpha=8.0,
        target_modules=cfg["target_modules"],
        target_parameters=cfg["target_parameters"],
        rank_pattern={r"mlp\.experts\.gate_up_proj": 2, r"mlp\.experts\.down_proj": 2},
        lora_dropout=0.0,
    )
    peft = get_peft_model(copy.deepcopy(hf), peft_cfg)
    assert not set_peft_model_state_dict(peft, tensors).unexpected_keys
    assert peft.base_model.model.model.layers[1].mlp.experts.lora_A["default"].weight.shape == (8 * 2, 32)

    seqs = random_sequences(hf.config.vocab_size, [12, 31], seed=3)
    datums = [Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:])}) for s in seqs]
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "cross_entropy")])
    loss_ref = 0.0
    for s, lp in zip(seqs, out.logprobs):
        logits = peft(torch.tensor([s[:-1]])).logits[0]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.from_numpy(lp), ref.detach(), atol=1e-4, rtol=0)
        loss_ref = loss_ref - ref.sum()
    loss_ref.backward()

    # compare gradients in PEFT's layout: our gradients written out as an adapter would be
    grads_as_adapter = copy.copy(adapter)
    grads_as_adapter.weights = adapter._views(adapter.flat.grad)
    mine, _ = adapter_to_peft(grads_as_adapter, "peft")
    theirs = {n: p.grad for n, p in peft.named_parameters() if p.grad is not None}
    assert len(theirs) == len(mine)
    for key, g in mine.items():
        ref = theirs[key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")]
        err = float((g - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < 1e-4, (key, err)


# -- decoding through the sampler's paged KV cache ------------------------------------------------


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (its own KV cache), no EOS stop."""
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id = None
    gc.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=gc, max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def check_decoding(hf, path, prompt_lens: list[int], new_tokens: int) -> None:
    """Greedy decoding through the sampler's paged KV cache equals transformers' generate; sampled
    tokens' logprobs (with a LoRA adapter) equal the trainer's full-sequence logprobs."""
    from ember.core.sampling import SamplerConfig
    from ember.types import SampleInput, SamplingParams

    worker = Worker.from_pretrained(
        path, "cpu", torch.float32, sampler_config=SamplerConfig(max_seqs=4, page_size=4, kv_tokens=512)
    )
    vocab = hf.config.vocab_size
    prompts = random_sequences(vocab, prompt_lens, seed=7)
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, stop=[])
    outs = worker.sample([SampleInput(0, np.array(p), greedy) for p in prompts])
    for p, out in zip(prompts, outs):
        assert out.sequences[0].tokens.tolist() == hf_greedy(hf, p, new_tokens)

    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=2))
    randomise(worker.adapter(slot), seed=3, scale=0.1)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=4, stop=[])
    (out,) = worker.sample([SampleInput(slot, np.array(prompts[0]), params, num_samples=2)])
    for seq in out.sequences:
        full = prompts[0] + seq.tokens.tolist()
        datum = Datum(np.array(full[:-1]), {"target_tokens": np.array(full[1:])})
        (ref,) = worker.forward_backward([ForwardBackwardInput(slot, [datum], "cross_entropy", forward_only=True)])
        np.testing.assert_allclose(seq.logprobs, ref.logprobs[0][len(prompts[0]) - 1 :], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["deepseek_yarn", "glm4_moe_lite"])
def test_decoding_matches_transformers_and_trainer(case, models):
    hf, path = models[case]
    check_decoding(hf, path, [6, 1], 8)
