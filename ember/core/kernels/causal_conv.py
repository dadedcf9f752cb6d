"""``silu(causal depthwise convolution)`` over packed sequences, forward and backward (Triton).

The Gated DeltaNet layers' short convolution (kernel 4 over the 8,192 q/k/v channels of
Qwen3-Next) took, through fla-core 0.4.2's kernels, 1.3 ms a layer in an H100 training step
(profile of 2026-12-06): the forward (216 µs, at the copy bandwidth), and in the backward a second
forward for the pre-activation, the backward kernel (972 µs) and a fill. Here the backward computes
the pre-activation from ``x`` (its ``K`` shifted tiles come from the cache) and ``g = dy · silu'(a)``
once per row; each tap's ``g · w`` reaches its output rows through a product with a 0/1 shift
matrix on the tensor cores (split into two or three bf16 parts, so the move keeps 16 or 24
significant bits), all taps summed in one accumulator; a program's rows overlap its neighbour's
by ``K - 1``. It reads ``x`` and ``dy`` and writes
``dx`` once. The weight's gradient (only for full fine-tuning: a LoRA run keeps the convolution
frozen) is summed per block of rows, then over blocks.

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
             SPLIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        # a program computes g = dy · silu'(a) once on BLOCK_T rows and writes dx of the first
        # BLOCK_T - (K - 1): dx[t] = Σ_j g[t + j] w[:, K-1-j] reads the K - 1 rows below it
        span = BLOCK_T - (K - 1)
        local = tl.arange(0, BLOCK_T)
        rows = tl.program_id(0) * span + local
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        live, cmask = rows < T, cols < C
        pos = tl.load(POS + rows, mask=live, other=0)
        a = _preact(X, W, rows, cols, pos, live, cmask, stride_x, K, BLOCK_T, BLOCK_C)
        dy = tl.load(DY + rows.to(tl.int64)[:, None] * stride_dy + cols[None, :],
                     mask=live[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        g = dy * sig * (1.0 + a * (1.0 - sig))  # d silu(a) / da
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            # row s reaches output row s - j through tap K-1-j if that row is in its sequence
            w = tl.load(W + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
            gw = tl.where((pos >= j)[:, None], g, 0.0) * w[None, :]
            # moved up j rows by a 0/1 product on the tensor cores (shift[t, s] = 1 where s = t + j),
            # in bf16 parts that add back to gw's leading 16 (two parts) or 24 bits (three)
            shift = (local[None, :] == local[:, None] + j).to(tl.bfloat16)
            part = gw.to(tl.bfloat16)
            dx = tl.dot(shift, part, dx)
            rest = gw - part.to(tl.float32)
            part = rest.to(tl.bfloat16)
            dx = tl.dot(shift, part, dx)
            if SPLIT == 3:
                dx = tl.dot(shift, (rest - part.to(tl.float32)).to(tl.bfloat16), dx)
            if HAS_DW:  # this block's share of dW[:, K-1-j] = Σ_t g[t + j] x[t], over its output rows t
                t_local = local - j
                ok = live & (pos >= j) & (t_local >= 0) & (t_local < span)
                x_t = tl.load(X + (rows - j).to(tl.int64)[:, None] * stride_x + cols[None, :],
                              mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                tl.store(DW + (tl.program_id(0) * C + cols) * K + (K - 1 - j), tl.sum(g * x_t, axis=0), mask=cmask)
        out = live & (local < span)
        tl.store(DX + rows.to(tl.int64)[:, None] * C + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=out[:, None] & cmask[None, :])


# a program's tile: (rows, channels, warps), of the forward and of the backward (whose rows are at
# least 16, the tensor cores' shortest side, and overlap by K - 1)
CONFIG = (32, 64, 4)
BWD_CONFIG = (64, 64, 8)


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
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor, config=None,  # type: ignore[override]
                bwd_config=None) -> torch.Tensor:
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
        ctx.bwd_config = bwd_config
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x, weight, pos = ctx.saved_tensors
        T, C = x.shape
        K = weight.shape[1]
        bt, bc, warps = ctx.bwd_config or BWD_CONFIG
        if bt < 16 or bt <= K - 1:
            raise ValueError(f"the backward's tile needs at least 16 rows and more than K - 1 = {K - 1}; got {bt}")
        if dy.stride(1) != 1:
            dy = dy.contiguous()
        dx = torch.empty(T, C, dtype=x.dtype, device=x.device)
        has_dw = ctx.needs_input_grad[1]
        blocks = triton.cdiv(T, bt - (K - 1))
        dw = torch.empty(blocks if has_dw else 1, C, K, dtype=torch.float32, device=x.device)
        # g's bf16 parts: two carry 16 significant bits (past bf16 and fp16 outputs), three fp32's 24
        split = 3 if x.dtype == torch.float32 else 2
        if T:
            _bwd[(blocks, triton.cdiv(C, bc))](x, weight, pos, dy, dx, dw, T, C, x.stride(0), dy.stride(0), K=K,
                                               HAS_DW=has_dw, SPLIT=split, BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        if has_dw:
            dw = dw.sum(0).to(weight.dtype) if T else torch.zeros_like(weight)
        return dx, dw if has_dw else None, None, None, None


def silu_causal_conv(x: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor,
                     config: tuple[int, int, int] | None = None,
                     bwd_config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """:class:`SiluCausalConv` (``config``, ``bwd_config``: the tiles, default :data:`CONFIG` and
    :data:`BWD_CONFIG`)."""
    return SiluCausalConv.apply(x, weight, pos, config, bwd_config)
