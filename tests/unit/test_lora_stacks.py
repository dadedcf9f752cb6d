"""The static decoder's adapter stacks: what an admission copies into them, and when.

An adapter is copied into the stacks when its requests are admitted and its factors changed since
the last copy (``Adapter.version``: an optimizer step, a load, another adapter in the slot), with
each module's own LoRA scale folded into ``B`` (``normalize_moe_lora`` experts have their own)."""

from __future__ import annotations

import numpy as np
import torch

from ember.core.adapters import LoraConfig
from ember.core.sampling import SamplerConfig
from ember.types import SampleInput, SamplingParams
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences
from tests.unit.test_sampler import VOCAB, _mixed_requests, _worker, decoded

STATIC = SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024, static_decode=True)
# experts at rank 4 / top_k (2) with scale alpha / 2: twice the attention modules' scale
NORMALIZED = LoraConfig(rank=4, alpha=8.0, seed=1, normalize_moe_lora=True)


def _copies(stacks) -> list[int]:
    """Record the slots ``stacks`` copies from now on."""
    seen = []
    copy = stacks._copy
    stacks._copy = lambda adapter: seen.append(adapter.slot) or copy(adapter)
    return seen


def _assert_holds(stacks, adapter) -> None:
    """The stacks hold ``adapter``'s current factors, its modules' scales folded into ``B``."""
    s = adapter.slot
    assert stacks.synced[s] == adapter.version
    checked = 0
    for name, w in adapter.weights.items():
        scale = adapter.module_scale(name)
        if name in stacks.stacks:
            A, B = (t[s] for t in stacks.stacks[name])
        elif name in stacks.experts:
            g = stacks.expert_slots.index(s)
            A, B = (t[:, g] for t in stacks.experts[name])
        else:
            continue
        r = w.rank
        torch.testing.assert_close(A[..., :r, :], w.A.to(A.dtype))
        torch.testing.assert_close(B[..., :r], (w.B * scale).to(B.dtype))
        assert not A[..., r:, :].any() and not B[..., r:].any()
        checked += 1
    assert checked == len(adapter.weights)


def test_stacks_copy_an_adapter_once_per_version(hf_models):
    _, path = hf_models["qwen3_moe"]
    worker = _worker(path, STATIC)
    slot = worker.create_adapter(NORMALIZED)
    adapter = worker.adapter(slot)
    randomise(adapter, seed=7)
    assert set(adapter.scale_multipliers.values()) == {2.0}  # the experts' ranks are 4 / top_k
    stacks = worker.sampler.static.stacks
    copies = _copies(stacks)
    reqs = _mixed_requests([slot], first_tokens=2)
    worker.sample(reqs)
    assert copies == [slot]  # once, though its requests are admitted in several steps
    _assert_holds(stacks, adapter)

    worker.sample(reqs)
    assert copies == [slot]  # unchanged: nothing to copy

    randomise(adapter, seed=8)  # in place, as an optimizer step or a load writes it
    worker.sample(reqs)
    assert copies == [slot, slot]
    _assert_holds(stacks, adapter)

    worker.free_adapter(slot)
    again = worker.create_adapter(NORMALIZED)  # a new adapter in the same slot
    assert again == slot
    worker.sample(reqs)
    assert copies == [slot, slot, slot]
    _assert_holds(stacks, worker.adapter(slot))


def test_static_decode_scales_normalized_expert_lora(hf_models):
    """A ``normalize_moe_lora`` adapter decodes through the static decoder's stacks as through the
    eager decoder (the trainer's modules): the experts' LoRA at their own scale."""
    _, path = hf_models["qwen3_moe"]
    runs = []
    for config in (STATIC, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024)):
        worker = _worker(path, config)
        slot = worker.create_adapter(NORMALIZED)
        randomise(worker.adapter(slot), seed=7)
        runs.append(decoded(worker.sample(_mixed_requests([slot]))))
        assert (worker.sampler.static is not None) == bool(config.static_decode)
    static, eager = runs
    assert [[t for t, _ in r] for r in static] == [[t for t, _ in r] for r in eager]
    for s_run, e_run in zip(static, eager, strict=True):
        for (_, s_lp), (_, e_lp) in zip(s_run, e_run, strict=True):
            np.testing.assert_allclose(s_lp, e_lp, atol=1e-5, rtol=0)


def test_eager_views_only_where_the_eager_decoder_runs(hf_models):
    """Beside a static decoder, the eager decoder casts an adapter only for the steps it runs (those
    that record MoE routing), then keeps that cast current at each admission; the routing record's
    logprobs are the static decoder's."""
    _, path = hf_models["qwen3_moe"]
    worker = _worker(path, STATIC)
    slot = worker.create_adapter(NORMALIZED)
    adapter = worker.adapter(slot)
    randomise(adapter, seed=7)
    eager = worker.sampler.eager
    reqs = _mixed_requests([slot])
    static = decoded(worker.sample(reqs))
    assert eager._views == {}  # every step was the static decoder's: no second copy of the factors

    prompt = random_sequences(VOCAB, [7], seed=13)[0]
    params = SamplingParams(max_tokens=6, seed=2, stop=[])
    (plain,) = worker.sample([SampleInput(slot, np.array(prompt), params, num_samples=2)])  # static
    assert eager._views == {}
    (recorded,) = worker.sample([SampleInput(slot, np.array(prompt), params, num_samples=2, record_routing=True)])
    assert set(eager._views) == {slot} and eager._versions[slot] == adapter.version
    for a, b in zip(plain.sequences, recorded.sequences, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)

    randomise(adapter, seed=8)  # an optimizer step: the view is taken again at the next admission
    assert decoded(worker.sample(reqs)) != static
    assert eager._versions[slot] == adapter.version
