"""The sampler against references: transformers/PEFT greedy generation, the trainer's logprobs, exact
filtered distributions, and each request sampled alone."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.core.batch import pack
from ember.core.layers.attention import PackedAttention
from ember.core.logprobs import token_logprobs
from ember.core.models.base import ForwardContext, RoutingRecord
from ember.core.optim import AdamParams
from ember.core.sampling import GenerationRequest, SamplerConfig, SamplingEngine, derive_seed
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput, RequestError, SampleInput, SamplingParams
from tests.lora_helpers import peft_model_like, randomise
from tests.tiny_models import build_hf_model, random_sequences, save_hf_model

VOCAB = 320
CFG = SamplerConfig(max_seqs=8, page_size=4, kv_tokens=1024)



def _worker(path, config=CFG, **kw) -> Worker:
    return Worker.from_pretrained(path, "cpu", torch.float32, sampler_config=config, **kw)


def _hf_greedy(model, prompt, n) -> list[int]:
    gc = copy.deepcopy(model.generation_config)
    gc.update(eos_token_id=None, pad_token_id=0, max_new_tokens=n, do_sample=False)
    ids = torch.tensor([prompt])
    with torch.no_grad():  # explicit mask: prompts may contain the pad id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    return out[0, len(prompt) :].tolist()


def _greedy(slot, prompt, n, **kw) -> SampleInput:
    return SampleInput(slot, np.array(prompt), SamplingParams(max_tokens=n, temperature=0.0, stop=[]), **kw)


def _adapters(worker, configs, seed=100, scale=0.05):
    slots = [worker.create_adapter(c) for c in configs]
    for i, s in enumerate(slots):
        randomise(worker.adapter(s), seed=seed + i, scale=scale)
    return slots


def _no_leak(worker):
    eng = worker.sampler
    assert eng.cache.free_pages == eng.cache.usable_pages
    assert eng.scheduler.reserved_pages == 0 and eng.scheduler.reserved_rows == 0


# -- greedy against transformers / PEFT -----------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_greedy_matches_hf_generate(family, hf_models):
    hf, path = hf_models[family]
    worker = _worker(path)
    prompts = random_sequences(VOCAB, [5, 3, 13, 1], seed=7)
    outs = worker.sample([_greedy(0, p, 12) for p in prompts])
    for p, out in zip(prompts, outs):
        (seq,) = out.sequences
        assert seq.tokens.tolist() == _hf_greedy(hf, p, 12)
        assert seq.stop_reason == "length"
    _no_leak(worker)


def test_greedy_with_adapter_matches_peft_generate(hf_models):
    _, path = hf_models["qwen3"]
    worker = _worker(path)
    (slot,) = _adapters(worker, [LoraConfig(rank=4, alpha=8.0, seed=1)], scale=0.2)
    peft = peft_model_like(build_hf_model("qwen3"), worker.adapter(slot))
    prompts = random_sequences(VOCAB, [6, 9], seed=3)
    outs = worker.sample([_greedy(slot, p, 10) for p in prompts] + [_greedy(0, p, 10) for p in prompts])
    for p, out in zip(prompts, outs[:2]):
        assert out.sequences[0].tokens.tolist() == _hf_greedy(peft, p, 10)
    # the adapter really changes the greedy chain (else the test could not tell adapters apart)
    assert any(a.sequences[0].tokens.tolist() != b.sequences[0].tokens.tolist() for a, b in zip(outs[:2], outs[2:]))


def test_sliding_window_decode_matches_hf(tmp_path):
    hf = build_hf_model("qwen3", use_sliding_window=True, sliding_window=3, max_window_layers=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    worker = _worker(save_hf_model(hf, tmp_path / "swa"))
    prompts = random_sequences(VOCAB, [7, 2], seed=11)
    outs = worker.sample([_greedy(0, p, 9) for p in prompts])
    for p, out in zip(prompts, outs):
        assert out.sequences[0].tokens.tolist() == _hf_greedy(hf, p, 9)


# -- logprobs against the trainer -----------------------------------------------------------------


def _trainer_distribution(worker, slot, tokens) -> np.ndarray:
    """Log-probabilities of every vocabulary token at every position of ``tokens[:-1]``, from the
    trainer's forward pass (2-D targets over the whole vocabulary)."""
    n = len(tokens) - 1
    targets = np.tile(np.arange(VOCAB), (n, 1))
    datum = Datum(np.array(tokens[:-1]), {"target_tokens": targets, "weights": np.zeros((n, VOCAB), np.float32)})
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, [datum], "cross_entropy", forward_only=True)])
    return out.logprobs[0]


