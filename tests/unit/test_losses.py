"""Each Tinker loss equals its float64 formula, in value and in gradient w.r.t. the logprobs."""

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.core.losses import loss_sum
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput
from tests.tiny_models import random_sequences


def reference(loss_fn, lp, q, A, w, cfg):
    """(loss, d loss / d lp) in float64, straight from shared/spec/tinker_api.md §3.4."""
    r = np.exp(lp - q)
    if loss_fn == "cross_entropy":
        return -(w * lp).sum(), -w
    if loss_fn == "importance_sampling":
        return -(r * A).sum(), -r * A
    if loss_fn == "ppo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        clipped = np.clip(r, lo, hi)
        unclipped_wins = r * A <= clipped * A
        value = -np.minimum(r * A, clipped * A).sum()
        # d/dlp of min(rA, clip(r)A): rA when the unclipped term is the min, else 0 outside [lo, hi]
        inside = (r >= lo) & (r <= hi)
        grad = np.where(unclipped_wins | inside, -r * A, 0.0)
        return value, grad
    if loss_fn == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        c = np.clip(r, lo, hi)
        return -(c * lp * A).sum(), -c * A
    if loss_fn == "dro":
        beta = cfg["beta"]
        return -(lp * A - 0.5 * beta * (lp - q) ** 2).sum(), -(A - beta * (lp - q))
    raise AssertionError(loss_fn)


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
    ("dro", {"beta": 0.05}),
]


@pytest.mark.parametrize("loss_fn,cfg", CASES)
def test_loss_matches_float64_formula(loss_fn, cfg):
    rng = np.random.default_rng(0)
    n = 200
    lp = -rng.random(n) * 4
    q = lp + rng.normal(0, 0.3, n)  # ratios spread across the clip range
    A = rng.normal(0, 1, n)
    w = rng.normal(0, 1, n)
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    inputs = {
        "logprobs": torch.tensor(q, dtype=torch.float32),
        "advantages": torch.tensor(A, dtype=torch.float32),
        "weights": torch.tensor(w, dtype=torch.float32),
    }
    loss = loss_sum(loss_fn, lp_t, inputs, cfg)
    loss.backward()
    ref_value, ref_grad = reference(loss_fn, lp_t.detach().double().numpy(), q.astype(np.float32).astype(np.float64),
                                    A.astype(np.float32).astype(np.float64), w.astype(np.float32).astype(np.float64), cfg)
    assert float(loss) == pytest.approx(ref_value, rel=1e-5, abs=1e-4)
    np.testing.assert_allclose(lp_t.grad.double().numpy(), ref_grad, rtol=1e-5, atol=1e-5)
    if loss_fn in ("ppo", "cispo"):
        ratios = np.exp(lp - q)
        assert (ratios < 0.8).any() and (ratios > 1.2).any()  # clipping really happened


def test_cross_entropy_2d_targets(hf_models):
    """(N, K) targets with weights: loss = -Σ w·lp over all N·K entries; logprobs come back (N, K)."""
    hf, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4))
    s = random_sequences(320, [12], seed=9)[0]
    rng = np.random.default_rng(3)
    targets = rng.integers(0, 320, (11, 3))
    weights = rng.random((11, 3)).astype(np.float32)
    (out,) = worker.forward_backward(
        [ForwardBackwardInput(slot, [Datum(np.array(s[:-1]), {"target_tokens": targets, "weights": weights})])]
    )
    assert out.logprobs[0].shape == (11, 3)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([s[:-1]])).logits[0].double(), -1)
    ref_lp = ref.gather(1, torch.tensor(targets)).numpy()
    np.testing.assert_allclose(out.logprobs[0], ref_lp, atol=1e-4)
    assert out.metrics["loss:sum"] == pytest.approx(-(weights * ref_lp).sum(), rel=1e-5)


@pytest.mark.parametrize("loss_fn,cfg", CASES)
def test_worker_loss_sum_matches_formula(loss_fn, cfg, hf_models):
    """Through the worker: loss:sum equals the float64 formula on the returned logprobs."""
    _, path = hf_models["qwen3_moe"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4))
    rng = np.random.default_rng(5)
    datums, refs = [], []
    for s in random_sequences(320, [9, 16], seed=6):
        n = len(s) - 1
        q = (-rng.random(n) * 8).astype(np.float32)
        A = rng.normal(0, 1, n).astype(np.float32)
        w = rng.random(n).astype(np.float32)
        inputs = {"target_tokens": np.array(s[1:]), "logprobs": q, "advantages": A, "weights": w}
        datums.append(Datum(np.array(s[:-1]), inputs))
        refs.append((q, A, w))
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, loss_fn, cfg)])
    total = sum(reference(loss_fn, lp.astype(np.float64), q, A, w, cfg)[0] for lp, (q, A, w) in zip(out.logprobs, refs))
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-4)
