"""The static decoder's L2 prefetch of the next product's weight (``SamplerConfig.prefetch_mb``).

The kernel only runs on Hopper GPUs (``bench/gpu_checks.py l2_prefetch``); here the launch is
recorded instead, which checks what is prefetched after each product, and that the samples do not
change."""

from __future__ import annotations

import numpy as np
import torch

from ember.core.adapters import LoraConfig
from ember.core.kernels import l2_prefetch
from ember.core.sampling import SamplerConfig
from ember.core.sampling.prefetch import WeightPrefetch
from ember.engine.worker import Worker
from ember.types import SampleInput, SamplingParams
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences

VOCAB = 320


def _worker(path, prefetch_mb: int) -> Worker:
    config = SamplerConfig(max_seqs=8, page_size=4, kv_tokens=1024, static_decode=True, prefetch_mb=prefetch_mb)
    return Worker.from_pretrained(path, "cpu", torch.float32, sampler_config=config)


def _requests(worker) -> list[SampleInput]:
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=1))
    randomise(worker.adapter(slot), seed=5, scale=0.2)
    prompts = random_sequences(VOCAB, [6, 9, 4], seed=3)
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=11, stop=[])
    return [SampleInput(s, np.array(p), params) for s, p in zip([slot, 0, slot], prompts)]


def _product_weights(model, packed) -> list[torch.Tensor]:
    """The weights a Qwen3 decode step reads, in order: per layer the packed q/k/v, o, the packed
    gate/up and down; then the LM head."""
    order = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        order += [
            packed.weights[attn.q_proj.lora_name][0],
            attn.o_proj.weight,
            packed.weights[mlp.gate_proj.lora_name][0],
            mlp.down_proj.weight,
        ]
    return order + [model.unembed_weight]


def test_each_product_prefetches_the_next_weight_and_samples_are_unchanged(hf_models):
    _, path = hf_models["qwen3"]
    plain = _worker(path, 0)
    assert plain.sampler.static.prefetch is None
    expected = plain.sample(_requests(plain))

    worker = _worker(path, 3)
    static = worker.sampler.static
    passes: list[list[tuple[int, int]]] = []
    begin = static.prefetch.begin
    static.prefetch.begin = lambda: passes.append([]) or begin()
    static.prefetch.launch = lambda w, budget: passes[-1].append((w.data_ptr(), budget))
    got = worker.sample(_requests(worker))

    for a, b in zip(expected, got):
        for x, y in zip(a.sequences, b.sequences):
            assert x.tokens.tolist() == y.tokens.tolist()
            np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-6, rtol=0)
    order = [w.data_ptr() for w in _product_weights(worker.model, static.packed)]
    assert len(set(order)) == len(order) == 4 * len(worker.model.model.layers) + 1
    # the first pass learns the order and prefetches nothing; each later one prefetches, after each
    # product, the weight of the product that follows it (after the LM head: the first layer's)
    assert passes[0] == [] and len(passes) > 3
    for launched in passes[1:]:
        assert launched == [(ptr, 3 << 20) for ptr in order[1:] + order[:1]]


def test_no_prefetch_for_routed_experts(hf_models):
    """In an MoE model a layer's experts run between its dense products and would evict the
    prefetched weight: the decoder prefetches nothing there."""
    _, path = hf_models["qwen3_moe"]
    assert _worker(path, 8).sampler.static.prefetch is None


def test_prefetch_learns_from_its_first_pass_and_wraps_around():
    weights = [torch.zeros(4, 4) for _ in range(3)]
    launched = []
    pf = WeightPrefetch(1 << 20, launch=lambda w, b: launched.append(w))
    for _ in range(2):
        pf.begin()
        for w in weights:
            pf.after(w)
        pf.end()
    assert [w is v for w, v in zip(launched, weights[1:] + weights[:1])] == [True] * 3
    pf.begin()
    pf.after(torch.zeros(2))  # a weight the first pass did not read: nothing to prefetch
    pf.end()
    assert len(launched) == 3


def test_chunk_choice_spreads_the_budget_evenly():
    nbytes = 1000 * l2_prefetch.CHUNK + 100  # the partial last chunk is never taken
    for budget, count in ((0, 0), (250 * l2_prefetch.CHUNK, 250), (10**9, 1000)):
        chosen = l2_prefetch.chosen(nbytes, budget)
        assert len(chosen) == count
        if count:  # evenly spread: gaps between taken chunks differ by at most one
            gaps = np.diff(np.concatenate([[-1], chosen.numpy()]))
            assert gaps.max() - gaps.min() <= 1 and chosen.max() < 1000
    assert not l2_prefetch.supported(torch.zeros(4))  # the CPU: the kernel does nothing
