"""A decode step's attention inputs from its packed q/k/v product in one launch (Triton).

Between the packed q/k/v product and attention a decode step of a Llama-style layer (Qwen3, Llama,
Qwen3-MoE) ran three small launches: the q/k/v LoRA expand (``y += h @ B.T`` for each adapter's
rows, a read and a write of ``y``), the q/k RMSNorms and rotations
(:func:`~ember.core.kernels.fused.qk_norm_rope`) and the KV write
(:func:`~ember.core.kernels.kv_write.kv_write`). Each is a few microseconds of a step's latency for
well under a megabyte of traffic. Here program ``(head, m)`` takes one head's columns of ``y`` for
the rows of block ``m``:

* it adds each adapter group's delta (rows sorted by group, as
  :mod:`ember.core.kernels.lora_decode` takes them) from its member's block of the group's
  block-diagonal ``B``, and rounds once to ``y``'s dtype, as the expand kernel does;
* a query head: its RMSNorm and rotation, as ``qk_norm_rope`` computes them, stored in ``q``;
* a key head: the same, stored in the key cache at the row's slot (converted to the cache's dtype
  from ``y``'s, as ``kv_write`` converts the rotated keys);
* a value head: its values, stored in the value cache at the row's slot.

The roundings are the three kernels'. The RMSNorm's sum of squares runs over the head's two rotary
halves and its other channels, not in one reduction, so its last bit may differ from
``qk_norm_rope``'s. The head's columns are read as the two rotary halves and the rest (the
rotation pairs channel ``i`` with ``i + rotary/2``), the LoRA delta of each part as its own product.

Launch shapes depend only on tensor shapes and the host-known bound of the active groups, so the
kernel captures in a CUDA graph. Under ``TRITON_INTERPRET=1`` it runs on the CPU (the tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ember.core.kernels import fused, pdl
from ember.core.kernels.lora_decode import ActiveGroups, _pow2, _prec, groups_pad

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.lora_decode import _block_groups, _group_at
    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _qkv_rope_write(
        Y, H, B, QW, KW, COS, SIN, QO, KC, VC, SLOTS, OFFS, ROWS, ACTIVE, N_ACTIVE,
        stride_y, stride_hm, stride_hj, stride_bg, stride_bo, stride_c, stride_qt, stride_qh,
        N, HQ, HK, D, R, rot_half, eps_q, eps_k,
        HAS_LORA: tl.constexpr, HAS_ROWS: tl.constexpr, NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr,
        HAS_REST: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
        R_PAD: tl.constexpr, PREC: tl.constexpr, G_PAD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        head = tl.program_id(0)
        m0 = tl.program_id(1) * BLOCK_M
        if HAS_LORA:
            # the groups of this row block, before the wait (kernels.pdl, "read early": the list and
            # the offsets are written at the step's start)
            j, gv, sv, ev, first, last = _block_groups(OFFS, ROWS, ACTIVE, N_ACTIVE, m0, BLOCK_M, G_PAD, HAS_ROWS)
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        rows = m0 + tl.arange(0, BLOCK_M)
        mmask = rows < N
        i = tl.arange(0, HALF)
        imask = i < rot_half
        tile = mmask[:, None] & imask[None, :]
        col0 = head * D  # the packed product's columns: query heads, then key heads, then value heads
        y_row = Y + rows.to(tl.int64)[:, None] * stride_y + col0
        x1 = tl.load(y_row + i[None, :], mask=tile, other=0.0).to(tl.float32)
        x2 = tl.load(y_row + rot_half + i[None, :], mask=tile, other=0.0).to(tl.float32)
        d = 2 * rot_half + tl.arange(0, BLOCK_D)
        dmask = d < D
        rest = mmask[:, None] & dmask[None, :]
        if HAS_REST:  # channels past the rotary ones
            xr = tl.load(y_row + d[None, :], mask=rest, other=0.0).to(tl.float32)
        # what the rest of the program reads, issued with the head's values (not after the LoRA loop)
        slot = tl.load(SLOTS + rows, mask=mmask, other=0).to(tl.int64)
        is_q = head < HQ
        c = tl.load(COS + rows.to(tl.int64)[:, None] * stride_c + i[None, :], mask=tile, other=0.0)
        s = tl.load(SIN + rows.to(tl.int64)[:, None] * stride_c + i[None, :], mask=tile, other=0.0)
        if NORM:
            w1 = tl.where(is_q, tl.load(QW + i, mask=imask, other=0.0), tl.load(KW + i, mask=imask, other=0.0))
            w2 = tl.where(is_q, tl.load(QW + rot_half + i, mask=imask, other=0.0),
                          tl.load(KW + rot_half + i, mask=imask, other=0.0))
            w1 = w1.to(tl.float32)[None, :]
            w2 = w2.to(tl.float32)[None, :]
        if HAS_LORA:
            member = (head >= HQ).to(tl.int32) + (head >= HQ + HK).to(tl.int32)  # q, k or v
            r = tl.arange(0, R_PAD)
            rmask = r < R
            bmask = imask[:, None] & rmask[None, :]
            for g in range(first, last + 1):
                grp, mine = _group_at(j, gv, sv, ev, g, rows)
                # the head's member's block of factor columns, of h and of B[grp]; stride_hj: the g-th
                # active group's h starts g · stride_hj columns on (windowed h)
                h_ptr = H + g * stride_hj + rows.to(tl.int64)[:, None] * stride_hm + member * R + r[None, :]
                b_ptr = B + (grp + tl.zeros([], tl.int64)) * stride_bg + member * R + r[None, :]
                b1 = tl.load(b_ptr + (col0 + i).to(tl.int64)[:, None] * stride_bo, mask=bmask, other=0.0)
                b2 = tl.load(b_ptr + (col0 + rot_half + i).to(tl.int64)[:, None] * stride_bo, mask=bmask, other=0.0)
                h = tl.load(h_ptr, mask=mine[:, None] & rmask[None, :], other=0.0).to(b1.dtype)
                x1 += tl.dot(h, tl.trans(b1), input_precision=PREC)
                x2 += tl.dot(h, tl.trans(b2), input_precision=PREC)
                if HAS_REST:
                    br = tl.load(b_ptr + (col0 + d).to(tl.int64)[:, None] * stride_bo,
                                 mask=dmask[:, None] & rmask[None, :], other=0.0)
                    xr += tl.dot(h, tl.trans(br), input_precision=PREC)
            # the expand kernel's one rounding of base + delta
            x1 = x1.to(Y.dtype.element_ty).to(tl.float32)
            x2 = x2.to(Y.dtype.element_ty).to(tl.float32)
            if HAS_REST:
                xr = xr.to(Y.dtype.element_ty).to(tl.float32)
        if head < HQ + HK:  # a query or key head: RMSNorm (if any), then the rotation
            if NORM:
                ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
                if HAS_REST:
                    ss += tl.sum(xr * xr, axis=1)
                rstd = (1.0 / tl.sqrt(ss / D + tl.where(is_q, eps_q, eps_k)))[:, None]
                if ZERO_CENTRED:
                    x1 = (x1 * rstd * (1.0 + w1)).to(Y.dtype.element_ty).to(tl.float32)
                    x2 = (x2 * rstd * (1.0 + w2)).to(Y.dtype.element_ty).to(tl.float32)
                else:
                    x1 = ((x1 * rstd).to(Y.dtype.element_ty).to(tl.float32) * w1).to(Y.dtype.element_ty).to(tl.float32)
                    x2 = ((x2 * rstd).to(Y.dtype.element_ty).to(tl.float32) * w2).to(Y.dtype.element_ty).to(tl.float32)
                if HAS_REST:
                    wr = tl.where(is_q, tl.load(QW + d, mask=dmask, other=0.0), tl.load(KW + d, mask=dmask, other=0.0))
                    wr = wr.to(tl.float32)[None, :]
                    if ZERO_CENTRED:
                        xr = xr * rstd * (1.0 + wr)
                    else:
                        xr = (xr * rstd).to(Y.dtype.element_ty).to(tl.float32) * wr
            cf = c.to(tl.float32)
            sf = s.to(tl.float32)
            o1 = (x1 * cf - x2 * sf).to(Y.dtype.element_ty)
            o2 = (x2 * cf + x1 * sf).to(Y.dtype.element_ty)
            if is_q:
                q_row = QO + rows.to(tl.int64)[:, None] * stride_qt + head * stride_qh
                tl.store(q_row + i[None, :], o1, mask=tile)
                tl.store(q_row + rot_half + i[None, :], o2, mask=tile)
                if HAS_REST:
                    tl.store(q_row + d[None, :], xr.to(Y.dtype.element_ty), mask=rest)
            else:  # the cache is contiguous: [slots, HK, D]
                k_row = KC + (slot * HK + head - HQ)[:, None] * D
                tl.store(k_row + i[None, :], o1.to(KC.dtype.element_ty), mask=tile)
                tl.store(k_row + rot_half + i[None, :], o2.to(KC.dtype.element_ty), mask=tile)
                if HAS_REST:
                    tl.store(k_row + d[None, :], xr.to(Y.dtype.element_ty).to(KC.dtype.element_ty), mask=rest)
        else:  # a value head
            v_row = VC + (slot * HK + head - HQ - HK)[:, None] * D
            tl.store(v_row + i[None, :], x1.to(Y.dtype.element_ty).to(VC.dtype.element_ty), mask=tile)
            tl.store(v_row + rot_half + i[None, :], x2.to(Y.dtype.element_ty).to(VC.dtype.element_ty), mask=tile)
            if HAS_REST:
                tl.store(v_row + d[None, :], xr.to(Y.dtype.element_ty).to(VC.dtype.element_ty), mask=rest)


class QkvLora(NamedTuple):
    """A packed q/k/v group's LoRA delta, not yet added: the shrink ``h`` (fp32 ``[N, 3·r]``, or
    windowed ``[N, P, 3·r]``: the ``i``-th active group's in ``h[:, i]``), the group's
    block-diagonal stack ``B`` ``[G, out, 3·r]`` (the scale folded in), and its row groups as
    :func:`~ember.core.kernels.lora_decode.lora_expand_add` takes them."""

    h: torch.Tensor
    B: torch.Tensor
    offsets: torch.Tensor
    n_rows: torch.Tensor | None
    active: ActiveGroups


# Rows a program and warps: 16 rows (the LoRA delta's smallest dot) and 4 warps fit the 255
# registers without spilling at Qwen3's heads of 128. ``bench/qkv_decode.py --sweep`` times the
# others: 32 rows and 2 or 8 warps were within the noise of this on an H100 (docs/performance.md).
_LAUNCH = {"block_m": 16, "num_warps": 4}


def qkv_rope_write(
    y: torch.Tensor,
    heads: tuple[int, int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float, float, bool] | None = None,
    lora: QkvLora | None = None,
) -> torch.Tensor:
    """The queries of a decode step, from its packed q/k/v product ``y`` ``[N, (Hq + 2·Hk)·D]``
    (``heads = (Hq, Hk)``, unit column stride), with the keys and values stored in the caches:

    * ``lora``: the group's delta is added first (rounded once to ``y``'s dtype), rows outside the
      active groups keep ``y``;
    * ``norms = (q_weight, k_weight, eps_q, eps_k, zero_centred)``: each query and key head's
      RMSNorm (``None``: none), then the rotation by ``cos``/``sin`` ``[N, rotary]`` (the first
      ``rotary`` channels of each head, ``rotate_half`` convention);
    * keys and values go to the flat ``slots`` ``[N]`` of ``kc``/``vc`` (contiguous
      ``[pages, page_size, Hk, D]``), converted to their dtype.

    Returns the queries ``[N, Hq, D]``."""
    N = y.shape[0]
    Hq, Hk = heads
    D = y.shape[1] // (Hq + 2 * Hk)
    rot_half = cos.shape[-1] // 2
    if y.dim() != 2 or y.stride(-1) != 1 or D * (Hq + 2 * Hk) != y.shape[1] or not 0 < 2 * rot_half <= D:
        raise ValueError(f"qkv_rope_write: y {tuple(y.shape)} for {Hq} + 2 × {Hk} heads, rotary {cos.shape[-1]}")
    if kc.shape != vc.shape or kc.shape[2:] != (Hk, D) or not (kc.is_contiguous() and vc.is_contiguous()):
        raise ValueError(f"qkv_rope_write: caches {tuple(kc.shape)}, {tuple(vc.shape)} for {Hk} heads of {D}")
    if cos.shape != (N, 2 * rot_half) or sin.shape != cos.shape or slots.shape != (N,):
        raise ValueError(f"qkv_rope_write: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, slots {tuple(slots.shape)} "
                         f"for {N} rows")
    q = torch.empty((N, Hq, D), dtype=y.dtype, device=y.device)
    if N == 0:
        return q
    cos, sin = cos.contiguous(), sin.contiguous()
    if lora is not None:
        h, B = lora.h, lora.B
        windowed = h.dim() == 3
        R = h.shape[-1] // 3
        if (h.shape[0] != N or h.shape[-1] != 3 * R or B.shape[1:] != (y.shape[1], 3 * R) or h.stride(-1) != 1
                or B.stride(-1) != 1 or (windowed and h.shape[1] < lora.active.bound)):
            raise ValueError(f"qkv_rope_write: LoRA h {tuple(h.shape)}, B {tuple(B.shape)} for y {tuple(y.shape)} "
                             f"and {lora.active.bound} active groups")
    qw, kw, eps_q, eps_k, zero_centred = norms if norms is not None else (y, y, 0.0, 0.0, False)
    rest = D - 2 * rot_half
    if lora is not None and lora.active.bound > 0:
        h, B, offsets, active = lora.h, lora.B, lora.offsets, lora.active
        n_rows, R = lora.n_rows, h.shape[-1] // 3
        h_strides = (h.stride(0), h.stride(1) if h.dim() == 3 else 0)
        group = dict(HAS_LORA=True, R_PAD=max(16, _pow2(R)), PREC=_prec(B), G_PAD=groups_pad(active))
        ids, count, b_strides = active.ids, active.count, (B.stride(0), B.stride(1))
    else:  # no delta: the LoRA arguments are never read
        h, B, offsets, n_rows, R = y, y, slots, None, 1
        ids, count, h_strides, b_strides = slots, slots, (0, 0), (0, 0)
        group = dict(HAS_LORA=False, R_PAD=16, PREC="tf32", G_PAD=2)
    block_m = _LAUNCH["block_m"]
    _qkv_rope_write[(Hq + 2 * Hk, triton.cdiv(N, block_m))](
        y, h, B, qw, kw, cos, sin, q, kc.view(-1, Hk, D), vc.view(-1, Hk, D), slots, offsets,
        n_rows if n_rows is not None else offsets, ids, count,
        y.stride(0), *h_strides, *b_strides, cos.stride(0), q.stride(0), q.stride(1),
        N, Hq, Hk, D, R, rot_half, eps_q, eps_k,
        HAS_ROWS=n_rows is not None, NORM=norms is not None, ZERO_CENTRED=zero_centred, HAS_REST=rest > 0,
        BLOCK_M=block_m, HALF=max(16, _pow2(rot_half)), BLOCK_D=max(16, _pow2(max(rest, 1))),
        num_warps=_LAUNCH["num_warps"],
        **group, **pdl.options(),
    )
    return q
