"""Inkling-2 (text model) against transformers 5.23 and PEFT, on a tiny random config.

The config is chosen so every feature is active: a sliding window (5) and a global relative extent
(12) shorter than the sequences, global layers at 0 and 5 (layer 0 has no attention-residual
query), attention-residual blocks of 3 layers, log-position scaling from position 4, L2 clipping
that bites on some heads, softcaps low enough to bend, a padded vocabulary, and random values for
the parameters transformers initialises to constants (residual queries, clip scales, static taps,
router bias).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from bench.common import TINY_INKLING2
from ember.core.adapters import LoraConfig
from ember.core.batch import pack
from ember.core.config import load_config
from ember.core.layers.relative_attention import (
    PackedRelativeAttention,
    RelativeAttentionSpec,
    relative_attention_dense,
)
from ember.core.loading import load_model
from ember.core.logprobs import token_logprobs
from ember.core.models import ForwardContext
from ember.core.models.base import RoutingRecord
from ember.core.models.inkling2 import Inkling2Dims
from ember.core.peft_format import adapter_to_peft
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput
from tests.lora_helpers import peft_grads_as_ember, randomise
from tests.tiny_models import random_sequences

# the bench shape less tie_word_embeddings, spelled out there for Ember's reader but not a field of
# transformers' Inkling2TextConfig (which would keep it as an extra attribute)
TINY = {k: v for k, v in TINY_INKLING2.items() if k != "tie_word_embeddings"}
TINY["initializer_range"] = 0.2  # logits far from uniform
VOCAB, UNPADDED = TINY["vocab_size"], TINY["unpadded_vocab_size"]  # 320, 300
LAYER_TYPES = TINY["layer_types"]  # global at 0 and 5, sliding-window otherwise


def build_hf_inkling2(seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Inkling2TextConfig(**(TINY | overrides))
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attention_input.query", "mlp_input.query", "final_input.query")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith(".scale"):  # L2-clip scales
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("static_weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def inkling(tmp_path_factory):
    hf = build_hf_inkling2()
    path = tmp_path_factory.mktemp("inkling2") / "m"
    hf.save_pretrained(str(path))
    return hf, path


def hf_logprobs(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    assert logits.shape[-1] == UNPADDED
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def ember_logprobs(worker: Worker, seqs: list[list[int]]) -> list[torch.Tensor]:
    batch = pack([s[:-1] for s in seqs], [0] * len(seqs), "cpu")
    targets = batch.gather([torch.tensor(s[1:]) for s in seqs])[:, None]
    with torch.no_grad():
        lp = worker.logprobs(batch, targets)[:, 0]
    return batch.split(lp)


def test_features_are_exercised(inkling):
    """Guards the meaning of the parity tests: clipping, windows and block boundaries are active."""
    _hf, path = inkling
    model = load_model(path, "cpu", torch.float32)
    dims = model.dims
    assert dims.layer_types == tuple(LAYER_TYPES) and dims.unpadded_vocab == UNPADDED
    assert [layer.is_block_boundary for layer in model.model.layers] == [True, False, False, True, False, False, True]
    assert model.model.layers[0].attention_input is None
    assert model.model.layers[5].attention_input.query.shape == (3, 64)
    # L2 clipping bites on some but not all query heads
    x = model.model.embed_tokens(torch.arange(40))
    attn = model.model.layers[1].self_attn
    q = attn.q_proj(model.model.layers[1].input_layernorm(x), None).view(40, attn.heads, -1) * attn.q_l2_clip.scale
    frac = (q.norm(dim=-1) > dims.qk_clip).float().mean()
    assert 0.1 < frac < 0.9, float(frac)


def test_default_layer_types_follow_transformers():
    import transformers as tf

    cfg = tf.Inkling2TextConfig(num_hidden_layers=13)
    raw = cfg.to_dict()
    hf_types = tuple(raw.pop("layer_types"))
    from ember.core.config import config_from_hf

    assert Inkling2Dims.from_config(config_from_hf(raw)).layer_types == hf_types
    local = {"local_layer_ids": [i for i in range(13) if hf_types[i] == "hybrid_sliding"]}
    assert Inkling2Dims.from_config(config_from_hf({**raw, **local})).layer_types == hf_types


def test_checkpoint_loads_into_transformers_names(inkling):
    """The released layout (interleaved gate/up experts, ``model.llm.*``) maps onto the
    transformers parameters exactly; non-token LM-head rows are kept but never used."""
    hf, path = inkling
    cfg = load_config(path)
    assert cfg.model_type == "inkling2_text" and cfg.vocab_size == UNPADDED  # requests may use real tokens only
    model = load_model(path, "cpu", torch.float32)
    ref = dict(hf.state_dict())
    mine = dict(model.named_parameters())
    assert set(mine) == set(ref), set(mine) ^ set(ref)
    for name, p in mine.items():
        assert torch.equal(p, ref[name]), name
    assert model.unembed_weight.shape == (UNPADDED, 64)


def test_logprobs_match_transformers(inkling):
    """Packed batch of several documents, longer than the window and the relative extent."""
    hf, path = inkling
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    seqs = random_sequences(UNPADDED, [17, 40, 5, 64, 2], seed=1)
    got = ember_logprobs(worker, seqs)
    for s, g in zip(seqs, got):
        ref = hf_logprobs(hf, s)
        assert len(ref) < 3 or ref.std() > 0.1  # not near-uniform
        torch.testing.assert_close(g.double(), ref, atol=1e-4, rtol=0)


def test_bf16_load_is_close(inkling):
    """bf16 weights (fp32 where transformers keeps fp32): as close to the fp32 reference as
    transformers' own bf16 model is (this tiny, sharply routed model amplifies bf16 rounding)."""
    import transformers as tf

    hf, path = inkling
    worker = Worker.from_pretrained(path, "cpu", torch.bfloat16)
    model = worker.model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].post_mlp_convolution.conv1d.weight.dtype == torch.float32
    hf_bf16 = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16).eval()
    seqs = random_sequences(UNPADDED, [30], seed=4)
    ref = hf_logprobs(hf, seqs[0])
    ours = (ember_logprobs(worker, seqs)[0].double() - ref).abs().mean()
    theirs = (hf_logprobs(hf_bf16, seqs[0]) - ref).abs().mean()
    assert ours < 1.5 * theirs + 0.02, (float(ours), float(theirs))


