"""An RMSNorm and the LoRA shrink of the products that read its output, in one launch (Triton,
decode steps).

In a decode layer each norm feeds one shared-input group (the input norm q/k/v, the
post-attention norm gate/up), and the group's LoRA shrink ``h = y @ A[g].T`` (rows sorted by
adapter group, as :mod:`ember.core.kernels.lora_decode` takes them) read the norm's output ``y``
right after the norm wrote it: two launches of a few microseconds each for about a megabyte.
Here program ``(s, m)`` owns the columns ``[s·BLOCK_K, (s+1)·BLOCK_K)`` of the rows of block
``m``:

* it first walks the whole of its rows (``x``, or ``s = x + r`` with a residual) for their sum of
  squares, which every program of the row block forms in the same order, so they agree on each
  row's ``rstd``;
* writes its columns of ``y`` (and of ``s``) with the norm kernel's roundings
  (:func:`~ember.core.kernels.fused.add_rms_norm`);
* adds the partial product of those columns of the rounded ``y`` with each row group's ``A[g]``
  into ``h`` (fp32, atomic adds: the shrink's split over K).

The extra reads of the first step come from L2 (the row block is a few hundred kilobytes).
``rstd`` is summed in column blocks rather than in one vector, so ``y`` may differ from the
separate norm's in the last bit of a value; the atomic adds' order makes the last bits of ``h``
differ from run to run, as in the shrink kernel. Launch shapes depend only on tensor shapes (CUDA
graphs capture it); under ``TRITON_INTERPRET=1`` it runs on the CPU (the tests).
"""

from __future__ import annotations

import torch