@pytest.mark.parametrize("family,softcap,static", [("qwen3", None, False), ("qwen3", 5.0, False), ("qwen3_moe", None, False),
                                                   ("qwen3", None, True), ("qwen3_moe", None, True)])
def test_sampler_logprobs_equal_trainer_logprobs(family, softcap, static, hf_models):
    """Sampled, prompt and target logprobs equal the trainer's; ``static``: the static decoder's
    steps, and prefill passes through its adapter stacks (``StaticDecoder.prefill_route``)."""
    _, path = hf_models[family]
    worker = _worker(path, dataclasses.replace(CFG, static_decode=static))
    passes = []
    if static:
        route = worker.sampler.static.prefill_route
        worker.sampler.static.prefill_route = lambda *a: passes.append(a) or route(*a)
    worker.model.final_logit_softcap = softcap
    (slot,) = _adapters(worker, [LoraConfig(rank=4, alpha=16.0, seed=2)], scale=0.1)  # attn, mlp, unembed
    prompt = random_sequences(VOCAB, [9], seed=5)[0]
    P, k = len(prompt), 3
    targets = np.array(random_sequences(VOCAB, [2 * (P - 1)], seed=6)[0]).reshape(P - 1, 2)
    targets[1, 0] = targets[4, 1] = -1
    req = SampleInput(
        slot,
        np.array(prompt),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[]),
        num_samples=2,
        prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=k,
        target_prompt_logprobs=targets,
    )
    last_n = dataclasses.replace(req, prompt_logprobs=False, prompt_logprobs_last_n=3, target_prompt_logprobs=None)
    out, out_last = worker.sample([req, last_n])
    for seq in out.sequences:
        full = _trainer_distribution(worker, slot, prompt + seq.tokens.tolist())  # [P + G - 1, V]
        gen = full[P - 1 :]
        np.testing.assert_allclose(seq.logprobs, gen[np.arange(len(seq.tokens)), seq.tokens], atol=1e-4, rtol=0)
        order = np.argsort(-gen, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(seq.topk_ids, order)
        np.testing.assert_allclose(seq.topk_logprobs, np.take_along_axis(gen, order, 1), atol=1e-4, rtol=0)
    prompt_ref = full[: P - 1]
    assert np.isnan(out.prompt_logprobs[0])
    np.testing.assert_allclose(out.prompt_logprobs[1:], prompt_ref[np.arange(P - 1), prompt[1:]], atol=1e-4, rtol=0)
    order = np.argsort(-prompt_ref, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(out.topk_prompt_ids[1:], order)
    np.testing.assert_allclose(out.topk_prompt_logprobs[1:], np.take_along_axis(prompt_ref, order, 1), atol=1e-4)
    assert out.topk_prompt_ids[0].tolist() == [0] * k and out.topk_prompt_logprobs[0].tolist() == [-99999.0] * k
    expect = np.where(targets < 0, 0.0, np.take_along_axis(prompt_ref, np.maximum(targets, 0), 1))
    np.testing.assert_allclose(out.target_prompt_logprobs, expect, atol=1e-4, rtol=0)
    # prompt_logprobs_last_n: NaN (and empty top-k) before the last 3 positions, the same values after
    assert np.isnan(out_last.prompt_logprobs[: P - 3]).all()
    np.testing.assert_allclose(out_last.prompt_logprobs[P - 3 :], out.prompt_logprobs[P - 3 :], atol=1e-6)
    assert (out_last.topk_prompt_logprobs[: P - 3] == -99999.0).all()
    np.testing.assert_array_equal(out_last.topk_prompt_ids[P - 3 :], out.topk_prompt_ids[P - 3 :])
    # the same seed gives the same samples in another batch composition (request alone)
    (alone,) = worker.sample([req])
    for a, b in zip(alone.sequences, out.sequences):
        assert a.tokens.tolist() == b.tokens.tolist()
    assert (worker.sampler.static is not None) == static and bool(passes) == static


# -- sampling parameters --------------------------------------------------------------------------


def _tokens(out) -> list[list[int]]:
    return [s.tokens.tolist() for s in out.sequences]


def test_seeds_reproducible_and_samples_differ(hf_models):
    _, path = hf_models["qwen3"]
    worker = _worker(path)
    prompt = np.array(random_sequences(VOCAB, [6], seed=1)[0])

    def req(seed, n=1, **p):
        return SampleInput(0, prompt, SamplingParams(max_tokens=8, seed=seed, stop=[], **p), num_samples=n)

    a, b, c, _ = worker.sample([req(11, 4), req(11, 1), req(12, 4), req(5, 3, temperature=0.5)])
    (again,) = worker.sample([req(11, 4)])
    assert _tokens(again) == _tokens(a)  # same request + seed, different batch
    assert _tokens(b)[0] == _tokens(a)[0]  # sample 0 of 4 = the single sample with that seed
    assert len({tuple(t) for t in _tokens(a)}) == 4  # samples of one request differ
    assert _tokens(c) != _tokens(a)  # another seed, other samples
    (unseeded1, unseeded2) = worker.sample([req(None, 2), req(None, 2)])
    assert _tokens(unseeded1) != _tokens(unseeded2)
    assert derive_seed(11, 0) != derive_seed(11, 1) != derive_seed(12, 0)


def test_seeded_uniforms_are_the_scalar_numbers():
    """A decode step's uniforms, hashed for all rows at once in NumPy, are bit for bit the scalar
    hash's (full 64-bit seeds, negative seeds masked, steps from 0 up)."""
    from ember.core.sampling.logits import seeded_uniform, seeded_uniforms

    rng = np.random.default_rng(0)
    seeds = [int(x) for x in rng.integers(0, 2**63, 200)] + [2**64 - 1, 0, -5, derive_seed(7, 3)]
    steps = [int(x) for x in rng.integers(0, 70_000, len(seeds))]
    got = seeded_uniforms(seeds, steps)
    assert got.dtype == np.float64 and got.shape == (len(seeds),)
    assert got.tolist() == [seeded_uniform(a, b) for a, b in zip(seeds, steps)]
    assert ((got > 0) & (got < 1)).all()


def _expected_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference of the filtered sampling distribution (top-k, then top-p on the renormalised
    probabilities, keeping the smallest most-likely set reaching top_p)."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if top_k > 0:
        p[top_k:] = 0
        p /= p.sum()
    if top_p < 1:
        before = np.cumsum(p) - p
        p[before >= top_p] = 0
        p /= p.sum()
    out = np.zeros_like(p)
    out[order] = p
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, -1, 1.0), (1.3, 5, 1.0), (1.0, -1, 0.6), (0.8, 8, 0.7)])
def test_sampling_follows_filtered_distribution(temperature, top_k, top_p, hf_models):
    hf, path = hf_models["qwen3"]
    n = 4000
    worker = _worker(path, SamplerConfig(max_seqs=8, page_size=4, kv_tokens=256))
    prompt = random_sequences(VOCAB, [6], seed=2)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1].double().numpy()
    expect = _expected_probs(logits, temperature, top_k, top_p)
    params = SamplingParams(max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=9, stop=[])
    (out,) = worker.sample([SampleInput(0, np.array(prompt), params, num_samples=n)])
    counts = np.bincount([s.tokens[0] for s in out.sequences], minlength=VOCAB)
    assert counts[expect == 0].sum() == 0, "sampled a token outside the top-k/top-p support"
    big = expect * n >= 20
    sigma = np.sqrt(n * expect * (1 - expect))
    assert np.all(np.abs(counts - n * expect)[big] <= 5 * sigma[big] + 1)
    rest = (~big) & (expect > 0)
    assert abs(counts[rest].sum() - n * expect[rest].sum()) <= 5 * np.sqrt(n * expect[rest].sum()) + 2
    assert big.sum() >= 2  # the check has something to bite on


