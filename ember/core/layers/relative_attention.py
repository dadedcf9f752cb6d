"""Causal attention with a learned relative-position bias and a per-query sink (Inkling, spec §1.7).

For query ``i`` and key ``j`` of the same document, at backward distance ``d = pos_i - pos_j``::

    logit[h, i, j] = scale · q_i·k_j + (profiles[i, h, d] if d < R else 0)     (0 <= d, d < window)
    p = softmax over [logit[h, i, :], sinks[i, h]]        # the sink has a zero value
    out[i, h] = Σ_j p[h, i, j] · v_j

``profiles`` (``[T, Hq, R]``) is each token's bias-vs-distance profile (Inkling's "relative logits":
relative states times a learned profile bank) and ``sinks`` (``[T, Hq]``) a logit per query and
head that only absorbs probability mass. Softmax over ``[scores, s]`` equals the plain softmax
scaled by ``σ(lse - s)``, which is how the FlexAttention path applies it.

Two interchangeable implementations for a packed batch of documents:

* ``eager`` — exact, in PyTorch, query-chunked so the score matrix of a chunk never exceeds
  ``chunk × (chunk + window)`` per head (CPU, tests, and the fallback anywhere);
* ``flex`` — ``torch.nn.attention.flex_attention`` (compiled; CUDA) with the bias as a
  ``score_mod``, documents and the window as a block mask, and the sink through the returned
  log-sum-exp. Gradients reach ``profiles`` and ``sinks``.

:func:`relative_attention_dense` is the single-document kernel; a KV cache that keeps key positions
can call it for decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class RelativeAttentionSpec:
    """How one layer attends: ``window`` keys at most (the current one included; ``None``: all
    earlier keys of the document), with a relative bias over backward distances ``< rel_extent``."""

    window: int | None
    rel_extent: int


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // x.shape[1]
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def relative_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    profiles: torch.Tensor,
    sinks: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    spec: RelativeAttentionSpec,
    scale: float,
) -> torch.Tensor:
    """Exact attention of one document's queries over its keys.

    q ``[m, Hq, D]``, k/v ``[n, Hkv, D]``, profiles ``[m, Hq, R]``, sinks ``[m, Hq]``; ``q_pos``
    ``[m]`` and ``k_pos`` ``[n]`` are positions in the document. Returns ``[m, Hq, Dv]``.
    Numerics follow transformers' eager Inkling-2 attention (scores in the input dtype, softmax in
    fp32 with the sink as an extra column).
    """
    Hq = q.shape[1]
    R = spec.rel_extent
    kh = _expand_kv(k, Hq).transpose(0, 1)
    vh = _expand_kv(v, Hq).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), kh.transpose(1, 2)) * scale  # [Hq, m, n]
    dist = q_pos[:, None] - k_pos[None, :]
    gather = dist.clamp(0, R - 1).expand(Hq, -1, -1)
    bias = profiles.permute(1, 0, 2).gather(-1, gather)
    scores = scores + bias.masked_fill((dist < 0) | (dist >= R), 0.0)
    masked = dist < 0
    if spec.window is not None:
        masked = masked | (dist >= spec.window)
    scores = scores.masked_fill(masked, float("-inf"))
    logits = torch.cat([scores, sinks.transpose(0, 1)[:, :, None].to(scores.dtype)], dim=-1).float()
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


def _eager_packed(q, k, v, profiles, sinks, positions, seq_lens, spec, scale, chunk):
    outs, start = [], 0
    for n in seq_lens:
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            k0 = 0 if spec.window is None else max(0, a - spec.window + 1)
            qs, ks = slice(start + a, start + b), slice(start + k0, start + b)
            outs.append(
                relative_attention_dense(
                    q[qs], k[ks], v[ks], profiles[qs], sinks[qs], positions[qs], positions[ks], spec, scale
                )
            )
        start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]


@cache
def _compiled_flex():
    """FlexAttention compiled once for every batch composition (``dynamic=True``). With Dynamo's
    default the first composition compiled static shapes and the second compiled again with
    dynamic ones; each gradient mode paid both, and each head layout of a process again, toward
    Dynamo's limit of 8, past which it would silently run the unfused ``[T, T]`` path. Without
    duck shapes: with them a length of 16,384 (128 tiles) shared the head dimension's symbol,
    was specialised with it, and the next composition compiled again (9 s)."""
    from torch.fx.experimental import _config as fx_config
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=True)

    def call(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


# FlexAttention's tile. The flex path pads a pass to a multiple of it (the padding is a document
# of its own) and says so, so the dynamic-shape kernel skips the bounds checks of a ragged end, as
# a static one whose length divides would (``IS_DIVISIBLE``). Every row sees at least its own key.
FLEX_BLOCK = 128
FLEX_KERNEL_OPTIONS = {"IS_DIVISIBLE": True}


def flex_available() -> bool:
    """Whether this torch has FlexAttention with auxiliary outputs (log-sum-exp)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def window_mask(doc: torch.Tensor, window: int | None):
    """FlexAttention ``mask_mod`` of packed documents (``doc`` ``[T]``, each token's document):
    causal, within a document, fewer than ``window`` keys back (``None``: no limit). The window is
    a tensor in the closure, not a Python int: Dynamo guards on a closed-over int's value, so every
    distinct window (Inkling2's sliding and global layers) compiled the mask and the attention
    again; a tensor is an input, and one compilation serves them all."""
    limit = torch.tensor(doc.shape[0] if window is None else window, device=doc.device)

    def mask_mod(b, h, qi, kv):
        return (qi >= kv) & (doc[qi] == doc[kv]) & (qi - kv < limit)

    return mask_mod


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense ``[n, n]`` block matrix as FlexAttention's (count per row, column indices) pair,
    ordered as ``create_block_mask`` orders them (the marked columns first, in order)."""
    b = blocks.to(torch.int32)[None, None]
    cols = torch.argsort(b, dim=-1, descending=True, stable=True)
    return b.sum(-1).to(torch.int32), cols.to(torch.int32)


# elements of the (query, key block) comparisons document_block_mask makes at a time
MASK_CHUNK = 1 << 24


def document_block_mask(doc: torch.Tensor, window: int | None, block: int = 128):
    """The FlexAttention ``BlockMask`` of :func:`window_mask` (``doc`` ``[T]``: each token's
    document, non-decreasing), computed from what each query may see rather than from a ``[T, T]``
    mask: query ``i`` attends to the interval ``[lo_i, i]`` of keys, ``lo_i`` = the later of its
    document's first token and ``i - window + 1``. A (query block, key block) pair is computed when
    one of its queries' intervals meets the key block, and is full (no ``mask_mod`` needed) when
    every query of the block sees every key of it. ``O(T · T / block)`` work in plain PyTorch:
    ``create_block_mask`` builds the whole ``[T, T]`` mask, and compiling it took 252 s on an H200
    at 16k tokens (the compiled attention itself 6 s)."""
    from torch.nn.attention.flex_attention import BlockMask

    T = doc.shape[0]
    idx = torch.arange(T, device=doc.device)
    lo = torch.searchsorted(doc, doc)  # the first token of each token's document
    if window is not None:
        lo = torch.maximum(lo, idx - window + 1)
    n = -(-T // block)
    first = torch.arange(n, device=doc.device) * block  # each key block's first key
    last = (first + block - 1).clamp(max=T - 1)  # and its last real one
    # rows past T (padding of the last query block) see nothing; query blocks in chunks, so that
    # the [rows, n] comparisons stay small at long context (1M tokens: 8192 blocks)
    pad = n * block - T
    lo = torch.nn.functional.pad(lo, (0, pad), value=T)
    idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    step = max(1, MASK_CHUNK // (block * n))
    meets, covers = [], []
    for b0 in range(0, n, step):
        rows = slice(b0 * block, min(n, b0 + step) * block)
        lo_r, idx_r = lo[rows, None], idx[rows, None]
        meets.append(((lo_r <= last) & (idx_r >= first)).view(-1, block, n).any(1))
        covers.append(((lo_r <= first) & (idx_r >= first + block - 1)).view(-1, block, n).all(1))
    meets, covers = torch.cat(meets), torch.cat(covers)
    partial, full = _ordered(meets & ~covers), _ordered(covers)
    return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=block, mask_mod=window_mask(doc, window),
                                    seq_lengths=(T, T))


class PackedRelativeAttention:
    """Relative-bias attention over a packed batch of documents (training, scoring, prefill from
    position 0). One object per forward pass: it caches the block masks of the pass."""

    def __init__(
        self,
        seq_lens: list[int],
        positions: torch.Tensor,
        backend: str | None = None,
        chunk: int = 256,
        compiled: bool = True,
    ):
        self.seq_lens = list(seq_lens)
        self.positions = positions
        device = positions.device
        self.backend = backend or ("flex" if device.type == "cuda" and flex_available() else "eager")
        if self.backend not in ("eager", "flex"):
            raise ValueError(f"backend must be 'eager' or 'flex', not {self.backend!r}")
        self.chunk = chunk
        self.compiled = compiled
        # each row's document, over the length the flex path pads to (its padding: one more document)
        self.pad = -sum(self.seq_lens) % FLEX_BLOCK
        lens = torch.tensor([*self.seq_lens, self.pad], device=device)
        self.doc_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
        self._block_masks: dict[int | None, object] = {}

    def __call__(self, q, k, v, profiles, sinks, spec: RelativeAttentionSpec, scale: float) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``, profiles ``[T, Hq, R]``, sinks ``[T, Hq]`` ->
        ``[T, Hq, Dv]``."""
        if self.backend == "flex":
            return self._flex(q, k, v, profiles, sinks, spec, scale)
        return _eager_packed(q, k, v, profiles, sinks, self.positions, self.seq_lens, spec, scale, self.chunk)

    def block_mask(self, window: int | None):
        """The FlexAttention block mask of this pass for ``window`` (causal, per document), over
        the padded length."""
        if window not in self._block_masks:
            self._block_masks[window] = document_block_mask(self.doc_ids, window)
        return self._block_masks[window]

    def _flex(self, q, k, v, profiles, sinks, spec: RelativeAttentionSpec, scale: float) -> torch.Tensor:
        from torch.nn.attention.flex_attention import AuxRequest, flex_attention

        R = spec.rel_extent
        T = q.shape[0]
        if self.pad:  # zero rows: they see only each other, and their gradients are dropped
            q, k, v, profiles = (torch.cat([t, t.new_zeros(self.pad, *t.shape[1:])]) for t in (q, k, v, profiles))
        prof = profiles  # [T, Hq, R], read in place (no [Hq, T, R] copy)

        # within a document packed indices are consecutive positions, so qi - kv is the distance;
        # the block mask already removes kv > qi and other documents' keys
        def score_mod(score, b, h, qi, kv):
            d = qi - kv
            bias = prof[qi, h, d.clamp(0, R - 1)]
            return score + torch.where(d < R, bias, torch.zeros_like(bias))

        fn = _compiled_flex() if self.compiled else flex_attention
        out, aux = fn(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            score_mod=score_mod,
            block_mask=self.block_mask(spec.window),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
            kernel_options=FLEX_KERNEL_OPTIONS,
        )
        out = out[0, :, :T].transpose(0, 1)  # [T, Hq, Dv]
        lse = aux.lse[0, :, :T].transpose(0, 1)  # [T, Hq], natural log, fp32
        keep = torch.sigmoid(lse.float() - sinks.float())
        return (out.float() * keep[..., None]).to(q.dtype)


__all__ = [
    "PackedRelativeAttention",
    "RelativeAttentionSpec",
    "document_block_mask",
    "flex_available",
    "relative_attention_dense",
]
