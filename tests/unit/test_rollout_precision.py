"""Rollout precision (``--rollout-precision``, :mod:`ember.core.rollout_precision`).

* The quantisers against a float64 model of the formats. ``tests/unit/test_quant.py`` already checks
  the dequantisers against a bit-level decoder and the byte round trip; here: e4m3 round-to-nearest-
  even (ties included), saturation at ±448, the FP8 tile scale ``amax / 448`` and the MXFP8 E8M0
  scale by OCP's floor rule (with the saturation it implies).
* A quantised tiny model (qwen3, qwen3_moe) samples with exactly the logprobs of the model whose
  base projections and experts were quantise-dequantised by hand, within the format's error of the
  unquantised one, without touching training (bitwise) or the bf16 default.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from ember.core import quant, rollout_precision
from ember.core.adapters import LoraConfig
from ember.core.layers.lora import LoraLinear
from ember.core.layers.moe import Experts
from ember.core.sampling import SamplerConfig
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput, SampleInput, SamplingParams
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences

VOCAB = 320
CFG = SamplerConfig(max_seqs=8, page_size=4, kv_tokens=1024)

# -- float64 reference of e4m3 (fn) --------------------------------------------------------------


def _e4m3_grid() -> np.ndarray:
    """Every finite non-negative e4m3fn value (exponent bias 7, subnormals 2^-9 · m, max 448)."""
    vals = [m * 2.0**-9 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return np.array(sorted(vals), dtype=np.float64)


GRID = _e4m3_grid()


def _e4m3_ref(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto the e4m3 grid in float64, saturating at ±448."""
    mag = np.minimum(np.abs(x), 448.0)
    hi = np.searchsorted(GRID, mag)  # GRID[hi-1] < mag <= GRID[hi]
    hi = np.clip(hi, 1, len(GRID) - 1)
    lo_v, hi_v = GRID[hi - 1], GRID[hi]
    d_lo, d_hi = mag - lo_v, hi_v - mag
    # the grid's index parity is the mantissa's (8 codes per binade, from code 0): even = even mantissa
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    out = np.where(pick_hi, hi_v, lo_v)
    out = np.where(mag == GRID[hi - 1], lo_v, out)
    return np.sign(x) * out


def test_e4m3_reference_grid():
    assert len(GRID) == 127 and GRID[-1] == 448.0 and GRID[1] == 2.0**-9
    # the reference itself: ties go to the even mantissa
    assert _e4m3_ref(np.array([1.0625]))[0] == 1.0  # between 1.0 (m=0) and 1.125 (m=1)
    assert _e4m3_ref(np.array([1.1875]))[0] == 1.25  # between 1.125 (m=1) and 1.25 (m=2)


def _cases() -> np.ndarray:
    """Random values over the whole range plus every exact midpoint (ties) and values past 448."""
    rng = np.random.default_rng(0)
    mids = (GRID[1:] + GRID[:-1]) / 2
    rand = np.exp(rng.uniform(np.log(2.0**-11), np.log(600.0), 4000)) * rng.choice([-1, 1], 4000)
    return np.concatenate([mids, -mids, rand, [448.0, 449.0, 464.0, 500.0, 1e4, -1e4, 0.0]])