def _peft_like(hf_model, adapter):
    """PEFT over transformers with the adapter's factors; the head's B gets zero rows for the
    padded vocabulary (Ember adapts only the token rows)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model, set_peft_model_state_dict

    tensors, cfg = adapter_to_peft(adapter, "peft")
    key = "base_model.model.lm_head.lora_B.weight"
    if key in tensors:
        b = tensors[key]
        tensors[key] = torch.cat([b, b.new_zeros(VOCAB - b.shape[0], b.shape[1])])
    model = get_peft_model(
        hf_model,
        PeftLoraConfig(
            r=cfg["r"],
            lora_alpha=cfg["lora_alpha"],
            target_modules=cfg["target_modules"],
            target_parameters=cfg.get("target_parameters"),
            lora_dropout=0.0,
        ),
    )
    result = set_peft_model_state_dict(model, tensors)
    assert not result.unexpected_keys, result.unexpected_keys
    return model.eval()


def test_lora_logprobs_and_gradients_match_peft(inkling):
    hf, path = inkling
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=5))
    adapter = worker.adapter(slot)
    randomise(adapter, seed=11)
    names = set(adapter.weights)
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "lm_head", "gate_up_proj", "down_proj"}
    peft = _peft_like(copy.deepcopy(hf), adapter)

    seqs = random_sequences(UNPADDED, [12, 31, 7], seed=3)
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
    assert out.metrics["loss:sum"] == pytest.approx(float(loss_ref.detach()), rel=1e-5)
    loss_ref.backward()

    ref_grads = peft_grads_as_ember(peft, adapter)
    mine = adapter.grads()
    assert set(ref_grads) == set(mine)
    for k, ref in ref_grads.items():
        if k == "lm_head.lora_B":
            assert torch.all(ref[UNPADDED:] == 0)
            ref = ref[:UNPADDED]
        assert mine[k] is not None, k
        err = (mine[k] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err < 1e-4, (k, float(err))


# -- decoding -------------------------------------------------------------------------------------


class DictState:
    """``SequenceState`` keyed by sequence id; rows of sequences without state are zeros."""

    def __init__(self):
        self.store: dict[tuple, torch.Tensor] = {}
        self.seq_ids: list[int] = []

    def get(self, layer, name):
        rows = [self.store.get((layer, name, s)) for s in self.seq_ids]
        if all(r is None for r in rows):
            return None
        ref = next(r for r in rows if r is not None)
        return torch.stack([torch.zeros_like(ref) if r is None else r for r in rows])

    def put(self, layer, name, value):
        assert value.shape[:2] == (len(self.seq_ids), 3)  # the last K - 1 = 3 inputs of each sequence
        for i, s in enumerate(self.seq_ids):
            self.store[(layer, name, s)] = value[i].detach().clone()


class CachedRelativeAttend:
    """A KV cache that keeps every key with its position and recomputes attention exactly."""

    def __init__(self):
        self.cache: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.seq_ids: list[int] = []
        self.seq_lens: list[int] = []
        self.positions = torch.empty(0)

    def __call__(self, *args):
        raise AssertionError("inkling2 must attend through .relative")

    def relative(self, layer, q, k, v, profiles, sinks, spec, scale):
        outs, start = [], 0
        for s, n in zip(self.seq_ids, self.seq_lens):
            rows = slice(start, start + n)
            pos = self.positions[rows]
            if (layer, s) in self.cache:
                K, V, P = self.cache[(layer, s)]
                K, V, P = torch.cat([K, k[rows]]), torch.cat([V, v[rows]]), torch.cat([P, pos])
            else:
                K, V, P = k[rows], v[rows], pos
            self.cache[(layer, s)] = (K, V, P)
            outs.append(relative_attention_dense(q[rows], K, V, profiles[rows], sinks[rows], pos, P, spec, scale))
            start += n
        return torch.cat(outs)


def test_decoding_through_states_matches_training_pass(inkling):
    """Prefill, token-by-token decoding and a sequence joining mid-way, through the conv states and
    a cached attend, give the training pass's logprobs."""
    _hf, path = inkling
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    model = worker.model
    seqs = random_sequences(UNPADDED, [20, 14, 11], seed=6)
    want = ember_logprobs(worker, seqs)

    state, attend = DictState(), CachedRelativeAttend()
    done = [0, 0, 0]
    schedule = [{0: 3, 1: 6}, {0: 1, 1: 1}, {0: 1, 1: 1, 2: 4}] + [{0: 1, 1: 1, 2: 1}] * 16
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    for step in schedule:
        step = {s: min(n, len(seqs[s]) - 1 - done[s]) for s, n in step.items()}
        step = {s: n for s, n in step.items() if n > 0}
        if not step:
            break
        ids = [s for s in step]
        lens = [step[s] for s in ids]
        tokens = torch.tensor([t for s in ids for t in seqs[s][done[s] : done[s] + step[s]]])
        targets = torch.tensor([t for s in ids for t in seqs[s][done[s] + 1 : done[s] + 1 + step[s]]])
        positions = torch.tensor([p for s in ids for p in range(done[s], done[s] + step[s])])
        state.seq_ids, attend.seq_ids, attend.seq_lens, attend.positions = ids, ids, lens, positions
        ctx = ForwardContext(positions=positions, attend=attend, seq_lens=lens, state=state)
        with torch.no_grad():
            h = model.hidden_states(tokens, ctx)
            lp = token_logprobs(h, model.unembed_weight, targets, softcap=model.final_logit_softcap)
        start = 0
        for s, n in zip(ids, lens):
            got[s].append(lp[start : start + n])
            start += n
            done[s] += n
    for s in range(3):
        torch.testing.assert_close(torch.cat(got[s]), want[s], atol=1e-4, rtol=0)


