"""Triton kernels for the LoRA delta of the static (CUDA-graph) decode step.

Rows are sorted by adapter slot and ``offsets`` (int32 ``[G]``, cumulative row ends, as for
``torch._grouped_mm``) says which rows belong to which group ``g`` of the stacked factors
``A`` ``[G, r, in]`` and ``B`` ``[G, out, r]`` (the adapter's scale already folded into ``B``). For
each group with rows, the delta is ``x[rows] @ A[g].T @ B[g].T``. Two launches:

* :func:`lora_shrink`, ``h = x @ A[g].T`` in fp32, split over K and over the rank: for each of its
  groups ``g``, program ``(j, s, b)`` multiplies the slice ``A[g][b·R_BLOCK : (b+1)·R_BLOCK,
  s·BLOCK_K : (s+1)·BLOCK_K]`` by each of the group's row blocks and adds the partial products
  into a zeroed fp32 ``h`` with atomic adds. A decode batch has few rows, so without the split one
  tile would walk the whole of K on one SM (what the grouped GEMM does); with it the
  ``in / BLOCK_K`` programs of a group stream ``A[g]`` and ``x`` in parallel (:func:`shrink_config`).
* :func:`lora_expand_add`, ``y[rows] += h[rows] @ B[g].T`` in place: program ``(j, o)`` loads the
  block ``B[g][o·BLOCK_O : (o+1)·BLOCK_O, :]`` once and loops over the group's row blocks, adding the
  delta to ``y`` in fp32 and rounding once to ``y``'s dtype (this fuses the ``y + delta`` add). For
  a packed group (``splits``) the block takes only its member's columns of the block-diagonal ``B``.
  ``h`` may come windowed from the base product instead (``[N, P, r]``: the static decoder's shrink
  windows, :class:`~ember.core.sampling.packed_linears.PackedLinears`).

Under programmatic dependent launch both kernels load the group list, the group's rows and their
first factor block before the grid-dependency wait (:mod:`ember.core.kernels.pdl`, "read early"),
and the next group's while the current one's products land.

The groups with rows are listed first (:func:`active_groups`, device ops computed once per step)
and spread over at most ``GROUP_PROGRAMS`` programs per split (program ``j`` takes active groups
``j``, ``j + programs``, ...), so the work does not grow with the number of configured slots
(measured on the H200: with one program per group, a bank of 32 slots made the decode step 6 %
slower than a bank of 1; walking every group from each program, 6-10 % once the shared-input groups
made the launches wider). Nor does the launch: its programs per split, and the width of the group
vectors the kernels load, follow :attr:`ActiveGroups.bound`, a bound on the active groups the host
knows (the static decoder: the adapters of the step's rows, to a power of two). Sized by the bank
instead, one busy adapter of a 32-slot bank launched 8 programs per split where 1 works (H100,
Qwen3-8B, 64 rows: 8.52 against 8.25 ms a step, the shrinks and expands 0.28 ms of it). Groups
known to be zero (slot 0, with ``skip_first``) and padding rows (from ``n_rows[0]`` on, an int32
device scalar) are skipped too. Launch grids and block sizes depend only on tensor shapes and that
host bound, never on the contents of ``offsets``
(nothing is read back on the host), so both kernels can be captured in a CUDA graph. ``h`` is kept
in fp32 (the K-reduction is accumulated and summed in fp32; the atomic adds make its last bits
depend on the order the splits land in); the expand
rounds it to ``B``'s dtype for the tensor-core product (as the two bf16 grouped products do).

:func:`lora_delta_add` runs one module's delta (shrink + expand), falling back to two
:func:`grouped_linear` calls and an add where Triton cannot run (CPU without ``TRITON_INTERPRET=1``,
no Triton); the benchmarks and tests use it. The static decoder
(:class:`ember.core.sampling.static_route.StaticRoute`) calls :func:`lora_shrink` and
:func:`lora_expand_add` itself, because one shrink serves a whole shared-input group and the
active-slot list is computed once per step.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch

from ember.core.kernels import fused, pdl
from ember.core.kernels.grouped import grouped_linear

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _group_rows(OFFS, ROWS, g, HAS_ROWS: tl.constexpr):
        # rows [start, end) of group g; group 0 starts at row 0. Rows from ROWS[0] on are padding.
        g = g + tl.zeros([], tl.int32)  # a tensor also where the loop index is a Python int (interpreter)
        start = tl.where(g > 0, tl.load(OFFS + tl.maximum(g - 1, 0)), 0)
        end = tl.load(OFFS + g)
        if HAS_ROWS:
            n = tl.load(ROWS)
            start = tl.minimum(start, n)
            end = tl.minimum(end, n)
        return start, end

    @triton.jit
    def _block_groups(OFFS, ROWS, ACTIVE, N_ACTIVE, m0, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr,
                      HAS_ROWS: tl.constexpr):
        # the active groups with rows in [m0, m0 + BLOCK_M): positions first..last of the active
        # list (rows are sorted by group, so they are consecutive there), with every active group's
        # id and rows as vectors, loaded at once rather than walked group by group
        j = tl.arange(0, G_PAD)
        live = j < tl.load(N_ACTIVE)
        gv = tl.load(ACTIVE + j, mask=live, other=0)
        ev = tl.load(OFFS + gv, mask=live, other=0)
        sv = tl.where(gv > 0, tl.load(OFFS + tl.maximum(gv - 1, 0), mask=live, other=0), 0)
        if HAS_ROWS:
            n = tl.load(ROWS)
            sv = tl.minimum(sv, n)
            ev = tl.minimum(ev, n)
        hit = live & (ev > sv) & (ev > m0) & (sv < m0 + BLOCK_M)
        first = tl.min(tl.where(hit, j, G_PAD), axis=0)
        last = tl.max(tl.where(hit, j, -1), axis=0)
        return j, gv, sv, ev, first, last

    @triton.jit
    def _group_at(j, gv, sv, ev, i, rows):
        # entry i of _block_groups' vectors (no load): the group's id and which of ``rows`` are its
        sel = j == i
        start = tl.sum(tl.where(sel, sv, 0), axis=0)
        end = tl.sum(tl.where(sel, ev, 0), axis=0)
        return tl.sum(tl.where(sel, gv, 0), axis=0), (rows >= start) & (rows < end)

    @triton.jit
    def _lora_shrink_kernel(
        X, A, H, OFFS, ROWS, ACTIVE, N_ACTIVE,
        stride_xm, stride_ag, stride_ar, stride_hm,
        K, R,
        HAS_ROWS: tl.constexpr, GSTRIDE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, R_BLOCK: tl.constexpr, PREC: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = k < K
        r = tl.program_id(2) * R_BLOCK + tl.arange(0, R_BLOCK)
        rmask = r < R
        # program (j, s, rb) serves the active groups j, j + GSTRIDE, ... of the list (configured
        # but unused slots cost nothing): columns [s · BLOCK_K, (s + 1) · BLOCK_K) of the rank rows of
        # block rb, added to h once per row block. Its first group's rows and slice of A are loaded
        # before the wait (kernels.pdl, "read early": the list, the offsets and the factors are
        # written before the step or at its start, never by the kernel just before)
        n_active = tl.load(N_ACTIVE)
        nxt = tl.program_id(0) + tl.zeros([], tl.int32)
        g = tl.load(ACTIVE + nxt, mask=nxt < n_active, other=0)
        start, end = _group_rows(OFFS, ROWS, g, HAS_ROWS)
        a_ptr = A + g.to(tl.int64) * stride_ag + r[:, None] * stride_ar + k[None, :]
        a = tl.load(a_ptr, mask=(rmask & (r * 0 + nxt < n_active))[:, None] & kmask[None, :], other=0.0)
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        for i in range(tl.program_id(0), n_active, GSTRIDE):
            for m0 in range(start, end, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                mmask = rows < end
                x_ptr = X + rows.to(tl.int64)[:, None] * stride_xm + k[None, :]
                x = tl.load(x_ptr, mask=mmask[:, None] & kmask[None, :], other=0.0)
                acc = tl.dot(x.to(a.dtype), tl.trans(a), input_precision=PREC)  # [BLOCK_M, R_BLOCK] fp32
                h_ptr = H + rows.to(tl.int64)[:, None] * stride_hm + r[None, :]
                tl.atomic_add(h_ptr, acc, mask=mmask[:, None] & rmask[None, :], sem="relaxed")
            nxt = i + GSTRIDE  # the next group's rows and factors, loaded while this one's products land
            g = tl.load(ACTIVE + nxt, mask=nxt < n_active, other=0)
            start, end = _group_rows(OFFS, ROWS, g, HAS_ROWS)
            a_ptr = A + g.to(tl.int64) * stride_ag + r[:, None] * stride_ar + k[None, :]
            a = tl.load(a_ptr, mask=(rmask & (r * 0 + nxt < n_active))[:, None] & kmask[None, :], other=0.0)

    @triton.jit
    def _lora_expand_kernel(
        H, B, Y, OFFS, ROWS, ACTIVE, N_ACTIVE, COL0,
        stride_hm, stride_hj, stride_bg, stride_bo, stride_ym,
        N_OUT, R,
        HAS_ROWS: tl.constexpr, GSTRIDE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, R_PAD: tl.constexpr, PREC: tl.constexpr,
        SPLIT: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        ob = tl.program_id(1)
        # SPLIT: B is block-diagonal over a packed group's members; this block of outputs belongs to
        # one member, whose R factor columns start at COL0[ob] (of h and of B)
        c0 = tl.load(COL0 + ob) if SPLIT else 0
        r = c0 + tl.arange(0, R_PAD)
        o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
        rmask = r < c0 + R
        omask = o < N_OUT
        # the active groups as in the shrink kernel; the first one's rows and block of B[g]
        # ([BLOCK_O, R_PAD]) loaded before the wait, as there
        n_active = tl.load(N_ACTIVE)
        nxt = tl.program_id(0) + tl.zeros([], tl.int32)
        g = tl.load(ACTIVE + nxt, mask=nxt < n_active, other=0)
        start, end = _group_rows(OFFS, ROWS, g, HAS_ROWS)
        b_ptr = B + g.to(tl.int64) * stride_bg + o.to(tl.int64)[:, None] * stride_bo + r[None, :]
        b = tl.load(b_ptr, mask=(omask & (o * 0 + nxt < n_active))[:, None] & rmask[None, :], other=0.0)
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        for i in range(tl.program_id(0), n_active, GSTRIDE):
            b_t = tl.trans(b)
            for m0 in range(start, end, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                mmask = rows < end
                # stride_hj: the i-th active group's h starts i · stride_hj columns on (windowed h)
                h_ptr = H + i * stride_hj + rows.to(tl.int64)[:, None] * stride_hm + r[None, :]
                h = tl.load(h_ptr, mask=mmask[:, None] & rmask[None, :], other=0.0).to(b.dtype)
                d = tl.dot(h, b_t, input_precision=PREC)  # [BLOCK_M, BLOCK_O] fp32
                y_ptr = Y + rows.to(tl.int64)[:, None] * stride_ym + o[None, :]
                ymask = mmask[:, None] & omask[None, :]
                y = tl.load(y_ptr, mask=ymask, other=0.0).to(tl.float32)
                tl.store(y_ptr, (y + d).to(Y.dtype.element_ty), mask=ymask)
            nxt = i + GSTRIDE  # the next group's rows and block of B, as in the shrink kernel
            g = tl.load(ACTIVE + nxt, mask=nxt < n_active, other=0)
            start, end = _group_rows(OFFS, ROWS, g, HAS_ROWS)
            b_ptr = B + g.to(tl.int64) * stride_bg + o.to(tl.int64)[:, None] * stride_bo + r[None, :]
            b = tl.load(b_ptr, mask=(omask & (o * 0 + nxt < n_active))[:, None] & rmask[None, :], other=0.0)

_STATE = {"ok": True}
# programs per split across the groups (each walks every GROUP_PROGRAMS-th group): bounds the launch
# size for a bank of many slots while a few busy adapters still run side by side. 8 against 4, at
# 256 rows over 8 busy adapters (H100, bench/lora_decode.py; 36 layers' shrinks and expands that a
# decode step launches): 1,566 against 1,773 us a step; one busy adapter has one program either way
GROUP_PROGRAMS = 8
_TILE = 8192  # elements of the largest register tile (weights slice, rows block) of one program


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def groups_pad(active: ActiveGroups) -> int:
    """``G_PAD`` of :func:`_block_groups`: the bound on the active groups as a power of two."""
    return max(2, _pow2(active.bound))


def _prec(t: torch.Tensor) -> str:
    # fp32 stacks: exact fp32 products (no TF32), as the fallback's fp32 matmuls; ignored for bf16/fp16
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _rows_block(n: int, r_pad: int) -> int:
    return max(16, min(64, _pow2(n), _TILE // r_pad))


def shrink_config(K: int, R: int, N: int) -> tuple[int, int]:
    """The shrink's ``(block_k, r_block)`` for ``N`` rows: each program multiplies ``block_k``
    columns for ``r_block`` rank rows and adds them to ``h`` once per row block, so ``K / block_k``
    splits each add ``N × R`` values into ``h``.

    Measured at Qwen3-8B's four projections (``bench/lora_decode.py``, H100): at 64 rows, 128-column
    splits with 16 rank rows per program were the fastest or within 2 % of it, and 9 % faster over
    a step than 64-column splits over the whole padded rank. At 256 rows each split's atomic adds
    into ``h`` weigh more: 256-column splits with 32 rank rows took q/k/v's shrinks from 331 to
    243 us a step and down's from 325 to 276 (o and gate/up within 3 %; 2026-12-06)."""
    r_block = min(max(16, _pow2(R)), 16 if N <= 64 else 32)
    return min(128 if N <= 64 else 256, _TILE // r_block), r_block


def expand_block(n_out: int, R: int, N: int) -> int:
    """The expand's output columns per program. At 64 rows or fewer: about 64 programs of 32..128
    columns. More rows make each program's pass over them longer, so wider blocks (fewer programs,
    ``B`` tiles up to 16K values) paid: 13 % over a step of 256 rows (``bench/lora_decode.py``, H100)."""
    r_pad = max(16, _pow2(R))
    if N <= 64:
        return max(16, min(128, max(32, _pow2(triton.cdiv(n_out, 64))), _TILE // r_pad))
    return max(16, min(256, max(64, _pow2(n_out // 48 + 1) // 2), 2 * _TILE // r_pad))


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or offsets.shape != (w.shape[0],):
        raise ValueError(f"lora decode kernels: bad shapes x {tuple(x.shape)}, w {tuple(w.shape)}, offsets {tuple(offsets.shape)}")
    if w.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("lora decode kernels need unit stride along the last dimension")


class ActiveGroups(NamedTuple):
    """The groups with rows (:func:`active_groups`): ``ids``, int32 ``[G]``, lists them first (the
    entries after them are unused); ``count``, int32 ``[1]``, is how many there are, on the device;
    ``bound`` is a host-known bound on ``count`` that sizes the launches (programs per split, the
    group vectors' width). A ``count`` above ``bound`` is a caller's error: the kernels' group
    vectors would miss the groups past it."""

    ids: torch.Tensor
    count: torch.Tensor
    bound: int


def active_groups(
    offsets: torch.Tensor, n_rows: torch.Tensor | None = None, skip_first: bool = False, bound: int | None = None
) -> ActiveGroups:
    """The groups with rows, in order, and their count: what the kernels walk. Device ops only (no
    host read, no sort), so a CUDA graph can capture them; compute once per step and pass to every
    call. ``bound``: at most this many groups have rows (the host knows it from the step's rows);
    by default every group that may (all but group 0 with ``skip_first``)."""
    groups = offsets.shape[0] - (1 if skip_first else 0)
    if bound is not None and bound < 0:
        raise ValueError(f"active_groups: a bound of {bound} groups")
    bound = groups if bound is None else min(bound, groups)
    ends = offsets if n_rows is None else torch.minimum(offsets, n_rows)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    has = ends > starts
    if skip_first:
        has[:1].fill_(False)  # a kernel, not a host-to-device copy (graph capture)
    # the i-th active group is the first position where the running count of active groups
    # reaches i + 1 (searchsorted: no sort, no host sync, so CUDA graphs capture it)
    count = torch.cumsum(has.to(torch.int32), 0, dtype=torch.int32)
    want = torch.arange(1, has.shape[0] + 1, dtype=torch.int32, device=offsets.device)
    order = torch.searchsorted(count, want, out_int32=True).clamp_max(has.shape[0] - 1)
    return ActiveGroups(order, count[-1:], bound)


def lora_shrink(
    x: torch.Tensor,
    A: torch.Tensor,
    offsets: torch.Tensor,
    n_rows: torch.Tensor | None = None,
    skip_first: bool = False,
    out: torch.Tensor | None = None,
    active: ActiveGroups | None = None,
    config: tuple[int, int] | None = None,
    group_programs: int | None = None,
) -> torch.Tensor:
    """``h[rows of g] = x[rows of g] @ A[g].T`` in fp32 (``x`` ``[N, in]``, ``A`` ``[G, r, in]``) ->
    ``[N, r]``. Rows of no group, rows from ``n_rows[0]`` on (an int32 device scalar, optional) and,
    with ``skip_first``, rows of group 0 (whose factors must then be zeros) are left at zero.
    ``out``: a zeroed fp32 ``[N, r]`` tensor (unit stride along r) to accumulate into. ``active``:
    :func:`active_groups` of these arguments (computed here when not given). ``config``: ``(block_k,
    r_block)`` instead of :func:`shrink_config`'s, ``group_programs`` instead of
    :data:`GROUP_PROGRAMS` (the benchmark sweeps them)."""
    _check(x, A, offsets)
    N, K = x.shape
    G, R, _ = A.shape
    if out is None:
        h = torch.zeros(N, R, dtype=torch.float32, device=x.device)
    elif out.shape != (N, R) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"lora_shrink: out must be fp32 [{N}, {R}] with unit stride, got {out.dtype} {tuple(out.shape)}")
    else:
        h = out
    first = 1 if skip_first else 0
    if N == 0 or G <= first:
        return h
    block_k, r_block = config or shrink_config(K, R, N)
    block_m = _rows_block(N, r_block)
    active = active if active is not None else active_groups(offsets, n_rows, skip_first)
    if active.bound == 0:  # no group has rows
        return h
    gstride = min(active.bound, group_programs or GROUP_PROGRAMS)
    grid = (gstride, triton.cdiv(K, block_k), triton.cdiv(R, r_block))
    _lora_shrink_kernel[grid](
        x, A, h, offsets, n_rows if n_rows is not None else offsets, active.ids, active.count,
        x.stride(0), A.stride(0), A.stride(1), h.stride(0),
        K, R,
        HAS_ROWS=n_rows is not None, GSTRIDE=gstride,
        BLOCK_M=block_m, BLOCK_K=block_k, R_BLOCK=r_block, PREC=_prec(A), num_warps=4,
        **pdl.options(),
        num_stages=1,  # pipelined, the group and row loops asked for more shared memory than an SM has (H100)
    )
    return h


def lora_expand_add(
    y: torch.Tensor,
    h: torch.Tensor,
    B: torch.Tensor,
    offsets: torch.Tensor,
    n_rows: torch.Tensor | None = None,
    skip_first: bool = False,
    active: ActiveGroups | None = None,
    block_o: int | None = None,
    group_programs: int | None = None,
    splits: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """``y[rows of g] += h[rows of g] @ B[g].T`` in place (``h`` ``[N, r]``, ``B`` ``[G, out, r]``,
    ``y`` ``[N, out]`` of any float dtype: the sum is formed in fp32 and rounded once); rows skipped
    as in :func:`lora_shrink` are left untouched. ``block_o`` and ``group_programs`` replace
    :func:`expand_block`'s and :data:`GROUP_PROGRAMS` (the benchmark sweeps them). ``splits``: the
    output widths of a packed group's members when ``B`` is block-diagonal over them (member ``j``'s
    outputs take only factor columns ``[j·r/m, (j+1)·r/m)``, zeros elsewhere, as
    :class:`~ember.core.sampling.lora_stacks.LoraStacks` packs them): each block of outputs then
    multiplies only its member's columns, ``1/m`` of the factor bytes.

    ``h`` may also be *windowed*, ``[N, P, r]``: the ``i``-th active group's rows then read
    ``h[:, i]`` (the shrink carried out by the base product, one window of columns per active group
    in the order of ``active``, :class:`~ember.core.sampling.packed_linears.PackedLinears`); ``P``
    must be at least ``active.bound``. Returns ``y``."""
    windowed = h.dim() == 3
    if windowed:
        if active is None or h.shape[1] < active.bound:
            raise ValueError(f"lora_expand_add: a windowed h {tuple(h.shape)} needs active groups bounded by its "
                             f"{h.shape[1]} windows")
        _check(h[:, 0], B, offsets)
    else:
        _check(h, B, offsets)
    if y.dim() != 2 or y.stride(-1) != 1 or y.shape != (h.shape[0], B.shape[1]):
        raise ValueError(f"lora_expand_add: y {tuple(y.shape)} does not match h {tuple(h.shape)}, B {tuple(B.shape)}")
    N, R = h.shape[0], h.shape[-1]
    G, n_out, _ = B.shape
    first = 1 if skip_first else 0
    if N == 0 or G <= first or n_out == 0:
        return y
    unit = 0  # with splits: the largest power of two dividing every member's width
    if splits is not None and len(splits) > 1:
        if sum(splits) != n_out or R % len(splits):
            raise ValueError(f"lora_expand_add: splits {splits} for {n_out} outputs and {R} factor columns")
        unit = math.gcd(*splits) & -math.gcd(*splits)
    split = unit >= 16  # else a block would straddle members: the whole of B
    if split:
        R //= len(splits)
    r_pad = max(16, _pow2(R))
    block_o = block_o or expand_block(n_out, R, N)
    col0 = None
    if split:
        block_o = min(block_o, unit)  # every block inside one member
        col0 = _member_columns(tuple(splits), R, block_o, y.device)
    block_m = _rows_block(N, r_pad)
    block_m = max(16, min(block_m, _TILE // block_o))  # the [BLOCK_M, BLOCK_O] delta tile
    active = active if active is not None else active_groups(offsets, n_rows, skip_first)
    if active.bound == 0:  # no group has rows
        return y
    gstride = min(active.bound, group_programs or GROUP_PROGRAMS)
    grid = (gstride, triton.cdiv(n_out, block_o))
    _lora_expand_kernel[grid](
        h, B, y, offsets, n_rows if n_rows is not None else offsets, active.ids, active.count,
        col0 if col0 is not None else offsets,
        h.stride(0), h.stride(1) if windowed else 0, B.stride(0), B.stride(1), y.stride(0),
        n_out, R,
        HAS_ROWS=n_rows is not None, GSTRIDE=gstride,
        BLOCK_M=block_m, BLOCK_O=block_o, R_PAD=r_pad, PREC=_prec(B), SPLIT=col0 is not None, num_warps=4,
        **pdl.options(),
    )
    return y


@functools.lru_cache(maxsize=64)
def _member_columns(splits: tuple[int, ...], rank: int, block_o: int, device: torch.device) -> torch.Tensor:
    """For each ``block_o`` block of a packed group's outputs (members of ``splits`` outputs, each
    with ``rank`` factor columns), the first factor column of its member: int32 on ``device``."""
    cols = [j * rank for j, n in enumerate(splits) for _ in range(n // block_o)]
    return torch.tensor(cols, dtype=torch.int32, device=device)


def lora_delta_torch(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The reference delta: two grouped products (``x.dtype``)."""
    return grouped_linear(grouped_linear(x, A, offsets), B, offsets)


def triton_ok(*tensors: torch.Tensor) -> bool:
    """Whether :func:`lora_delta_add` takes the Triton path for these (floating) tensors."""
    return (
        _STATE["ok"]
        and fused.use_triton(*tensors)
        and all(t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors)
    )


def lora_delta_add(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    offsets: torch.Tensor,
    n_rows: torch.Tensor | None = None,
    skip_first: bool = False,
) -> torch.Tensor:
    """``y + x[rows of g] @ A[g].T @ B[g].T`` for every group ``g`` (``x`` ``[..., in]``, ``y``
    ``[..., out]``). The Triton path adds into ``y`` in place (and returns it); the fallback returns
    ``y + delta`` (two grouped products). ``n_rows`` (int32 device scalar) and ``skip_first`` (group 0
    has zero factors) only let the Triton path skip rows whose delta is zero or unused (padding)."""
    if triton_ok(y, x, A, B) and fused.use_triton(offsets):
        try:
            x2 = x.reshape(-1, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            y2 = y.view(-1, y.shape[-1]) if y.is_contiguous() else None
            if y2 is not None:
                h = lora_shrink(x2, A, offsets, n_rows, skip_first)
                lora_expand_add(y2, h, B, offsets, n_rows, skip_first)
                return y
        except Exception as e:  # e.g. a GPU/Triton combination the kernels were never compiled for
            if fused.INTERPRET:
                raise
            _STATE["ok"] = False
            warnings.warn(f"LoRA decode kernels failed ({type(e).__name__}: {e}); using grouped products", stacklevel=2)
    return y + lora_delta_torch(x, A, B, offsets)
