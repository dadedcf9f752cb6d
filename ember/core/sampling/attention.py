"""Attention over the paged KV cache.

* Prefill (every sequence of the pass starts at position 0): the pass's own keys and values are
  stored in the cache and attention runs exactly as in training (:class:`PackedAttention`: varlen
  flash attention on CUDA, per-document SDPA elsewhere), so prompt logprobs match the trainer's.
* Decode (one new token per sequence): the query attends to the sequence's cached keys through its
  block table. On CUDA (and under ``TRITON_INTERPRET=1``) the flash-decoding kernels of
  :mod:`ember.core.kernels.paged_decode` do it, reading a prefix that several rows share once for
  them (cascade attention; the groups from :func:`shared_prefix_groups`); elsewhere a gather of
  the pages and a masked softmax compute the same thing.

Sliding-window layers (``AttentionSpec("sliding", window)``) see the last ``window`` positions,
the current token included.

Inkling-2's ``relative(...)`` (relative bias by distance and sinks, sliding or global) runs the same
kernel with the bias and the sink added (so it captures too); without Triton it gathers the pages
(:func:`gather_pages`, only those of the window on sliding layers). A QSA block selection
(``accepts_selection``; Qwen3.8-Flash-Next) runs the kernel over the chosen blocks and the tail
only (without Triton, a gather of all pages and a masked softmax); the QSA indexer's raw keys are kept in the pages
(``store_index_keys`` / ``index_keys`` / ``index_key_table``).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ember.core.config import AttentionSpec
from ember.core.kernels import fused
from ember.core.kernels.paged_decode import PREFIX_GROUP, paged_decode_triton
from ember.core.kernels.qkv_decode import QkvLora, qkv_rope_write
from ember.core.layers.attention import PackedAttention
from ember.core.layers.qsa import BlockSelection, selected_attention
from ember.core.layers.relative_attention import PackedRelativeAttention, RelativeAttentionSpec
from ember.core.sampling.kv_cache import SCRATCH_PAGE, PagedKVCache


def paged_decode_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Reference decode attention (same contract as :func:`paged_decode_triton`): gathers the
    block table's pages and applies a masked softmax in fp32."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_pages.shape
    W = block_table.shape[1]
    L = W * page
    idx = block_table.long()
    k = k_pages[idx].reshape(B, L, Hkv, D).float()
    v = v_pages[idx].reshape(B, L, Hkv, -1).float()
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhrd,blhd->bhrl", qg, k) * scale
    pos = torch.arange(L, device=q.device)
    lens = seq_lens.to(q.device).long()[:, None]
    valid = pos[None, :] < lens
    if window:
        valid &= pos[None, :] >= lens - window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows of length 0 -> zeros
    out = torch.einsum("bhrl,blhd->bhrd", probs, v)
    return out.reshape(B, Hq, -1).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache: the Triton kernel where it runs (reading each
    ``prefix`` group's shared tokens once), else the reference."""
    out = _decode_triton_or_none(q, k_pages, v_pages, block_table, seq_lens, scale, window, prefix=prefix)
    return out if out is not None else paged_decode_torch(q, k_pages, v_pages, block_table, seq_lens, scale, window)


_TRITON_DECODE = {"ok": True}


def _decode_triton_or_none(q: torch.Tensor, k_pages: torch.Tensor, *args, **kwargs) -> torch.Tensor | None:
    """:func:`paged_decode_triton` where it runs; ``None`` where it does not (or once it failed:
    the caller then takes its PyTorch path)."""
    if not (_TRITON_DECODE["ok"] and fused.use_triton(q, k_pages)):
        return None
    try:
        return paged_decode_triton(q, k_pages, *args, **kwargs)
    except Exception as e:  # e.g. a GPU/Triton combination the kernel was never compiled for
        if fused.INTERPRET:
            raise
        _TRITON_DECODE["ok"] = False
        warnings.warn(f"paged decode kernel failed ({type(e).__name__}: {e}); using the PyTorch path", stacklevel=2)
        return None


