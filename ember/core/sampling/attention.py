"""Attention over the paged KV cache.

* Prefill (every sequence of the pass starts at position 0): the pass's own keys and values are
  stored in the cache and attention runs exactly as in training (:class:`PackedAttention`: varlen
  flash attention on CUDA, per-document SDPA elsewhere), so prompt logprobs match the trainer's.
* Decode (one new token per sequence): the query attends to the sequence's cached keys through its
  block table. On CUDA (and under ``TRITON_INTERPRET=1``) a Triton kernel walks the pages with an
  online softmax, one program per (sequence, KV head), reading each cached key once; its shapes
  depend only on the batch size, so a decode step can be captured in a CUDA graph. Elsewhere a
  gather of the pages and a masked softmax compute the same thing.

Sliding-window layers (``AttentionSpec("sliding", window)``) see the last ``window`` positions,
the current token included.
"""

from __future__ import annotations

import warnings

import torch

from ember.core.config import AttentionSpec
from ember.core.kernels import fused
from ember.core.layers.attention import PackedAttention
from ember.core.sampling.kv_cache import PagedKVCache

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_decode_kernel(
        Q,
        K,
        V,
        O,
        BT,
        LENS,
        scale,
        window,
        stride_qb,
        stride_qh,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_vp,
        stride_vs,
        stride_vh,
        stride_ob,
        stride_oh,
        stride_bt,
        REP: tl.constexpr,
        REP_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        PAGE: tl.constexpr,
    ):
        b = tl.program_id(0)
        hk = tl.program_id(1)
        n = tl.load(LENS + b)
        r = tl.arange(0, REP_PAD)
        d = tl.arange(0, D_PAD)
        dv = tl.arange(0, DV_PAD)
        s = tl.arange(0, PAGE)
        rmask = r < REP
        q_ptr = Q + b * stride_qb + (hk * REP + r)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=rmask[:, None] & (d[None, :] < D), other=0.0).to(tl.float32) * scale
        start = tl.maximum(n - window, 0)  # window = 2**30 when the layer has none
        m = tl.full([REP_PAD], -1e30, tl.float32)
        lsum = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, DV_PAD], tl.float32)
        for p in range(start // PAGE, (n + PAGE - 1) // PAGE):
            page = tl.load(BT + b * stride_bt + p).to(tl.int64)
            pos = p * PAGE + s
            valid = (pos < n) & (pos >= start)
            k_ptr = K + page * stride_kp + s[:, None] * stride_ks + hk * stride_kh + d[None, :]
            k = tl.load(k_ptr, mask=valid[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            prob = tl.exp(scores - m_new[:, None])
            lsum = lsum * alpha + tl.sum(prob, axis=1)
            v_ptr = V + page * stride_vp + s[:, None] * stride_vs + hk * stride_vh + dv[None, :]
            v = tl.load(v_ptr, mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / tl.maximum(lsum, 1e-30)[:, None]
        o_ptr = O + b * stride_ob + (hk * REP + r)[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=rmask[:, None] & (dv[None, :] < DV))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Triton decode attention: ``q`` ``[B, Hq, D]`` against each sequence's ``seq_lens[b]`` cached
    tokens (``block_table`` ``[B, W]`` int32) -> ``[B, Hq, Dv]``; rows with length 0 give zeros."""
    B, Hq, D = q.shape
    _, page, Hkv, _ = k_pages.shape
    Dv = v_pages.shape[-1]
    rep = Hq // Hkv
    out = torch.empty(B, Hq, Dv, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    q = q.contiguous()
    _paged_decode_kernel[(B, Hkv)](
        q,
        k_pages,
        v_pages,
        out,
        block_table,
        seq_lens,
        float(scale),
        int(window or 1 << 30),
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        v_pages.stride(0),
        v_pages.stride(1),
        v_pages.stride(2),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        REP=rep,
        REP_PAD=_pow2(rep),
        D=D,
        D_PAD=_pow2(D),
        DV=Dv,
        DV_PAD=_pow2(Dv),
        PAGE=page,
    )
    return out


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
) -> torch.Tensor:
    """Decode attention over the paged cache: the Triton kernel where it runs, else the reference."""
    if _TRITON_DECODE["ok"] and fused.use_triton(q, k_pages):
        try:
            return paged_decode_triton(q, k_pages, v_pages, block_table, seq_lens, scale, window)
        except Exception as e:  # e.g. a GPU/Triton combination the kernel was never compiled for
            if fused.INTERPRET:
                raise
            _TRITON_DECODE["ok"] = False
            warnings.warn(f"paged decode kernel failed ({type(e).__name__}: {e}); using the PyTorch path", stacklevel=2)
    return paged_decode_torch(q, k_pages, v_pages, block_table, seq_lens, scale, window)


_TRITON_DECODE = {"ok": True}


def _window(spec: AttentionSpec) -> int:
    return int(spec.window) if spec.kind == "sliding" and spec.window else 0


class PrefillAttention:
    """``ForwardContext.attend`` of a prefill pass: store the pass's keys/values at ``slot_mapping``
    and attend within each prompt exactly as training does."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, doc_lengths: list[int]):
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.packed = PackedAttention(doc_lengths, cache.device)

    def __call__(self, layer: int, q, k, v, spec: AttentionSpec, scale: float) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        return self.packed(q, k, v, spec, scale)


class DecodeAttention:
    """``ForwardContext.attend`` of a decode pass (one token per sequence): store the new keys and
    values, then attend over each sequence's cached tokens (``seq_lens`` includes the new one).

    All inputs are tensors, so the same object serves a captured CUDA graph whose buffers are
    refilled between replays.
    """

    def __init__(
        self, cache: PagedKVCache, slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor
    ):
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.block_table = block_table
        self.seq_lens = seq_lens

    def __call__(self, layer: int, q, k, v, spec: AttentionSpec, scale: float) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slot_mapping)
        return paged_decode_attention(
            q, self.cache.k[layer], self.cache.v[layer], self.block_table, self.seq_lens, scale, _window(spec)
        )
