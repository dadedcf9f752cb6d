"""A SwiGLU block's LoRA work between its two base products in one launch (Triton, decode steps).

Between the packed gate/up product and the down product a decode step with adapters ran three
launches: the gate/up LoRA expand (``gu += h_gu @ B_gu.T``, a read and a write of ``gu``), the
``silu(g) * u`` kernel, and the down projection's LoRA shrink (``h_down = act @ A_down.T``). Each is
a few microseconds of latency for a few megabytes of traffic (``bench/lora_decode.py``). Here
program ``(s, m)`` owns the columns ``[s·BLOCK_K, (s+1)·BLOCK_K)`` of the intermediate width for
the rows of block ``m``: it loads those columns of gate and up once, adds each adapter group's delta from its block of
``B_gu`` (rows sorted by group, as :mod:`ember.core.kernels.lora_decode` takes them), rounds them to
the input's dtype as the expand kernel does, writes ``act = silu(g) · u``, and adds the partial
product of its ``act`` columns with ``A_down``'s into ``h_down`` (fp32, atomic adds: the shrink's
split over K). The down projection then reads ``act`` and, through the route, ``h_down``.

The numbers are the three kernels' (the same roundings); only the atomic adds' order makes the
last bits of ``h_down`` differ from run to run, as in the shrink kernel. Launch shapes depend only
on tensor shapes, so the kernel captures in a CUDA graph. Under ``TRITON_INTERPRET=1`` it runs on
the CPU (the tests).
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
    def _swiglu_lora(
        GU, HGU, BGU, AD, HD, ACT, OFFS, ROWS, ACTIVE, N_ACTIVE,
        stride_gu, stride_hgu, stride_hj, stride_bg, stride_bo, stride_ag, stride_ar, stride_hd, stride_act,
        N, I, R, RD,
        HAS_ROWS: tl.constexpr, HAS_GU: tl.constexpr, HAS_DOWN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R_PAD: tl.constexpr, RD_PAD: tl.constexpr,
        PREC: tl.constexpr, G_PAD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        m0 = tl.program_id(1) * BLOCK_M
        # the groups of this row block, before the wait (kernels.pdl, "read early": the list and the
        # offsets are written at the step's start)
        j, gv, sv, ev, first, last = _block_groups(OFFS, ROWS, ACTIVE, N_ACTIVE, m0, BLOCK_M, G_PAD, HAS_ROWS)
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        cmask = cols < I
        r = tl.arange(0, R_PAD)
        rmask = r < R
        rd = tl.arange(0, RD_PAD)
        rdmask = rd < RD
        rows = m0 + tl.arange(0, BLOCK_M)
        mmask = rows < N
        tile = mmask[:, None] & cmask[None, :]
        gu_ptr = GU + rows.to(tl.int64)[:, None] * stride_gu + cols[None, :]
        g = tl.load(gu_ptr, mask=tile, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + I, mask=tile, other=0.0).to(tl.float32)
        if HAS_GU:
            for i in range(first, last + 1):
                grp, mine = _group_at(j, gv, sv, ev, i, rows)
                # stride_hj: the i-th active group's h starts i · stride_hj columns on (windowed h)
                h_ptr = HGU + i * stride_hj + rows.to(tl.int64)[:, None] * stride_hgu + r[None, :]
                hmask = mine[:, None] & rmask[None, :]
                b_ptr = BGU + (grp + tl.zeros([], tl.int64)) * stride_bg + r[None, :]
                bmask = cmask[:, None] & rmask[None, :]
                # gate: B rows [0, I), factor columns [0, R); up: rows [I, 2I), columns [R, 2R)
                bg = tl.load(b_ptr + cols.to(tl.int64)[:, None] * stride_bo, mask=bmask, other=0.0)
                bu = tl.load(b_ptr + (I + cols).to(tl.int64)[:, None] * stride_bo + R, mask=bmask, other=0.0)
                hg = tl.load(h_ptr, mask=hmask, other=0.0).to(bg.dtype)
                hu = tl.load(h_ptr + R, mask=hmask, other=0.0).to(bg.dtype)
                g += tl.dot(hg, tl.trans(bg), input_precision=PREC)
                u += tl.dot(hu, tl.trans(bu), input_precision=PREC)
            # the expand kernel's one rounding of base + delta
            g = g.to(GU.dtype.element_ty).to(tl.float32)
            u = u.to(GU.dtype.element_ty).to(tl.float32)
        act = (g * tl.sigmoid(g) * u).to(ACT.dtype.element_ty)
        tl.store(ACT + rows.to(tl.int64)[:, None] * stride_act + cols[None, :], act, mask=tile)
        if HAS_DOWN:
            # the down shrink's partial over the program's columns: the groups' rows are disjoint, so
            # one partial for all of them and one atomic add
            hd = tl.zeros([BLOCK_M, RD_PAD], tl.float32)
            for i in range(first, last + 1):
                grp, mine = _group_at(j, gv, sv, ev, i, rows)
                a_ptr = AD + (grp + tl.zeros([], tl.int64)) * stride_ag + rd[:, None] * stride_ar + cols[None, :]
                a = tl.load(a_ptr, mask=rdmask[:, None] & cmask[None, :], other=0.0)
                x = tl.where(mine[:, None], act, 0.0).to(a.dtype)
                hd += tl.dot(x, tl.trans(a), input_precision=PREC)  # [BLOCK_M, RD_PAD] fp32
            # the rows of the block's groups (consecutive: rows are sorted by group)
            lo = tl.sum(tl.where(j == first, sv, 0), axis=0)
            hi = tl.sum(tl.where(j == last, ev, 0), axis=0)
            ours = (rows >= lo) & (rows < hi)
            hd_ptr = HD + rows.to(tl.int64)[:, None] * stride_hd + rd[None, :]
            tl.atomic_add(hd_ptr, hd, mask=ours[:, None] & rdmask[None, :], sem="relaxed")


def swiglu_config(n_rows: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_K)`` of the launch (8 warps): up to 32 rows a block, 256 intermediate
    columns a program (the down shrink's split). ``bench/gpu_checks.py swiglu_lora`` times every
    shape; on an H100 (Qwen3-8B's MLP, 36 layers) this one took 363 µs a step at 64 rows of one
    adapter and 1,043 µs at 256 rows of eight, against 374 and 1,153 µs for 64 × 128 (fewer atomic
    adds into ``h_down``, and a row block rarely spans two adapters' rows). Compiled for sm_90a
    (Triton 3.6) it takes 246 registers a thread, one program an SM. Walking a program's columns in
    steps (fewer registers, two programs an SM at 4 warps; 7330c85) was slower on an H100 at every
    shape tried (2026-12-07): 128-column steps 476 against 368 µs at 64 rows, 1,117 against 1,030
    at 256 rows with 4 warps; 64-column steps 675-1,560. The loads of one step wait for the step
    before, where one tile has them all in flight."""
    return max(16, min(32, _pow2(n_rows))), 256


