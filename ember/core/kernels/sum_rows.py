"""Each token's sum of its ``k`` expert rows, of one tensor or of two (Triton).

An MoE layer's outputs come as ``[T·k, H]`` rows sorted by expert: the base product's and, with
LoRA, the correction's. ``out[t] = Σ_j a[inv[t·k + j]] (+ b[inv[t·k + j]])`` reads each row once,
sums in fp32 and rounds once. In PyTorch the same is ``a + b`` (a pass that reads two
``[T·k, H]`` tensors and writes a third), a gather (reads it, writes a fourth) and a reduction
(reads that): about four times the traffic. The same kernel sums the gradient of an MoE layer's
input over its gathered rows (the base product's and the LoRA correction's). Under
``TRITON_INTERPRET=1`` it runs on the CPU (the tests).
"""

from __future__ import annotations

import torch

from ember.core.kernels.fused import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sum_rows(A, B, INV, OUT, n_cols, K: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in range(K):
            r = tl.load(INV + t * K + j).to(tl.int64)
            acc += tl.load(A + r * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                acc += tl.load(B + r * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + t.to(tl.int64) * n_cols + cols, acc.to(OUT.dtype.element_ty), mask=mask)


BLOCK = 1024


def available(rows: torch.Tensor) -> bool:
    """Whether :func:`sum_rows` runs as the kernel on ``rows`` (else PyTorch's ops)."""
    return use_triton(rows)


def sum_rows(a: torch.Tensor, inverse: torch.Tensor, tokens: int, out_dtype: torch.dtype,
             b: torch.Tensor | None = None) -> torch.Tensor:
    """``[tokens, H]``: each token's sum of its rows of ``a`` (plus those of ``b``), in fp32, rounded
    once to ``out_dtype``; ``inverse[t * k + j]`` is the row of token ``t``'s ``j``-th choice."""
    a = a.contiguous()
    b = b.contiguous() if b is not None else None
    n_cols = a.shape[1]
    k = inverse.numel() // tokens if tokens else 1
    out = torch.empty(tokens, n_cols, dtype=out_dtype, device=a.device)
    if tokens == 0 or n_cols == 0:
        return out
    grid = (tokens, triton.cdiv(n_cols, BLOCK))
    _sum_rows[grid](a, b if b is not None else a, inverse.contiguous(), out, n_cols, K=k, HAS_B=b is not None,
                    BLOCK=BLOCK)
    return out
