"""``silu(causal depthwise convolution)`` over packed sequences, forward and backward (Triton).

The Gated DeltaNet layers' short convolution (kernel 4 over the 8,192 q/k/v channels of
Qwen3-Next) took, through fla-core 0.4.2's kernels, 1.3 ms a layer in an H100 training step
(profile of 2026-12-06): the forward (216 µs, at the copy bandwidth), and in the backward a second
forward for the pre-activation, the backward kernel (972 µs) and a fill. Here the backward
recomputes the pre-activation where it needs it, from ``x`` (its ``K`` shifted tiles come from the
cache), so it reads ``x`` and ``dy`` and writes ``dx`` once. The weight's gradient (only for full
fine-tuning: a LoRA run keeps the convolution frozen) is summed per block of rows, then over blocks.

Sequences are packed: ``pos[t]`` is token ``t``'s index in its sequence, and tap ``j`` (reading
``x[t - j]``) counts only where ``j <= pos[t]``; so no window crosses a sequence, and no gradient
either (row ``t + j`` is in ``t``'s sequence exactly when ``pos[t + j] >= j``). fp32 inside, one
rounding to ``x``'s dtype. Under ``TRITON_INTERPRET=1`` the kernels run on the CPU (the tests).
"""

from __future__ import annotations

import torch

from ember.core.kernels.fused import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _preact(X, w_ptr, rows, cols, pos, live, cmask, stride_x, K: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_C: tl.constexpr):
        """The convolution at ``rows`` (fp32): ``Σ_j w[:, K-1-j] · x[rows - j]`` over the taps
        inside each row's sequence."""
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            ok = live & (pos >= j)
            x = tl.load(X + (rows - j).to(tl.int64)[:, None] * stride_x + cols[None, :],
                        mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
            acc += x * w[None, :]
        return acc

    @triton.jit
    def _fwd(X, W, POS, Y, T, C, stride_x, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        live, cmask = rows < T, cols < C
        pos = tl.load(POS + rows, mask=live, other=0)
        a = _preact(X, W, rows, cols, pos, live, cmask, stride_x, K, BLOCK_T, BLOCK_C)
        y = a * tl.sigmoid(a)
        tl.store(Y + rows.to(tl.int64)[:, None] * C + cols[None, :], y.to(Y.dtype.element_ty),
                 mask=live[:, None] & cmask[None, :])

    @triton.jit
    def _bwd(X, W, POS, DY, DX, DW, T, C, stride_x, stride_dy, K: tl.constexpr, HAS_DW: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        live, cmask = rows < T, cols < C
        tile = live[:, None] & cmask[None, :]
        if HAS_DW:
            x_here = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=tile,
                             other=0.0).to(tl.float32)
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            # output row r = t + j reads x[t] through tap K-1-j, if r is in t's sequence
            r = rows + j
            pos_r = tl.load(POS + r, mask=r < T, other=0)
            same = (r < T) & (pos_r >= j) & live
            a = _preact(X, W, r, cols, pos_r, same, cmask, stride_x, K, BLOCK_T, BLOCK_C)
            dy = tl.load(DY + r.to(tl.int64)[:, None] * stride_dy + cols[None, :], mask=same[:, None] & cmask[None, :],
                         other=0.0).to(tl.float32)
            s = tl.sigmoid(a)
            g = dy * s * (1.0 + a * (1.0 - s))  # d silu(a) / da
            w = tl.load(W + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
            dx += g * w[None, :]
            if HAS_DW:  # this block's share of dW[:, K-1-j] = Σ_t g[t + j] x[t]
                tl.store(DW + (tl.program_id(0) * C + cols) * K + (K - 1 - j), tl.sum(g * x_here, axis=0),
                         mask=cmask)
        tl.store(DX + rows.to(tl.int64)[:, None] * C + cols[None, :], dx.to(DX.dtype.element_ty), mask=tile)


# a program's tile: (rows, channels, warps)
CONFIG = (32, 64, 4)


def positions(seq_lens: list[int]) -> torch.Tensor:
    """Each packed token's index in its sequence (int32, on the host)."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    starts = torch.cumsum(lens, 0) - lens
    return (torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)).to(torch.int32)


class SiluCausalConv(torch.autograd.Function):
    """``silu(conv(x))`` of packed ``x`` ``[T, C]`` (rows may be strided; channels contiguous),
    ``weight`` ``[C, K]``, ``pos`` int32 ``[T]`` (:func:`positions`, on ``x``'s device); the
    output is contiguous, in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, config=None) -> torch.Tensor:  # type: ignore[override]
        if x.stride(1) != 1:
            x = x.contiguous()
        weight = weight.contiguous()
        T, C = x.shape
        y = torch.empty(T, C, dtype=x.dtype, device=x.device)
        bt, bc, warps = config or CONFIG
        if T:
            _fwd[(triton.cdiv(T, bt), triton.cdiv(C, bc))](x, weight, pos, y, T, C, x.stride(0), K=weight.shape[1],
                                                           BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        ctx.save_for_backward(x, weight, pos)
        ctx.config = config
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, pos = ctx.saved_tensors
        T, C = x.shape
        K = weight.shape[1]
        bt, bc, warps = ctx.config or CONFIG
        if dy.stride(1) != 1:
            dy = dy.contiguous()
        dx = torch.empty(T, C, dtype=x.dtype, device=x.device)
        has_dw = ctx.needs_input_grad[1]
        blocks = triton.cdiv(T, bt)
        dw = torch.empty(blocks if has_dw else 1, C, K, dtype=torch.float32, device=x.device)
        if T:
            _bwd[(blocks, triton.cdiv(C, bc))](x, weight, pos, dy, dx, dw, T, C, x.stride(0), dy.stride(0), K=K,
                                               HAS_DW=has_dw, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        if has_dw:
            dw = dw.sum(0).to(weight.dtype) if T else torch.zeros_like(weight)
        return dx, dw if has_dw else None, None, None


def silu_causal_conv(x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor,
                     config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """:class:`SiluCausalConv` (``config``: the tile, default :data:`CONFIG`)."""
    return SiluCausalConv.apply(x, weight, pos, config)
