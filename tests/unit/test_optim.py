"""Per-adapter AdamW equals torch.optim.AdamW + clip_grad_norm_, and touches only its adapter."""

import copy

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.core.optim import AdamParams, total_norm
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput, InvalidRequest
from tests.tiny_models import random_sequences


def _ce(slot, seed, lengths=(10, 14)):
    seqs = random_sequences(320, lengths, seed=seed)
    return ForwardBackwardInput(
        slot, [Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:])}) for s in seqs], "cross_entropy"
    )


@pytest.mark.parametrize("clip", [0.0, 0.05, 1e3])  # off, clipping, asked for but above the norm
def test_adamw_matches_torch_reference(clip, hf_models):
    _, path = hf_models["qwen3_moe"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, seed=1))
    params = worker.adapter(slot).parameters()
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    hp = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=clip)
    for step in range(3):
        # two forward_backward calls accumulate before the step
        worker.forward_backward([_ce(slot, 10 * step)])
        worker.forward_backward([_ce(slot, 10 * step + 1)])
        for p, r in zip(params, ref_params):
            r.grad = p.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(ref_params, clip if clip > 0 else float("inf"))
        if clip > 0:  # clipping is exercised where asked for below the norm, and only there
            assert (norm > clip) == (clip == 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        metrics = worker.optim_step(slot, hp)
        assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p.detach(), r.detach(), atol=1e-7, rtol=1e-6)
        assert all(p.grad is None for p in params)


def test_step_leaves_other_adapters_untouched(hf_models):
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    a, b = worker.create_adapter(LoraConfig(rank=4, seed=1)), worker.create_adapter(LoraConfig(rank=8, seed=2))
    worker.forward_backward([_ce(a, 1), _ce(b, 2)])
    worker.optim_step(b, AdamParams(learning_rate=1e-3))
    before = {k: (t.clone(), worker.adapter(a).grads()[k].clone()) for k, t in worker.adapter(a).tensors().items()}
    worker.forward_backward([_ce(b, 3)])
    worker.optim_step(b, AdamParams(learning_rate=1e-3))
    assert worker.adapter(a).optimizer.opt.state == {}
    grads = worker.adapter(a).grads()
    for k, t in worker.adapter(a).tensors().items():
        assert torch.equal(t, before[k][0]) and torch.equal(grads[k], before[k][1]), k
    # a's own step still uses exactly its accumulated gradient
    ref = copy.deepcopy(before)
    worker.optim_step(a, AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-12))
    for k, t in worker.adapter(a).tensors().items():
        w, g = ref[k]
        # first Adam step: update = lr * sign-like m/(sqrt(v)+eps) = lr * g/|g|
        expected = w - 1e-3 * g / (g.abs() + 1e-12)
        torch.testing.assert_close(t.detach(), expected, atol=1e-7, rtol=1e-6)


def test_bad_adam_params_are_rejected(hf_models):
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4))
    with pytest.raises(InvalidRequest, match="beta2"):
        worker.optim_step(slot, AdamParams(beta2=1.5))
    with pytest.raises(InvalidRequest, match="learning_rate"):
        worker.optim_step(slot, AdamParams(learning_rate=float("nan")))


def test_total_norm_sums_in_float64_on_the_cpu():
    # torch's fp32 CPU norm accumulates serially: about 1e-5 off at 2·10^6 elements
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(2_000_000, generator=gen) + 0.5, torch.randn(3, 5, generator=gen)]
    exact = sum(float(g.double().square().sum()) for g in grads) ** 0.5
    got = total_norm(grads)
    assert got.dtype == torch.float32 and got.shape == ()
    assert float(got) == pytest.approx(exact, rel=1e-7)
