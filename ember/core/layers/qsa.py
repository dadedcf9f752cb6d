"""Qwen Sparse Attention (QSA): the block indexer of Qwen3.8-Flash-Next's attention layers (spec §3.5;
transformers ``Qwen4ExpTextQSAIndexer``).

The indexer pools the keys of each complete block of ``r`` consecutive tokens (mean of raw index
keys, zero-centred RMSNorm, RoPE at the block's first position) and scores them against ``h`` index
queries: ``Σ_h relu(q_h · k_block) / sqrt(d)``. A query at position ``p`` sees ``n_c = (p + 1) // r``
complete blocks; it attends to the top ``budget / r`` of them plus its tail (positions
``r·n_c … p``). While ``n_c <= budget / r`` every block is chosen and QSA *is* dense causal
attention, so the layer only builds a selection when some query of the pass is past that threshold.

The selection is discrete: no gradient reaches the indexer (it is frozen, spec §3.9).

Decoding needs each sequence's earlier raw index keys. An ``attend`` with a KV cache may keep them
(``attend.store_index_keys(layer, keys [T, d])`` and ``attend.index_keys(layer, keys) -> [n_i, d]``
per sequence, the pass's included: the sampler stores them in its KV pages); otherwise they travel in
``ctx.state`` under ``index_keys`` (``[N, L, d]``, zero-padded to the longest sequence; it grows by one
row per token, like a KV cache).

A static-shape decode step (CUDA graphs) can neither test the threshold on the device nor select per
sequence: its ``ctx.position_bound`` decides the threshold on the host, and an ``attend`` with
``fixed_selection`` hands every row's index keys up to that bound as one ``[B, L, d]`` table
(``index_key_table``), over which all rows select at once (:meth:`QSAIndexer.select_fixed`). Ties among block scores are
then broken toward the lower block (``torch.topk``, which the per-sequence path calls as transformers
does, breaks them in an order of its own that depends on the row's length); set ``stable_ties`` to
break them so on every path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.layers.norms import RMSNorm
from ember.core.layers.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from ember.core.models.base import ForwardContext

# score rows computed at once: bounds the [rows, heads, blocks] fp32 intermediate to ~256 MiB
_SCORE_ELEMENTS = 1 << 26


@dataclass
class BlockSelection:
    """The keys each query of a pass may attend to: the complete ``block_size``-token blocks in
    ``blocks`` (``[T, K]`` block numbers within the query's sequence, ``-1`` = none) plus its tail
    (the keys after its last complete block), never keys after the query's ``positions``."""

    blocks: torch.Tensor
    block_size: int
    positions: torch.Tensor

    def token_mask(self, rows: slice, kv_len: int) -> torch.Tensor:
        """``[rows, kv_len]`` bool: may query ``t`` attend to the key at sequence position ``j``."""
        pos, blocks = self.positions[rows], self.blocks[rows]
        num_blocks = -(-kv_len // self.block_size)
        chosen = torch.zeros(pos.shape[0], num_blocks + 1, dtype=torch.bool, device=pos.device)
        chosen.scatter_(1, torch.where(blocks >= 0, blocks, num_blocks), True)
        j = torch.arange(kv_len, device=pos.device)
        tail_start = (pos + 1) // self.block_size * self.block_size
        in_block = chosen[:, j // self.block_size]
        return (j[None] <= pos[:, None]) & (in_block | (j[None] >= tail_start[:, None]))


class QSAIndexer(nn.Module):
    """Chooses the key blocks of every query (frozen: ``index_qk_proj`` and the two norms)."""

    frozen_in_full_finetune = True  # ember.core.full_ft: it selects under no_grad, nothing trains it
    stable_ties = False  # True: the per-sequence path breaks ties toward the lower block too (module doc)

    def __init__(self, hidden: int, n_heads: int, head_dim: int, budget: int, block_size: int, eps: float, layer: int):
        super().__init__()
        if budget % block_size:
            raise ValueError(f"indexer_budget ({budget}) must be a multiple of indexer_compress_ratio ({block_size})")
        self.layer = layer
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.block_topk = budget // block_size
        self.index_qk_proj = nn.Linear(hidden, (n_heads + 1) * head_dim, bias=False)
        self.q_layernorm = RMSNorm(head_dim, eps, zero_centred=True)
        self.k_layernorm = RMSNorm(head_dim, eps, zero_centred=True)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, ctx: ForwardContext, rotary: RotaryEmbedding) -> BlockSelection | None:
        """The selection of every query in the pass, or ``None`` when all of them are dense."""
        positions = ctx.positions
        bound = ctx.position_bound if ctx.position_bound is not None else int(positions.max())
        dense = (bound + 1) // self.block_size <= self.block_topk
        if dense and ctx.state is None:
            return None  # training below the threshold: the keys are not needed later either
        T, d = x.shape[0], self.head_dim
        qk = self.index_qk_proj(x)
        raw = qk[:, self.n_heads * d :]
        seq_lens = ctx.seq_lens or [T]
        cache = ctx.attend if hasattr(ctx.attend, "store_index_keys") else None
        if cache is not None:  # a KV cache keeps the keys (the sampler's paged cache)
            cache.store_index_keys(self.layer, raw)
            if dense:
                return None
            if getattr(cache, "fixed_selection", False):
                keys = cache.index_key_table(self.layer, bound + 1)
                blocks = self.select_fixed(self._queries(x, qk, ctx, rotary), keys, positions, rotary)
                return BlockSelection(blocks, self.block_size, positions)
            keys = cache.index_keys(self.layer, raw)
        else:
            keys = self._keys_from_state(raw, ctx, seq_lens)
            if dense:
                return None
        q = self._queries(x, qk, ctx, rotary)
        blocks = torch.full((T, self.block_topk), -1, dtype=torch.long, device=x.device)
        start = 0
        for seq_keys, n in zip(keys, seq_lens):
            rows = slice(start, start + n)
            self._select(q[rows], seq_keys, positions[rows], rotary, blocks[rows])
            start += n
        return BlockSelection(blocks, self.block_size, positions)

    def _queries(self, x: torch.Tensor, qk: torch.Tensor, ctx: ForwardContext, rotary: RotaryEmbedding) -> torch.Tensor:
        """The index queries ``[T, h, d]`` (fp32) of the pass."""
        T, d = x.shape[0], self.head_dim
        cos, sin = ctx.rope(rotary, x.dtype)
        return apply_rope(self.q_layernorm(qk[:, : self.n_heads * d].view(T, self.n_heads, d)), cos, sin).float()

    def _block_keys(self, keys: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """The pooled, normalised and rotated keys ``[..., C, d]`` (fp32) of the complete blocks of
        raw index keys ``[..., L, d]`` (``C = L // r``)."""
        r = self.block_size
        num_blocks = keys.shape[-2] // r
        # the mean in fp32 (as a cast, then the mean), without an fp32 copy of the keys
        pooled = keys[..., : num_blocks * r, :].unflatten(-2, (num_blocks, r)).mean(-2, dtype=torch.float32)
        pooled = pooled.to(keys.dtype)
        starts = torch.arange(num_blocks, device=keys.device) * r
        cos, sin = rotary.cos_sin(starts, keys.dtype)
        normed = self.k_layernorm(pooled)  # [..., C, d] -> blocks along the token axis of apply_rope
        flat = normed.reshape(-1, num_blocks, normed.shape[-1]).transpose(0, 1)
        return apply_rope(flat, cos, sin).transpose(0, 1).reshape(normed.shape).float()

    def _scores(self, q: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
        """``Σ_h relu(q_h · k_c) / sqrt(d)``: q ``[T, h, d]``, block keys ``[C, d]`` -> ``[T, C]``
        (or, batched, ``[B, h, d]`` and ``[B, C, d]`` -> ``[B, C]``)."""
        spec = "thd,cd->tch" if block_keys.dim() == 2 else "bhd,bcd->bch"
        return torch.relu(torch.einsum(spec, q, block_keys)).sum(-1) / math.sqrt(self.head_dim)

    def _top(self, scores: torch.Tensor, stable: bool) -> torch.Tensor:
        """The ``block_topk`` best columns of each row of ``scores``."""
        if stable:
            return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.block_topk]
        return scores.topk(self.block_topk, dim=-1).indices

    def select_fixed(
        self, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        """The chosen blocks ``[B, K]`` of one query per row (``q`` ``[B, h, d]`` at ``positions``)
        over each row's raw index keys ``keys`` ``[B, L, d]`` (the row's first ``positions + 1``
        are its own; the rest are never read): fixed shapes, no host data, ties toward the lower
        block. A row that sees at most ``K`` blocks gets them all."""
        r, K = self.block_size, self.block_topk
        L = keys.shape[1]
        visible = (positions + 1) // r
        j = torch.arange(K, device=q.device)
        dense = torch.where(j[None] < visible[:, None], j[None], -1)
        if L // r <= K:  # no row can see more than K blocks
            return dense
        block_keys = self._block_keys(keys, rotary)  # [B, C, d]
        scores = self._scores(q, block_keys)
        seen = torch.arange(scores.shape[1], device=q.device)[None] < visible[:, None]
        top = self._top(scores.masked_fill(~seen, float("-inf")), stable=True)
        return torch.where((visible > K)[:, None], top, dense)

    def _keys_from_state(self, raw: torch.Tensor, ctx: ForwardContext, seq_lens: list[int]) -> list[torch.Tensor]:
        """Every sequence's raw index keys so far, its earlier ones read from ``ctx.state``
        (``index_keys``), which is then updated."""
        positions = ctx.positions
        history = ctx.state.get(self.layer, "index_keys") if ctx.state is not None else None
        keys, start = [], 0
        for i, n in enumerate(seq_lens):
            prior = int(positions[start])
            own = raw[start : start + n]
            if prior and history is None:
                raise RuntimeError(f"layer {self.layer}: a sequence continues at {prior} without index_keys state")
            keys.append(torch.cat([history[i, :prior].to(own.dtype), own]) if prior else own)
            start += n
        if ctx.state is not None:
            longest = max(k.shape[0] for k in keys)
            padded = [F.pad(k, (0, 0, 0, longest - k.shape[0])) for k in keys]
            ctx.state.put(self.layer, "index_keys", torch.stack(padded))
        return keys

    def _select(
        self, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, out: torch.Tensor
    ) -> None:
        """Fill ``out`` ``[n, K]`` with the chosen blocks of one sequence's queries ``q`` ``[n, h, d]``
        (consecutive positions) given all its raw index keys so far ``[L, d]``.

        Several blocks can tie (relu makes scores of exactly 0 common), so the choice among them must
        not depend on how a pass is laid out: every query's top-k runs on a row of exactly its
        visible blocks, the call transformers makes, whether it is scored in a training pass or
        while decoding."""
        r, K = self.block_size, self.block_topk
        num_blocks = keys.shape[0] // r
        visible = (positions + 1) // r  # complete blocks each query sees
        dense = visible <= K
        if dense.any():
            j = torch.arange(K, device=q.device)
            out[dense] = torch.where(j[None] < visible[dense, None], j[None], -1)
        if dense.all():
            return
        block_keys = self._block_keys(keys[: num_blocks * r], rotary)
        first = int(torch.nonzero(~dense)[0])  # positions increase: the sparse queries come last
        step = max(1, _SCORE_ELEMENTS // (num_blocks * self.n_heads))
        for s in range(first, q.shape[0], step):
            e = min(q.shape[0], s + step)
            scores = self._scores(q[s:e], block_keys)
            seen, counts = torch.unique_consecutive(visible[s:e], return_counts=True)
            a = 0
            for c, n in zip(seen.tolist(), counts.tolist()):  # runs of queries that see the same blocks
                out[s + a : s + a + n] = self._top(scores[a : a + n, :c], self.stable_ties)
                a += n


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: list[int],
    selection: BlockSelection,
    scale: float,
    rows_per_chunk: int = 1024,
) -> torch.Tensor:
    """Exact attention restricted to ``selection`` for a pass of whole sequences (training, scoring):
    q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` -> ``[T, Hq, Dv]``. Eager (masked SDPA over query chunks);
    the GPU path wants a block-sparse kernel (FlexAttention, cuDNN QSA)."""
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in seq_lens:
        kh = k[start : start + n].transpose(0, 1).repeat_interleave(rep, dim=0)
        vh = v[start : start + n].transpose(0, 1).repeat_interleave(rep, dim=0)
        for s in range(0, n, rows_per_chunk):
            e = min(n, s + rows_per_chunk)
            mask = selection.token_mask(slice(start + s, start + e), e)
            qh = q[start + s : start + e].transpose(0, 1)
            o = F.scaled_dot_product_attention(qh, kh[:, :e], vh[:, :e], attn_mask=mask, scale=scale)
            outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs)
