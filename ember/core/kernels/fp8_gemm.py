"""Blockwise fp8 products at decode batch sizes (W8A8, DeepSeek-V3's recipe) in Triton.

``y = x @ dequant(q, scale_inv).T`` for the fp8 rollout copies (:mod:`ember.core.rollout_precision`):
``q`` ``[N, K]`` e4m3 with one fp32 ``scale_inv`` per 128 × 128 tile, ``x`` ``[M, K]`` quantised per
1 × 128 block by :mod:`ember.core.kernels.fp8_quant` (``xq``, row-major scales ``xs``). For each
128-wide K block the kernel multiplies the e4m3 tiles on the tensor cores (fp32 accumulation within
the block), scales the block's product by ``scale_inv[n // 128, kb] · xs[m, kb]`` and adds it to an
fp32 accumulator: the same arithmetic as ``scaled_mm``'s BlockWise1x128 × BlockWise128x128 recipe,
with the terms summed in another order.

Why a kernel of our own: at decode shapes (M = 64) ``scaled_mm``'s blockwise kernel takes longer than
bf16 ``F.linear`` on the same projection (13.5 against 8.1 µs on 4096 × 4096, H200), so the fp8
rollout's halved weight bytes did not pay. A decode product is a stream over the weights; this
kernel is shaped for that:

* the weight tile is the MMA's M side (``tl.dot(w, xq.T)``, ``[BLOCK_N, BLOCK_M]``), so a block of
  64 rows or fewer is one narrow MMA per K block;
* the grid is ``(N / BLOCK_N, M / BLOCK_M, split)``: K is split so that a projection with few
  column blocks still puts two programs on every SM. Each split writes its fp32 partial sums to a
  workspace ``[split, M, N]`` and one more launch adds them in split order and rounds once:
  deterministic (no atomics), so a seeded rollout is reproducible.

On an H100 at 64 rows, with the weights streamed from HBM, a Qwen3-8B layer's four products took
98.6 µs here (plus 13.8 of activation quantisation) against 122.0 with ``scaled_mm`` and 160.6 in
bf16; at 128 and 256 rows ``scaled_mm`` was faster (``docs/performance.md``).

Launch shapes depend only on tensor shapes (never on values), so the products capture in a CUDA
graph. Both kernels take part in programmatic dependent launch (:mod:`ember.core.kernels.pdl`)
inside the static decoder's steps; neither reads anything before its wait. :func:`config` picks
the blocks and the split; the benchmark ``bench/fp8_decode_gemm.py`` sweeps them on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.core.kernels import fused, pdl

BLOCK = 128  # the weight tile and activation block along K (and the weight tile along N)
# rows up to which rollout_precision takes this kernel instead of scaled_mm: at 64 rows it was
# faster than scaled_mm on q/o, k/v and down (12.2 against 14.3 µs for 4096 x 4096, quantisation
# apart) and level on the wide products; at 128 and 256 rows scaled_mm was (H100,
# bench/fp8_decode_gemm.py, docs/performance.md)
SMALL_M = 64

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _fp8_gemm_kernel(
        XQ, XS, W, WS, P, M, N, K_BLOCKS, PER_SPLIT,
        stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ps, stride_pm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_s = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        rmask = rows < M
        cmask = cols < N
        w_ptr = W + cols.to(tl.int64)[:, None] * stride_wn + kk[None, :]
        x_ptr = XQ + rows.to(tl.int64)[:, None] * stride_xm + kk[None, :]
        ws_ptr = WS + (cols // BLOCK_K) * stride_wsn
        xs_ptr = XS + rows * stride_xsm
        kb0 = pid_s * PER_SPLIT
        kb1 = tl.minimum(kb0 + PER_SPLIT, K_BLOCKS)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for kb in range(kb0, kb1):
            w = tl.load(w_ptr + kb * BLOCK_K, mask=cmask[:, None], other=0.0)
            x = tl.load(x_ptr + kb * BLOCK_K, mask=rmask[:, None], other=0.0)
            ws = tl.load(ws_ptr + kb, mask=cmask, other=0.0)
            xs = tl.load(xs_ptr + kb, mask=rmask, other=0.0)
            part = tl.dot(w, tl.trans(x))  # [BLOCK_N, BLOCK_M], fp32 within the K block
            acc += part * ws[:, None] * xs[None, :]
        out = P + pid_s * stride_ps + rows.to(tl.int64)[None, :] * stride_pm + cols[:, None]
        tl.store(out, acc.to(P.dtype.element_ty), mask=cmask[:, None] & rmask[None, :])

    @triton.jit
    def _sum_splits_kernel(P, Y, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        # Y = sum over s of P[s] (in split order, fp32), rounded once to Y's dtype; P [SPLIT, numel]
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.load(P + offs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(P + s * numel + offs, mask=mask, other=0.0)
        tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Config:
    """Launch shape of one product: rows and columns per program, K splits, and Triton's
    ``num_warps`` / ``num_stages`` (the depth of the software pipeline over K blocks)."""

    block_m: int
    block_n: int
    split: int
    warps: int = 4
    stages: int = 3


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def config(M: int, N: int, K: int, device: torch.device) -> Config:
    """The launch shape for ``[M, K] @ [N, K].T``: blocks of up to 64 rows and 64 columns, and the
    fewest K splits (of at least four K blocks each) that make two programs per SM (rounded down
    to a power of two). At 64 rows on an H100 this was the best of 180 launch shapes on each of
    Qwen3-8B's five projections (``bench/fp8_decode_gemm.py``)."""
    block_m = max(16, min(64, triton.next_power_of_2(M))) if fused.HAVE_TRITON else 64
    block_n = 64
    tiles = -(-N // block_n) * -(-M // block_m)
    k_blocks = K // BLOCK
    programs = 1 << (2 * _sm_count(device)).bit_length() - 1
    split = 1
    while tiles * split < programs and k_blocks // (split * 2) >= 4:
        split *= 2
    return Config(block_m, block_n, split)


def available(x: torch.Tensor) -> bool:
    """Whether :func:`fp8_linear` can run on ``x``'s device (CUDA, or the CPU interpreter)."""
    return fused.use_triton(x) and hasattr(torch, "float8_e4m3fn")


def fp8_linear(
    xq: torch.Tensor,
    xs: torch.Tensor,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    cfg: Config | None = None,
) -> torch.Tensor:
    """``dequant(xq, xs) @ dequant(q, scale_inv).T`` -> ``[M, N]`` of ``out_dtype``.

    ``xq`` ``[M, K]`` e4m3 and ``xs`` ``[M, K/128]`` fp32 (any strides with unit stride along K for
    ``xq``), ``q`` ``[N, K]`` e4m3 (unit stride along K) and ``scale_inv`` ``[N/128, K/128]`` fp32;
    ``K`` and ``N`` multiples of 128. ``cfg``: the launch shape (default :func:`config`)."""
    M, K = xq.shape
    N = q.shape[0]
    if q.shape[1] != K or K % BLOCK or N % BLOCK:
        raise ValueError(f"fp8_linear: x {tuple(xq.shape)} and weight {tuple(q.shape)} (K and N multiples of {BLOCK})")
    if xs.shape != (M, K // BLOCK) or scale_inv.shape != (N // BLOCK, K // BLOCK):
        raise ValueError(f"fp8_linear: scales {tuple(xs.shape)} / {tuple(scale_inv.shape)} do not match x {tuple(xq.shape)}, "
                         f"weight {tuple(q.shape)}")
    if xq.stride(1) != 1 or q.stride(1) != 1 or xs.stride(1) != 1 or scale_inv.stride(1) != 1:
        raise ValueError("fp8_linear needs unit stride along K (data and scales)")
    y = torch.empty(M, N, device=xq.device, dtype=out_dtype)
    if M == 0:
        return y
    cfg = cfg or config(M, N, K, xq.device)
    k_blocks = K // BLOCK
    per_split = -(-k_blocks // cfg.split)
    split = -(-k_blocks // per_split)  # no empty split
    parts = y if split == 1 else torch.empty(split, M, N, device=xq.device, dtype=torch.float32)
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m), split)
    _fp8_gemm_kernel[grid](
        xq, xs, q, scale_inv, parts, M, N, k_blocks, per_split,
        xq.stride(0), xs.stride(0), q.stride(0), scale_inv.stride(0),
        parts.stride(0) if split > 1 else 0, N,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK,
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl.options(),
    )
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](parts, y, M * N, SPLIT=split, BLOCK=block, num_warps=4,
                                                          **pdl.options())
    return y