def test_stop_forms(hf_models):
    hf, path = hf_models["qwen3"]
    worker = _worker(path)
    prompt = random_sequences(VOCAB, [5], seed=4)[0]
    ref = _hf_greedy(hf, prompt, 12)

    def first(pred) -> int:
        return next(i for i in range(len(ref)) if pred(ref[: i + 1]))

    eos = ref[3]
    worker.config = dataclasses.replace(worker.config, eos_token_ids=(eos,))

    def detok(ids):
        return "".join(f"<{i}>" for i in ids)

    cases = [  # (stop, max_tokens, expected length, expected reason)
        (None, 12, first(lambda t: t[-1] == eos) + 1, "stop"),
        ([], 12, 12, "length"),
        (None, first(lambda t: t[-1] == eos), first(lambda t: t[-1] == eos), "length"),
        (None, first(lambda t: t[-1] == eos) + 1, first(lambda t: t[-1] == eos) + 1, "stop"),
        ([ref[5], 319], 12, first(lambda t: t[-1] in (ref[5], 319)) + 1, "stop"),
        ([[ref[6], ref[7]]], 12, first(lambda t: t[-2:] == ref[6:8]) + 1, "stop"),
        (f"<{ref[4]}><{ref[5]}>", 12, first(lambda t: f"<{ref[4]}><{ref[5]}>" in detok(t)) + 1, "stop"),
        (f"<{ref[2]}><{ref[3]}", 12, first(lambda t: f"<{ref[2]}><{ref[3]}" in detok(t)) + 1, "stop"),
        ([f"<{ref[9]}>", "<9999>"], 12, first(lambda t: f"<{ref[9]}>" in detok(t)) + 1, "stop"),
        (detok(ref[6:9]), 12, first(lambda t: detok(ref[6:9]) in detok(t)) + 1, "stop"),
    ]
    reqs = [
        SampleInput(0, np.array(prompt), SamplingParams(max_tokens=m, temperature=0.0, stop=s)) for s, m, _, _ in cases
    ]
    outs = worker.sample(reqs, detokenize=detok)
    for (stop, _, n, reason), out in zip(cases, outs):
        (seq,) = out.sequences
        assert seq.tokens.tolist() == ref[:n], stop
        assert seq.stop_reason == reason, stop
    # stop strings without the tokenizer fail alone, with a message
    err, ok = worker.sample([reqs[6], reqs[1]])
    assert isinstance(err, RequestError) and "tokenizer" in err.message
    assert ok.sequences[0].tokens.tolist() == ref


