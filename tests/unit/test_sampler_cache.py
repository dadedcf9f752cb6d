"""Sampler building blocks: paged decode attention (PyTorch and Triton) against dense attention, the
page allocator's sharing, the recurrent-state store, page reservations."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from ember.core.config import AttentionSpec
from ember.core.layers.attention import sdpa_document
from ember.core.sampling.attention import paged_decode_torch
from ember.core.sampling.kv_cache import OutOfPages, PagedKVCache, RecurrentStateStore
from ember.core.sampling.scheduler import page_reservation
from tests.triton_interp import run_interpreted


def _paged_case(lengths, page=4, hq=6, hkv=2, d=16, dv=12, seed=0, extra_columns=0):
    """Random keys/values of sequences stored in shuffled pages; returns the cache, per-sequence dense
    k/v, queries, block table (``extra_columns`` more than needed, like a decode step's static table)
    and lengths."""
    g = torch.Generator().manual_seed(seed)
    num_pages = max(40, sum((n + page - 1) // page for n in lengths) + 1)
    cache = PagedKVCache(num_pages=num_pages, page_size=page, dtype=torch.float32, device="cpu")
    order = torch.randperm(num_pages - 1, generator=g).tolist()
    for p in order:  # take pages in a random order, so block tables are not contiguous
        cache._free.remove(p + 1)
        cache._free.append(p + 1)
    dense, tables = [], []
    for n in lengths:
        pages = [cache.allocate() for _ in range((n + page - 1) // page)]
        k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, dv, generator=g)
        if n:
            cache.write(0, k, v, torch.tensor(cache.slots(pages, 0, n)))
        dense.append((k, v))
        tables.append(pages)
    if 0 not in cache.k:
        cache.write(0, torch.zeros(0, hkv, d), torch.zeros(0, hkv, dv), torch.zeros(0, dtype=torch.long))
    width = max(len(t) for t in tables) + extra_columns
    bt = torch.zeros(len(lengths), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(len(lengths), hq, d, generator=g)
    return cache, dense, q, bt, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("window", [0, 3, 5])
def test_paged_decode_equals_dense_attention(window):
    lengths = [1, 7, 13, 4, 9]
    cache, dense, q, bt, lens = _paged_case(lengths)
    out = paged_decode_torch(q, cache.k[0], cache.v[0], bt, lens, 0.3, window)
    spec = AttentionSpec("sliding", window) if window else AttentionSpec()
    for i, (n, (k, v)) in enumerate(zip(lengths, dense)):
        # the last query of a causal pass over the sequence = decode of its last token
        qs = torch.zeros(n, q.shape[1], q.shape[2])
        qs[-1] = q[i]
        ref = sdpa_document(qs, k, v, spec, 0.3)[-1]
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_paged_decode_triton_kernel_matches_reference():
    """The flash-decoding kernel (BLOCK_N tokens over several pages per step, split-K over the
    sequence, merge kernel) against the reference, under Triton's interpreter: empty, 1-token,
    page-boundary and multi-block/multi-split lengths, pages of 4 and 16, windows shorter and
    longer than the sequences, GQA groups of 1, 3, 4 and 8, Dv != D and head dims that are not
    powers of two; one KV head a program and several."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import torch
        from tests.triton_interp import patch_interpreter
        patch_interpreter()

        from ember.core.kernels import fused, paged_decode
        from ember.core.kernels.paged_decode import paged_decode_triton
        from ember.core.sampling.attention import paged_decode_attention, paged_decode_torch
        from tests.unit.test_sampler_cache import _paged_case
        assert fused.use_triton(torch.zeros(1))

        def check(lengths, windows, splits, **kw):
            for window in windows:
                cache, _, q, bt, lens = _paged_case(lengths, seed=window, **kw)
                ref = paged_decode_torch(q, cache.k[0], cache.v[0], bt, lens, 0.3, window)
                for ns in splits:
                    if ns == "dispatch":
                        got = paged_decode_attention(q, cache.k[0], cache.v[0], bt, lens, 0.3, window)
                    else:
                        got = paged_decode_triton(q, cache.k[0], cache.v[0], bt, lens, 0.3, window, num_splits=ns)
                    assert got.shape == ref.shape, (got.shape, ref.shape)
                    err = (got - ref).abs().max().item()
                    assert err < 1e-5, (lengths, window, ns, kw, err)
                    for i, n in enumerate(lengths):
                        if n == 0:
                            assert got[i].abs().max().item() == 0.0  # length-0 (padding) row

        # short sequences (one 64-token block): GQA 3 and 1, Dv != D, the dispatcher
        for hq, dv in ((6, 12), (2, 16)):
            check([1, 7, 13, 0, 9], (0, 3, 6), ("dispatch", 1, 2), hq=hq, dv=dv)
        # page 4: page-boundary lengths and up to 9 blocks of 64 (splits take >= 2 blocks: up to 4);
        # windows inside one block, across blocks and splits, and longer than every sequence;
        # default splits, one, and two
        long4 = [0, 1, 4, 5, 63, 64, 65, 129, 300, 520]
        check(long4, (0, 5, 300, 1000), (None, 1, 2), page=4, hq=3, hkv=1, d=16, dv=16)
        # page 16, a static table wider than needed, GQA 4, non-power-of-two head dims (24 -> 32, 20)
        long16 = [0, 1, 16, 17, 64, 65, 190, 257, 420]
        check(long16, (0, 7, 70), (None, 1, 3), page=16, hq=4, hkv=1, d=24, dv=20, extra_columns=40)
        # GQA 8 with two KV heads, page 16; GQA 1 (MHA) with Dv > D
        check([1, 16, 33, 150], (0, 40), (None, 2), page=16, hq=16, hkv=2, d=16, dv=16)
        check([0, 3, 80, 200], (0, 9), (None,), page=4, hq=2, hkv=2, d=12, dv=32)
        # several KV heads a program (forced: shapes this small choose one): 2 and 4 of 8 KV heads
        # with GQA 4 (Qwen3-8B's), 4 a program of 3 KV heads (a group's last head past the end)
        for heads in (2, 4):
            paged_decode._DECODE_LAUNCH["heads"] = heads
            check([0, 1, 16, 17, 64, 150], (0, 20), (None, 1, 3), page=16, hq=32, hkv=8, d=16, dv=16)
            check([1, 7, 40, 0], (0,), (1, 2), page=4, hq=6, hkv=3, d=16, dv=12)
        print("ok")
        """
    )
    assert "ok" in run_interpreted(script, timeout=300)


def test_decode_heads_choice():
    """KV heads a split-kernel program takes: enough to fill the tile's 16 rows with query heads, as
    long as the programs still make 3 an SM (132 SMs on the CPU) without splits; at most 16 keys a
    head of a step's 64 (32 for heads wider than 128: two heads at most); forced by the launch."""
    from ember.core.kernels import paged_decode
    from ember.core.kernels.paged_decode import _decode_heads

    cpu = torch.device("cpu")
    assert [_decode_heads(b, 8, 4, 64, cpu) for b in (1, 64, 98, 99, 197, 198, 256, 512)] == [1, 1, 1, 2, 2, 4, 4, 4]
    assert _decode_heads(512, 8, 8, 64, cpu) == 2  # GQA 8: two heads fill 16 rows
    assert _decode_heads(512, 8, 16, 64, cpu) == 1
    assert _decode_heads(512, 8, 1, 64, cpu) == 4  # MHA: 16 keys a head of 64
    assert _decode_heads(512, 8, 2, 32, cpu) == 2  # wide heads: 32 keys a step
    assert _decode_heads(512, 2, 1, 64, cpu) == 2  # no more heads than the model has
    paged_decode._DECODE_LAUNCH["heads"] = 4
    try:
        assert _decode_heads(1, 8, 4, 64, cpu) == 4 and _decode_heads(1, 3, 4, 64, cpu) == 4
    finally:
        paged_decode._DECODE_LAUNCH["heads"] = None


def _shared_case(groups, page=4, hq=8, hkv=2, d=16, dv=16, seed=0, extra_columns=3):
    """Rows whose block tables begin with shared pages, as the prefix cache and forks leave them:
    ``groups`` lists ``(shared tokens, [each row's own tokens after them])`` (shared: whole pages);
    a group's rows hold the same page ids for the shared part. Random keys and values in every page
    (shuffled); returns the cache, queries, block table, lengths."""
    g = torch.Generator().manual_seed(seed)
    need = sum(p // page + sum(-(-n // page) for n in own) for p, own in groups)
    cache = PagedKVCache(num_pages=need + 8, page_size=page, dtype=torch.float32, device="cpu")
    order = torch.randperm(need + 7, generator=g).tolist()
    for p in order:  # pages in a random order, so tables are not contiguous
        cache._free.remove(p + 1)
        cache._free.append(p + 1)
    tables, lengths = [], []
    for shared, own in groups:
        assert shared % page == 0
        common = [cache.allocate() for _ in range(shared // page)]
        for n in own:
            tables.append(common + [cache.allocate() for _ in range(-(-n // page))])
            lengths.append(shared + n)
    cache.write(0, torch.zeros(0, hkv, d), torch.zeros(0, hkv, dv), torch.zeros(0, dtype=torch.long))
    cache.k[0].copy_(torch.randn(cache.num_pages, page, hkv, d, generator=g))
    cache.v[0].copy_(torch.randn(cache.num_pages, page, hkv, dv, generator=g))
    width = max(len(t) for t in tables) + extra_columns
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.randn(len(tables), hq, d, generator=g)
    return cache, q, bt, torch.tensor(lengths, dtype=torch.int32)


def test_shared_prefix_decode_kernel_matches_reference():
    """Cascade attention (each group's shared prefix read once by the prefix kernel, each row's
    own tokens by the split kernel, the partials merged) gives the reference's attention, under
    Triton's interpreter: groups of 2 to 20 rows (a group wider than PREFIX_GROUP split over
    lines), prefixes of one to several 64-token blocks and over several splits, rows that do not
    share, a padding row, GQA 4 and 1 (MHA), one and several splits of the rows' own tokens; with
    GQA 32 (a program would take one row) the prefix kernel is not launched."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import numpy as np
        import torch
        from tests.triton_interp import patch_interpreter
        patch_interpreter()

        from ember.core.kernels import paged_decode
        from ember.core.kernels.paged_decode import paged_decode_triton
        from ember.core.sampling.attention import paged_decode_torch, shared_prefix_groups
        from tests.triton_interp import LaunchGrids
        from tests.unit.test_sampler_cache import _shared_case

        def check(groups, splits, page=4, min_tokens=8, shared=True, **kw):
            cache, q, bt, lens = _shared_case(groups, page=page, **kw)
            lens = torch.cat([lens, torch.zeros(1, dtype=torch.int32)])  # a padding row
            bt = torch.cat([bt, torch.zeros(1, bt.shape[1], dtype=torch.int32)])
            q = torch.cat([q, torch.randn(1, *q.shape[1:])])
            pre, members = shared_prefix_groups(bt.numpy(), lens.numpy(), page, min_tokens)
            assert members.shape[0] > 0 and pre.any()
            prefix = (torch.from_numpy(pre), torch.from_numpy(members))
            ref = paged_decode_torch(q, cache.k[0], cache.v[0], bt, lens, 0.3)
            for ns in splits:
                launches = LaunchGrids(paged_decode, "_shared_prefix_kernel")
                got = paged_decode_triton(q, cache.k[0], cache.v[0], bt, lens, 0.3, num_splits=ns, prefix=prefix)
                launches.restore()
                assert len(launches.grids) == int(shared), launches.grids
                err = (got - ref).abs().max().item()
                assert err < 1e-5, (groups, ns, kw, err)
                assert got[-1].abs().max().item() == 0.0

        # GRPO-shaped: groups of rows with a long common prompt and short own tails; prefixes of
        # 1, 3 and 9 blocks (the last over several prefix splits); rows that share nothing
        check([(64, [1, 5, 9]), (192, [2, 3]), (576, [7, 1, 30, 4]), (0, [13]), (0, [70])], (None, 1, 2))
        # a group wider than PREFIX_GROUP (20 rows: two lines); GQA 1 (MHA) with two KV heads
        check([(128, list(range(1, 21))), (32, [3, 3])], (None,), hq=2, hkv=2)
        # page 16, GQA 4, prefix not a multiple of 64 tokens, own tokens over several blocks
        check([(80, [100, 1, 17]), (16, [2, 40])], (None, 3), page=16, hq=4, hkv=1, min_tokens=16)
        # 32 query heads a KV head: a prefix program would take one row, so every row reads its own
        check([(64, [3, 9])], (None,), hq=32, hkv=1, shared=False)
        print("ok")
        """
    )
    assert "ok" in run_interpreted(script, timeout=300)


def test_shared_prefix_groups():
    """Rows group by the deepest page they share with another row: a prompt prefix common to all
    (a system prompt) does not hide the longer prefixes of the groups under it; a row alone at its
    depth, a share shorter than the minimum, padding rows and the page a step writes take no part;
    a group wider than PREFIX_GROUP takes several lines."""
    from ember.core.sampling.attention import PREFIX_GROUP, shared_prefix_groups

    page = 4
    # rows 0-2 share 8 pages; rows 3-4 share 3; all five share the first 2; row 5 shares only those 2
    sys_, a, b = [11, 12], [13, 14, 15, 16, 17, 18], [23]
    tables = [sys_ + a + [30 + i] for i in range(3)] + [sys_ + b + [40 + i] for i in range(2)] + [sys_ + [50, 51]]
    tables += [[60 + i, 70 + i] for i in range(2)]  # no sharing
    tables += [[90, 91, 92, 93, 94, 100 + i] for i in range(20)]  # 20 rows share 5 pages
    tables += [[0]]  # padding
    W = max(map(len, tables))
    table = np.array([t + [0] * (W - len(t)) for t in tables])
    lens = np.array([8 * page + 2] * 3 + [3 * page + 1] * 2 + [3 * page] + [2 * page] * 2 + [5 * page + 4] * 20 + [0])
    pre, members = shared_prefix_groups(table, lens, page, min_tokens=2 * page)
    assert pre[:3].tolist() == [8 * page] * 3 and pre[3:5].tolist() == [3 * page] * 2
    assert pre[5] == 0  # shares 2 pages, but no other row's deepest shared page is its own
    assert pre[6:8].tolist() == [0, 0] and pre[-1] == 0
    assert pre[8:28].tolist() == [5 * page] * 20
    lines = sorted(tuple(int(x) for x in m if x >= 0) for m in members)
    assert lines == sorted([(0, 1, 2), (3, 4), tuple(range(8, 8 + PREFIX_GROUP)), tuple(range(8 + PREFIX_GROUP, 28))])
    # the page a row writes (its last, partly filled) is never counted: rows 3-4 at exactly 3 pages
    lens2 = lens.copy()
    lens2[3:5] = 3 * page  # the new token at position 3 * page - 1: in the third page
    pre2, _ = shared_prefix_groups(table, lens2, page, min_tokens=2 * page)
    assert pre2[3:5].tolist() == [2 * page] * 2 and pre2[5] == 2 * page  # now the system prompt's group
    # a minimum above every share: no group
    pre3, members3 = shared_prefix_groups(table, lens, page, min_tokens=64 * page)
    assert not pre3.any() and members3.shape == (0, PREFIX_GROUP)


def _prefix_groups_by_rows(table, lens, page, min_tokens):
    """:func:`shared_prefix_groups`'s rule row by row in plain Python: ``{row: shared tokens}``
    and the groups as sets of rows."""
    full = [min(max(n - 1, 0) // page, table.shape[1]) for n in lens]
    held = {}
    for r, f in enumerate(full):
        for p in table[r, :f]:
            held[p] = held.get(p, 0) + 1
    by_page = {}
    for r, f in enumerate(full):
        depth = 0
        while depth < f and table[r, depth] != 0 and held[table[r, depth]] >= 2:
            depth += 1
        if depth and depth * page >= min_tokens:
            by_page.setdefault(table[r, depth - 1], []).append((r, depth))
    shared, groups = {}, []
    for rows in by_page.values():
        if len(rows) >= 2:
            shared.update({r: d * page for r, d in rows})
            groups.append({r for r, _ in rows})
    return shared, groups


def test_shared_prefix_groups_on_random_prefix_trees():
    """Random prefix trees of pages (rows that take a leading part of an earlier row's pages, then
    pages of their own), every minimum length: the same groups as the rule applied row by row."""
    from ember.core.sampling.attention import PREFIX_GROUP, shared_prefix_groups

    rng = np.random.default_rng(0)
    for _ in range(200):
        n, width, page = int(rng.integers(1, 40)), int(rng.integers(1, 10)), int(rng.choice([1, 4, 16]))
        table, lens, rows, fresh = np.zeros((n, width), dtype=np.int32), np.zeros(n, dtype=np.int64), [], 1
        for r in range(n):
            row = rows[int(rng.integers(len(rows)))][: int(rng.integers(width + 1))] if rows and rng.random() < 0.7 else []
            while len(row) < width and rng.random() < 0.8:
                row, fresh = row + [fresh], fresh + 1
            rows.append(row)
            table[r, : len(row)] = row
            lens[r] = int(rng.integers((len(row) - 1) * page + 1, len(row) * page + 1)) if row else 0
        for min_tokens in (0, page, 3 * page):
            pre, members = shared_prefix_groups(table, lens, page, min_tokens)
            shared, groups = _prefix_groups_by_rows(table, lens, page, min_tokens)
            assert {r: int(t) for r, t in enumerate(pre) if t} == shared
            got = {}  # a group's lines: PREFIX_GROUP rows each, the last one padded with -1
            for line in members:
                live = line[line >= 0]
                assert len(live) and (line[len(live):] == -1).all()
                got.setdefault(pre[live[0]] and table[live[0], pre[live[0]] // page - 1], set()).update(live.tolist())
            assert sorted(map(sorted, got.values())) == sorted(map(sorted, groups))
            assert len(members) == sum(-(-len(g) // PREFIX_GROUP) for g in groups)


def test_pages_are_shared_by_forks_and_released():
    cache = PagedKVCache(num_pages=6, page_size=4, dtype=torch.float32, device="cpu")
    pages = [cache.allocate() for _ in range(2)]  # 6 tokens: one full page, one partial
    k = torch.arange(6 * 2 * 3, dtype=torch.float32).view(6, 2, 3)
    cache.write(0, k, -k, torch.tensor(cache.slots(pages, 0, 6)))
    fork = cache.fork(pages, 6)
    assert fork[0] == pages[0] and cache.refcount(pages[0]) == 2  # full page shared
    assert fork[1] != pages[1] and torch.equal(cache.k[0][fork[1]], cache.k[0][pages[1]])  # partial copied
    # writing the fork's next token leaves the original untouched
    cache.write(0, torch.ones(1, 2, 3), torch.ones(1, 2, 3), torch.tensor(cache.slots(fork, 6, 1)))
    assert torch.equal(cache.k[0][pages[1], :2].reshape(2, 2, 3), k[4:6])
    assert cache.k[0][pages[1], 2].abs().sum() == 0 and cache.k[0][fork[1], 2].sum() == 6
    assert cache.free_pages == 2
    cache.release(pages)
    assert cache.refcount(pages[0]) == 1 and cache.free_pages == 3
    cache.release(fork)
    assert cache.free_pages == cache.usable_pages == 5
    held = [cache.allocate() for _ in range(5)]
    assert 0 not in held  # the scratch page is never handed out
    with pytest.raises(OutOfPages):
        cache.allocate()
    with pytest.raises(ValueError):
        cache.release([0])


def test_recurrent_state_store():
    store = RecurrentStateStore()
    first = store.view([1, 2])
    assert first.get(0, "conv") is None  # every sequence starts here
    first.put(0, "conv", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    store.fork(2, 3)
    mixed = store.view([3, 4, 1])  # 4 is new: zeros
    torch.testing.assert_close(mixed.get(0, "conv"), torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 2.0]]))
    mixed.put(0, "conv", torch.tensor([[5.0, 5.0], [6.0, 6.0], [7.0, 7.0]]))
    torch.testing.assert_close(store.view([2]).get(0, "conv"), torch.tensor([[3.0, 4.0]]))  # fork is a copy
    store.free(3)
    assert 3 not in store and 1 in store
    # rows of different lengths (a sequence shorter than a convolution window) are zero-padded
    ragged = store.view([5, 6])
    ragged.put(1, "h", torch.full((2, 3, 1), 2.0))
    store.view([5]).put(1, "h", torch.ones(1, 1, 1))  # a shorter value for 5 alone
    torch.testing.assert_close(store.view([5, 6]).get(1, "h")[:, :, 0], torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]]))
    assert store.view([5]).get(1, "h").shape == (1, 1, 1)  # no longer than the pass's longest value
    store.view([5]).put(1, "h", torch.ones(1, 4, 1))  # a longer one than any before
    assert store.view([6, 5]).get(1, "h").shape == (2, 4, 1)
    with pytest.raises(ValueError):
        ragged.put(1, "h", torch.zeros(3, 1))
    with pytest.raises(ValueError, match="after"):
        ragged.put(1, "h", torch.zeros(2, 3, 2))  # another shape for the same value
    # a freed sequence's row goes to the next one, which reads zeros, not the old values
    store.free(6)
    store.view([1, 7]).put(0, "conv", torch.tensor([[8.0, 8.0], [9.0, 9.0]]))
    assert store.view([7, 1]).get(1, "h") is None  # neither has "h"
    mixed = store.view([7, 5]).get(1, "h")[:, :, 0]  # 7 has the row 6 had: it reads zeros
    torch.testing.assert_close(mixed, torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    # many sequences: the slabs grow, earlier rows keep their values
    store.view(list(range(100, 140))).put(0, "conv", torch.arange(80.0).reshape(40, 2))
    torch.testing.assert_close(store.view([1, 139, 7]).get(0, "conv"), torch.tensor([[8.0, 8.0], [78.0, 79.0], [9.0, 9.0]]))
    # 0-d values (one number per sequence)
    store.view([1, 7]).put(2, "n", torch.tensor([3, 4]))
    assert store.view([7, 1, 100]).get(2, "n").tolist() == [4, 3, 0]


def test_static_state_view():
    """A static-shape decode step's state: fixed device rows (padding rows on scratch row 0), one
    gather and one scatter, the same values as the eager view; versions count reallocations."""
    store = RecurrentStateStore()
    store.view([1, 2, 3]).put(0, "conv", torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]))
    store.view([1, 2, 3]).put(1, "h", torch.ones(3, 2, 1))
    rows = np.full(5, -1, dtype=np.int64)
    store.fill_rows([3, 1], rows)
    assert rows[2:].tolist() == [0, 0, 0] and 0 not in rows[:2] and rows[0] != rows[1]
    static = store.static_view(torch.from_numpy(rows))
    torch.testing.assert_close(static.get(0, "conv")[:2], store.view([3, 1]).get(0, "conv"))
    assert static.get(2, "absent") is None
    static.put(0, "conv", torch.arange(10.0).reshape(5, 2))
    torch.testing.assert_close(store.view([1, 2, 3]).get(0, "conv"), torch.tensor([[2.0, 3.0], [2.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="static-shape"):
        static.put(0, "conv", torch.zeros(5, 3))  # another shape
    with pytest.raises(ValueError, match="static-shape"):
        static.put(3, "new", torch.zeros(5, 3))  # a value no pass has written
    store.view([4]).put(0, "conv", torch.zeros(1, 2))  # 4 has no "h"
    with pytest.raises(ValueError, match="absent or shorter"):
        store.fill_rows([1, 4], rows)
    store.view([5]).put(1, "h", torch.ones(1, 3, 1))  # "h" grows: 1's value is shorter now
    with pytest.raises(ValueError, match="absent or shorter"):
        store.fill_rows([1], rows)
    # more sequences than rows: the slabs are allocated again and the version says so
    version = store.version
    store.view(list(range(100, 140))).put(0, "conv", torch.zeros(40, 2))
    assert store.version > version


def test_page_reservation():
    # 10 prompt tokens + up to 7 new ones -> 16 tokens fed at most -> 4 pages of 4
    assert page_reservation(10, 7, 1, 4) == (0, 4)
    # three samples share the 2 full prompt pages; each owns 2 (its copy of the partial page included)
    assert page_reservation(10, 7, 3, 4) == (2, 2)
    # max_tokens=1: every sample ends at the prefill, only the prompt's pages
    assert page_reservation(10, 1, 50, 4) == (3, 0)
