"""A packed batch mixing adapters gives every sequence and every adapter what it would get alone."""

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences

CONFIGS = [
    LoraConfig(rank=2, alpha=4.0, seed=1),
    LoraConfig(rank=4, alpha=32.0, seed=2),
    LoraConfig(rank=8, alpha=16.0, seed=3, targets=frozenset({"attn"})),
    LoraConfig(rank=16, alpha=8.0, seed=4, targets=frozenset({"mlp", "unembed"})),
]


def _request(slot, seqs, rng, loss_fn="cross_entropy", forward_only=False):
    datums = []
    for s in seqs:
        n = len(s) - 1
        inputs = {"target_tokens": np.array(s[1:])}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.random(n).astype(np.float32)
        else:
            inputs["logprobs"] = (-rng.random(n) * 3).astype(np.float32)
            inputs["advantages"] = rng.standard_normal(n).astype(np.float32)
        datums.append(Datum(np.array(s[:-1]), inputs))
    return ForwardBackwardInput(slot, datums, loss_fn, forward_only=forward_only)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_mixed_adapters_equal_alone(family, hf_models):
    hf, path = hf_models[family]
    # small logprob chunks, so chunk boundaries fall inside adapter groups
    worker = Worker.from_pretrained(path, "cpu", torch.float32, logprob_chunk=16)
    slots = [worker.create_adapter(c) for c in CONFIGS]
    for i, s in enumerate(slots):
        randomise(worker.adapter(s), seed=100 + i, scale=0.05)
    rng = np.random.default_rng(0)
    vocab = hf.config.vocab_size
    losses = ["cross_entropy", "ppo", "importance_sampling", "cross_entropy"]
    requests = [
        _request(s, random_sequences(vocab, [9 + 3 * i, 20, 5], seed=10 + i), rng, losses[i])
        for i, s in enumerate(slots)
    ]
    requests.append(_request(0, random_sequences(vocab, [14, 6], seed=50), rng, forward_only=True))
    requests.append(_request(slots[1], random_sequences(vocab, [11], seed=51), rng, forward_only=True))

    alone_out, alone_grads = [], []
    for req in requests:
        (out,) = worker.forward_backward([req])
        alone_out.append(out)
        if req.slot and not req.forward_only:
            a = worker.adapter(req.slot)
            alone_grads.append({k: g.clone() for k, g in a.grads().items()})
            a.optimizer.zero_grad()

    mixed = worker.forward_backward(list(reversed(requests)))[::-1]
    for req, alone, together in zip(requests, alone_out, mixed):
        for a, b in zip(alone.logprobs, together.logprobs):
            np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        assert together.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], abs=1e-4, rel=1e-5)
    trained = [r for r in requests if r.slot and not r.forward_only]
    assert len(trained) == len(alone_grads) == 4
    for req, ref in zip(trained, alone_grads):
        grads = worker.adapter(req.slot).grads()
        for k, g in ref.items():
            torch.testing.assert_close(grads[k], g, atol=1e-5, rtol=1e-5)
    if family == "qwen3_moe":
        assert any(".experts." in k for k in alone_grads[0])


def test_forward_only_adapter_gets_no_gradient(hf_models):
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    a, b = worker.create_adapter(LoraConfig(rank=4)), worker.create_adapter(LoraConfig(rank=4))
    rng = np.random.default_rng(1)
    seqs = random_sequences(320, [10, 12], seed=1)
    worker.forward_backward([_request(a, seqs, rng), _request(b, seqs, rng, forward_only=True)])
    assert worker.adapter(a).grads() is not None
    assert worker.adapter(b).grads() is None


def test_new_adapter_reproduces_base_model(hf_models):
    _, path = hf_models["qwen3_moe"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=8, seed=3))
    rng = np.random.default_rng(2)
    seqs = random_sequences(320, [15, 8], seed=4)
    (base,) = worker.forward_backward([_request(0, seqs, rng, forward_only=True)])
    (lora,) = worker.forward_backward([_request(slot, seqs, rng, forward_only=True)])
    for x, y in zip(base.logprobs, lora.logprobs):
        np.testing.assert_array_equal(x, y)


def test_two_requests_of_one_adapter_accumulate(hf_models):
    """Chunks of one model's forward_backward may share a pass: gradients add up as if sequential."""
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, seed=2))
    randomise(worker.adapter(slot), seed=3, scale=0.05)
    rng = np.random.default_rng(4)
    r1 = _request(slot, random_sequences(320, [10, 7], seed=5), rng)
    r2 = _request(slot, random_sequences(320, [12], seed=6), rng, loss_fn="ppo")
    worker.forward_backward([r1])
    worker.forward_backward([r2])
    sequential = {k: g.clone() for k, g in worker.adapter(slot).grads().items()}
    worker.adapter(slot).optimizer.zero_grad()
    worker.forward_backward([r2, r1])
    for k, g in worker.adapter(slot).grads().items():
        torch.testing.assert_close(g, sequential[k], atol=1e-5, rtol=1e-5)


def test_bank_changes_do_not_disturb_a_training_adapter(hf_models):
    """Creating, resetting and freeing other slots between forward_backward and optim_step leaves an
    adapter's accumulated gradient and its step untouched."""
    from ember.core.optim import AdamParams

    _, path = hf_models["qwen3"]
    results = []
    for churn in (False, True):
        worker = Worker.from_pretrained(path, "cpu", torch.float32)
        slot = worker.create_adapter(LoraConfig(rank=4, seed=1))
        rng = np.random.default_rng(0)
        worker.forward_backward([_request(slot, random_sequences(320, [9, 13], seed=2), rng)])
        if churn:
            other = worker.create_adapter(LoraConfig(rank=8, seed=5))
            worker.forward_backward([_request(other, random_sequences(320, [6], seed=3), rng)])
            worker.reset_adapter(other)
            worker.free_adapter(other)
            worker.create_adapter(LoraConfig(rank=2, seed=6))
        worker.optim_step(slot, AdamParams(learning_rate=1e-2))
        results.append(worker.adapter(slot).flat.detach().clone())
    torch.testing.assert_close(results[1], results[0], atol=0, rtol=0)