def swiglu_lora(
    gu: torch.Tensor,
    offsets: torch.Tensor,
    active: ActiveGroups,
    n_rows: torch.Tensor | None = None,
    gate_up: tuple[torch.Tensor, torch.Tensor] | None = None,
    down: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``act = silu(g) · u`` of the packed ``gu = [g | u]`` (``[N, 2·I]``, unit stride along
    columns) -> ``[N, I]``, with LoRA on either side:

    * ``gate_up = (h_gu, B_gu)``: the gate/up group's shrink ``[N, 2·r]`` (gate's ``r`` columns
      first), or windowed, ``[N, P, 2·r]`` (the ``i``-th active group's in ``h_gu[:, i]``, as
      :func:`~ember.core.kernels.lora_decode.lora_expand_add` takes it), and its block-diagonal
      stack ``[G, 2·I, 2·r]``; each group's delta is added to g and u first (rounded once to
      ``gu``'s dtype);
    * ``down = (A_down, h_down)``: the down projection's stack ``[G, r_d, I]`` and a zeroed fp32
      ``[N, r_d]`` that receives ``act @ A_down[g].T`` for each row's group ``g``.

    Groups as :func:`~ember.core.kernels.lora_decode.lora_shrink` takes them (``offsets``,
    ``n_rows``, and ``active`` from :func:`~ember.core.kernels.lora_decode.active_groups`).
    ``config``: ``(BLOCK_M, BLOCK_K)`` instead of :func:`swiglu_config`'s (the check sweeps them)."""
    N, two_i = gu.shape
    I = two_i // 2  # the intermediate width
    if gu.stride(-1) != 1 or two_i % 2:
        raise ValueError(f"swiglu_lora: gu must be [N, 2·I] with unit column stride, got {tuple(gu.shape)}")
    act = torch.empty(N, I, dtype=gu.dtype, device=gu.device)
    if N == 0:
        return act
    h_gu, B_gu = gate_up if gate_up is not None else (gu, gu)
    A_d, h_d = down if down is not None else (gu, gu)
    windowed = gate_up is not None and h_gu.dim() == 3
    R = h_gu.shape[-1] // 2 if gate_up is not None else 1
    RD = A_d.shape[1] if down is not None else 1
    if gate_up is not None and (B_gu.shape[1:] != (two_i, 2 * R) or h_gu.shape[0] != N or h_gu.stride(-1) != 1
                                or B_gu.stride(-1) != 1 or (windowed and h_gu.shape[1] < active.bound)):
        raise ValueError(f"swiglu_lora: gate_up stacks {tuple(B_gu.shape)}, h {tuple(h_gu.shape)} for gu {tuple(gu.shape)}"
                         f" and {active.bound} active groups")
    if down is not None and (A_d.shape[2] != I or h_d.shape != (N, RD) or h_d.dtype != torch.float32
                             or A_d.stride(-1) != 1 or h_d.stride(-1) != 1):
        raise ValueError(f"swiglu_lora: down stack {tuple(A_d.shape)}, h {tuple(h_d.shape)} for gu {tuple(gu.shape)}")
    block_m, block_k = config or swiglu_config(N)
    _swiglu_lora[(triton.cdiv(I, block_k), triton.cdiv(N, block_m))](
        gu, h_gu, B_gu, A_d, h_d, act, offsets, n_rows if n_rows is not None else offsets, active.ids, active.count,
        gu.stride(0), h_gu.stride(0), h_gu.stride(1) if windowed else 0, B_gu.stride(0) if gate_up is not None else 0,
        B_gu.stride(1) if gate_up is not None else 0, A_d.stride(0) if down is not None else 0,
        A_d.stride(1) if down is not None else 0, h_d.stride(0) if down is not None else 0, act.stride(0),
        N, I, R, RD,
        HAS_ROWS=n_rows is not None, HAS_GU=gate_up is not None, HAS_DOWN=down is not None,
        BLOCK_M=block_m, BLOCK_K=block_k, R_PAD=max(16, _pow2(R)), RD_PAD=max(16, _pow2(RD)),
        PREC=_prec(B_gu if gate_up is not None else A_d), G_PAD=groups_pad(active), num_warps=8,
        **pdl.options(),
    )
    return act
