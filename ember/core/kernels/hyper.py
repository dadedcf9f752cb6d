"""Fused kernels of Qwen3.8-Flash-Next's gated hyper-connections (:mod:`ember.core.layers.hyper_connections`).

The residual stream ``X`` is ``[T, n·H]``: ``n`` streams of width ``H`` side by side. One site reads::

    r_j    = rsqrt(mean_h X_j² + eps)                          [T, n]   (fp32, kept)
    X̂_j    = X_j · r_j · (1 + w_j)                             [T, n·H] (bf16, not kept)
    d      = X̂ · W_downᵀ                                       [T, rank] (kept)
    mix    = σ(silu(d / n) · W_upᵀ)                             [T, n·H] (recomputed in backward)
    read   = mean_j mix_j ⊙ X̂_j                                 [T, H]
    ι      = 2·σ(X̂ · W_injᵀ / n)                                [T, n]

and writes ``X' = X + [ι_j · y]_j``. The eager functions of the layer module are a dozen passes
over ``[T, n·H]`` each way; compiled by Inductor (dynamic shapes) a site's forward and backward
still took ~12 ms at 16k tokens × 4 × 2560 on an H200, ~4× its memory traffic. Here the
elementwise work is four kernels (norm, read, read backward, norm backward) around cuBLAS's
products, each pass over ``[T, n·H]`` reading or writing what it must; the backward recomputes
``X̂`` from ``X`` and ``r`` and ``mix`` from ``d`` (one product) rather than keeping
``[T, n·H]`` tensors. The write is one kernel each way. Values are computed in fp32 and rounded
once; the eager functions (CPU, reference) round their bf16 intermediates, so bf16 results differ
by their rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.core.kernels.fused import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_fwd(X, W, NORMED, R, H, NH, eps, N: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (token, stream): the stream's RMS over its H channels
        t = tl.program_id(0)
        j = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        base = t.to(tl.int64) * NH + j * H
        x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(W + j * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(NORMED + base + cols, (x * r * (1.0 + w)).to(NORMED.dtype.element_ty), mask=mask)
        tl.store(R + t * N + j, r)

    @triton.jit
    def _read_fwd(MPRE, NORMED, READ, H, NH, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        base = t.to(tl.int64) * NH
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(N):
            m = tl.load(MPRE + base + j * H + cols, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(NORMED + base + j * H + cols, mask=mask, other=0.0).to(tl.float32)
            acc += tl.sigmoid(m) * v
        tl.store(READ + t.to(tl.int64) * H + cols, (acc / N).to(READ.dtype.element_ty), mask=mask)

    @triton.jit
    def _read_bwd(X, W, R, MPRE, GREAD, GMPRE, GNORMED, H, NH, N: tl.constexpr, BLOCK: tl.constexpr):
        # read = mean_j σ(m_j) X̂_j  ->  d/dm_j = g X̂_j σ'(m_j) / n,  d/dX̂_j = g σ(m_j) / n
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        base = t.to(tl.int64) * NH
        g = tl.load(GREAD + t.to(tl.int64) * H + cols, mask=mask, other=0.0).to(tl.float32) / N
        for j in tl.static_range(N):
            x = tl.load(X + base + j * H + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + j * H + cols, mask=mask, other=0.0).to(tl.float32)
            v = x * tl.load(R + t * N + j) * (1.0 + w)
            s = tl.sigmoid(tl.load(MPRE + base + j * H + cols, mask=mask, other=0.0).to(tl.float32))
            tl.store(GMPRE + base + j * H + cols, (g * v * s * (1.0 - s)).to(GMPRE.dtype.element_ty), mask=mask)
            tl.store(GNORMED + base + j * H + cols, (g * s).to(GNORMED.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_bwd(X, W, R, GNORMED, GINJ, WINJ, GX, H, NH, N: tl.constexpr, HAS_INJ: tl.constexpr,
                  BLOCK: tl.constexpr):
        # X̂ = X r (1 + w): dX = r (ĝ - x̂ · mean(ĝ x̂)), ĝ = dX̂ (1 + w), x̂ = X r; the injection
        # product's gradient (dι_pre · W_inj, K = n) is added here rather than in its own pass
        t = tl.program_id(0)
        j = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        base = t.to(tl.int64) * NH + j * H
        g = tl.load(GNORMED + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_INJ:
            for i in tl.static_range(N):
                gi = tl.load(GINJ + t * N + i)
                g += gi * tl.load(WINJ + i * NH + j * H + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + t * N + j)
        w = tl.load(W + j * H + cols, mask=mask, other=0.0).to(tl.float32)
        gh = g * (1.0 + w)
        xh = x * r
        dx = r * (gh - xh * (tl.sum(gh * xh, axis=0) / H))
        tl.store(GX + base + cols, dx.to(GX.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_fwd(X, Y, GATES, OUT, H, NH, N: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        base = t.to(tl.int64) * NH
        y = tl.load(Y + t.to(tl.int64) * H + cols, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(N):
            x = tl.load(X + base + j * H + cols, mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(GATES + t * N + j).to(tl.float32)
            tl.store(OUT + base + j * H + cols, (x + gate * y).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_bwd(GOUT, Y, GATES, GY, GGATES, H, NH, N: tl.constexpr, BLOCK: tl.constexpr):
        # dy = Σ_j ι_j dOut_j; dι_j = Σ_h dOut_j y, one partial sum per column block
        t = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        base = t.to(tl.int64) * NH
        y = tl.load(Y + t.to(tl.int64) * H + cols, mask=mask, other=0.0).to(tl.float32)
        gy = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(N):
            go = tl.load(GOUT + base + j * H + cols, mask=mask, other=0.0).to(tl.float32)
            gy += tl.load(GATES + t * N + j).to(tl.float32) * go
            tl.store(GGATES + (t * N + j) * tl.num_programs(1) + blk, tl.sum(go * y, axis=0))
        tl.store(GY + t.to(tl.int64) * H + cols, gy.to(GY.dtype.element_ty), mask=mask)


_BLOCK = 1024  # columns per program of the read and write kernels


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _mix_input(d: torch.Tensor, n: int) -> torch.Tensor:
    """``silu(d / n)`` in fp32, rounded to ``d``'s dtype: the up product's input, the same in the
    forward and in the backward's recomputation."""
    return F.silu(d.float() / n).to(d.dtype)


