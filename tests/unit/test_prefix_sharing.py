"""Prefix sharing across requests: prompts that begin with whole KV pages already in the cache (for
the same adapter weights) reuse them and prefill only the rest, with the outputs of an engine that
shares nothing (tokens with fixed seeds, sampled logprobs, stop reasons)."""

from __future__ import annotations

import dataclasses
import textwrap

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.core.config import AttentionSpec
from ember.core.layers.attention import PackedAttention
from ember.core.sampling import GenerationRequest, SamplerConfig
from ember.core.sampling.attention import PrefillAttention
from ember.core.sampling.kv_cache import PagedKVCache, PrefixIndex
from ember.core.sampling.requests import StopRule
from ember.engine.worker import Worker
from tests.lora_helpers import randomise
from tests.tiny_models import build_hf_model, random_sequences, save_hf_model
from tests.triton_interp import run_interpreted

VOCAB = 320
PS = 4
CFG = SamplerConfig(max_seqs=16, page_size=PS, kv_tokens=512)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    save_hf_model(build_hf_model(request.param, seed=1), path)
    return path


def _worker(path, sharing: bool, **cfg) -> Worker:
    config = dataclasses.replace(CFG, prefix_sharing=sharing, **cfg)
    worker = Worker.from_pretrained(path, "cpu", torch.float32, sampler_config=config)
    for i in range(2):
        slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=3 + i))
        randomise(worker.adapter(slot), seed=17 + i, scale=0.1)
    return worker


def _pair(path, **cfg):
    return _worker(path, True, **cfg), _worker(path, False, **cfg)


def _req(prompt, slot=1, seeds=(11, 12), max_tokens=6, **kw) -> GenerationRequest:
    return GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, seeds=list(seeds), slot=slot, **kw)


def _same(a, b):
    for ra, rb in zip(a, b, strict=True):
        for sa, sb in zip(ra.sequences, rb.sequences, strict=True):
            assert sa.tokens.tolist() == sb.tokens.tolist()
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=2e-5, rtol=0)
            assert sa.stop_reason == sb.stop_reason
        for name in ("prompt_logprobs", "topk_prompt_logprobs", "target_prompt_logprobs"):
            x, y = getattr(ra, name), getattr(rb, name)
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_allclose(x, y, atol=2e-5, rtol=0)


def _both(on, off, batches):
    """Run each batch of requests to completion on both engines (one batch after the other)."""
    for reqs in batches:
        _same(on.sampler.generate(reqs), off.sampler.generate(reqs))


def _no_leak(worker):
    eng = worker.sampler
    assert eng.cache.free_pages == eng.cache.usable_pages
    assert eng.scheduler.reserved_pages == 0 and eng.scheduler.reserved_rows == 0


PREFIX = random_sequences(VOCAB, [14], seed=2)[0]  # 3 full pages and 2 tokens
TAILS = random_sequences(VOCAB, [5, 3, 9], seed=3)


def test_shared_prefix_together_and_one_after_the_other(model_path):
    on, off = _pair(model_path)
    eos = StopRule(token_ids=frozenset(range(0, VOCAB, 7)))  # stops early on some samples
    together = [_req(PREFIX + t, stop=eos) for t in TAILS]
    _both(on, off, [together])
    s_on, s_off = on.sampler.stats, off.sampler.stats
    # the 2nd and 3rd prompts reuse the 1st's three full pages (its 4th page is partial)
    assert s_on.prefix_pages_reused == 6 and s_on.prefill_tokens_saved == 24
    assert s_on.prefill_tokens == s_off.prefill_tokens - 24
    assert off.sampler.stats.prefix_pages_reused == 0
    # one after the other: the finished requests' pages stay listed, and are reused
    later = [_req(PREFIX + TAILS[0][:2], seeds=(5,)), _req(PREFIX[:12], seeds=(6, 7), max_tokens=3)]
    _both(on, off, [[r] for r in later])
    assert s_on.prefix_pages_reused == 6 + 3 + 2  # PREFIX[:12] is 3 full pages: the last one is computed
    _no_leak(on)
    _no_leak(off)


def test_pages_are_shared_while_running(model_path):
    on, _ = _pair(model_path)
    eng = on.sampler
    eng.submit(_req(PREFIX + TAILS[0], seeds=(1,), max_tokens=20))
    eng.step()
    eng.submit(_req(PREFIX + TAILS[1], seeds=(2,), max_tokens=20))
    eng.step()
    a, b = sorted(eng.scheduler.running, key=lambda s: s.id)
    assert a.pages[:3] == b.pages[:3] and a.pages[3] != b.pages[3]
    assert all(eng.cache.refcount(p) == 3 for p in a.pages[:3])  # two sequences and the index
    while not eng.idle:
        eng.step()
    assert all(eng.cache.refcount(p) == 1 for p in a.pages[:3])  # the index alone
    _no_leak(on)


