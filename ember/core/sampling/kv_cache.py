"""Paged KV cache and per-sequence recurrent state for decoding.

Keys and values of every attention layer live in fixed-size pages (``[num_pages, page_size, Hkv,
D]`` per layer); each sequence owns a block table, the list of its pages in order, so a sequence
grows one page at a time and memory is never reserved for padding. Page 0 is a scratch page that is
never handed out: padded rows of a static-shape decode step write there, and block tables are
padded with it.

Pages are reference-counted. The samples of one prompt share the prompt's full pages (a *fork*);
only a sequence's last, partly filled page is ever written, and a fork copies that one page.

Besides keys and values, a layer may keep other per-token rows in the same pages (``rows``, under a
name: the QSA indexer's raw index keys), so they follow the sequence's block table, are shared and
copied by forks and freed with its pages.

A :class:`PrefixIndex` remembers full prompt pages by their exact token prefix (per adapter and
weights version), so a later prompt that begins with the same whole pages reuses them instead of
computing them again. It holds one reference to each page it lists; pages only it references are
reclaimed (least recently used first) when an allocation finds no free page, so the index never
takes memory a sequence needs.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from ember.core.kernels.kv_write import kv_write

SCRATCH_PAGE = 0


class OutOfPages(RuntimeError):
    """The cache has no free page left (the scheduler's reservations should prevent this)."""


class PagedKVCache:
    """Keys and values of the attention layers in ``num_pages`` pages of ``page_size`` tokens, plus
    the page allocator.

    A layer's pages are allocated at its first write, with the shapes of what it stores (``[Hkv,
    D]`` keys, ``[Hkv, Dv]`` values), so families whose layers differ (latent attention, hybrid
    models whose linear-attention layers keep no KV) need nothing special.
    """

    def __init__(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str):
        if num_pages < 2 or page_size < 1:
            raise ValueError("the KV cache needs at least 2 pages (page 0 is scratch) of >= 1 token")
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        # other per-token rows, ``[num_pages, page_size, ...]`` under (layer, name)
        self.rows: dict[tuple[int, str], torch.Tensor] = {}
        # pop() hands out the lowest free page first
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._refs = [0] * num_pages
        # frees pages held only by a cache of reusable pages (PrefixIndex); returns how many it freed
        self.reclaim: Callable[[int], int] | None = None
        self.reclaimable: Callable[[], int] | None = None

    # -- allocation ------------------------------------------------------------------------------

    @property
    def usable_pages(self) -> int:
        """Pages that can hold sequence data (all but the scratch page)."""
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        """Pages an allocation can get: free ones and those only a prefix index holds."""
        return len(self._free) + (self.reclaimable() if self.reclaimable is not None else 0)

    def allocate(self) -> int:
        """A fresh page with reference count 1."""
        if not self._free and self.reclaim is not None:
            self.reclaim(1)
        if not self._free:
            raise OutOfPages(f"all {self.usable_pages} KV pages are in use")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def share(self, page: int) -> int:
        """One more reference to ``page`` (a fork shares it)."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is not allocated")
        self._refs[page] += 1
        return page

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages nobody references return to the free list."""
        for page in pages:
            if self._refs[page] < 1:
                raise ValueError(f"page {page} released more often than allocated")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def fork(self, pages: list[int], num_tokens: int) -> list[int]:
        """A block table for a copy of the sequence whose ``num_tokens`` tokens live in ``pages``: its
        full pages are shared, the partly filled last page (which the copy will write) is copied."""
        full = num_tokens // self.page_size
        out = [self.share(p) for p in pages[:full]]
        if num_tokens % self.page_size:
            src, dst = pages[full], self.allocate()
            for layer in self.k:
                self.k[layer][dst].copy_(self.k[layer][src])
                self.v[layer][dst].copy_(self.v[layer][src])
            for rows in self.rows.values():
                rows[dst].copy_(rows[src])
            out.append(dst)
        return out

    # -- data ------------------------------------------------------------------------------------

    def slots(self, pages: list[int], start: int, count: int) -> list[int]:
        """Flat cache slots (``page * page_size + offset``) of token positions ``[start, start+count)``."""
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, start + count)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, Hkv, D]``) of one layer at the flat slots ``slot_mapping`` ``[T]``."""
        kc, vc = self.pages(layer, tuple(k.shape[1:]), tuple(v.shape[1:]))
        kv_write(kc, vc, k, v, slot_mapping)

    def pages(self, layer: int, k_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value pages of ``layer`` (``[num_pages, page_size, *k_shape]`` and ``v_shape``),
        allocated (zeros) if this is the layer's first write."""
        if layer not in self.k:
            shape = (self.num_pages, self.page_size)
            self.k[layer] = torch.zeros(shape + k_shape, dtype=self.dtype, device=self.device)
            self.v[layer] = torch.zeros(shape + v_shape, dtype=self.dtype, device=self.device)
        return self.k[layer], self.v[layer]

    def write_rows(self, layer: int, name: str, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store per-token rows ``x`` (``[T, ...]``) of ``(layer, name)`` at the flat slots ``slot_mapping``
        (pages allocated at the first write, like keys and values)."""
        key = (layer, name)
        if key not in self.rows:
            shape = (self.num_pages, self.page_size) + tuple(x.shape[1:])
            self.rows[key] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        r = self.rows[key]
        r.view(-1, *r.shape[2:]).index_copy_(0, slot_mapping, x.to(r.dtype))

    def nbytes_per_token(self) -> int:
        """Bytes one cached token takes over the layers written so far (keys, values and other rows)."""
        kv = sum((self.k[i][0, 0].numel() + self.v[i][0, 0].numel()) * self.k[i].element_size() for i in self.k)
        return kv + sum(r[0, 0].numel() * r.element_size() for r in self.rows.values())


class _Node:
    __slots__ = ("block", "children", "page", "parent")

    def __init__(self, page: int, parent: _Node | None, block: tuple[int, ...] | None):
        self.page = page
        self.parent = parent
        self.block = block
        self.children: dict[tuple[int, ...], _Node] = {}


class PrefixIndex:
    """Full prompt pages by the exact tokens before and in them, one tree per ``key`` (an adapter
    slot and the version of its weights: LoRA changes keys and values).

    A node stands for the page-sized token block that follows its parent's prefix and names a page
    whose keys and values were computed for exactly that prefix, so any prompt beginning with the
    same blocks (under the same key) can read it. The index holds one reference to each listed page.
    Dropping a node drops its subtree (their prefixes contain its block); pages still used by
    sequences stay allocated, the others return to the free list. :meth:`reclaim` drops least
    recently used nodes whose page only the index holds (deepest first among equals).
    """

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.roots: dict[Hashable, _Node] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # page -> node, least recently used first
        cache.reclaim = self.reclaim
        cache.reclaimable = self.reclaimable

    def __len__(self) -> int:
        return len(self._lru)

    def _blocks(self, tokens: Sequence[int], n: int):
        ps = self.cache.page_size
        return (tuple(int(t) for t in tokens[i * ps : (i + 1) * ps]) for i in range(n))

    def match(self, key: Hashable, tokens: Sequence[int], max_pages: int) -> list[int]:
        """Pages of the longest indexed run of whole-page blocks that ``tokens`` begin with (at most
        ``max_pages``), marked as recently used; the caller takes its own references."""
        node = self.roots.get(key)
        path: list[_Node] = []
        if node is not None:
            for block in self._blocks(tokens, max_pages):
                node = node.children.get(block)
                if node is None:
                    break
                path.append(node)
        for n in reversed(path):  # parents end up more recent than their children
            self._lru.move_to_end(n.page)
        return [n.page for n in path]

    def insert(self, key: Hashable, tokens: Sequence[int], pages: Sequence[int], num_pages: int) -> None:
        """List the first ``num_pages`` pages of a sequence with ``tokens`` (all full, their keys and
        values written or being written by the current pass). Blocks already listed keep their page."""
        node = self.roots.get(key)
        if node is None:
            node = self.roots[key] = _Node(SCRATCH_PAGE, None, None)
        path = []
        for block, page in zip(self._blocks(tokens, num_pages), pages):
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Node(self.cache.share(page), node, block)
                self._lru[page] = child
            node = child
            path.append(node)
        for n in reversed(path):
            self._lru.move_to_end(n.page)

    def _drop(self, node: _Node, released: list[int]) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}
            del self._lru[n.page]
            released.append(n.page)
        if node.parent is not None:
            del node.parent.children[node.block]

    def drop_key(self, key: Hashable) -> None:
        """Forget every page listed under ``key`` (its adapter changed or went away)."""
        root = self.roots.pop(key, None)
        if root is not None:
            released: list[int] = []
            for child in list(root.children.values()):
                self._drop(child, released)
            self.cache.release(released)

    def keys(self) -> list[Hashable]:
        return list(self.roots)

    def clear(self) -> None:
        for key in list(self.roots):
            self.drop_key(key)

    def reclaimable(self) -> int:
        """Listed pages nobody but the index holds."""
        return sum(1 for p in self._lru if self.cache.refcount(p) == 1)

    def reclaim(self, want: int) -> int:
        """Drop least recently used nodes whose page only the index holds until ``want`` pages
        were freed (or none is left); returns the pages freed."""
        before = len(self.cache._free)
        while len(self.cache._free) - before < want:
            victim = next((n for p, n in self._lru.items() if self.cache.refcount(p) == 1), None)
            if victim is None:
                break
            released: list[int] = []
            self._drop(victim, released)
            self.cache.release(released)
        return len(self.cache._free) - before


class _Slab:
    """One value of every sequence (one ``(layer, name)``): rows of one tensor ``[capacity, *shape]``,
    and each row's length along the value's first axis (``-1``: no value; values may grow, as QSA's
    index keys do; a shorter value is stored zero-padded; 0-d values have length 0)."""

    def __init__(self, like: torch.Tensor, capacity: int):
        self.data = like.new_zeros(capacity, *like.shape)
        self.lengths = np.full(capacity, -1, dtype=np.int64)

    def fit(self, capacity: int, first: int = 0) -> bool:
        """Grow to at least ``capacity`` rows and, for values with axes, a first value axis of at
        least ``first`` (new entries are zeros). Whether the tensor was allocated again."""
        old = self.data
        shape = list(old.shape)
        shape[0] = max(shape[0], capacity)
        if old.dim() > 1:
            shape[1] = max(shape[1], first)
        grown = tuple(shape) != tuple(old.shape)
        if grown:
            self.data = old.new_zeros(shape)
            self.data[tuple(slice(0, n) for n in old.shape)] = old
        if len(self.lengths) < shape[0]:
            self.lengths = np.concatenate([self.lengths, np.full(shape[0] - len(self.lengths), -1, dtype=np.int64)])
        return grown


class RecurrentStateStore:
    """Per-sequence recurrent state of non-attention layers (short-convolution windows, linear
    attention), kept between the passes of decoding sequences; :meth:`view` gives one pass the
    :class:`~ember.core.models.base.SequenceState` it reads and writes.

    Each sequence owns a row of every value's slab (:class:`_Slab`), so a pass reads a value with
    one gather and writes it with one scatter, whatever its number of sequences (a pass used to
    stack and split per-sequence tensors). Slabs grow by a quarter (16 rows at least) when rows run
    out; the rows of freed sequences are reused. Row 0 is scratch, never a sequence's: the padding
    rows of a static-shape decode step (:class:`StaticPassState`) write there. :attr:`version`
    counts the slab tensors allocated, so a captured CUDA graph knows when the tensors it reads
    were replaced."""

    def __init__(self):
        self._rows: dict[int, int] = {}  # sequence -> its row
        self._free: list[int] = []
        self._capacity = 1  # row 0: scratch
        self._slabs: dict[tuple[int, str], _Slab] = {}
        self._held: set[int] = set()  # sequences with at least one value
        self.version = 0

    def _fit(self, slab: _Slab, first: int = 0) -> None:
        if slab.fit(self._capacity, first):
            self.version += 1

    def static_view(self, rows: torch.Tensor) -> StaticPassState:
        """The state of a static-shape decode step whose rows read and write the store rows
        ``rows`` (a fixed device tensor, refilled by :meth:`fill_rows` before each step)."""
        return StaticPassState(self, rows)

    def fill_rows(self, seq_ids: Sequence[int], out: np.ndarray) -> None:
        """Write the store rows of ``seq_ids`` into ``out`` (the rest: scratch row 0) and fit every
        slab to them. Raises ``ValueError`` when a sequence's value is shorter than its slab or
        absent (a value that still grows, or one no pass has written: those decode eagerly)."""
        out[:] = 0
        if not self._slabs:  # a model without recurrent layers
            return
        rows = np.array([self._row(s) for s in seq_ids], dtype=np.int64)
        out[: len(rows)] = rows
        for (layer, name), slab in self._slabs.items():
            self._fit(slab)
            full = slab.data.shape[1] if slab.data.dim() > 1 else 0
            if len(rows) and (slab.lengths[rows] != full).any():
                raise ValueError(f"state {name!r} of layer {layer} is absent or shorter than its slab for some "
                                 "sequence of the step: a static-shape step cannot read it")

    def view(self, seq_ids: list[int]) -> PassState:
        """The state of the sequences of one pass, in packed order."""
        return PassState(self, list(seq_ids))

    def _row(self, seq_id: int) -> int:
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free:
                grown = max(self._capacity + 16, self._capacity * 5 // 4)
                self._free = list(range(grown - 1, self._capacity - 1, -1))
                self._capacity = grown
            row = self._rows[seq_id] = self._free.pop()
        return row

    def fork(self, src: int, dst: int) -> None:
        """``dst`` continues from ``src``'s state (a copy of its rows)."""
        if src not in self._held:
            return
        a, b = self._rows[src], self._row(dst)
        for slab in self._slabs.values():
            self._fit(slab)
            if slab.lengths[a] >= 0:
                slab.data[b] = slab.data[a]
            slab.lengths[b] = slab.lengths[a]
        self._held.add(dst)

    def free(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        self._held.discard(seq_id)
        if row is not None:
            for slab in self._slabs.values():
                if row < len(slab.lengths):
                    slab.lengths[row] = -1
            self._free.append(row)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._held


class PassState:
    """:class:`SequenceState` of one pass: values stacked over the pass's sequences (``[N, ...]``).

    ``get`` is ``None`` when no sequence of the pass has a value yet (they all start here); when only
    some do, the others read zeros, and rows of different lengths along their first axis are
    zero-padded to the longest.
    """

    def __init__(self, store: RecurrentStateStore, seq_ids: list[int]):
        self.store = store
        self.seq_ids = seq_ids
        self._index: dict[torch.device, torch.Tensor] = {}

    @functools.cached_property
    def rows(self) -> np.ndarray:
        """The pass's rows, given at its first read or write of a value (a new sequence's holds no
        value yet; a pass of a model without recurrent layers gives none)."""
        return np.array([self.store._row(s) for s in self.seq_ids], dtype=np.int64)

    def _device_rows(self, device: torch.device) -> torch.Tensor:
        """The pass's rows as an index on ``device`` (one copy per pass, shared by its layers)."""
        if device not in self._index:
            self._index[device] = torch.from_numpy(self.rows).to(device)
        return self._index[device]

    def get(self, layer: int, name: str) -> torch.Tensor | None:
        slab = self.store._slabs.get((layer, name))
        if slab is None:
            return None
        rows = self.rows  # first: a new sequence's row may grow the capacity
        self.store._fit(slab)
        lengths = slab.lengths[rows]
        longest = int(lengths.max()) if len(lengths) else -1
        if longest < 0:
            return None
        out = slab.data.index_select(0, self._device_rows(slab.data.device))
        if slab.data.dim() > 1:
            out = out[:, :longest]
        absent = np.flatnonzero(lengths < 0)
        if len(absent):  # rows of sequences without a value (a reused row may hold an old one): zeros
            out[torch.from_numpy(absent).to(out.device)] = 0
        return out

    def put(self, layer: int, name: str, value: torch.Tensor) -> None:
        if value.shape[0] != len(self.seq_ids):
            raise ValueError(
                f"state {name!r} of layer {layer}: {value.shape[0]} rows for {len(self.seq_ids)} sequences"
            )
        store = self.store
        rows = self.rows  # first: a new sequence's row may grow the capacity
        key = (layer, name)
        slab = store._slabs.get(key)
        if slab is None:
            slab = store._slabs[key] = _Slab(value[0], store._capacity)
            store.version += 1
        elif slab.data.shape[2:] != value.shape[2:] or slab.data.dim() != value.dim() or slab.data.dtype != value.dtype:
            raise ValueError(f"state {name!r} of layer {layer}: {tuple(value.shape[1:])} {value.dtype} after "
                             f"{tuple(slab.data.shape[1:])} {slab.data.dtype}")
        length = int(value.shape[1]) if value.dim() > 1 else 0
        store._fit(slab, length)
        if value.dim() > 1 and length < slab.data.shape[1]:  # zeros beyond this value's length
            value = torch.cat([value, value.new_zeros(value.shape[0], slab.data.shape[1] - length, *value.shape[2:])], 1)
        slab.data.index_copy_(0, self._device_rows(value.device), value)
        slab.lengths[rows] = length
        store._held.update(self.seq_ids)


class StaticPassState:
    """:class:`SequenceState` of a static-shape decode step (CUDA graphs): each value is read with
    one ``index_select`` and written with one ``index_copy_`` through the fixed device index
    ``rows`` (one store row per batch row; padding rows use scratch row 0), with no host work, so
    the step can be captured. Only values whose shape no longer changes are supported (convolution
    windows, delta-rule states: :meth:`RecurrentStateStore.fill_rows` checks)."""

    def __init__(self, store: RecurrentStateStore, rows: torch.Tensor):
        self.store = store
        self.rows = rows

    def get(self, layer: int, name: str) -> torch.Tensor | None:
        slab = self.store._slabs.get((layer, name))
        return None if slab is None else slab.data.index_select(0, self.rows)

    def put(self, layer: int, name: str, value: torch.Tensor) -> None:
        slab = self.store._slabs.get((layer, name))
        if slab is None or slab.data.shape[1:] != value.shape[1:] or slab.data.dtype != value.dtype:
            raise ValueError(
                f"state {name!r} of layer {layer}: a static-shape step writes {tuple(value.shape[1:])} {value.dtype} "
                f"where the store holds {None if slab is None else (tuple(slab.data.shape[1:]), slab.data.dtype)}"
            )
        slab.data.index_copy_(0, self.rows, value)