class HyperRead(torch.autograd.Function):
    """``(read [T, H], ι [T, n])`` of one site (module doc); ``w_inj`` None (the final mixer):
    ``ι`` is an empty ``[T, 0]`` tensor."""

    @staticmethod
    def forward(ctx, x, norm_w, w_down, w_up, w_inj, n: int, eps: float):
        x = x.contiguous()
        T, NH = x.shape
        H = NH // n
        normed = torch.empty_like(x)
        r = torch.empty(T, n, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(H)
        _norm_fwd[(T, n)](x, norm_w, normed, r, H, NH, eps, N=n, BLOCK=block, num_warps=_warps(block))
        d = F.linear(normed, w_down)
        m_pre = F.linear(_mix_input(d, n), w_up)
        read = torch.empty(T, H, dtype=x.dtype, device=x.device)
        grid = (T, triton.cdiv(H, _BLOCK))
        _read_fwd[grid](m_pre, normed, read, H, NH, N=n, BLOCK=_BLOCK)
        if w_inj is not None:
            inj = F.linear(normed, w_inj)
            gates = 2 * torch.sigmoid(inj.float() / n)
        else:
            gates = torch.empty(T, 0, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, norm_w, w_down, w_up, w_inj, r, d, gates)
        ctx.n = n
        return read, gates.to(x.dtype)

    @staticmethod
    def backward(ctx, g_read, g_gates):
        x, norm_w, w_down, w_up, w_inj, r, d, gates = ctx.saved_tensors
        n = ctx.n
        T, NH = x.shape
        H = NH // n
        m_pre = F.linear(_mix_input(d, n), w_up)
        g_mpre = torch.empty_like(m_pre)
        g_normed = torch.empty_like(x)
        grid = (T, triton.cdiv(H, _BLOCK))
        _read_bwd[grid](x, norm_w, r, m_pre, g_read.contiguous(), g_mpre, g_normed, H, NH, N=n, BLOCK=_BLOCK)
        z = d.float() / n
        s = torch.sigmoid(z)
        g_d = (g_mpre @ w_up).float() * (s * (1.0 + z * (1.0 - s))) / n
        g_normed.addmm_(g_d.to(x.dtype), w_down)
        has_inj = w_inj is not None
        # ι = 2σ(p / n): dp = dι · ι (1 - ι / 2) / n
        g_inj = (g_gates.float() * gates * (1.0 - gates / 2) / n).contiguous() if has_inj else r
        gx = torch.empty_like(x)
        block = triton.next_power_of_2(H)
        _norm_bwd[(T, n)](x, norm_w, r, g_normed, g_inj, w_inj if has_inj else x, gx, H, NH, N=n,
                          HAS_INJ=has_inj, BLOCK=block, num_warps=_warps(block))
        return gx, None, None, None, None, None, None


class HyperWrite(torch.autograd.Function):
    """``x + [ι_j · y]_j`` over the streams (``x`` ``[T, n·H]``, ``y`` ``[T, H]``, ``ι`` ``[T, n]``)."""

    @staticmethod
    def forward(ctx, x, y, gates):
        x, y, gates = x.contiguous(), y.contiguous(), gates.contiguous()
        T, NH = x.shape
        n = gates.shape[1]
        H = NH // n
        out = torch.empty_like(x)
        _write_fwd[(T, triton.cdiv(H, _BLOCK))](x, y, gates, out, H, NH, N=n, BLOCK=_BLOCK)
        ctx.save_for_backward(y, gates)
        return out

    @staticmethod
    def backward(ctx, g_out):
        y, gates = ctx.saved_tensors
        g_out = g_out.contiguous()
        T, H = y.shape
        n = gates.shape[1]
        grid = (T, triton.cdiv(H, _BLOCK))
        gy = torch.empty_like(y)
        partial = torch.empty(T, n, grid[1], dtype=torch.float32, device=y.device)
        _write_bwd[grid](g_out, y, gates, gy, partial, H, n * H, N=n, BLOCK=_BLOCK)
        return g_out, gy, partial.sum(-1).to(gates.dtype)


__all__ = ["HyperRead", "HyperWrite"]
