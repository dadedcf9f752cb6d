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

The launch depends only on shapes (``offsets`` stays on the device), so a decode step captures it.
``bench/fp8_decode_gemm.py --only experts`` times it against ``torch._grouped_mm``.
"""

from __future__ import annotations

import warnings

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
        HAS_ROWS: tl.constexpr, SCALED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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


def expert_product(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`expert_linear`, or where it fails (turning it off, with a warning) the grouped product
    of the gathered rows, on the dequantised weights for an e4m3 ``weight``."""
    if available(x):
        try:
            return expert_linear(x, rows, weight, offsets, scale_inv)
        except Exception as e:
            if fused.INTERPRET:
                raise
            _STATE["ok"] = False
            warnings.warn(f"expert decode kernel failed ({type(e).__name__}: {e}); using grouped products",
                          stacklevel=2)
    if scale_inv is not None:
        weight = quant.dequant_fp8_block(weight, scale_inv).to(x.dtype)
    return grouped_linear(x if rows is None else x[rows], weight, offsets)


def expert_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    scale_inv: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_n: int = BLOCK,
) -> torch.Tensor:
    """``y[i] = x[rows[i]] @ W[e].T`` for the rows ``i`` of expert ``e`` (``offsets``: int32
    cumulative row ends per expert, as for ``torch._grouped_mm``; ``rows`` None: ``x``'s own rows)
    -> ``[R, N]`` in ``out_dtype`` (default ``x``'s dtype). ``weight`` ``[E, N, K]``: bf16/fp16
    (``x`` is read in its dtype), or e4m3 with ``scale_inv`` ``[E, N/128, K/128]`` (``x`` is then
    quantised per 1 × 128 block here). Products accumulate in fp32 and are rounded once."""
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
        HAS_ROWS=rows is not None, SCALED=scaled,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK if scaled or K % BLOCK == 0 else 64,
        num_warps=4, num_stages=4,
    )
    return y