def test_routing_replay_reproduces_routing(inkling):
    _hf, path = inkling
    model = load_model(path, "cpu", torch.float32)
    ids = torch.tensor(random_sequences(UNPADDED, [25], seed=9)[0])
    pos = torch.arange(25)

    def run(routing):
        ctx = ForwardContext(positions=pos, attend=None, seq_lens=[25], routing=routing)
        with torch.no_grad():
            return model.hidden_states(ids, ctx)

    rec = RoutingRecord(record={})
    h = run(rec)
    assert sorted(rec.record) == list(range(len(LAYER_TYPES))) and rec.record[0].shape == (25, 2)
    torch.testing.assert_close(run(RoutingRecord(replay=rec.record)), h, atol=0, rtol=0)
    flipped = {k: v.flip(-1) for k, v in rec.record.items()}
    torch.testing.assert_close(run(RoutingRecord(replay=flipped)), h, atol=1e-5, rtol=0)


# -- FlexAttention vs the eager path ---------------------------------------------------------------


def _random_attention_inputs(seq_lens, hq=4, hkv=2, d=8, r=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(seq_lens)
    q = torch.randn(T, hq, d, generator=g)
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)
    profiles = torch.randn(T, hq, r, generator=g)
    sinks = torch.randn(T, hq, generator=g) * 2
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    return q, k, v, profiles, sinks, positions


