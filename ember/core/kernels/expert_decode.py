"""Routed experts' products at decode shapes, in bf16 or in blockwise fp8 (Triton).

A decode step of an MoE model sends a few rows to each expert (64 tokens × top-8 over 128 experts:
about 4 rows each), so its products are streams over every expert's weight. ``torch._grouped_mm``
(CUTLASS) tiles each group for many rows and reached about half the memory bandwidth there
(Qwen3-30B-A3B: 27.7 ms of a 40 ms step on an H200 for 58 GB of expert weights). This kernel is
shaped for few rows per expert:

Measured on an H100 (``bench/fp8_decode_gemm.py --only experts``, 64 tokens, weights from HBM):
1.12-1.29× ``torch._grouped_mm`` in bf16 (3.0-3.1 TB/s of touched weights), and 2.1-2.4× it with
the fp8 copies (half the bytes at 2.6-2.9 TB/s). Qwen3-30B-A3B's decode step: 38.9 ms (42.2 ms before,
another call on an H100).

* program ``(j, e)`` streams columns ``j·BLOCK_N ..`` of expert ``e``'s weight once, K block by K
  block, against the expert's rows (at most ``BLOCK_M`` of them in one tile; more are walked block
  by block) with the weight tile as the MMA's M side (``tl.dot(w, x.T)``); experts without rows
  return at once;
* rows are read through ``rows`` (row ``i`` of the output is ``x[rows[i]]``'s product): the
  ``[rows, K]`` gather before the product is not made;
* weights in bf16 (the model's) or as the fp8 rollout copy (:mod:`ember.core.rollout_precision`):
  e4m3 with one fp32 ``scale_inv`` per 128 × 128 tile, the input quantised per 1 × 128 block
  (:mod:`ember.core.kernels.fp8_quant`, once per token, before the gather), each K block's product
  scaled by ``scale_inv · x_scale`` as in :mod:`ember.core.kernels.fp8_gemm` (W8A8, DeepSeek-V3's
  recipe).

* the batch's LoRA on the experts (:class:`ExpertLora`): its shrink ``x·A[p]ᵀ`` (rank ≤ 32 per
  expert) is one launch of the same kernel over the (expert, adapter group) pairs, and its expand
  ``scale · h·B[p]ᵀ`` is added in the product's epilogue before the one rounding: for each adapter
  group with rows in the tile, tensor-core products of ``B[p]`` with the fp32 ``h`` split into three
  bf16 parts (all 24 bits of its mantissa: the sum is fp32's). Before the kernel, a projection's LoRA ran a
  gather, two grouped products (CUTLASS, ~29 µs each on an H200 at 4 rows per expert), a scale and
  an add. (The epilogue was first a broadcast sum, row by row, of ``[BLOCK_N, BLOCK_M, 4]``
  temporaries, addressed by as many 64-bit pointers: at a prefill's 64-row tiles the fp8 kernel
  spilled 5,020 bytes a thread, against 1,924 now and 1,940 without LoRA (ptxas for sm_90a). On an
  H100, Qwen3-30B-A3B's down projection with rank-32 LoRA went from 1,600 to 188 µs at 1,024 tokens
  and from 124 to 89 µs at 64, in fp8; docs/performance.md, 2026-12-07.)

The launch depends only on shapes (``offsets`` stays on the device), so a decode step captures it.
``bench/fp8_decode_gemm.py --only experts`` times it against ``torch._grouped_mm``.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from ember.core import quant
from ember.core.kernels import fp8_quant, fused
from ember.core.kernels.grouped import grouped_linear

BLOCK = 128  # fp8 tiles and activation blocks along K (and the weight tiles along N)
# average rows per expert up to which a bf16 product takes this kernel: on an H100 it beat
# torch._grouped_mm at 4-5 rows per expert (Qwen3-30B-A3B gate_up 263 against 297 µs, down 131
# against 164; Qwen3-Next 486 / 691 against 543 / 763) and lost on gate_up at 16 (390 against 314)
ROWS_PER_EXPERT = 8

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_kernel(
        X, XS, ROWS, W, WS, Y, OFFS, N, K,
        stride_xm, stride_xsm, stride_we, stride_wn, stride_wse, stride_wsn, stride_ym,
        H, GRP, LB, LS, R, G, stride_hm, stride_be, stride_bn,
        HAS_ROWS: tl.constexpr, SCALED: tl.constexpr, LORA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        e = tl.program_id(1)
        start = tl.where(e > 0, tl.load(OFFS + tl.maximum(e - 1, 0)), 0)
        end = tl.load(OFFS + e)
        if end > start:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            kk = tl.arange(0, BLOCK_K)
            cmask = cols < N
            w_ptr = W + e.to(tl.int64) * stride_we + cols.to(tl.int64)[:, None] * stride_wn + kk[None, :]
            ws_ptr = WS + e.to(tl.int64) * stride_wse + (cols // BLOCK_K) * stride_wsn
            for m0 in range(start, end, BLOCK_M):
                r = m0 + tl.arange(0, BLOCK_M)
                rmask = r < end
                if HAS_ROWS:
                    src = tl.load(ROWS + r, mask=rmask, other=0)
                else:
                    src = r
                x_ptr = X + src.to(tl.int64)[:, None] * stride_xm + kk[None, :]
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for kb in range(tl.cdiv(K, BLOCK_K)):
                    kmask = kb * BLOCK_K + kk < K
                    w = tl.load(w_ptr + kb * BLOCK_K, mask=cmask[:, None] & kmask[None, :], other=0.0)
                    x = tl.load(x_ptr + kb * BLOCK_K, mask=rmask[:, None] & kmask[None, :], other=0.0)
                    if SCALED:
                        ws = tl.load(ws_ptr + kb, mask=cmask, other=0.0)
                        xs = tl.load(XS + src * stride_xsm + kb, mask=rmask, other=0.0)
                        acc += tl.dot(w, tl.trans(x)) * ws[:, None] * xs[None, :]
                    else:
                        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
                if LORA:
                    # + scale · h·B[p]ᵀ, ``h`` the rows' fp32 shrink and ``p = e·G + group`` each
                    # row's (expert, adapter group) pair. Rows of several adapters may share the
                    # tile: products for each group from the tile's first to its last, over that
                    # group's rows (the others' h masked to zero, which adds nothing to them)
                    grp = tl.load(GRP + r, mask=rmask, other=0)
                    s = tl.load(LS + r, mask=rmask, other=0.0).to(tl.float32)
                    rr = tl.arange(0, BLOCK_R)
                    h = tl.load(H + r.to(tl.int64)[:, None] * stride_hm + rr[None, :],
                                mask=rmask[:, None] & (rr < R)[None, :], other=0.0) * s[:, None]
                    g_lo = tl.min(tl.where(rmask, grp, G), axis=0)
                    g_hi = tl.max(tl.where(rmask, grp, -1), axis=0)
                    for gg in range(g_lo, g_hi + 1):
                        b = tl.load(LB + (e * G + gg).to(tl.int64) * stride_be + cols.to(tl.int64)[:, None] * stride_bn
                                    + rr[None, :], mask=cmask[:, None] & (rr < R)[None, :], other=0.0)
                        hg = tl.where((grp == gg)[:, None], h, 0.0)
                        if LB.dtype.element_ty == tl.float32:
                            acc = tl.dot(b, tl.trans(hg), acc, input_precision="ieee")
                        else:  # h as three 16-bit parts (all 24 of its bits), on the tensor cores
                            for _ in tl.static_range(3):
                                part = hg.to(b.dtype)
                                acc = tl.dot(b, tl.trans(part), acc)
                                hg -= part.to(tl.float32)
                y_ptr = Y + r.to(tl.int64)[None, :] * stride_ym + cols[:, None]
                tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=cmask[:, None] & rmask[None, :])


_STATE = {"ok": True}  # off after a failed launch (a GPU/Triton combination it was never compiled for)


def available(x: torch.Tensor) -> bool:
    """Whether :func:`expert_linear` can run on ``x``'s device (CUDA, or the CPU interpreter)."""
    return _STATE["ok"] and fused.use_triton(x)