PREFIX_MIN_TOKENS = 64  # a shorter shared prefix is attended by each row (one BLOCK_N)


def _window(spec: AttentionSpec) -> int:
    return int(spec.window) if spec.kind == "sliding" and spec.window else 0


def shared_prefix_groups(table: np.ndarray, lens: np.ndarray, page: int, min_tokens: int = PREFIX_MIN_TOKENS
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The prefix groups of a decode step (cascade attention, :func:`paged_decode_triton`'s
    ``prefix``): rows whose block tables (``[B, W]``; ``lens`` ``[B]`` tokens, the new one
    included) begin with the same pages share those tokens, since a page is shared only through
    the prefix cache or a fork, which share every page before it too.

    Each row's shared prefix is its leading pages that another row's table also holds (the
    deepest node of the prefix tree it shares; never the page the step writes), and the rows
    whose deepest shared page is the same form a group. Returns each row's shared tokens
    (``int32 [B]``; 0 alone or below ``min_tokens``) and the groups' rows (``int32 [G,
    PREFIX_GROUP]``, ``-1`` after the last; a larger group takes several lines)."""
    lens = np.asarray(lens, dtype=np.int64)
    shared = np.zeros(len(lens), dtype=np.int32)
    full = np.maximum(lens - 1, 0) // page  # pages before the one the new token goes to
    width = min(int(full.max(initial=0)), table.shape[1])
    if width * page < min_tokens:
        return shared, np.zeros((0, PREFIX_GROUP), dtype=np.int32)
    cols = np.arange(width)
    pages = np.where(cols < full[:, None], table[:, :width], SCRATCH_PAGE).astype(np.int64)
    held = np.bincount(pages.ravel())[pages] >= 2
    held &= pages != SCRATCH_PAGE
    depth = np.cumprod(held, axis=1).sum(axis=1)  # leading pages some other row holds too
    rows = np.flatnonzero((depth > 0) & (depth * page >= min_tokens))
    deepest = pages[rows, depth[rows] - 1]
    order = np.argsort(deepest, kind="stable")
    rows, deepest = rows[order], deepest[order]
    starts = np.flatnonzero(np.r_[True, deepest[1:] != deepest[:-1]])
    sizes = np.diff(np.r_[starts, len(rows)])
    group = np.repeat(np.arange(len(starts)), sizes)  # each sorted row's group
    pos = np.arange(len(rows)) - starts[group]  # and its place in it
    keep = (sizes >= 2)[group]  # a row alone at its deepest page shares nothing
    rows, group, pos = rows[keep], group[keep], pos[keep]
    shared[rows] = depth[rows] * page
    lines = np.where(sizes >= 2, -(-sizes // PREFIX_GROUP), 0)  # a group's lines
    first = np.cumsum(lines) - lines
    members = np.full((int(lines.sum()), PREFIX_GROUP), -1, dtype=np.int32)
    members[first[group] + pos // PREFIX_GROUP, pos % PREFIX_GROUP] = rows
    return shared, members


class PrefillAttention:
    """``ForwardContext.attend`` of a prefill pass: store the pass's keys/values at ``slot_mapping``
    and attend within each prompt exactly as training does.

    Besides ``attend(layer, q, k, v, spec, scale)`` it serves the attention variants that need more
    than that (every prompt starts at position 0, so each is the trainer's own packed call):

    * a QSA block ``selection`` (``accepts_selection``): :func:`~ember.core.layers.qsa.selected_attention`;
    * ``relative(layer, q, k, v, profiles, sinks, spec, scale)`` (Inkling-2's relative bias and sinks):
      :class:`~ember.core.layers.relative_attention.PackedRelativeAttention` with ``relative_backend``;
    * ``store_index_keys`` / ``index_keys``: the QSA indexer's raw keys kept in the cache's pages.

    With ``prefix_lens`` (packed order), a document may continue a prefix already in the cache (its
    first ``prefix_lens[i]`` tokens, shared prompt pages, listed in ``block_tables[i]`` with the
    pages its own tokens go to): the pass holds only its remaining tokens, at positions from
    ``prefix_lens[i]``, and they attend over the prefix's cached keys and their own
    (:meth:`_continued`). Documents without a prefix still run the trainer's packed call. Only plain
    attention (sliding windows included) continues a prefix; the variants above refuse it.
    """

    accepts_selection = True

    def __init__(
        self,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        doc_lengths: list[int],
        positions: torch.Tensor | None = None,
        relative_backend: str | None = None,
        prefix_lens: list[int] | None = None,
        block_tables: list[list[int]] | None = None,
    ):
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.doc_lengths = list(doc_lengths)
        self.prefix_lens = list(prefix_lens) if prefix_lens and any(prefix_lens) else None
        if self.prefix_lens is None:
            self.packed = PackedAttention(self.doc_lengths, cache.device)
        else:
            starts = [0]
            for n in self.doc_lengths:
                starts.append(starts[-1] + n)
            fresh = [i for i, p in enumerate(self.prefix_lens) if p == 0]
            self.packed = PackedAttention([self.doc_lengths[i] for i in fresh], cache.device) if fresh else None
            self._fresh_rows = (
                torch.cat([torch.arange(starts[i], starts[i + 1]) for i in fresh]).to(cache.device) if fresh else None
            )
            # continued documents grouped by (prefix, own tokens): one batched attention per group,
            # its rows of the pass ([B, n]) and page tables ([B, pages]) made once for every layer
            groups: dict[tuple[int, int], list[int]] = {}
            for i, p in enumerate(self.prefix_lens):
                if p:
                    groups.setdefault((p, self.doc_lengths[i]), []).append(i)
            ps = cache.page_size
            self._groups = [
                (p, n, (torch.tensor([starts[i] for i in docs])[:, None] + torch.arange(n)).to(cache.device),
                 torch.tensor([block_tables[i][: -(-(p + n) // ps)] for i in docs], dtype=torch.long,
                              device=cache.device))
                for (p, n), docs in groups.items()
            ]
        if positions is None:
            positions = torch.cat([torch.arange(n, device=cache.device) for n in self.doc_lengths])
        self.positions = positions
        self.relative_backend = relative_backend
        self._relative: PackedRelativeAttention | None = None

    def __call__(
        self, layer: int, q, k, v, spec: AttentionSpec, scale: float, selection: BlockSelection | None = None
    ) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        if selection is not None:
            self._no_prefix("a QSA block selection")
            if _window(spec):
                raise NotImplementedError("a QSA block selection on a sliding-window layer")
            return selected_attention(q, k, v, self.doc_lengths, selection, scale)
        if self.prefix_lens is None:
            return self.packed(q, k, v, spec, scale)
        return self._continued(layer, q, k, v, spec, scale)

    def _no_prefix(self, what: str) -> None:
        if self.prefix_lens is not None:
            raise NotImplementedError(f"{what} cannot continue a cached prompt prefix")

    # elements of one batched score tensor [B, Hq, n, L] (bounds the memory of a continued group)
    CONTINUED_ELEMENTS = 1 << 26

    def _continued(self, layer: int, q, k, v, spec: AttentionSpec, scale: float) -> torch.Tensor:
        """Attention of a pass in which some documents continue a cached prefix: those read every
        key of theirs from the pages (the prefix's and, written just before, their own), masked
        causally (and by the window) at their true positions; the others run the packed call.
        Without a window the mask is causal aligned to the last key (``causal_lower_right``), which
        SDPA runs in its flash kernel on CUDA instead of materialising it (a long prompt's later
        chunks attend over all of its cached keys), with the query heads of a key head read against
        it (``enable_gqa``): the keys and values are not repeated per query head. With a window the
        boolean mask needs the memory-efficient kernel, which takes no grouped heads: they are
        repeated."""
        T, Hq, _ = q.shape
        out = q.new_empty(T, Hq, v.shape[-1])
        if self.packed is not None:
            rows = self._fresh_rows
            out[rows] = self.packed(q[rows], k[rows], v[rows], spec, scale)
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        ps = self.cache.page_size
        window = _window(spec)
        Hkv = kc.shape[2]
        rep = Hq // Hkv
        for prefix, n, rows, tables in self._groups:
            L = prefix + n
            width = tables.shape[1]
            if window:
                d = torch.arange(prefix, L, device=q.device)[:, None] - torch.arange(L, device=q.device)[None, :]
                mask = (d >= 0) & (d < window)
            per_doc = max(1, self.CONTINUED_ELEMENTS // max(1, Hq * n * L))
            for b0 in range(0, tables.shape[0], per_doc):
                t = tables[b0 : b0 + per_doc]
                B = t.shape[0]
                kk = kc[t].reshape(B, width * ps, Hkv, -1)[:, :L].to(q.dtype).transpose(1, 2)
                vv = vc[t].reshape(B, width * ps, Hkv, -1)[:, :L].to(q.dtype).transpose(1, 2)
                if rep > 1 and window:
                    kk = kk.repeat_interleave(rep, dim=1)
                    vv = vv.repeat_interleave(rep, dim=1)
                r = rows[b0 : b0 + per_doc]
                qq = q[r].transpose(1, 2)  # [B, Hq, n, D]
                # rows at a time, so that a materialised mask and scores stay bounded (CUDA's
                # kernels materialise neither without a window)
                step = n if q.is_cuda and not window else max(1, self.CONTINUED_ELEMENTS // max(1, B * Hq * L))
                for c0 in range(0, n, step):
                    c1 = min(n, c0 + step)
                    if window:
                        o = F.scaled_dot_product_attention(qq[:, :, c0:c1], kk, vv, attn_mask=mask[c0:c1], scale=scale)
                    else:  # rows c0..c1 see the keys up to their own position prefix + c1 - 1
                        hi = prefix + c1
                        o = F.scaled_dot_product_attention(qq[:, :, c0:c1], kk[:, :, :hi], vv[:, :, :hi],
                                                           attn_mask=causal_lower_right(c1 - c0, hi), scale=scale,
                                                           enable_gqa=rep > 1)
                    out[r[:, c0:c1].reshape(-1)] = o.transpose(1, 2).reshape(B * (c1 - c0), Hq, -1)
        return out

    def relative(self, layer: int, q, k, v, profiles, sinks, spec: RelativeAttentionSpec, scale: float) -> torch.Tensor:
        self._no_prefix("relative attention")
        self.cache.write(layer, k, v, self.slot_mapping)
        if self._relative is None:  # one per pass: it keeps the pass's block masks
            self._relative = PackedRelativeAttention(self.doc_lengths, self.positions, backend=self.relative_backend)
        return self._relative(q, k, v, profiles, sinks, spec, scale)

    def store_index_keys(self, layer: int, keys: torch.Tensor) -> None:
        """Keep the pass's raw QSA index keys ``[T, d]`` in the cache (read by later decode steps)."""
        self._no_prefix("the QSA indexer")
        self.cache.write_rows(layer, INDEX_KEYS, keys, self.slot_mapping)

    def index_keys(self, layer: int, keys: torch.Tensor) -> list[torch.Tensor]:
        """Every sequence's raw index keys so far (``[n_i, d]``, packed order): the pass's own."""
        return list(keys.split(self.doc_lengths))


INDEX_KEYS = "index_keys"


def gather_pages(
    pages: torch.Tensor, block_table: torch.Tensor, first: torch.Tensor | None = None, count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens in pages ``first[b] .. first[b] + count - 1`` of each row's block table (all its
    pages by default): ``[B, count * page, ...]`` and their positions ``[B, count * page]``. Columns
    past the table read the scratch page; their positions lie beyond any cached token."""
    B, W = block_table.shape
    ps = pages.shape[1]
    device = pages.device
    count = W if count is None else count
    cols = torch.arange(count, device=device)[None].expand(B, -1)
    if first is not None:
        cols = cols + first.to(device).long()[:, None]
    table = block_table.to(device).long().gather(1, cols.clamp(max=W - 1))
    table = torch.where(cols < W, table, SCRATCH_PAGE)
    x = pages[table].reshape(B, count * ps, *pages.shape[2:])
    pos = (cols[:, :, None] * ps + torch.arange(ps, device=device)).reshape(B, count * ps)
    return x, pos


def masked_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row over gathered keys: q ``[B, Hq, D]``, k/v ``[B, L, Hkv, D]``, ``valid``
    ``[B, L]`` -> ``[B, Hq, Dv]`` (a masked softmax in fp32, as :func:`paged_decode_torch`)."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bhrd,blhd->bhrl", qg, k.float()) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhrl,blhd->bhrd", probs, v.float())
    return out.reshape(B, Hq, -1).to(q.dtype)


def relative_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pos: torch.Tensor,
    profiles: torch.Tensor,
    sinks: torch.Tensor,
    q_pos: torch.Tensor,
    spec: RelativeAttentionSpec,
    scale: float,
) -> torch.Tensor:
    """Relative-bias attention with sinks of one query per row over gathered keys (the batched form
    of :func:`~ember.core.layers.relative_attention.relative_attention_dense`, same numerics): q
    ``[B, Hq, D]`` at ``q_pos`` ``[B]``; k/v ``[B, L, Hkv, D]`` at ``k_pos`` ``[B, L]``; profiles
    ``[B, Hq, R]``; sinks ``[B, Hq]`` -> ``[B, Hq, Dv]``."""
    B, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    R = spec.rel_extent
    scores = torch.einsum("bhrd,blhd->bhrl", q.view(B, Hkv, rep, D), k.to(q.dtype)).reshape(B, Hq, L) * scale
    dist = q_pos.long()[:, None] - k_pos  # [B, L]
    bias = profiles.gather(-1, dist.clamp(0, R - 1)[:, None, :].expand(B, Hq, L))
    scores = scores + bias.masked_fill(((dist < 0) | (dist >= R))[:, None], 0.0)
    masked = dist < 0
    if spec.window is not None:
        masked = masked | (dist >= spec.window)
    scores = scores.masked_fill(masked[:, None], float("-inf"))
    logits = torch.cat([scores, sinks[:, :, None].to(scores.dtype)], dim=-1).float()
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    out = torch.einsum("bhrl,blhd->bhrd", probs.view(B, Hkv, rep, L), v.to(q.dtype))
    return out.reshape(B, Hq, -1)


class DecodeAttention:
    """``ForwardContext.attend`` of a decode pass (one token per sequence): store the new keys and
    values, then attend over each sequence's cached tokens (``seq_lens`` includes the new one).

    All inputs are tensors, so the same object serves a captured CUDA graph whose buffers are
    refilled between replays (plain attention, and Inkling-2's ``relative(...)`` through the Triton
    kernel: relative bias by distance and the sink, over the last ``window`` positions on sliding
    layers; without Triton only the pages that hold them are gathered), and a QSA block
    ``selection`` (``accepts_selection``: the selected blocks plus the query's tail, through the
    kernel, which reads only those; without Triton a gather of the pages and a masked softmax).
    ``store_index_keys`` / ``index_keys`` keep and read the QSA indexer's raw keys in the pages.

    ``fixed_selection`` (the static decoder): the QSA indexer reads the index keys as one table
    (:meth:`index_key_table`) and selects for all rows at once, with no host data.

    ``prefix`` (:func:`shared_prefix_groups` on the device): plain attention without a window
    reads each group's shared prefix once for the group (cascade attention, Triton only).
    """

    accepts_selection = True

    def __init__(
        self,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        fixed_selection: bool = False,
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.fixed_selection = fixed_selection
        self.prefix = prefix

    def __call__(
        self, layer: int, q, k, v, spec: AttentionSpec, scale: float, selection: BlockSelection | None = None
    ) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        return self._attend(layer, q, spec, scale, selection)

    def takes_qkv(self, x: torch.Tensor) -> bool:
        """Whether :meth:`attend_qkv` runs here (its kernel: the Triton path)."""
        return fused.use_triton(x, self.slot_mapping)

    def attend_qkv(self, layer: int, y: torch.Tensor, heads: tuple[int, int], cos: torch.Tensor, sin: torch.Tensor,
                   norms: tuple | None, lora: QkvLora | None, spec: AttentionSpec, scale: float) -> torch.Tensor:
        """:meth:`__call__` from a layer's packed q/k/v product ``y`` (``heads = (Hq, Hk)``): one
        kernel adds its LoRA delta ``lora`` (if any), normalises (``norms``, see
        :func:`~ember.core.kernels.qkv_decode.qkv_rope_write`) and rotates the queries and keys, and
        stores the keys and values in the cache; then attention as there."""
        Hq, Hk = heads
        D = y.shape[1] // (Hq + 2 * Hk)
        kc, vc = self.cache.pages(layer, (Hk, D), (Hk, D))
        q = qkv_rope_write(y, heads, cos, sin, kc, vc, self.slot_mapping, norms, lora)
        return self._attend(layer, q, spec, scale, None)

    def _attend(self, layer: int, q, spec: AttentionSpec, scale: float, selection: BlockSelection | None) -> torch.Tensor:
        if selection is None:
            window = _window(spec)
            return paged_decode_attention(
                q, self.cache.k[layer], self.cache.v[layer], self.block_table, self.seq_lens, scale, window,
                prefix=None if window else self.prefix,
            )
        if _window(spec):
            raise NotImplementedError("a QSA block selection on a sliding-window layer")
        out = _decode_triton_or_none(
            q, self.cache.k[layer], self.cache.v[layer], self.block_table, self.seq_lens, scale,
            selected=selection.blocks, select_block=selection.block_size,
        )
        if out is not None:
            return out
        keys, _ = gather_pages(self.cache.k[layer], self.block_table)
        values, _ = gather_pages(self.cache.v[layer], self.block_table)
        valid = selection.token_mask(slice(None), keys.shape[1])  # causal, selected blocks + tail
        return masked_decode(q, keys, values, valid, scale)

    def relative(self, layer: int, q, k, v, profiles, sinks, spec: RelativeAttentionSpec, scale: float) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        out = _decode_triton_or_none(
            q, self.cache.k[layer], self.cache.v[layer], self.block_table, self.seq_lens, scale, spec.window or 0,
            profiles=profiles, sinks=sinks,
        )
        if out is not None:
            return out
        q_pos = self.seq_lens.long() - 1
        first = count = None
        if spec.window is not None:
            ps = self.cache.page_size
            first = (q_pos - spec.window + 1).clamp(min=0) // ps
            # positions q_pos - window + 1 .. q_pos span at most this many pages
            count = min(self.block_table.shape[1], (spec.window + ps - 2) // ps + 1)
        keys, k_pos = gather_pages(self.cache.k[layer], self.block_table, first, count)
        values, _ = gather_pages(self.cache.v[layer], self.block_table, first, count)
        return relative_decode(q, keys, values, k_pos, profiles, sinks, q_pos, spec, scale)

    def store_index_keys(self, layer: int, keys: torch.Tensor) -> None:
        """Keep the new tokens' raw QSA index keys ``[B, d]`` in the cache."""
        self.cache.write_rows(layer, INDEX_KEYS, keys, self.slot_mapping)

    def index_keys(self, layer: int, keys: torch.Tensor) -> list[torch.Tensor]:
        """Every sequence's raw index keys so far (``[n_i, d]``, the new token's included)."""
        rows = self.index_key_table(layer)
        return [rows[b, :n] for b, n in enumerate(self.seq_lens.tolist())]

    def index_key_table(self, layer: int, tokens: int | None = None) -> torch.Tensor:
        """Every row's raw index keys ``[B, L, d]``: the pages of the block table's first columns
        that hold ``tokens`` positions (all of them by default); row ``b``'s first ``seq_lens[b]``
        are its own, the new token's included."""
        table = self.block_table
        if tokens is not None:
            table = table[:, : min(table.shape[1], -(-tokens // self.cache.page_size))]
        return gather_pages(self.cache.rows[(layer, INDEX_KEYS)], table)[0]