def test_fp8_block_quantiser_matches_float64_reference():
    """``quantize_fp8_block``: ``scale_inv = amax / 448`` per tile, elements RNE onto e4m3 of
    ``w / scale_inv`` (the tile's amax lands on ±448 exactly)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 72)) * np.exp(rng.uniform(-6, 6, (40, 1)))  # rows of very different scale
    wt = torch.tensor(w, dtype=torch.float32)
    q, scale_inv = quant.quantize_fp8_block(wt, block=16)
    w32 = wt.double().numpy()
    amax = np.zeros((3, 5))
    for i in range(3):
        for j in range(5):
            amax[i, j] = np.abs(w32[16 * i : 16 * i + 16, 16 * j : 16 * j + 16]).max()
    np.testing.assert_array_equal(scale_inv.numpy(), (amax / 448.0).astype(np.float32))
    full = np.repeat(np.repeat(scale_inv.double().numpy(), 16, 0), 16, 1)[:40, :72]
    want = _e4m3_ref((w32 / full).astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(q.float().double().numpy(), want)
    assert np.abs(q.float().numpy()).max() == 448.0


def test_mxfp8_quantiser_matches_float64_reference():
    """``quantize_mxfp8``: E8M0 code ``floor(log2 amax) − 8 + 127`` per 32 along K, elements RNE of
    ``w / 2^e`` saturated to ±448 (the floor rule lets a block's amax reach 2^9 > 448), all-zero
    blocks code 0."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 128)) * np.exp(rng.uniform(-8, 8, (6, 1)))
    w[0, 32:64] = 0.0  # an all-zero block
    w[1, :32] = 0.0
    w[1, 5] = 511.0 / 8  # floor(log2 63.875) = 5: e = -3, and 63.875 / 2^-3 = 511 saturates to 448
    wt = torch.tensor(w, dtype=torch.float32)
    q, code = quant.quantize_mxfp8(wt)
    w32 = wt.double().numpy().reshape(6, 4, 32)
    amax = np.abs(w32).max(-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 8, -127)
    want_code = np.clip(e + 127, 0, 254)
    np.testing.assert_array_equal(code.numpy(), want_code.astype(np.uint8))
    assert code[0, 1] == 0
    want = _e4m3_ref(w32 / np.exp2(want_code - 127)[..., None]).reshape(6, 128)
    np.testing.assert_array_equal(q.float().double().numpy(), want)
    # saturation really happened: 511/8 = 63.875 -> e = floor(log2) - 8 = -3, scaled 511 -> 448
    assert code[1, 0] == 124 and float(q[1, 5].float()) == 448.0


def test_e4m3_rounding_ties_and_saturation():
    """The quantisers' element step against the float64 reference on every tie between e4m3 values
    and past ±448: MXFP8 blocks held at code 127 (a 256 in each block), FP8 tiles at scale 1 (a 448
    in each tile)."""
    x = np.clip(_cases(), -500.0, 500.0)
    n = len(x)
    pad = -n % 31
    body = torch.tensor(np.concatenate([x, np.zeros(pad)]), dtype=torch.float32).reshape(-1, 31)
    mx = torch.cat([body, torch.full((body.shape[0], 1), 256.0)], dim=1)  # amax in [256, 512): e = 0
    q, code = quant.quantize_mxfp8(mx)
    assert (code == 127).all()
    got = q[:, :31].float().reshape(-1)[:n].double().numpy()
    np.testing.assert_array_equal(got, _e4m3_ref(body.reshape(-1)[:n].double().numpy()))
    assert (np.abs(got[np.abs(x) > 448]) == 448).all() and (np.abs(x) > 448).any()  # saturated, not NaN
    fp = torch.cat([body.clamp(-448, 448), torch.full((body.shape[0], 1), 448.0)], dim=1)
    qb, s = quant.quantize_fp8_block(fp, block=32)
    assert torch.equal(s, torch.ones_like(s))
    np.testing.assert_array_equal(qb[:, :31].float().double().numpy(), _e4m3_ref(fp[:, :31].double().numpy()))


# -- the mechanism on tiny models ------------------------------------------------------------------


def _worker(path, precision="bf16") -> Worker:
    return Worker.from_pretrained(path, "cpu", torch.float32, sampler_config=CFG, rollout_precision=precision)


def _qdq_by_hand(worker: Worker, precision: str) -> None:
    """Replace the intended weights (attention/MLP projections, routed experts) by their
    quantise-dequantise values, in place: the reference the rollout copy must reproduce."""
    with torch.no_grad():
        for m in worker.model.modules():
            if isinstance(m, LoraLinear) and m.category in ("attn", "mlp"):
                m.weight.copy_(rollout_precision.qdq(m.weight, precision))
            elif isinstance(m, Experts):
                m.gate_up_proj.copy_(rollout_precision.qdq(m.gate_up_proj, precision))
                m.down_proj.copy_(rollout_precision.qdq(m.down_proj, precision))


def _requests(slot):
    prompts = random_sequences(VOCAB, [7, 4, 11], seed=3)
    return [SampleInput(slot, np.array(p), SamplingParams(max_tokens=10, temperature=1.0, seed=5 + i, stop=[]),
                        num_samples=2) for i, p in enumerate(prompts)]


def _trainer_logprobs(worker, slot, prompt, tokens) -> np.ndarray:
    seq = list(prompt) + list(tokens)
    d = Datum(np.array(seq[:-1]), {"target_tokens": np.array(seq[1:])})
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, [d], forward_only=True)])
    return np.asarray(out.logprobs[0])[len(prompt) - 1 :]


def _adapter(worker):
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=1))
    randomise(worker.adapter(slot), seed=11, scale=0.1)
    return slot


