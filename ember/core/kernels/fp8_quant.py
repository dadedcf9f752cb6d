"""Activation quantisation for the fp8 rollout products (:mod:`ember.core.rollout_precision`) in
one Triton launch.

:func:`quantize_act_fp8` is :func:`~ember.core.rollout_precision._quantize_act_torch` (the PyTorch
version, which launches several kernels: cast, abs, amax, divide, clamp, convert) as one pass over
``x``: ``x`` ``[M, K]`` (bf16, fp16 or fp32, ``K`` a multiple of 128) becomes e4m3 ``xq`` ``[M, K]``
with one fp32 scale per 1 × 128 block, ``scale = max(amax / 448, 1e-12)`` and
``xq = e4m3(clamp(x / scale, -448, 448))``, bit for bit:

* both divisions are IEEE round-to-nearest (``tl.math.div_rn``: Triton's ``/`` on fp32 is the
  approximate ``div.full.f32`` on NVIDIA GPUs); ``1e-12`` is the same fp32 constant as PyTorch's
  ``clamp_min(1e-12)`` on an fp32 tensor;
* the e4m3 byte is computed from the fp32 bits with integer arithmetic, as c10's
  ``fp8e4m3fn_from_fp32_value`` does (round to nearest, ties to even; e4m3 subnormals rounded by
  adding ``2^14``, whose fp32 ulp is e4m3's subnormal step ``2^-9``), and stored through a ``uint8``
  view of the output. The cast to ``tl.float8e4nv`` would give the same bytes on a GPU, but Triton's
  CPU interpreter rounds fp8 casts half-up without carrying into the exponent, so the tests could
  not check it; the integer version is the same code on both. The sign of ``-0.0`` and of negative
  values that round to zero is kept (byte ``0x80``), as PyTorch keeps it.

NaN and ``inf`` behave as in PyTorch: a block holding a NaN gets a NaN scale and NaN bytes, one
holding an ``inf`` an ``inf`` scale, signed zeros for its finite values and NaN for the ``inf``
(NaN bytes are ``0x7F`` plus the NaN's sign bit, which may differ between the two: the sign of
``inf / inf`` depends on the processor).

Launch: program ``(i, j)`` quantises rows ``i·BLOCK_M .. i·BLOCK_M + BLOCK_M - 1`` of column block
``j`` (a ``[BLOCK_M, 128]`` tile: each row of it is one 1 × 128 block, reduced along the tile's
columns). The scales are written through strides, so the caller picks their layout: row-major
``[M, K/128]`` (what the PyTorch version returns) or outer-dim-major (the transposed storage that
``scaled_mm``'s ``BlockWise1x128`` recipe takes, saving the copy ``xs.t().contiguous().t()``), where
a program's ``BLOCK_M`` scales are contiguous. The kernel takes part in programmatic dependent
launch (:mod:`ember.core.kernels.pdl`) inside the static decoder's steps.
"""

from __future__ import annotations

import torch

from ember.core.kernels import fused, pdl

BLOCK_K = 128  # the 1 x 128 activation block (rollout_precision.FP8_BLOCK)
E4M3_MAX = 448.0

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _quant_act(X, Q, S, stride_xm, stride_qm, stride_sm, stride_sk, M,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        pid_m = tl.program_id(0)
        kb = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        rmask = rows < M
        rows64 = rows.to(tl.int64)
        mask = rmask[:, None] & (cols[None, :] < (kb + 1) * BLOCK_K)
        x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        x_nan = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
        amax = tl.where(tl.max(x_nan.to(tl.int32), axis=1) > 0, float("nan"), amax)  # NaN propagates
        scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-12,
                           propagate_nan=tl.PropagateNan.ALL)
        v = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        bits = v.to(tl.int32, bitcast=True)
        a = tl.minimum(tl.abs(v), 448.0)  # the clamp to +-448 (the sign is taken from the bits)
        ab = a.to(tl.int32, bitcast=True)
        # e4m3 normal (|v| >= 2^-6): round the fp32 mantissa to 3 bits, ties to even, rebias 127 -> 7
        odd = (ab >> 20) & 1
        normal = (ab - (120 << 23) + 0x7FFFF + odd) >> 20
        # e4m3 subnormal: |v| + 2^14 rounds |v| to a multiple of 2^-9; the low bits are the code
        sub = (a + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        code = tl.where(ab < (121 << 23), sub, normal)
        v_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        code = tl.where(v_nan, 0x7F, code) + tl.where(bits < 0, 128, 0)  # NaN: 0x7F with its sign
        tl.store(Q + rows64[:, None] * stride_qm + cols[None, :], code.to(tl.uint8), mask=mask)
        tl.store(S + rows64 * stride_sm + kb * stride_sk, scale, mask=rmask)


def available(x: torch.Tensor) -> bool:
    """Whether :func:`quantize_act_fp8` can run on ``x`` (a CUDA tensor, or the CPU interpreter)."""
    return fused.use_triton(x) and hasattr(torch, "float8_e4m3fn")


def quantize_act_fp8(x: torch.Tensor, outer_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``x`` ``[M, K]`` and its fp32 scales ``[M, K/128]``, one per 1 × 128 block (module doc).

    The scales are row-major (contiguous) by default, like the PyTorch version; with
    ``outer_major_scales`` they are the transposed view of a contiguous ``[K/128, M]`` (strides
    ``(1, M)``), the layout ``scaled_mm`` takes for ``BlockWise1x128``."""
    if x.dim() != 2 or x.shape[1] % BLOCK_K:
        raise ValueError(f"quantize_act_fp8 takes [M, K] with K a multiple of {BLOCK_K}, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_act_fp8 takes bf16, fp16 or fp32, got {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    kb = K // BLOCK_K
    xq = torch.empty(M, K, device=x.device, dtype=torch.float8_e4m3fn)
    if outer_major_scales:
        scales = torch.empty(kb, M, device=x.device, dtype=torch.float32).t()
    else:
        scales = torch.empty(M, kb, device=x.device, dtype=torch.float32)
    if M == 0 or kb == 0:
        return xq, scales
    block_m = min(32, triton.next_power_of_2(M))
    grid = (triton.cdiv(M, block_m), kb)
    _quant_act[grid](x, xq.view(torch.uint8), scales, x.stride(0), xq.stride(0), scales.stride(0),
                     scales.stride(1), M, BLOCK_M=block_m, BLOCK_K=BLOCK_K, num_warps=4, **pdl.options())
    return xq, scales