# -- adapters: mixed batches, snapshots, checkpoints ----------------------------------------------


CONFIGS = [
    LoraConfig(rank=2, alpha=4.0, seed=1),
    LoraConfig(rank=8, alpha=16.0, seed=3, targets=frozenset({"attn"})),
    LoraConfig(rank=4, alpha=8.0, seed=4, targets=frozenset({"mlp", "unembed"})),
]


def _mixed_requests(slots, first_tokens: int = 6):
    prompts = random_sequences(VOCAB, [4, 11, 7, 2, 9, 5], seed=21)
    reqs = []
    for i, p in enumerate(prompts):
        slot = ([0] + slots)[i % (len(slots) + 1)]
        if i % 2:
            params = SamplingParams(max_tokens=first_tokens + i, temperature=1.0, top_k=40, seed=i, stop=[])
        else:
            params = SamplingParams(max_tokens=first_tokens + i, temperature=0.0, stop=[])
        reqs.append(SampleInput(slot, np.array(p), params, num_samples=1 + i % 3))
    return reqs


# request i samples INTERPRETED_FIRST_TOKENS + i tokens where every step runs under Triton's
# interpreter (2 to 7 decode steps; the PyTorch paths' tests take 6 to 11)
INTERPRETED_FIRST_TOKENS = 2


def static_decode_requests(worker, first_tokens: int = 6) -> list[SampleInput]:
    """The requests the static decoder's tests decode: :func:`_mixed_requests` over three
    adapters (one without MLP LoRA), with request 1 on the base model among adapted ones; request
    ``i`` samples ``first_tokens + i`` tokens (fewer where each step runs under Triton's
    interpreter: the sequences still end at different steps)."""
    reqs = _mixed_requests(_adapters(worker, CONFIGS), first_tokens)
    reqs[1] = dataclasses.replace(reqs[1], slot=0)
    return reqs


