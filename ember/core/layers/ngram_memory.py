"""Qwen3.8-Flash-Next's hashed n-gram memory, "PLE" (spec §3.6; transformers ``Qwen4ExpTextNGramEmbedding``
and ``Qwen4ExpTextPLELayer``).

Every token's bigram and trigram (with the one or two tokens before it in its sequence; EOS before the
sequence starts, and a context never reaches back across an EOS) are hashed by several heads, each
modulo its own prime, into one large embedding table. The looked-up vector gates, per residual
stream, a shared value; a dilated causal convolution adds local context::

    e = concat_h Table[(XOR_i shift_i · m_i) mod p_h + offset_h]
    K = GroupedRMSNorm(key_proj(e)),  V = value_proj(e),  Q = GroupedRMSNorm(X)
    g_j = <K_j, Q_j>/sqrt(H);  g_j ← sign(g_j)·sqrt(max(|g_j|, 1e-6));  G_j = σ(g_j)·V
    out = flatten(G) + silu(DWConv1d_{dilation = n}(GroupedRMSNorm(flatten(G))))

The table is frozen and never part of an adapter; so are the projections, norms and convolution
(spec §3.9 lists none of them as LoRA targets). Decoding keeps ``ngram_context`` (each sequence's
last ``n - 1`` token ids, plus one) and ``ple_conv`` (the convolution's input window) in ``ctx.state``.

The table lives in host memory, never on the GPU (the released model's is 51.2 B parameters, ~95 GiB
in bf16): :class:`NGramEmbedding` names it in ``host_parameters``, so
:func:`ember.core.loading.load_model` materialises it on the CPU (pinned when the model is on a GPU)
whatever the model's device. A lookup computes the row ids on the device, copies them to the host,
gathers the rows there into a pinned buffer and copies that to the device without blocking the host
(:func:`host_rows`; on a CPU run the same code makes no copies). The static decoder computes the
ids on the host from the sequences' last tokens (:meth:`NGramEmbedding.window_ids`) and fetches the
rows before its step (``ctx.prefetched``), so the step itself never waits for the host. Under expert parallelism each rank
holds a block of the rows and ``lookup`` fetches the others' (set from outside the model by
:mod:`ember.dist.host_table`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.layers.hyper_connections import GroupedRMSNorm
from ember.core.layers.packed_conv import causal_conv, extend_with_history

if TYPE_CHECKING:
    from ember.core.models.base import ForwardContext

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers ``m_i`` below ``(2^63 - 1) / vocab`` so that ``token · m_i`` fits in int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def head_primes(base: int, first_head: int, heads: int) -> list[int]:
    """The primes above ``base - 1`` numbered ``first_head + 1 … first_head + heads`` (one per head)."""
    primes, p = [], base - 1
    while len(primes) < first_head + heads:
        p += 1
        if _is_prime(p):
            primes.append(p)
    return primes[first_head:]


def host_rows(table: torch.Tensor, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
    """Rows ``ids`` of ``table`` (both in host memory), gathered into host memory (pinned if ``pin``,
    so that the copy to a GPU can run asynchronously)."""
    out = torch.empty((ids.shape[0], *table.shape[1:]), dtype=table.dtype, device=table.device, pin_memory=pin)
    return torch.index_select(table, 0, ids, out=out)


# (this rank's table, row ids on the host [N], pin) -> the rows [N, dim] on the host
RowLookup = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


class NGramEmbedding(nn.Module):
    """Hashed n-gram ids of every token and their rows of ``ngram_embedding`` (frozen, in host
    memory: see the module doc). ``lookup`` fetches rows from the table; ``None``: the whole table
    is here (:func:`host_rows`)."""

    host_parameters = ("ngram_embedding.weight",)  # read by load_model: kept in host memory
    lookup: RowLookup | None = None

    def __init__(self, raw: dict[str, Any], embed_dim: int, ple_index: int, layer: int, eos_token_id: int):
        super().__init__()
        self.layer = layer
        self.ngram_size = int(raw.get("ngram_size", 3))
        self.heads_per_ngram = int(raw.get("heads_per_ngram", 8))
        heads = (self.ngram_size - 1) * self.heads_per_ngram
        self.eos = eos_token_id
        # python ints: the model is built on the meta device, so tensors are made in forward
        seed = int(raw.get("seed", 1234))
        self.multipliers = hash_multipliers(int(raw["vocab_size"]), self.ngram_size, ple_index, seed)
        self.primes = head_primes(int(raw.get("ngram_vocab_size_base", 20_000_000)), ple_index * heads, heads)
        self.offsets = [sum(self.primes[:h]) for h in range(heads)]
        divisor = int(raw.get("make_ngram_vocab_size_divisible_by", 128))
        rows = math.ceil(sum(self.primes) / divisor) * divisor
        self.ngram_embedding = nn.Embedding(rows, embed_dim // heads)
        self._consts: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def ids(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Table rows ``[T, heads]`` of every token's n-grams."""
        return self._hash(*self._context(input_ids, ctx))

    def window_ids(self, windows: torch.Tensor) -> torch.Tensor:
        """Table rows ``[B, heads]`` of the last token of each window ``[B, ngram_size]`` of token ids
        (oldest first; EOS where a window reaches before its sequence's start): the rows
        :meth:`ids` gives that token, computed where ``windows`` lives (the host, before a pass)."""
        B, n = windows.shape
        if n != self.ngram_size:
            raise ValueError(f"windows of {n} tokens, the n-gram size is {self.ngram_size}")
        index = torch.arange(B, device=windows.device) * n + n - 1
        return self._hash(windows.reshape(-1).long(), index)

    def _context(self, input_ids: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token with the ``n - 1`` before it in its sequence: the extended ids and each token's
        index in them (:func:`extend_with_history`); the sequences' new contexts go to ``ctx.state``."""
        context = self.ngram_size - 1
        seq_lens = ctx.seq_lens or [input_ids.shape[0]]
        # the state keeps ids + 1, so that a zero state (a sequence that starts) reads as EOS
        history = ctx.state.get(self.layer, "ngram_context") if ctx.state is not None else None
        if history is not None:
            history = torch.where(history > 0, history - 1, self.eos)
        ext, index, last = extend_with_history(input_ids.long(), seq_lens, history, context, fill=self.eos)
        if ctx.state is not None:
            ctx.state.put(self.layer, "ngram_context", ext[last] + 1)
        return ext, index

    def _hash(self, ext: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The table rows ``[len(index), heads]`` of the tokens ``ext[index]`` given the ids before them."""
        if ext.device not in self._consts:
            self._consts[ext.device] = tuple(
                torch.tensor(v, dtype=torch.long, device=ext.device) for v in (self.multipliers, self.primes, self.offsets)
            )
        mult, primes, offsets = self._consts[ext.device]
        # shift_s: the token s places back, or EOS if the context crosses an EOS (one at t itself does not count)
        shifted, valid = [ext[index]], torch.ones_like(index, dtype=torch.bool)
        for s in range(1, self.ngram_size):
            prev = ext[index - s]
            valid = valid & (prev != self.eos)
            shifted.append(torch.where(valid, prev, self.eos))
        blocks, mixed = [], shifted[0] * mult[0]
        for n in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[n - 1] * mult[n - 1])
            h = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
            blocks.append(torch.remainder(mixed[:, None], primes[h]) + offsets[h])
        return torch.cat(blocks, dim=-1)

    def rows(self, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """The table's rows ``ids`` ``[N, heads]`` (on the host), concatenated per token:
        ``[N, heads · dim]`` in host memory (pinned if ``pin``)."""
        table = self.ngram_embedding.weight
        rows = (self.lookup or host_rows)(table, ids.reshape(-1).to(table.device), pin)
        return rows.view(ids.shape[0], ids.shape[1] * table.shape[1])

    def fetch(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """:meth:`rows` of ``ids`` (on any device) on ``device``: the ids go to the host (a sync when
        they are on a GPU) and the rows come back without blocking the host."""
        pin = device.type == "cuda" and self.ngram_embedding.weight.device.type == "cpu"
        return self.rows(ids.to(self.ngram_embedding.weight.device), pin).to(device, non_blocking=True)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        rows = ctx.prefetched.get(self.layer) if ctx.prefetched is not None else None
        if rows is not None:  # fetched before the pass (the static decoder): only the context advances
            self._context(input_ids, ctx)
            return rows
        return self.fetch(self.ids(input_ids, ctx), input_ids.device)


class PLELayer(nn.Module):
    """The n-gram memory read of one layer, added to all residual streams before its attention read."""

    def __init__(self, raw: dict[str, Any], hidden: int, streams: int, eps: float, ple_index: int, layer: int,
                 eos_token_id: int):
        super().__init__()
        self.layer = layer
        self.hidden = hidden
        self.streams = streams
        embed_dim = int(raw.get("ple_embed_dim") or hidden)
        width = streams * hidden
        self.dilation = int(raw.get("ngram_size", 3))
        self.ple_embedding = NGramEmbedding(raw, embed_dim, ple_index, layer, eos_token_id)
        self.key_proj = nn.Linear(embed_dim, width, bias=False)
        self.value_proj = nn.Linear(embed_dim, hidden, bias=False)
        self.norm_key = GroupedRMSNorm(width, streams, eps)
        self.norm_query = GroupedRMSNorm(width, streams, eps)
        self.norm_conv = GroupedRMSNorm(width, streams, eps)
        kernel = int(raw.get("ple_conv_kernel_size", 4))
        self.conv1d = nn.Conv1d(width, width, kernel, groups=width, dilation=self.dilation, bias=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n, H = self.streams, self.hidden
        e = self.ple_embedding(input_ids, ctx)
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (n, H))
        query = self.norm_query(x).unflatten(-1, (n, H))
        g = (key * query).sum(-1, keepdim=True) / math.sqrt(H)
        g = g.abs().clamp_min(1e-6).sqrt() * g.sign()
        gated = (torch.sigmoid(g) * self.value_proj(e)[:, None, :]).flatten(-2)
        history = ctx.state.get(self.layer, "ple_conv") if ctx.state is not None else None
        conv, history = causal_conv(self.norm_conv(gated), self.conv1d.weight[:, 0], ctx.seq_lens or [x.shape[0]],
                                    history, self.dilation)
        if ctx.state is not None:
            ctx.state.put(self.layer, "ple_conv", history)
        return gated + F.silu(conv).to(gated.dtype)