def test_eager_packed_attention_matches_a_float64_loop():
    """The packed, query-chunked eager path against a direct per-(doc, head, query) float64 loop."""
    seq_lens = [13, 7, 20]
    q, k, v, profiles, sinks, positions = _random_attention_inputs(seq_lens)
    for spec in (RelativeAttentionSpec(window=5, rel_extent=5), RelativeAttentionSpec(window=None, rel_extent=6)):
        got = PackedRelativeAttention(seq_lens, positions, backend="eager", chunk=4)(
            q, k, v, profiles, sinks, spec, 0.3
        )
        ref = torch.zeros_like(got, dtype=torch.float64)
        start = 0
        for n in seq_lens:
            for i in range(n):
                for h in range(4):
                    js = [j for j in range(i + 1) if spec.window is None or i - j < spec.window]
                    kk = k[start + torch.tensor(js), h // 2].double()
                    bias = torch.tensor(
                        [profiles[start + i, h, i - j].item() if i - j < spec.rel_extent else 0.0 for j in js]
                    ).double()
                    logits = torch.cat(
                        [kk @ q[start + i, h].double() * 0.3 + bias, sinks[start + i, h : h + 1].double()]
                    )
                    p = torch.softmax(logits, 0)[:-1]
                    ref[start + i, h] = p @ v[start + torch.tensor(js), h // 2].double()
            start += n
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seq_lens", [[13, 7, 140, 30], [13, 99, 144]], ids=["padded", "tile-multiple"])
def test_flex_attention_forward_matches_eager_on_cpu(seq_lens):
    """torch 2.13 runs FlexAttention on the CPU only uncompiled and forward-only (no backward,
    compiled CPU kernels return no log-sum-exp): this checks the score_mod, block masks of packed
    documents and windows, GQA and the sink, and the padding of a pass to FlexAttention's
    128-row tile (190 rows padded to 256; 256 rows as they are); bench/inkling_flex_check.py
    checks the compiled CUDA kernels and their gradients."""
    import warnings

    q, k, v, profiles, sinks, positions = _random_attention_inputs(seq_lens, seed=1)
    for spec in (RelativeAttentionSpec(window=5, rel_extent=5), RelativeAttentionSpec(window=None, rel_extent=6)):
        eager = PackedRelativeAttention(seq_lens, positions, backend="eager")(q, k, v, profiles, sinks, spec, 0.3)
        with warnings.catch_warnings():  # "flex_attention called without torch.compile()"
            warnings.simplefilter("ignore")
            flex = PackedRelativeAttention(seq_lens, positions, backend="flex", compiled=False)(
                q, k, v, profiles, sinks, spec, 0.3
            )
        torch.testing.assert_close(flex, eager, atol=1e-5, rtol=0)


def test_flex_attention_compiles_once_for_every_batch_composition(monkeypatch):
    """The flex path's compiled FlexAttention serves every batch composition with one graph:
    dynamic shapes from the first call, and no duck shapes. With them a pass of 16 tiles (2,048
    rows) shared the symbol of the head dimension (16), was specialised with it, and the next
    composition compiled again. Dynamo's own graphs are counted (CPU: no inductor)."""
    import warnings

    from ember.core.layers import relative_attention

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": backend}))
    relative_attention._compiled_flex.cache_clear()
    torch._dynamo.reset()
    spec = RelativeAttentionSpec(window=64, rel_extent=48)
    try:
        for seq_lens in ([256] * 8, [300, 700, 200], [1000, 999]):
            q, k, v, profiles, sinks, positions = _random_attention_inputs(seq_lens, hq=2, hkv=1, d=16, r=48)
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                PackedRelativeAttention(seq_lens, positions, backend="flex")(q, k, v, profiles, sinks, spec, 0.25)
    finally:
        relative_attention._compiled_flex.cache_clear()
        torch._dynamo.reset()
    assert len(graphs) == 1


@pytest.mark.parametrize("chunk", [1 << 24, 1])
def test_document_block_mask_equals_create_block_mask(chunk, monkeypatch):
    """The block mask built from each query's interval of keys is create_block_mask's, index for
    index (partial and full blocks, both directions), for packed documents across block borders,
    lengths that are not a multiple of the block, windows below, at and above the block size;
    computed at once and one query block at a time (as at long context)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ember.core.layers import relative_attention
    from ember.core.layers.relative_attention import document_block_mask, window_mask

    monkeypatch.setattr(relative_attention, "MASK_CHUNK", chunk)

    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    for lens in ([100, 60, 96], [300], [1, 129, 7, 400, 3], [128, 128, 256]):
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        T = doc.shape[0]
        for w in (1, 5, 100, 128, 200, None):
            want = create_block_mask(window_mask(doc, w), None, None, T, T, device="cpu")
            got = document_block_mask(doc, w)
            assert got.seq_lengths == want.seq_lengths
            for f in fields:
                assert torch.equal(getattr(got, f), getattr(want, f)), (lens, w, f)


def test_one_compiled_attention_serves_every_window():
    """The window is a tensor input of the mask, not a constant Dynamo guards on: the attention of
    a sliding and a global layer traces once (on the GPU each window compiled flex_attention
    again, seen with TORCH_LOGS=recompiles)."""
    import warnings

    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    from ember.core.layers.relative_attention import document_block_mask

    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 60, 96]))
    T = doc.shape[0]
    q, k, v = (torch.randn(1, 2, T, 16) for _ in range(3))
    counter = CompileCounter()
    attend = torch.compile(flex_attention, backend=counter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for w in (5, 9, None):
            attend(q, k, v, block_mask=document_block_mask(doc, w))
    assert counter.frame_count == 1