def decoded(results) -> list:
    """Each result's sequences as ``[tokens, logprobs]`` lists (JSON: from a subprocess)."""
    return [[[s.tokens.tolist(), np.asarray(s.logprobs, np.float64).tolist()] for s in r.sequences] for r in results]


def assert_equals_eager(path, got: list, first_tokens: int = 6) -> None:
    """``got`` (:func:`decoded`) holds the eager decoder's tokens, and its logprobs to 1e-5, for
    :func:`static_decode_requests` (with ``first_tokens``) on the model at ``path`` (computed here,
    in this process: the PyTorch paths, not the Triton interpreter's)."""
    worker = _worker(path, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024))
    want = decoded(worker.sample(static_decode_requests(worker, first_tokens)))
    assert worker.sampler.static is None
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        for (_, g_lp), (_, w_lp) in zip(g, w, strict=True):
            np.testing.assert_allclose(g_lp, w_lp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_mixed_adapters_equal_alone(family, hf_models):
    _, path = hf_models[family]
    worker = _worker(path, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024))
    slots = _adapters(worker, CONFIGS)
    reqs = _mixed_requests(slots)
    alone = [worker.sample([r])[0] for r in reqs]
    together = worker.sample(reqs[::-1])[::-1]
    for a, b in zip(alone, together):
        assert _tokens(a) == _tokens(b)
        for x, y in zip(a.sequences, b.sequences):
            np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-5, rtol=0)
    # each adapter's requests really differ from the base model's
    base = worker.sample([dataclasses.replace(r, slot=0) for r in reqs])
    assert sum(_tokens(a) != _tokens(b) for a, b in zip(base, together)) >= 3
    _no_leak(worker)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_static_decode_path_equals_eager(family, hf_models):
    """The static-shape decode step (bucket padding, stacked LoRA through grouped products, routed
    experts with their LoRA stacked per expert group; what CUDA graphs capture) gives the eager
    step's tokens and logprobs, with mixed adapters (one without expert LoRA) and base rows."""
    _, path = hf_models[family]
    worker = _worker(path, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024, static_decode=True))
    got = decoded(worker.sample(static_decode_requests(worker)))
    assert worker.sampler.static is not None
    assert_equals_eager(path, got)


def _overlap_run(path, overlap: bool, prompts, stops):
    """Requests through the engine's own loop (static decoder), three of them submitted after the
    third step; returns the results, how many steps ended with a step queued, and the rows the
    decoder ran."""
    from ember.core.sampling import StopRule

    worker = _worker(path, SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024, static_decode=True,
                                         overlap_decode=overlap))
    slots = _adapters(worker, CONFIGS)
    eng = worker.sampler
    rows = []
    run = eng.static.run
    eng.static.run = lambda batch, *a: rows.append(len(batch)) or run(batch, *a)

    def req(i, p):
        return GenerationRequest(p, [1, 2, 6, 9, 4, 11, 7][i], [10 + i, 20 + i][: 1 + i % 2],
                                 slot=([0] + slots)[i % 4], temperature=[0.0, 1.0, 0.7][i % 3],
                                 stop=stops if i % 3 == 1 else StopRule(), topk_sample=2 if i == 6 else 0)

    handles = [eng.submit(req(i, p)) for i, p in enumerate(prompts[:4])]
    done, queued = {}, 0
    for k in range(300):
        if k == 3:  # these join while a step is queued
            handles += [eng.submit(req(i, p)) for i, p in enumerate(prompts[4:], start=4)]
        done.update(eng.step())
        queued += eng._inflight is not None
        if k > 3 and eng.idle:
            break
    assert eng.idle and eng._inflight is None
    _no_leak(worker)
    return [done[h] for h in handles], queued, sum(rows)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_overlapped_decode_gives_the_same_samples(family, hf_models):
    """``overlap_decode`` queues each static decode step before the previous one is read back
    (inputs from its draws on the device): the same tokens and logprobs as steps read back at
    once, with rows ending by length and by stop tokens, several samples per request, mixed
    adapters, requests joining while a step is queued, and one that asks for top-k logprobs (its
    steps run synchronously); nothing is left queued or reserved after the run, and the only rows
    decoded for nothing are one step of each sequence a stop token ended."""
    from ember.core.sampling import StopRule

    _, path = hf_models[family]
    prompts = random_sequences(VOCAB, [5, 9, 3, 12, 7, 4, 8], seed=41)
    stops = StopRule(token_ids=frozenset(range(1, VOCAB, 3)))  # a third of the vocabulary: stops early
    (plain, q0, rows0), (overlapped, q1, rows1) = (_overlap_run(path, o, prompts, stops) for o in (False, True))
    assert q0 == 0 and q1 > 5
    assert {s.stop_reason for r in overlapped for s in r.sequences} == {"stop", "length"}
    stopped = sum(s.stop_reason == "stop" for r in overlapped for s in r.sequences)
    assert rows0 <= rows1 <= rows0 + stopped
    for a, b in zip(plain, overlapped):
        for x, y in zip(a.sequences, b.sequences):
            assert x.tokens.tolist() == y.tokens.tolist() and x.stop_reason == y.stop_reason
            np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-5, rtol=0)
            if x.topk_ids is not None:
                assert np.array_equal(x.topk_ids, y.topk_ids)


