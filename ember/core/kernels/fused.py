"""Fused elementwise kernels (Triton) for RMSNorm (also gated, as Qwen3-Next's), SwiGLU's ``silu(g) * u``
and rotary embeddings.

Each is one pass over memory in forward and one in backward, where the plain PyTorch versions
launch several kernels and round-trip through fp32 copies. They compute in fp32 and round once.
``ember.core.layers`` calls them for CUDA tensors when Triton is available and falls back to the
PyTorch formulas otherwise (CPU, tests). ``TRITON_INTERPRET=1`` runs them on the CPU, which is how
CI checks them against the PyTorch versions.
"""

from __future__ import annotations

import os

import torch

from ember.core.kernels import pdl

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without triton
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels can run on these tensors."""
    if not HAVE_TRITON:
        return False
    return all(t.is_cuda for t in tensors) or INTERPRET


if HAVE_TRITON:
    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _rmsnorm_fwd(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, ZERO_CENTRED: tl.constexpr,
                     FP32_PRODUCT: tl.constexpr, BLOCK: tl.constexpr,
                     R=None, S=None, stride_r=0, stride_s=0, HAS_RES: tl.constexpr = False,
                     PDL: tl.constexpr = False):
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:  # normalise s = x + r, rounded to the input dtype (as the add would), and store s
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(S.dtype.element_ty)
            tl.store(S + row * stride_s + cols, s, mask=mask)
            x = s.to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        xhat = x * rstd
        if ZERO_CENTRED:
            y = xhat * (1.0 + w)
        elif FP32_PRODUCT:  # Olmo's order: scale in fp32, then round
            y = xhat * w
        else:
            # reference order: round the normalised value to the input dtype, then scale
            y = xhat.to(Y.dtype.element_ty).to(tl.float32) * w
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rmsnorm_bwd(X, W, DY, DX, RSTD, stride_x, stride_dy, stride_dx, n_cols,
                     ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            w = w + 1.0
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        dxhat = dy * w
        dx = rstd * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=0) / n_cols))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)

    @triton.jit
    def _gate_act(g, SIGMOID: tl.constexpr):
        """``act(g)`` and ``act'(g)`` of the output gate: silu, or sigmoid."""
        s = tl.sigmoid(g)
        if SIGMOID:
            return s, s * (1.0 - s)
        return g * s, s * (1.0 + g * (1.0 - s))

    @triton.jit
    def _row_tile(n_rows, n_cols, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's ROWS rows of n_cols columns: rows, columns, row mask, tile mask, int64 rows."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        rmask = rows < n_rows
        return rows, cols, rmask, rmask[:, None] & (cols[None, :] < n_cols), rows.to(tl.int64)[:, None]

    @triton.jit
    def _load_tile(P, r64, stride, cols, mask):
        return tl.load(P + r64 * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _gated_rmsnorm_fwd(X, G, W, Y, RSTD, n_rows, stride_x, stride_g, stride_y, n_cols, eps,
                           SIGMOID: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # ROWS rows of n_cols (a head's width) per program; the reference's order: normalise in fp32,
        # round to the input dtype, scale by w (rounded: a product in that dtype), then times the
        # gate's activation in fp32, rounded once more
        rows, cols, rmask, mask, r64 = _row_tile(n_rows, n_cols, ROWS, BLOCK)
        x = _load_tile(X, r64, stride_x, cols, mask)
        g = _load_tile(G, r64, stride_g, cols, mask)
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        xhat = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
        yw = (xhat * w[None, :]).to(Y.dtype.element_ty).to(tl.float32)
        act, _ = _gate_act(g, SIGMOID)
        tl.store(Y + r64 * stride_y + cols[None, :], (yw * act).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rmask)

    @triton.jit
    def _gated_rmsnorm_bwd(X, G, W, DY, DX, DG, RSTD, n_rows, stride_x, stride_g, stride_dy, stride_dx, stride_dg,
                           n_cols, SIGMOID: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows, cols, rmask, mask, r64 = _row_tile(n_rows, n_cols, ROWS, BLOCK)
        x = _load_tile(X, r64, stride_x, cols, mask)
        g = _load_tile(G, r64, stride_g, cols, mask)
        dy = _load_tile(DY, r64, stride_dy, cols, mask)
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        yw = (xhat.to(DX.dtype.element_ty).to(tl.float32) * w[None, :]).to(DX.dtype.element_ty).to(tl.float32)
        act, dact = _gate_act(g, SIGMOID)
        dg = dy * yw * dact
        dn = dy * act * w[None, :]
        dx = rstd[:, None] * (dn - xhat * (tl.sum(dn * xhat, axis=1) / n_cols)[:, None])
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DG + r64 * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_fwd(G, U, S, Y, stride_g, stride_u, stride_y, n_cols, HAS_SCALE: tl.constexpr,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        if HAS_SCALE:
            y = y * tl.load(S + row).to(tl.float32)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_bwd(G, U, S, DY, DG, DU, DS, stride_g, stride_u, stride_dy, stride_dg, stride_du, n_cols,
                      HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        if HAS_SCALE:
            # the row scale's gradient, one partial sum per column block (masked columns are 0)
            tl.store(DS + row * tl.num_programs(1) + blk, tl.sum(dy * silu * u, axis=0))
            dy = dy * tl.load(S + row).to(tl.float32)
        dg = dy * u * (s * (1.0 + g * (1.0 - s)))
        du = dy * silu
        tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope(X, COS, SIN, Y, stride_xt, stride_xh, stride_yt, stride_yh, stride_c, n_heads, rot_half, head_dim,
              SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program per token: all heads at once
        t = tl.program_id(0)
        hh = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK)[None, :]
        m_rot = (hh < n_heads) & (i < rot_half)
        x_base = X + t * stride_xt + hh * stride_xh
        y_base = Y + t * stride_yt + hh * stride_yh
        x1 = tl.load(x_base + i, mask=m_rot, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + rot_half + i, mask=m_rot, other=0.0).to(tl.float32)
        c = tl.load(COS + t * stride_c + i, mask=i < rot_half, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * stride_c + i, mask=i < rot_half, other=0.0).to(tl.float32) * SIGN
        tl.store(y_base + i, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=m_rot)
        tl.store(y_base + rot_half + i, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=m_rot)
        # channels past the rotary dimensions pass through
        rest = 2 * rot_half + tl.arange(0, BLOCK_D)[None, :]
        m_rest = (hh < n_heads) & (rest < head_dim)
        v = tl.load(x_base + rest, mask=m_rest, other=0.0)
        tl.store(y_base + rest, v, mask=m_rest)

    @triton.jit
    def _norm_rope_heads(X, W, COS, SIN, Y, t, stride_xt, stride_xh, stride_yt, stride_yh, stride_c, n_heads,
                         rot_half, head_dim, eps, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        # token t's heads: RMSNorm (as _rmsnorm_fwd, rounded to Y's dtype) then the rotation (as _rope)
        hh = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK)[None, :]
        d = tl.arange(0, BLOCK_D)[None, :]
        m_rot = (hh < n_heads) & (i < rot_half)
        rest = 2 * rot_half + d
        m_rest = (hh < n_heads) & (rest < head_dim)
        x_base = X + t * stride_xt + hh * stride_xh
        x1 = tl.load(x_base + i, mask=m_rot, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + rot_half + i, mask=m_rot, other=0.0).to(tl.float32)
        xr = tl.load(x_base + rest, mask=m_rest, other=0.0).to(tl.float32)
        if NORM:
            row = tl.load(x_base + d, mask=(hh < n_heads) & (d < head_dim), other=0.0).to(tl.float32)
            rstd = (1.0 / tl.sqrt(tl.sum(row * row, axis=1) / head_dim + eps))[:, None]
            w1 = tl.load(W + i, mask=i < rot_half, other=0.0).to(tl.float32)
            w2 = tl.load(W + rot_half + i, mask=i < rot_half, other=0.0).to(tl.float32)
            wr = tl.load(W + rest, mask=rest < head_dim, other=0.0).to(tl.float32)
            if ZERO_CENTRED:
                x1 = (x1 * rstd * (1.0 + w1)).to(Y.dtype.element_ty).to(tl.float32)
                x2 = (x2 * rstd * (1.0 + w2)).to(Y.dtype.element_ty).to(tl.float32)
                xr = xr * rstd * (1.0 + wr)
            else:
                x1 = ((x1 * rstd).to(Y.dtype.element_ty).to(tl.float32) * w1).to(Y.dtype.element_ty).to(tl.float32)
                x2 = ((x2 * rstd).to(Y.dtype.element_ty).to(tl.float32) * w2).to(Y.dtype.element_ty).to(tl.float32)
                xr = (xr * rstd).to(Y.dtype.element_ty).to(tl.float32) * wr
        c = tl.load(COS + t * stride_c + i, mask=i < rot_half, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * stride_c + i, mask=i < rot_half, other=0.0).to(tl.float32)
        y_base = Y + t * stride_yt + hh * stride_yh
        tl.store(y_base + i, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=m_rot)
        tl.store(y_base + rot_half + i, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=m_rot)
        tl.store(y_base + rest, xr.to(Y.dtype.element_ty), mask=m_rest)

    @triton.jit
    def _qk_norm_rope(Q, K, QW, KW, COS, SIN, QO, KO, stride_qt, stride_qh, stride_kt, stride_kh, stride_qot,
                      stride_qoh, stride_kot, stride_koh, stride_c, n_q, n_k, rot_half, head_dim, eps_q, eps_k,
                      NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK_HQ: tl.constexpr,
                      BLOCK_HK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr = False):
        # one program per token: its query heads, then its key heads
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0)
        _norm_rope_heads(Q, QW, COS, SIN, QO, t, stride_qt, stride_qh, stride_qot, stride_qoh, stride_c, n_q,
                         rot_half, head_dim, eps_q, NORM, ZERO_CENTRED, BLOCK_HQ, BLOCK, BLOCK_D)
        _norm_rope_heads(K, KW, COS, SIN, KO, t, stride_kt, stride_kh, stride_kot, stride_koh, stride_c, n_k,
                         rot_half, head_dim, eps_k, NORM, ZERO_CENTRED, BLOCK_HK, BLOCK, BLOCK_D)

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _row_lse(L, LSE, INV_T, stride, N: tl.constexpr, CAP, HAS_CAP: tl.constexpr, HAS_T: tl.constexpr,
                 BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = L + row.to(tl.int64) * stride
        inv_t = tl.load(INV_T + row) if HAS_T else 1.0
        m = tl.full((BLOCK,), -1e30, tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            z = tl.load(base + cols, mask=mask, other=-1e30).to(tl.float32)
            if HAS_CAP:
                z = CAP * _tanh(z / CAP)
            if HAS_T:
                z = tl.where(mask, z * inv_t, -1e30)
            new_m = tl.maximum(m, z)
            s = s * tl.exp(m - new_m) + tl.where(mask, tl.exp(z - new_m), 0.0)
            m = new_m
        top = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - top), axis=0)
        tl.store(LSE + row, top + tl.log(total))

    @triton.jit
    def _scaled_softmax(L, LSE, SCALE, INV_T, OUT, stride_l, stride_o, N: tl.constexpr, CAP, HAS_CAP: tl.constexpr,
                        HAS_T: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        lse = tl.load(LSE + row)
        sc = tl.load(SCALE + row)
        inv_t = tl.load(INV_T + row) if HAS_T else 1.0
        base_l = L + row.to(tl.int64) * stride_l
        base_o = OUT + row.to(tl.int64) * stride_o
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            z = tl.load(base_l + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_CAP:
                t = _tanh(z / CAP)
                p = tl.exp(CAP * t * inv_t - lse) * sc * (1.0 - t * t)
            else:
                p = tl.exp(z * inv_t - lse) * sc
            tl.store(base_o + cols, p.to(OUT.dtype.element_ty), mask=mask)


def row_logsumexp(logits: torch.Tensor, softcap: float | None, inv_t: torch.Tensor | None = None) -> torch.Tensor:
    """``logsumexp`` of each row of ``softcap(logits) * inv_t`` (fp32 ``[C, V]``; ``inv_t`` ``[C]``
    per-row inverse temperatures, None for 1), one pass."""
    C, V = logits.shape
    lse = torch.empty(C, dtype=torch.float32, device=logits.device)
    t = lse if inv_t is None else inv_t.float().contiguous()
    _row_lse[(C,)](logits, lse, t, logits.stride(0), V, float(softcap or 1.0), HAS_CAP=softcap is not None,
                   HAS_T=inv_t is not None, BLOCK=4096, num_warps=8)
    return lse


def scaled_softmax(logits, lse, row_scale, softcap, dtype, inv_t: torch.Tensor | None = None,
                   width: int | None = None) -> torch.Tensor:
    """``row_scale * exp(z * inv_t - lse) * (1 - tanh²)`` with ``z = softcap(logits)``, written in
    ``dtype``; ``width``: the output's columns (those past ``V`` zero)."""
    C, V = logits.shape
    out = torch.empty((C, width or V), dtype=dtype, device=logits.device)
    if width is not None:
        out[:, V:] = 0
    t = lse if inv_t is None else inv_t.float().contiguous()
    _scaled_softmax[(C,)](logits, lse.contiguous(), row_scale.float().contiguous(), t, out, logits.stride(0),
                          out.stride(0), V, float(softcap or 1.0), HAS_CAP=softcap is not None,
                          HAS_T=inv_t is not None, BLOCK=4096, num_warps=8)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _rmsnorm_launch(x2: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool, fp32_product: bool,
                    r2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The forward kernel over rows ``x2``: ``(y, rstd, s)``; with ``r2``, of ``s = x2 + r2`` (else
    ``s`` is None). ``fp32_product`` already includes ``zero_centred``."""
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2, dtype=x2.dtype if fp32_product else torch.promote_types(x2.dtype, weight.dtype))
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2.device)
    s = torch.empty_like(x2) if r2 is not None else None
    res = dict(R=r2, S=s, stride_r=r2.stride(0), stride_s=s.stride(0), HAS_RES=True) if r2 is not None else {}
    block = triton.next_power_of_2(n_cols)
    _rmsnorm_fwd[(n_rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), n_cols, eps,
                            ZERO_CENTRED=zero_centred, FP32_PRODUCT=fp32_product, BLOCK=block,
                            num_warps=min(8, max(1, block // 256)), **res, **pdl.options())
    return y, rstd, s


class RMSNormFn(torch.autograd.Function):
    """Fused RMSNorm (see ``ember.core.layers.norms`` for the reference formula; ``fp32_product``:
    the weight product in fp32 before rounding, Olmo's order)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centred: bool, fp32_product: bool = False):
        x2 = _rows(x)
        fp32_product = fp32_product or zero_centred
        y, rstd, _ = _rmsnorm_launch(x2, weight, eps, zero_centred, fp32_product)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.zero_centred = zero_centred
        ctx.fp32_product = fp32_product
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        block = triton.next_power_of_2(n_cols)
        _rmsnorm_bwd[(n_rows,)](x2, weight, dy2, dx, rstd, x2.stride(0), dy2.stride(0), dx.stride(0), n_cols,
                                ZERO_CENTRED=ctx.zero_centred, BLOCK=block, num_warps=min(8, max(1, block // 256)))
        dw = None
        if ctx.needs_input_grad[1]:  # only full fine-tuning trains norm weights: plain torch is enough
            xhat = x2.float() * rstd[:, None]
            n = xhat if ctx.fp32_product else xhat.to(x2.dtype).float()
            dw = (dy2.float() * n).sum(0).to(weight.dtype)
        return dx.view(ctx.shape), dw, None, None, None


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
                 fp32_product: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + r`` and RMSNorm(s) in one kernel, without gradient (the sampler's passes): the
    values of the add followed by :class:`RMSNormFn`, bit for bit (``x``, ``r`` one dtype)."""
    y, _, s = _rmsnorm_launch(_rows(x), weight, eps, zero_centred, fp32_product or zero_centred, _rows(r))
    return s.view(x.shape), y.view(x.shape)


def _gated_rows(x: torch.Tensor) -> int:
    """Rows per program of the gated norm: about 4096 elements a program."""
    return max(1, min(64, 4096 // triton.next_power_of_2(x.shape[-1])))


class GatedRMSNormFn(torch.autograd.Function):
    """Fused ``(w · round(RMSNorm(x))) · act(gate)`` over the last dimension (Qwen3-Next's gated
    norm; ``sigmoid``: σ as the gate's activation, else silu); see
    ``ember.core.layers.norms.gated_rms_norm`` for the reference. Keeps ``x``, ``gate`` and one fp32
    scalar per row; the backward is one kernel (in fp32, without the forward's intermediate
    roundings)."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps: float, sigmoid: bool):
        x2, g2 = _rows(x), _rows(gate)
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rows = _gated_rows(x)
        _gated_rmsnorm_fwd[(triton.cdiv(n_rows, rows),)](
            x2, g2, weight, y, rstd, n_rows, x2.stride(0), g2.stride(0), y.stride(0), n_cols, eps,
            SIGMOID=sigmoid, ROWS=rows, BLOCK=triton.next_power_of_2(n_cols))
        ctx.save_for_backward(x2, g2, weight, rstd)
        ctx.sigmoid, ctx.shape = sigmoid, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = _rows(dy)
        dx, dg = torch.empty_like(x2), torch.empty_like(g2)
        rows = _gated_rows(x2)
        _gated_rmsnorm_bwd[(triton.cdiv(n_rows, rows),)](
            x2, g2, weight, dy2, dx, dg, rstd, n_rows, x2.stride(0), g2.stride(0), dy2.stride(0), dx.stride(0),
            dg.stride(0), n_cols, SIGMOID=ctx.sigmoid, ROWS=rows, BLOCK=triton.next_power_of_2(n_cols))
        dw = None
        if ctx.needs_input_grad[2]:  # only full fine-tuning trains norm weights: plain torch is enough
            g = g2.float()
            act = torch.sigmoid(g) if ctx.sigmoid else torch.nn.functional.silu(g)
            n = (x2.float() * rstd[:, None]).to(x2.dtype).float()
            dw = (dy2.float() * act * n).sum(0).to(weight.dtype)
        return dx.view(ctx.shape), dg.view(ctx.shape), dw, None, None


SILU_BLOCK = 1024


def _silu_mul_fwd_launch(g2: torch.Tensor, u2: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    n_rows, n_cols = g2.shape
    y = torch.empty((n_rows, n_cols), dtype=g2.dtype, device=g2.device)
    grid = (n_rows, triton.cdiv(n_cols, SILU_BLOCK))
    s = scale.reshape(n_rows) if scale is not None else g2
    _silu_mul_fwd[grid](g2, u2, s, y, g2.stride(0), u2.stride(0), y.stride(0), n_cols,
                        HAS_SCALE=scale is not None, BLOCK=SILU_BLOCK)
    return y


def _silu_mul_bwd_launch(g2, u2, scale, dy, dg, du, need_dscale: bool):
    """Writes the gradients of gate and up into ``dg`` and ``du`` (views, maybe of one buffer);
    returns the scale's gradient (or None)."""
    n_rows, n_cols = g2.shape
    dy2 = _rows(dy)
    grid = (n_rows, triton.cdiv(n_cols, SILU_BLOCK))
    has = scale is not None
    ds = torch.empty(grid, dtype=torch.float32, device=g2.device) if has else dg
    _silu_mul_bwd[grid](g2, u2, scale.reshape(n_rows) if has else g2, dy2, dg, du, ds, g2.stride(0),
                        u2.stride(0), dy2.stride(0), dg.stride(0), du.stride(0), n_cols, HAS_SCALE=has,
                        BLOCK=SILU_BLOCK)
    return ds.sum(1).to(scale.dtype).view(scale.shape) if has and need_dscale else None


class SiluMulFn(torch.autograd.Function):
    """Fused ``silu(gate) * up`` over the last dimension (inputs may be strided views), each row
    times ``scale`` (``[rows]``) when given (an MoE layer's routing weights)."""

    @staticmethod
    def forward(ctx, gate, up, scale=None):
        g2, u2 = _rows(gate), _rows(up)
        ctx.save_for_backward(g2, u2, scale)
        ctx.shape = gate.shape
        return _silu_mul_fwd_launch(g2, u2, scale).view(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        g2, u2, scale = ctx.saved_tensors
        dg, du = (torch.empty(g2.shape, dtype=g2.dtype, device=g2.device) for _ in range(2))
        dscale = _silu_mul_bwd_launch(g2, u2, scale, dy, dg, du, scale is not None and ctx.needs_input_grad[2])
        return dg.view(ctx.shape), du.view(ctx.shape), dscale


class SiluMulPackedFn(torch.autograd.Function):
    """:class:`SiluMulFn` of one ``[..., 2·I]`` tensor, gate first (an expert block's gate_up
    product): its gradient is one ``[..., 2·I]`` tensor that the kernel writes both halves of,
    where the autograd of ``chunk`` would copy two ``[..., I]`` gradients into one."""

    @staticmethod
    def forward(ctx, gate_up, scale=None):
        gu = _rows(gate_up)
        half = gu.shape[1] // 2
        ctx.save_for_backward(gu, scale)
        ctx.shape = gate_up.shape
        return _silu_mul_fwd_launch(gu[:, :half], gu[:, half:], scale).view(*gate_up.shape[:-1], half)

    @staticmethod
    def backward(ctx, dy):
        gu, scale = ctx.saved_tensors
        half = gu.shape[1] // 2
        dgu = torch.empty(gu.shape, dtype=gu.dtype, device=gu.device)
        dscale = _silu_mul_bwd_launch(gu[:, :half], gu[:, half:], scale, dy, dgu[:, :half], dgu[:, half:],
                                      scale is not None and ctx.needs_input_grad[1])
        return dgu.view(ctx.shape), dscale


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    T, H, D = x.shape
    rot_half = cos.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    block = triton.next_power_of_2(max(rot_half, 1))
    _rope[(T,)](x, cos, sin, y, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), H,
                rot_half, D, SIGN=sign, BLOCK_H=triton.next_power_of_2(H), BLOCK=block,
                BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return y


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps_q: float, eps_k: float, zero_centred: bool, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated RMSNorms of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` (weights None: the
    rotation alone) in one launch, without gradients: each head's norm is rounded to the input's
    dtype before the rotation, as :class:`RMSNormFn` then :class:`RopeFn` give. Heads are read
    through their strides (a packed projection's column slices are not copied)."""
    (T, Hq, D), Hk = q.shape, k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    norm = q_weight is not None
    qo = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, Hk, D), dtype=k.dtype, device=k.device)
    if T == 0:
        return qo, ko
    cos, sin = cos.contiguous(), sin.contiguous()
    rot_half = cos.shape[-1] // 2
    _qk_norm_rope[(T,)](
        q, k, q_weight if norm else q, k_weight if norm else k, cos, sin, qo, ko, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos.stride(0), Hq, Hk,
        rot_half, D, eps_q, eps_k, NORM=norm, ZERO_CENTRED=zero_centred, BLOCK_HQ=triton.next_power_of_2(Hq),
        BLOCK_HK=triton.next_power_of_2(Hk), BLOCK=triton.next_power_of_2(max(rot_half, 1)),
        BLOCK_D=triton.next_power_of_2(D), num_warps=4, **pdl.options(),
    )
    return qo, ko


class RopeFn(torch.autograd.Function):
    """Fused rotary embedding (``rotate_half`` convention); backward rotates by the opposite angle."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy, cos, sin, -1.0), None, None
