"""A grouped weight gradient whose second operand is gathered by row index (Triton).

An MoE layer's gate/up projection multiplies the layer's input rows gathered in expert order,
``xs = x[index]`` (``[T·k, H]``: each token ``k`` times). The gradient of its LoRA shrink factor is
``gA[g] = a[rows of g].T @ xs[rows of g]`` with ``a`` the shrunk rows' gradient (``[T·k, r]``).
Through ``torch._grouped_mm`` that needs ``xs`` again in the backward: a gather that writes
``[T·k, H]`` and a product that reads it back, besides the gather's own read of ``x``'s rows.
:func:`wgrad_gathered` reads ``x``'s rows by index inside the product: one program per (column
block, group) walks its group's rows, loads their ``a`` rows and their ``x`` rows (through
``index``) and sums ``a.T @ x`` in fp32, rounded once. At Qwen3-Next's training shape (163,840
rows, hidden 2048, 512 experts, rank 32) the gather and the product took 0.4 + 0.34 ms a layer on
an H100 (profile of 2026-12-06); the kernel moves a third of their bytes. Under
``TRITON_INTERPRET=1`` it runs on the CPU (the tests).
"""

from __future__ import annotations

import torch

from ember.core.kernels import fused

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _wgrad_gathered(A, X, IDX, OUT, OFFS, R, n_cols, stride_am, stride_xm, stride_og, stride_or,
                        R_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        g = tl.program_id(1)
        start = tl.where(g > 0, tl.load(OFFS + tl.maximum(g - 1, 0)), 0)
        end = tl.load(OFFS + g)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, R_PAD)
        cmask = cols < n_cols
        rmask = r < R
        acc = tl.zeros((BLOCK_N, R_PAD), tl.float32)  # out[g].T: the columns as the product's M (wgmma)
        for m0 in range(start, end, BLOCK_K):
            m = m0 + tl.arange(0, BLOCK_K)
            mmask = m < end
            a = tl.load(A + m.to(tl.int64)[:, None] * stride_am + r[None, :], mask=mmask[:, None] & rmask[None, :],
                        other=0.0)
            src = tl.load(IDX + m, mask=mmask, other=0).to(tl.int64)
            x = tl.load(X + src[:, None] * stride_xm + cols[None, :], mask=mmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.dot(tl.trans(x), a, input_precision="ieee" if x.dtype == tl.float32 else "tf32")
        out = OUT + g.to(tl.int64) * stride_og + r[:, None] * stride_or + cols[None, :]
        tl.store(out, tl.trans(acc).to(OUT.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


CONFIG = (32, 128, 4)  # a program's rows a step and columns, and its warps (ranks up to 32)
R_MAX = 128  # ranks the kernel takes (the [rank, columns] fp32 sum stays in registers)


def available(a: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether :func:`wgrad_gathered` runs as the kernel on these operands."""
    return (fused.use_triton(a, x) and a.dim() == 2 and x.dim() == 2 and a.dtype == x.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and a.stride(-1) == 1 and x.stride(-1) == 1 and a.shape[1] <= R_MAX)


def wgrad_gathered(a: torch.Tensor, x: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor,
                   out_dtype: torch.dtype | None = None,
                   config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``out[g] = a[rows of g].T @ x[index[rows of g]]`` (``[G, r, H]``) for ``a`` ``[N, r]``, ``x``
    ``[T, H]``, ``index`` ``[N]`` (rows of ``x``) and ``offsets`` int32 ``[G]`` cumulative row ends;
    empty groups give zeros, rows past ``offsets[-1]`` are not read. Summed in fp32, rounded once to
    ``out_dtype`` (default ``a``'s). ``config``: ``(block_k, block_n, num_warps)`` instead of
    :data:`CONFIG` (the GPU check sweeps them)."""
    N, R = a.shape
    n_cols = x.shape[1]
    G = offsets.shape[0]
    if index.shape != (N,) or offsets.dim() != 1:
        raise ValueError(f"wgrad_gathered: a {tuple(a.shape)}, index {tuple(index.shape)}, "
                         f"offsets {tuple(offsets.shape)} do not match")
    out = torch.empty(G, R, n_cols, dtype=out_dtype or a.dtype, device=a.device)
    if G == 0 or R == 0 or n_cols == 0:
        return out
    r_pad = max(16, triton.next_power_of_2(R))
    block_k, block_n, warps = config or ((*CONFIG[:2], 8) if r_pad > 32 else CONFIG)
    grid = (triton.cdiv(n_cols, block_n), G)
    _wgrad_gathered[grid](a, x, index, out, offsets.to(torch.int32), R, n_cols,
                          a.stride(0), x.stride(0), out.stride(0), out.stride(1),
                          R_PAD=r_pad, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=warps)
    return out