def test_multi_turn_episode(model_path):
    """Turn k+1's prompt is turn k's prompt, its completion and new text."""
    on, off = _pair(model_path)
    prompt = list(PREFIX)
    for turn in range(3):
        req = _req(prompt, seeds=(40 + turn,), max_tokens=5)
        (a,), (b,) = on.sampler.generate([req]), off.sampler.generate([req])
        _same([a], [b])
        prompt = prompt + a.sequences[0].tokens.tolist() + TAILS[turn]
    # each turn reuses every full page of the previous turn's prompt and completion (but its last
    # generated token, never fed back): 14 + 4 tokens, then 18 + 5 + 3 + 4 tokens
    assert on.sampler.stats.prefix_pages_reused == 4 + 7
    _no_leak(on)


def test_different_adapters_and_weights_never_share(model_path):
    on, off = _pair(model_path)
    reqs = [_req(PREFIX + TAILS[0], slot=1), _req(PREFIX + TAILS[0], slot=2), _req(PREFIX + TAILS[1], slot=0)]
    _both(on, off, [reqs])
    assert on.sampler.stats.prefix_pages_reused == 0
    # the adapter's weights change in place (as an optimizer step does): its old pages are stale
    for w in (on, off):
        randomise(w.adapter(1), seed=99, scale=0.1)
    _both(on, off, [[_req(PREFIX + TAILS[1], slot=1)]])
    assert on.sampler.stats.prefix_pages_reused == 0
    _both(on, off, [[_req(PREFIX + TAILS[2], slot=1)]])
    assert on.sampler.stats.prefix_pages_reused == 3  # the new weights' pages are shared
    # a new adapter in a freed slot does not read the old one's pages
    for w in (on, off):
        w.sampler.bank.free(2)
        slot = w.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=8))
        assert slot == 2
        randomise(w.adapter(2), seed=23, scale=0.1)
    _both(on, off, [[_req(PREFIX + TAILS[2], slot=2)]])
    assert on.sampler.stats.prefix_pages_reused == 3
    _no_leak(on)


def test_divergence_inside_a_page_shares_only_the_full_pages_before_it(model_path):
    on, off = _pair(model_path)
    other = list(PREFIX)
    other[9] = (other[9] + 1) % VOCAB  # inside the third page
    _both(on, off, [[_req(PREFIX + TAILS[0])], [_req(other + TAILS[1])]])
    assert on.sampler.stats.prefix_pages_reused == 2
    assert on.sampler.stats.prefill_tokens_saved == 8


def test_prompt_side_outputs_prefill_the_whole_prompt(model_path):
    on, off = _pair(model_path)
    asks = [
        dict(prompt_logprobs_from=0),
        dict(prompt_logprobs_from=3, topk_prompt=4),
        dict(prompt_targets=np.zeros((len(PREFIX) + 2, 2), dtype=np.int64)),
    ]
    reqs = [_req(PREFIX + TAILS[0])] + [_req(PREFIX + TAILS[0][:3], **kw) for kw in asks]
    _both(on, off, [reqs])
    assert on.sampler.stats.prefix_pages_reused == 0


def test_memory_pressure_evicts_cached_prefixes(model_path):
    """A cache of 24 pages: the index must give back pages of finished prompts for new ones."""
    on, off = _pair(model_path, kv_tokens=24 * PS)
    prompts = random_sequences(VOCAB, [13] * 6, seed=9)
    batches = []
    for i, p in enumerate(prompts):
        batches.append([_req(p, seeds=(i, i + 50), max_tokens=8), _req(p + TAILS[1], seeds=(i + 100,), max_tokens=8)])
        batches.append([_req(prompts[max(0, i - 1)] + TAILS[0], seeds=(i + 200,), max_tokens=8)])
    eng = on.sampler
    reclaimed = []
    reclaim = eng.cache.reclaim
    eng.cache.reclaim = lambda n: reclaimed.append(reclaim(n)) or reclaimed[-1]
    _both(on, off, batches)
    assert sum(reclaimed) > 0
    assert eng.stats.prefix_pages_reused > 0
    assert len(eng.prefix) > 0
    _no_leak(on)  # listed pages count as free: an allocation reclaims them
    # and an allocation that needs every page takes them all back
    big = _req(random_sequences(VOCAB, [60], seed=4)[0], seeds=(3,), max_tokens=30)
    _both(on, off, [[big]])
    _no_leak(on)


def test_index_reclaims_least_recently_used_leaves_first():
    cache = PagedKVCache(6, 2, torch.float32, "cpu")
    index = PrefixIndex(cache)
    a = [cache.allocate() for _ in range(3)]  # tokens 0..5
    index.insert("k", [0, 1, 2, 3, 4, 5], a, 3)
    b = [cache.share(a[0]), cache.allocate()]  # tokens 0, 1, 7, 7
    index.insert("k", [0, 1, 7, 7], b, 2)
    assert index.match("k", [0, 1, 2, 3, 4, 5, 6], 3) == a
    assert index.match("k", [0, 1, 7, 7], 1) == [a[0]]
    cache.release(a)
    cache.release(b)
    assert cache.free_pages == 5 and len(cache._free) == 1
    assert index.match("k", [0, 1, 7, 7], 2) == b  # b's leaf is now the most recent
    got = [cache.allocate(), cache.allocate()]  # the free page, then a's leaf (least recent)
    assert len(index) == 3 and a[2] in got
    assert index.match("k", [0, 1, 2, 3, 4, 5], 3) == a[:2]
    index.drop_key("k")
    assert len(index) == 0 and cache.free_pages == 3