# The precise check is the one above: the sampled logprobs equal the hand-quantised model's. The gap
# to the unquantised model is then the format's own error: e4m3 keeps 3 mantissa bits, so rounding
# moves a weight by at most 2^-4 of itself (MXFP8: up to 2^-3 where the floor rule saturates), about
# 2^-4/√3 ≈ 3.6 % rms, and each product's output by about as much. The tiny models are deliberately
# sharp (initializer_range 0.2: logits of tens of units), so a few percent of the logits is a few
# tenths of a logprob on average: bound the mean at 0.5 (measured: 0.11-0.14 dense, 0.28-0.33 MoE).
# A logprob moves by at most twice the largest logit change: dense max < 1.5 (measured 0.37-0.49).
# In the MoE model a perturbed hidden state can flip a router's top-k choice, a discrete change that
# no smooth bound covers (measured max 2.2-4.0): bound it at 8 only to catch a broken path. The gap
# must also be nonzero: the quantised copy really ran.
MEAN_BOUND = 0.5
MAX_BOUND = {"qwen3": 1.5, "qwen3_moe": 8.0}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_quantised_sampling(family, precision, hf_models):
    _, path = hf_models[family]
    worker = _worker(path, precision)
    ref = _worker(path)  # the model's own weights, fp32
    slot, ref_slot = _adapter(worker), _adapter(ref)
    seq = random_sequences(VOCAB, [12], seed=8)[0]
    datum = Datum(np.array(seq[:-1]), {"target_tokens": np.array(seq[1:]), "weights": np.ones(11, np.float32)})
    train = [ForwardBackwardInput(slot, [datum], "cross_entropy")]

    def grads():
        worker.adapter(slot).flat.grad = None  # gradients accumulate over passes
        (o,) = worker.forward_backward(train)
        g = worker.adapter(slot).grads()
        return np.asarray(o.logprobs[0]), {k: v.clone() for k, v in g.items()}

    weights_before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    lp0, g0 = grads()
    outs = worker.sample(_requests(slot))
    lp1, g1 = grads()
    # training is untouched by a quantised sampling run: logprobs, gradients and weights bitwise
    np.testing.assert_array_equal(lp0, lp1)
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k
    for k, v in worker.model.state_dict().items():
        assert torch.equal(v, weights_before[k]), k
    (r,) = ref.forward_backward([ForwardBackwardInput(ref_slot, [datum], "cross_entropy")])
    np.testing.assert_array_equal(np.asarray(r.logprobs[0]), lp0)  # as a worker without a rollout copy
    for k, v in ref.adapter(ref_slot).grads().items():
        assert torch.equal(v, g0[k]), k

    # the sampled logprobs are exactly those of the hand-quantised model (every intended weight,
    # nothing else: LM head, embeddings, norms, router unquantised) ...
    qdq = _worker(path)
    q_slot = _adapter(qdq)
    _qdq_by_hand(qdq, precision)
    gaps = []
    for req, out in zip(_requests(slot), outs):
        for s in out.sequences:
            want = _trainer_logprobs(qdq, q_slot, req.prompt, s.tokens)
            np.testing.assert_allclose(s.logprobs, want, atol=2e-4, rtol=0)
            gaps.append(np.abs(np.asarray(s.logprobs) - _trainer_logprobs(ref, ref_slot, req.prompt, s.tokens)))
    # ... and within the format's error of the unquantised model's (the rollout/trainer gap)
    gap = np.concatenate(gaps)
    assert 1e-3 < gap.mean() < MEAN_BOUND, gap.mean()
    assert gap.max() < MAX_BOUND[family], gap.max()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_bf16_precision_is_today(family, hf_models):
    """The default attaches nothing: the sampler's outputs are those of a worker built without the flag."""
    _, path = hf_models[family]
    a = Worker.from_pretrained(path, "cpu", torch.float32, sampler_config=CFG)
    b = _worker(path, "bf16")
    assert b.sampler.rollout_bytes == 0
    assert not any(m.__dict__.get("rollout") for m in b.model.modules())
    sa, sb = _adapter(a), _adapter(b)
    for x, y in zip(a.sample(_requests(sa)), b.sample(_requests(sb))):
        for p, q in zip(x.sequences, y.sequences):
            np.testing.assert_array_equal(p.tokens, q.tokens)
            np.testing.assert_array_equal(p.logprobs, q.logprobs)


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_copies_only_intended_modules(precision, hf_models):
    """Rollout copies on the attention/MLP projections and experts only; the copies hold the QDQ
    values; the model's parameters are not replaced; ``sampling`` turns them on only inside."""
    _, path = hf_models["qwen3_moe"]
    worker = _worker(path, precision)
    engine = worker.sampler
    model = worker.model
    with_copy = {n for n, m in model.named_modules() if m.__dict__.get("rollout") is not None}
    want = {n for n, m in model.named_modules()
            if isinstance(m, Experts) or (isinstance(m, LoraLinear) and m.category in ("attn", "mlp"))}
    assert with_copy == want and want
    assert not any("lm_head" in n or "embed" in n or "norm" in n or n.endswith(".gate") for n in with_copy)
    assert any(n.endswith("experts") for n in with_copy) and any(n.endswith("q_proj") for n in with_copy)
    total = 0
    for n in with_copy:
        m = model.get_submodule(n)
        r = m.rollout
        assert not r.active
        if isinstance(m, Experts):
            assert torch.equal(r.gate_up_proj, rollout_precision.qdq(m.gate_up_proj, precision))
            assert not torch.equal(r.gate_up_proj, m.gate_up_proj)
        else:
            assert torch.equal(r.data, rollout_precision.qdq(m.weight, precision))
            assert not torch.equal(r.data, m.weight)
        total += r.nbytes()
    assert engine.rollout_bytes == total
    with rollout_precision.sampling(model):
        assert all(model.get_submodule(n).rollout.active for n in with_copy)
    assert not any(model.get_submodule(n).rollout.active for n in with_copy)
    # a base weight changed in place (full fine-tuning) is quantised again at the next sampling pass
    q = model.get_submodule(next(n for n in sorted(with_copy) if n.endswith("q_proj")))
    with torch.no_grad():
        q.weight.mul_(2.0)
    with rollout_precision.sampling(model):
        assert torch.equal(q.rollout.data, rollout_precision.qdq(q.weight, precision))
    # bf16 removes the copies
    rollout_precision.attach(model, "bf16")
    assert not any(m.__dict__.get("rollout") for m in model.modules())
    with pytest.raises(ValueError, match="rollout precision"):
        rollout_precision.check_precision("fp4")