def _train(worker, slot, steps=3):
    seq = random_sequences(VOCAB, [12], seed=8)[0]
    datum = Datum(np.array(seq[:-1]), {"target_tokens": np.array(seq[1:]), "weights": np.ones(11, np.float32)})
    for _ in range(steps):
        worker.forward_backward([ForwardBackwardInput(slot, [datum], "cross_entropy")])
        worker.optim_step(slot, AdamParams(learning_rate=5e-2))


def _probe(slot):
    prompts = random_sequences(VOCAB, [6, 3], seed=31)
    return [
        _greedy(slot, prompts[0], 8),
        SampleInput(slot, np.array(prompts[1]), SamplingParams(max_tokens=8, seed=4, stop=[]), num_samples=2),
    ]


@pytest.mark.parametrize("static", [False, True])
def test_snapshot_keeps_sampling_old_weights(static, hf_models):
    _, path = hf_models["qwen3"]
    worker = _worker(path, dataclasses.replace(CFG, static_decode=static))
    (slot,) = _adapters(worker, [LoraConfig(rank=4, alpha=8.0, seed=5)])
    before = worker.sample(_probe(slot))
    snap = worker.snapshot_adapter(slot)
    assert snap != slot and worker.adapter(snap).optimizer.opt.state == {}
    _train(worker, slot)
    after_snap = worker.sample(_probe(snap))
    after_live = worker.sample(_probe(slot))
    for a, b in zip(before, after_snap):
        assert _tokens(a) == _tokens(b)
        for x, y in zip(a.sequences, b.sequences):
            np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-6, rtol=0)
    # training moved the live adapter: its samples (and their logprobs) change, the snapshot's did not
    moved = max(
        np.abs(x.logprobs[:1] - y.logprobs[:1]).max()
        for a, b in zip(before, after_live)
        for x, y in zip(a.sequences, b.sequences)
    )
    assert moved > 1e-3


def test_sample_from_saved_checkpoint(hf_models, tmp_path):
    _, path = hf_models["qwen3"]
    worker = _worker(path)
    (slot,) = _adapters(worker, [LoraConfig(rank=4, alpha=8.0, seed=6)])
    worker.save_adapter(slot, tmp_path / "ckpt", with_optimizer=False)
    expect = worker.sample(_probe(slot))
    fresh = _worker(path)  # as another process would
    loaded = fresh.load_adapter(tmp_path / "ckpt", with_optimizer=False)
    got = fresh.sample(_probe(loaded))
    for a, b in zip(expect, got):
        assert _tokens(a) == _tokens(b)
        for x, y in zip(a.sequences, b.sequences):
            np.testing.assert_allclose(y.logprobs, x.logprobs, atol=1e-6, rtol=0)


# -- continuous batching --------------------------------------------------------------------------


