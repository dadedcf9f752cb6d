"""Key heads L2-normalised once and repeated to the value heads, for fla's gated delta rule (Triton).

A Qwen3-Next Gated DeltaNet layer has 16 query/key heads and 32 value heads. fla-core 0.4.2's
chunked rule has no grouped value heads: it takes q and k repeated to the value heads, and its
``use_qk_l2norm_in_kernel`` normalises every repeated copy in a pass of its own. Both ways cost
memory passes: the repeat (a copy), fla's norm (a read and a write of twice the data), and in the
backward fla's norm backward and the sum of the copies' gradients, about 6.5 ms of an 8-layer
training step on an H100 (profile of 2026-12-06). Here one kernel reads each key head once,
normalises it in fp32 and writes its ``r`` copies (``r`` value heads per key head, value head
``j`` reading key head ``j // r`` as ``repeat_interleave`` orders them); the backward sums the
``r`` copies' gradients in fp32 and takes the norm's backward once, which is the same as summing
the ``r`` backwards (the norm's backward is linear in the gradient). fla then runs with its own
norm off. The formula is fla's: ``y = x / sqrt(Σx² + eps)``, fp32 inside, rounded once; the
backward ``dx = (dy − (dy·y) y) · rstd`` with ``y`` the rounded output, as fla's. Without Triton
(or off CUDA) the same function is the PyTorch formula. Under ``TRITON_INTERPRET=1`` the kernels
run on the CPU (the tests).
"""

from __future__ import annotations

import torch

from ember.core.kernels.fused import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fwd(X, Y, RSTD, n_rows, H, stride_t, stride_h, eps, D: tl.constexpr, R: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # row = token * H + key head
        cols = tl.arange(0, BLOCK_D)
        live = rows < n_rows
        mask = live[:, None] & (cols[None, :] < D)
        src = (rows // H).to(tl.int64) * stride_t + (rows % H) * stride_h
        x = tl.load(X + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
        y = (x * rstd[:, None]).to(Y.dtype.element_ty)
        dst = Y + (rows.to(tl.int64) * (R * D))[:, None] + cols[None, :]
        for j in tl.static_range(R):
            tl.store(dst + j * D, y, mask=mask)
        tl.store(RSTD + rows, rstd, mask=live)

    @triton.jit
    def _bwd(DY, Y, RSTD, DX, n_rows, D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_D)
        live = rows < n_rows
        mask = live[:, None] & (cols[None, :] < D)
        copies = (rows.to(tl.int64) * (R * D))[:, None] + cols[None, :]
        dy = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(R):
            dy += tl.load(DY + copies + j * D, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + copies, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=live, other=0.0)
        dx = (dy - tl.sum(dy * y, axis=1)[:, None] * y) * rstd[:, None]
        tl.store(DX + rows.to(tl.int64)[:, None] * D + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


# a program's launch shape: (elements it holds, BLOCK_N rows of BLOCK_D columns; warps)
CONFIG = (4096, 4)


def _launch(D: int, config: tuple[int, int] | None) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_D, num_warps)`` for rows of ``D``."""
    elements, warps = config or CONFIG
    block_d = triton.next_power_of_2(D)
    return max(1, elements // block_d), block_d, warps


class _L2NormRepeat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, r: int, eps: float, config) -> torch.Tensor:  # type: ignore[override]
        T, H, D = x.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = torch.empty(T, H * r, D, dtype=x.dtype, device=x.device)
        rstd = torch.empty(T * H, dtype=torch.float32, device=x.device)
        if T * H:
            block_n, block_d, warps = _launch(D, config)
            _fwd[(triton.cdiv(T * H, block_n),)](x, y, rstd, T * H, H, x.stride(0), x.stride(1), eps, D=D, R=r,
                                                 BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)
        ctx.save_for_backward(y, rstd)
        ctx.r, ctx.config = r, config
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        y, rstd = ctx.saved_tensors
        T, HR, D = y.shape
        n_rows = T * (HR // ctx.r)
        dx = torch.empty(T, HR // ctx.r, D, dtype=y.dtype, device=y.device)
        if n_rows:
            block_n, block_d, warps = _launch(D, ctx.config)
            _bwd[(triton.cdiv(n_rows, block_n),)](dy.contiguous(), y, rstd, dx, n_rows, D=D, R=ctx.r,
                                                  BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)
        return dx, None, None, None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dimension (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_repeat(x: torch.Tensor, r: int, eps: float = 1e-6, config: tuple[int, int] | None = None) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dimension of ``x`` ``[T, H, D]``, each head repeated
    ``r`` times (``[T, H·r, D]``, ``repeat_interleave``'s order), in ``x``'s dtype: the kernels on
    CUDA (launched with ``config``, default :data:`CONFIG`), else the PyTorch formula (in fp32, or
    fp64 for fp64 ``x``)."""
    if x.dim() != 3 or r < 1:
        raise ValueError(f"l2norm_repeat takes [T, H, D] heads and r >= 1, got {tuple(x.shape)} and r={r}")
    if use_triton(x) and x.dtype != torch.float64:
        return _L2NormRepeat.apply(x, r, eps, config)
    y = l2norm(x.to(torch.promote_types(x.dtype, torch.float32)), eps).to(x.dtype)
    return y.repeat_interleave(r, dim=1) if r > 1 else y