def test_flag_reaches_the_engine():
    from types import SimpleNamespace

    from ember.server.supervisor import EngineOptions, EngineSupervisor

    models = {"m": SimpleNamespace(path="/x")}
    sup = EngineSupervisor(None, models, EngineOptions("sqlite://", "/s", rollout_precision="fp8"))
    cmd = sup.command("m")
    assert cmd[cmd.index("--rollout-precision") + 1] == "fp8"
    default = EngineSupervisor(None, models, EngineOptions("sqlite://", "/s")).command("m")
    assert default[default.index("--rollout-precision") + 1] == "bf16"


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_the_static_decoder_decodes_with_the_rollout_copies(precision, hf_models):
    """The static (CUDA-graph) decoder multiplies the rollout copies too: its tokens and logprobs
    are the eager decoder's with the same precision, and a copy quantised again (the weights
    changed) makes it drop its graphs."""
    _, path = hf_models["qwen3"]
    outs = {}
    for static in (False, True):
        worker = Worker.from_pretrained(path, "cpu", torch.float32, rollout_precision=precision,
                                        sampler_config=dataclasses.replace(CFG, static_decode=static))
        assert (worker.sampler.static is not None) == static
        slot = _adapter(worker)
        outs[static] = worker.sample(_requests(slot))
    for a, b in zip(outs[False], outs[True]):
        for p, q in zip(a.sequences, b.sequences):
            np.testing.assert_array_equal(q.tokens, p.tokens)
            np.testing.assert_allclose(q.logprobs, p.logprobs, atol=1e-5, rtol=0)
    # the static decoder multiplied each shared-input group's copies in one product: they are now
    # consecutive rows of one tensor, as the packed weights are
    attn, mlp = worker.model.model.layers[0].self_attn, worker.model.model.layers[0].mlp
    for members in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        data = [m.rollout.data for m in members]
        assert len({d.untyped_storage().data_ptr() for d in data}) == 1
        assert all(a.data_ptr() + a.numel() * a.element_size() == b.data_ptr() for a, b in itertools.pairwise(data))
    assert attn.o_proj.rollout.data.untyped_storage().data_ptr() != attn.q_proj.rollout.data.untyped_storage().data_ptr()
    # and not the bf16 decoder's: the copies were used
    plain = Worker.from_pretrained(path, "cpu", torch.float32, sampler_config=dataclasses.replace(CFG, static_decode=True))
    ref = plain.sample(_requests(_adapter(plain)))
    assert any(not np.allclose(p.logprobs, q.logprobs, atol=1e-3)
               for a, b in zip(ref, outs[True]) for p, q in zip(a.sequences, b.sequences) if len(p.logprobs) == len(q.logprobs))

    model = worker.model
    before = rollout_precision.version(model)
    with rollout_precision.sampling(model):
        pass  # nothing changed: nothing quantised again
    assert rollout_precision.version(model) == before
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # as full fine-tuning's step would
    with rollout_precision.sampling(model):
        pass
    assert rollout_precision.version(model) == before + 1