@pytest.mark.parametrize("window", [None, 5])
def test_continued_prefill_attention_equals_the_whole_prompt(window):
    """Documents continuing a cached prefix attend like the whole prompt in one pass (GQA, sliding)."""
    torch.manual_seed(0)
    ps, Hq, Hkv, D = 4, 4, 2, 8
    spec = AttentionSpec("sliding", window) if window else AttentionSpec("global")
    cache = PagedKVCache(32, ps, torch.float32, "cpu")
    lengths, prefixes = [11, 9, 11, 6], [8, 0, 8, 4]
    tables = [[cache.allocate() for _ in range(-(-n // ps))] for n in lengths]
    q, k, v = (torch.randn(sum(lengths), h, D) for h in (Hq, Hkv, Hkv))
    full = PackedAttention(lengths, torch.device("cpu"))(q, k, v, spec, 0.3)
    starts = np.cumsum([0] + lengths)
    prefix_rows = torch.tensor([j for s, p in zip(starts, prefixes) for j in range(s, s + p)], dtype=torch.long)
    cache.write(0, k[prefix_rows], v[prefix_rows],
                torch.tensor([x for t, p in zip(tables, prefixes) for x in cache.slots(t, 0, p)]))
    rows = torch.tensor([j for s, n, p in zip(starts, lengths, prefixes) for j in range(s + p, s + n)])
    slots = torch.tensor([x for t, n, p in zip(tables, lengths, prefixes) for x in cache.slots(t, p, n - p)])
    attend = PrefillAttention(cache, slots, [n - p for n, p in zip(lengths, prefixes)],
                              prefix_lens=prefixes, block_tables=tables)
    out = attend(0, q[rows], k[rows], v[rows], spec, 0.3)
    torch.testing.assert_close(out, full[rows], atol=1e-6, rtol=1e-5)


def test_recurrent_families_prefill_whole_prompts(tmp_path):
    """Qwen3-Next's linear-attention layers keep per-sequence state the pages do not hold: its
    engine keeps no prefix index, and shared prompts give the outputs of separate prefills."""
    from tests.parity import test_qwen3_next as qwen3_next_parity

    path = tmp_path / "m"
    qwen3_next_parity.build_hf().save_pretrained(str(path))
    on, off = _pair(path)
    assert on.sampler.prefix is None
    _both(on, off, [[_req(PREFIX + t, max_tokens=4) for t in TAILS[:2]], [_req(PREFIX + TAILS[2], max_tokens=4)]])
    assert on.sampler.stats.prefix_pages_reused == 0
    assert on.sampler.stats.prefill_tokens == off.sampler.stats.prefill_tokens


def test_shared_prefix_attention_in_the_engine(tmp_path):
    """Decode steps of sequences that share a prompt's pages (a request's samples, and another
    request of the same prompt through the prefix index) attend that prefix once for the group
    (cascade attention), in the eager decoder and the static one, under Triton's interpreter: the
    tokens and logprobs of an engine that reads each sequence's prefix on its own."""
    pytest.importorskip("triton")
    path = tmp_path / "m"
    save_hf_model(build_hf_model("qwen3", seed=1), path)
    script = textwrap.dedent(
        f"""
        from tests.triton_interp import LaunchGrids, patch_interpreter
        patch_interpreter()
        import numpy as np
        from ember.core.kernels import paged_decode
        from tests.tiny_models import random_sequences
        from tests.unit.test_prefix_sharing import VOCAB, _req, _same, _worker

        # 70 tokens: 17 full pages of 4 (>= the 64 tokens a shared prefix needs)
        prompt, other = random_sequences(VOCAB, [70, 70], seed=4)
        reqs = [_req(prompt, seeds=(1, 2, 3), max_tokens=4), _req(prompt, seeds=(4,), max_tokens=4),
                _req(other, seeds=(5,), max_tokens=4)]
        launches = LaunchGrids(paged_decode, "_shared_prefix_kernel")
        for static in (False, True):
            runs = []
            for shared in (True, False):
                before = len(launches.grids)
                worker = _worker({str(path)!r}, True, shared_prefix_attention=shared, static_decode=static)
                runs.append(worker.sampler.generate(reqs))
                assert (len(launches.grids) > before) == shared, (static, shared, len(launches.grids) - before)
            _same(*runs)
        print("ok")
        """
    )
    assert "ok" in run_interpreted(script, timeout=600)