from ember.core.kernels import fused, pdl
from ember.core.kernels.lora_decode import ActiveGroups, _pow2, _prec, groups_pad

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.lora_decode import _block_groups, _group_at
    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _norm_shrink(
        X, RES, S, W, Y, A, H, OFFS, ROWS, ACTIVE, N_ACTIVE,
        stride_x, stride_r, stride_s, stride_y, stride_ag, stride_ar, stride_h,
        N, K, R, eps,
        HAS_RES: tl.constexpr, ZERO_CENTRED: tl.constexpr, FP32_PRODUCT: tl.constexpr, HAS_ROWS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, SUM_K: tl.constexpr, R_PAD: tl.constexpr,
        G_PAD: tl.constexpr, PREC: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        m0 = tl.program_id(1) * BLOCK_M
        # the row block's groups, before the wait (kernels.pdl, "read early": the list and the
        # offsets are written at the step's start)
        j, gv, sv, ev, first, last = _block_groups(OFFS, ROWS, ACTIVE, N_ACTIVE, m0, BLOCK_M, G_PAD, HAS_ROWS)
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        rows = m0 + tl.arange(0, BLOCK_M)
        mmask = rows < N
        row_off = rows.to(tl.int64)[:, None]
        # each row's sum of squares over the whole width, SUM_K columns at a time
        sq = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(0, K, SUM_K):
            c = c0 + tl.arange(0, SUM_K)
            t = mmask[:, None] & (c < K)[None, :]
            v = tl.load(X + row_off * stride_x + c[None, :], mask=t, other=0.0).to(tl.float32)
            if HAS_RES:  # s = x + r rounded to the input dtype, as the add would
                v = (v + tl.load(RES + row_off * stride_r + c[None, :], mask=t, other=0.0).to(tl.float32))
                v = v.to(X.dtype.element_ty).to(tl.float32)
            sq += tl.sum(v * v, axis=1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
        r = tl.arange(0, R_PAD)
        rmask = r < R
        acc = tl.zeros([BLOCK_M, R_PAD], tl.float32)  # the shrink's partial over the program's columns
        # the program's BLOCK_K columns CHUNK at a time (a smaller live tile): s, y, and the product of
        # y with each group's A (the groups' rows are disjoint: one partial for all of them)
        for c0 in range(0, BLOCK_K, CHUNK):
            cols = tl.program_id(0) * BLOCK_K + c0 + tl.arange(0, CHUNK)
            cmask = cols < K
            tile = mmask[:, None] & cmask[None, :]
            x = tl.load(X + row_off * stride_x + cols[None, :], mask=tile, other=0.0).to(tl.float32)
            if HAS_RES:
                s = (x + tl.load(RES + row_off * stride_r + cols[None, :], mask=tile, other=0.0).to(tl.float32))
                s = s.to(S.dtype.element_ty)
                tl.store(S + row_off * stride_s + cols[None, :], s, mask=tile)
                x = s.to(tl.float32)
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            xhat = x * rstd[:, None]
            if ZERO_CENTRED:
                y = xhat * (1.0 + w[None, :])
            elif FP32_PRODUCT:  # Olmo's order: scale in fp32, then round
                y = xhat * w[None, :]
            else:  # reference order: round the normalised value to the input dtype, then scale
                y = xhat.to(Y.dtype.element_ty).to(tl.float32) * w[None, :]
            y = y.to(Y.dtype.element_ty)
            tl.store(Y + row_off * stride_y + cols[None, :], y, mask=tile)
            for i in range(first, last + 1):
                grp, mine = _group_at(j, gv, sv, ev, i, rows)
                a_ptr = A + (grp + tl.zeros([], tl.int64)) * stride_ag + r[:, None] * stride_ar + cols[None, :]
                a = tl.load(a_ptr, mask=rmask[:, None] & cmask[None, :], other=0.0)
                acc += tl.dot(tl.where(mine[:, None], y, 0.0).to(a.dtype), tl.trans(a), input_precision=PREC)
        lo = tl.sum(tl.where(j == first, sv, 0), axis=0)  # the rows of the block's groups
        hi = tl.sum(tl.where(j == last, ev, 0), axis=0)
        ours = (rows >= lo) & (rows < hi)
        tl.atomic_add(H + row_off * stride_h + r[None, :], acc, mask=ours[:, None] & rmask[None, :], sem="relaxed")


def norm_shrink_config(n_rows: int, width: int, rank: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_K, CHUNK, num_warps)``: 16-row blocks (``tl.dot``'s least), ``BLOCK_K``
    columns a program in steps of ``CHUNK``, 8 warps. Each program also reads its rows' whole width
    for their norms, so the width over ``BLOCK_K`` is how many times the rows are read (from L2):
    256 columns (16 times) up to 64 rows, 512 above, where the rows weigh more and there are row
    blocks enough to fill the GPU (128 programs at 256 rows). 128-column steps keep the ``A`` tile
    at q/k/v's padded rank (128) to 16K values (108 registers a thread at 8 warps, sm_90a, Triton
    3.6). Not yet measured on a GPU."""
    block_k = 256 if n_rows <= 64 else 512
    return 16, min(block_k, _pow2(width)), min(128, _pow2(width)), 8


def norm_shrink(
    x: torch.Tensor,
    res: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    A: torch.Tensor,
    h: torch.Tensor,
    offsets: torch.Tensor,
    active: ActiveGroups,
    n_rows: torch.Tensor | None = None,
    fp32_product: bool = False,
    config: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(s, y)``: ``s = x + res`` (None without ``res``) and ``y = RMSNorm(s)`` as
    :func:`~ember.core.kernels.fused.add_rms_norm` computes them, while ``h[rows of g] +=
    y[rows of g] @ A[g].T`` (``A`` ``[G, R, K]``, ``h`` a zeroed fp32 ``[N, R]``) for the groups of
    ``offsets`` / ``active`` / ``n_rows`` as :func:`~ember.core.kernels.lora_decode.lora_shrink`
    takes them. ``config``: ``(BLOCK_M, BLOCK_K, CHUNK, num_warps)`` instead of
    :func:`norm_shrink_config`'s (``CHUNK`` divides ``BLOCK_K``)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"norm_shrink: x must be [N, K] with unit column stride, got {tuple(x.shape)}")
    N, K = x.shape
    G, R, _ = A.shape
    if res is not None and (res.shape != x.shape or res.dtype != x.dtype or res.stride(-1) != 1):
        raise ValueError(f"norm_shrink: residual {res.dtype} {tuple(res.shape)} for x {x.dtype} {tuple(x.shape)}")
    if A.shape[2] != K or A.stride(-1) != 1 or weight.shape != (K,) or offsets.shape != (G,):
        raise ValueError(f"norm_shrink: A {tuple(A.shape)}, weight {tuple(weight.shape)}, offsets "
                         f"{tuple(offsets.shape)} for x {tuple(x.shape)}")
    if h.shape != (N, R) or h.dtype != torch.float32 or h.stride(-1) != 1:
        raise ValueError(f"norm_shrink: h must be fp32 [{N}, {R}] with unit stride, got {h.dtype} {tuple(h.shape)}")
    fp32_product = fp32_product or zero_centred
    y = torch.empty_like(x, dtype=x.dtype if fp32_product else torch.promote_types(x.dtype, weight.dtype))
    s = torch.empty_like(x) if res is not None else None
    if N == 0:
        return s, y
    block_m, block_k, chunk, warps = config or norm_shrink_config(N, K, R)
    if block_k % chunk:
        raise ValueError(f"norm_shrink: CHUNK {chunk} must divide BLOCK_K {block_k}")
    sum_k = min(_pow2(K), max(16, 4096 // block_m))  # about 4K values a step of the sum
    _norm_shrink[(triton.cdiv(K, block_k), triton.cdiv(N, block_m))](
        x, res if res is not None else x, s if s is not None else x, weight, y, A, h,
        offsets, n_rows if n_rows is not None else offsets, active.ids, active.count,
        x.stride(0), res.stride(0) if res is not None else 0, s.stride(0) if s is not None else 0, y.stride(0),
        A.stride(0), A.stride(1), h.stride(0),
        N, K, R, eps,
        HAS_RES=res is not None, ZERO_CENTRED=zero_centred, FP32_PRODUCT=fp32_product, HAS_ROWS=n_rows is not None,
        BLOCK_M=block_m, BLOCK_K=block_k, CHUNK=chunk, SUM_K=sum_k, R_PAD=max(16, _pow2(R)), G_PAD=groups_pad(active),
        PREC=_prec(A), num_warps=warps, **pdl.options(),
    )
    return s, y