def test_continuous_batching_requests_join_midway(hf_models):
    hf, path = hf_models["llama"]
    worker = _worker(path)
    engine = SamplingEngine(worker.model, worker.bank, SamplerConfig(max_seqs=2, page_size=4, kv_tokens=512))
    prompts = random_sequences(VOCAB, [5, 8, 3, 6, 4], seed=12)
    lengths = [10, 4, 7, 3, 6]
    refs = [_hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]

    def req(i):
        return GenerationRequest(prompts[i], lengths[i], [0], temperature=0.0)

    # (a) five requests, two rows: the rest wait and join as rows free up
    results = engine.generate([req(i) for i in range(5)])
    assert [r.sequences[0].tokens.tolist() for r in results] == refs
    assert max(b for b, _ in engine.stats.step_times) == 2
    # (b) requests submitted while another is decoding
    h0 = engine.submit(req(0))
    done = {}
    for _ in range(3):
        done.update(engine.step())
    assert not done and len(engine.scheduler.running) == 1
    h1, h2 = engine.submit(req(1)), engine.submit(req(2))
    while not engine.idle:
        done.update(engine.step())
    assert [done[h].sequences[0].tokens.tolist() for h in (h0, h1, h2)] == refs[:3]
    assert engine.cache.free_pages == engine.cache.usable_pages


def test_admission_waits_for_kv_pages(hf_models):
    hf, path = hf_models["qwen3"]
    worker = _worker(path)
    # 7 usable pages of 4 tokens; each request needs ceil((8 + 6 - 1) / 4) = 4: one runs at a time
    engine = SamplingEngine(worker.model, worker.bank, SamplerConfig(max_seqs=4, page_size=4, kv_tokens=28))
    prompts = random_sequences(VOCAB, [8, 8, 8], seed=14)
    results = engine.generate([GenerationRequest(p, 6, [0], temperature=0.0) for p in prompts])
    assert [r.sequences[0].tokens.tolist() for r in results] == [_hf_greedy(hf, p, 6) for p in prompts]
    assert max(b for b, _ in engine.stats.step_times) == 1
    with pytest.raises(ValueError, match="KV pages"):
        engine.submit(GenerationRequest(prompts[0], 30, [0]))


# -- MoE routing record ---------------------------------------------------------------------------


def _trainer_logprobs(worker, slot, tokens, routing):
    """The trainer's packed forward over ``tokens[:-1]`` (logprobs of ``tokens[1:]``) with a routing
    record or replay."""
    batch = pack([tokens[:-1]], [(slot, False)], "cpu")
    attn = PackedAttention(batch.doc_lengths, torch.device("cpu"))
    ctx = ForwardContext(
        batch.positions,
        lambda i, q, k, v, s, sc: attn(q, k, v, s, sc),
        lora=worker.bank.route(batch.groups),
        seq_lens=batch.doc_lengths,
        routing=routing,
    )
    with torch.no_grad():
        h = worker.model.hidden_states(batch.input_ids, ctx)
        return token_logprobs(h, worker.model.unembed_weight, torch.tensor(tokens[1:]), lora=ctx.lora)


def test_moe_routing_record_matches_trainer_routing(hf_models):
    _, path = hf_models["qwen3_moe"]
    worker = _worker(path)
    (slot,) = _adapters(worker, [LoraConfig(rank=4, alpha=8.0, seed=7)])
    prompt = random_sequences(VOCAB, [7], seed=13)[0]
    req = SampleInput(
        slot, np.array(prompt), SamplingParams(max_tokens=6, seed=2, stop=[]), num_samples=2, record_routing=True
    )
    (out,) = worker.sample([req])
    assert out.routing_layers == (0, 1)
    for seq in out.sequences:
        tokens = prompt + seq.tokens.tolist()
        assert seq.routing.shape == (len(tokens) - 1, 2, 2)
        rec = RoutingRecord(record={})
        _trainer_logprobs(worker, slot, tokens, rec)
        for j, layer in enumerate(out.routing_layers):
            np.testing.assert_array_equal(np.sort(seq.routing[:, j], 1), np.sort(rec.record[layer].numpy(), 1))
        replay = {layer: torch.as_tensor(seq.routing[:, j]) for j, layer in enumerate(out.routing_layers)}
        replayed = _trainer_logprobs(worker, slot, tokens, RoutingRecord(replay=replay))
        np.testing.assert_allclose(seq.logprobs, replayed[len(prompt) - 1 :].numpy(), atol=1e-4, rtol=0)


# -- bad input ------------------------------------------------------------------------------------