def takes(x: torch.Tensor, rows: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether a product of these rows is decode-shaped enough for :func:`expert_linear`: no
    gradient, at most :data:`ROWS_PER_EXPERT` rows per expert on average, a weight the kernel reads
    (bf16/fp16, or e4m3) with unit stride along K."""
    n = x.shape[0] if rows is None else rows.shape[0]
    return (
        available(x)
        and not torch.is_grad_enabled()
        and n <= ROWS_PER_EXPERT * weight.shape[0]
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
        and weight.stride(-1) == 1
        and x.stride(-1) == 1
    )


class ExpertLora(NamedTuple):
    """The batch's LoRA term of an expert product, over (expert, adapter group) pairs: ``A``
    ``[E·G, r, K]`` and ``B`` ``[E·G, N, r]`` (pair ``e·G + g``), each row's ``scale`` and
    ``group`` (rows sorted by expert, then group), ``groups`` (G) and ``offsets``, the pairs' int32
    row ends ``[E·G]``. Row ``i`` of expert ``e`` gets ``scale[i] · (x_i A[p]ᵀ) B[p]ᵀ``."""

    A: torch.Tensor
    B: torch.Tensor
    scale: torch.Tensor
    group: torch.Tensor
    groups: int
    offsets: torch.Tensor


def expert_product(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    scale_inv: torch.Tensor | None = None,
    lora: ExpertLora | None = None,
) -> torch.Tensor:
    """:func:`expert_linear`, or where it fails (turning it off, with a warning) the grouped products
    of the gathered rows, on the dequantised weights for an e4m3 ``weight``. For passes without
    gradients (the sampler's)."""
    if torch.is_grad_enabled() and (x.requires_grad or (lora is not None and lora.A.requires_grad)):
        raise ValueError("expert_product: the decode-shaped product has no gradient")
    if available(x):
        try:
            return expert_linear(x, rows, weight, offsets, scale_inv, lora=lora)
        except Exception as e:
            if fused.INTERPRET:
                raise
            _STATE["ok"] = False
            warnings.warn(f"expert decode kernel failed ({type(e).__name__}: {e}); using grouped products",
                          stacklevel=2)
    if scale_inv is not None:
        weight = quant.dequant_fp8_block(weight, scale_inv).to(x.dtype)
    xs = x if rows is None else x[rows]
    y = grouped_linear(xs, weight, offsets)
    if lora is not None:
        h = grouped_linear(xs, lora.A, lora.offsets) * lora.scale[:, None]
        y = y + grouped_linear(h, lora.B, lora.offsets)
    return y


def expert_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    scale_inv: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_n: int = BLOCK,
    lora: ExpertLora | None = None,
) -> torch.Tensor:
    """``y[i] = x[rows[i]] @ W[e].T`` for the rows ``i`` of expert ``e`` (``offsets``: int32
    cumulative row ends per expert, as for ``torch._grouped_mm``; ``rows`` None: ``x``'s own rows)
    -> ``[R, N]`` in ``out_dtype`` (default ``x``'s dtype). ``weight`` ``[E, N, K]``: bf16/fp16
    (``x`` is read in its dtype), or e4m3 with ``scale_inv`` ``[E, N/128, K/128]`` (``x`` is then
    quantised per 1 × 128 block here). With ``lora``, its term is added to the fp32 accumulator
    before the one rounding: the shrink ``x·A[p]ᵀ`` is one launch of this kernel over the pairs
    (fp32, from ``x`` unquantised), the expand is in the product's own epilogue."""
    E, N, K = weight.shape
    R = x.shape[0] if rows is None else rows.shape[0]
    if offsets.shape != (E,):
        raise ValueError(f"expert_linear: offsets {tuple(offsets.shape)} for {E} experts")
    scaled = scale_inv is not None
    if scaled and (K % BLOCK or N % BLOCK or scale_inv.shape != (E, N // BLOCK, K // BLOCK)):
        raise ValueError(f"expert_linear: fp8 weight {tuple(weight.shape)} with scales {tuple(scale_inv.shape)} "
                         f"(N and K multiples of {BLOCK})")
    if scaled != (weight.dtype == torch.float8_e4m3fn):
        raise ValueError("expert_linear: an e4m3 weight needs its scale_inv, and only it")
    y = torch.empty(R, N, device=x.device, dtype=out_dtype or x.dtype)
    if R == 0:
        return y
    if lora is not None:
        pairs, rank = E * lora.groups, lora.A.shape[1]
        if lora.A.shape != (pairs, rank, K) or lora.B.shape != (pairs, N, rank) or lora.offsets.shape != (pairs,) \
                or lora.scale.shape != (R,) or lora.group.shape != (R,):
            raise ValueError(f"expert_linear: LoRA factors {tuple(lora.A.shape)} / {tuple(lora.B.shape)} for {E} "
                             f"experts × {lora.groups} groups, weight {tuple(weight.shape)}, {R} rows")
        h = expert_linear(x, rows, lora.A, lora.offsets, out_dtype=torch.float32, block_n=16)
        lb = lora.B if lora.B.stride(-1) == 1 else lora.B.contiguous()
        lora_args = (h, lora.group, lb, lora.scale, rank, lora.groups, h.stride(0), lb.stride(0), lb.stride(1))
    else:
        lora_args = (y, y, y, y, 0, 1, 0, 0, 0)  # unused
    if scaled:
        xq, xs = fp8_quant.quantize_act_fp8(x)
    else:
        xq, xs = x, x  # xs unused
    block_m = max(16, min(64, triton.next_power_of_2(max(1, R // E))))
    grid = (triton.cdiv(N, block_n), E)
    _expert_kernel[grid](
        xq, xs, rows if rows is not None else offsets, weight, scale_inv if scaled else weight, y, offsets, N, K,
        xq.stride(0), xs.stride(0) if scaled else 0, weight.stride(0), weight.stride(1),
        scale_inv.stride(0) if scaled else 0, scale_inv.stride(1) if scaled else 0, y.stride(0),
        *lora_args,
        HAS_ROWS=rows is not None, SCALED=scaled, LORA=lora is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK if scaled or K % BLOCK == 0 else 64,
        BLOCK_R=max(16, triton.next_power_of_2(lora.A.shape[1])) if lora is not None else 16,
        num_warps=4, num_stages=4,
    )
    return y