def test_bad_requests_fail_alone(hf_models):
    _, path = hf_models["qwen3"]
    worker = _worker(path, max_seq_len=64)
    good = _greedy(0, [1, 2, 3], 5)
    prompt = np.array([4, 5, 6])

    def with_params(**p):
        return SampleInput(0, prompt, SamplingParams(**{"max_tokens": 4, **p}))

    bad = {
        "prompt": SampleInput(0, np.array([], dtype=np.int64), SamplingParams(max_tokens=4)),
        "context length": _greedy(0, list(range(70)), 1),
        "exceeds the context": _greedy(0, [1, 2], 63),
        "max_tokens": with_params(max_tokens=0),
        "temperature": with_params(temperature=-0.5),
        "top_p": with_params(top_p=0.0),
        "top_p=1.5": with_params(top_p=1.5),
        "top_k": with_params(top_k=-2),
        "token ids": SampleInput(0, np.array([1, VOCAB]), SamplingParams(max_tokens=4)),
        "[0, 320)": SampleInput(0, np.array([-1, 2]), SamplingParams(max_tokens=4)),
        "slot 7": SampleInput(7, prompt, SamplingParams(max_tokens=4)),
        "num_samples": SampleInput(0, prompt, SamplingParams(max_tokens=4), num_samples=0),
        "target_prompt_logprobs": SampleInput(
            0, prompt, SamplingParams(max_tokens=4), target_prompt_logprobs=np.zeros((5, 2), np.int64)
        ),
        "stop token ids": with_params(stop=[VOCAB + 3]),
        "concurrent sequences": SampleInput(0, prompt, SamplingParams(max_tokens=4), num_samples=9),
    }
    reqs = [good, *bad.values(), good]
    outs = worker.sample(reqs)
    (expect,) = worker.sample([good])
    assert _tokens(outs[0]) == _tokens(outs[-1]) == _tokens(expect)
    for (word, _), out in zip(bad.items(), outs[1:-1]):
        assert isinstance(out, RequestError), word
        assert word in out.message, (word, out.message)
    _no_leak(worker)


def test_prompt_alternative_draws(hf_models):
    """prompt_alt_tokens_k: k draws per prompt position 1..P-1 with the model's logprobs of them;
    greedy draws are the argmax, seeded draws reproduce, and the logprobs equal the prompt-position
    logprobs of the same tokens (asked as target_prompt_logprobs)."""
    _, path = hf_models["qwen3"]
    worker = _worker(path)
    (slot,) = _adapters(worker, [LoraConfig(rank=4, alpha=8.0, seed=7)])
    prompt = np.array(random_sequences(VOCAB, [9], seed=41)[0])
    P, k = len(prompt), 4
    greedy = SampleInput(slot, prompt, SamplingParams(max_tokens=2, temperature=0.0), prompt_alt_tokens_k=k,
                         topk_prompt_logprobs=1)
    (g,) = worker.sample([greedy])
    assert g.prompt_alt_tokens.shape == (P - 1, k) and g.prompt_alt_logprobs.shape == (P - 1, k)
    assert (g.prompt_alt_tokens == g.topk_prompt_ids[1:, :1]).all()
    np.testing.assert_allclose(g.prompt_alt_logprobs, np.repeat(g.topk_prompt_logprobs[1:, :1], k, 1), atol=1e-5)

    hot = SampleInput(slot, prompt, SamplingParams(max_tokens=2, temperature=1.5, seed=3), prompt_alt_tokens_k=k)
    a, b = worker.sample([hot, hot])
    other = worker.sample([dataclasses.replace(hot, params=SamplingParams(max_tokens=2, temperature=1.5, seed=4))])[0]
    assert (a.prompt_alt_tokens == b.prompt_alt_tokens).all()
    assert (a.prompt_alt_tokens != other.prompt_alt_tokens).any()
    assert len(np.unique(a.prompt_alt_tokens)) > P  # draws, not one token per position
    scored = worker.sample([dataclasses.replace(hot, prompt_alt_tokens_k=0, target_prompt_logprobs=a.prompt_alt_tokens)])
    np.testing.assert_allclose(a.prompt_alt_logprobs, scored[0].target_prompt_logprobs, atol=1e-5)
    assert (a.prompt_alt_logprobs < 0).all() and scored[0].prompt_alt_tokens is None
