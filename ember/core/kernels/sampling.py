"""One Triton kernel that samples a token per row and returns its logprob (the plain rows of
:func:`ember.core.sampling.logits.sample_tokens`: greedy, or temperature without top-k/top-p).

Program ``b`` owns row ``b`` of the logits ``z`` (``[B, V]`` fp32, softcap already applied) and
reads it three times in blocks of ``BLOCK`` tokens (the rows of a decode batch stay in L2 between
passes):

1. online maximum and log-sum-exp at temperature 1 (the token's logprob, as the trainer defines
   it) and the first index of the maximum (greedy);
2. the total mass ``S = sum exp((z - max) / T)``, block sums in fp32 added in fp64;
3. the first token whose cumulative mass reaches ``u * S`` (``u`` in (0, 1), the row's uniform
   number): the same block sums, added in the same order, find the block; an in-block cumulative
   sum finds the token.

This is the inverse-CDF draw of the fp64 PyTorch version (:func:`~ember.core.sampling.logits.
_invert_cdf`), one launch instead of a dozen and no ``[B, V]`` fp64 intermediates; the two pick
the same token unless ``u`` falls within rounding distance of a boundary of the cumulative
distribution. Each row depends only on its own logits, temperature and ``u``, and the launch has
static shapes, so the static decoder captures it in its CUDA graph.
"""

from __future__ import annotations

import torch

from ember.core.kernels import fused

BLOCK = 2048

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _sample_kernel(Z, INV_T, U, TOK, LP, stride_z, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = Z + row.to(tl.int64) * stride_z
        cols = tl.arange(0, BLOCK)
        inv_t = tl.load(INV_T + row).to(tl.float32)  # 0: greedy
        neg_inf = float("-inf")

        # pass 1: max, log-sum-exp at T = 1, first index of the max
        m = tl.full([], neg_inf, tl.float32)
        s = tl.zeros([], tl.float32)
        best = tl.zeros([], tl.int32)
        for v0 in range(0, V, BLOCK):
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < V, other=neg_inf)
            bm = tl.max(x, axis=0)
            barg = tl.min(tl.where(x == bm, idx, V), axis=0)
            best = tl.where(bm > m, barg, best)
            m_new = tl.maximum(m, bm)
            p = tl.where(x > neg_inf, tl.exp(x - m_new), 0.0)
            s = s * tl.where(m > neg_inf, tl.exp(m - m_new), 0.0) + tl.sum(p, axis=0)
            m = m_new
        lse = m + tl.log(s)

        tok = best
        if inv_t > 0:
            mt = m * inv_t
            # pass 2: total mass at temperature T
            total = tl.zeros([], tl.float64)
            for v0 in range(0, V, BLOCK):
                idx = v0 + cols
                x = tl.load(base + idx, mask=idx < V, other=neg_inf)
                p = tl.where(x > neg_inf, tl.exp(x * inv_t - mt), 0.0)
                total += tl.sum(p, axis=0).to(tl.float64)
            # pass 3: the first token whose cumulative mass reaches u * total
            target = tl.load(U + row).to(tl.float64) * total
            acc = tl.zeros([], tl.float64)
            found = tl.zeros([], tl.int32)
            for v0 in range(0, V, BLOCK):
                if found == 0:
                    idx = v0 + cols
                    x = tl.load(base + idx, mask=idx < V, other=neg_inf)
                    p = tl.where(x > neg_inf, tl.exp(x * inv_t - mt), 0.0)
                    bsum = tl.sum(p, axis=0).to(tl.float64)
                    if acc + bsum >= target:
                        c = acc + tl.cumsum(p, axis=0).to(tl.float64)
                        first = tl.min(tl.where(c >= target, idx, V), axis=0)
                        # the in-block sum may round below the block sum: never past its last token
                        last = tl.max(tl.where(p > 0, idx, -1), axis=0)
                        tok = tl.minimum(first, last)
                        found = 1
                    acc += bsum
        tl.store(TOK + row, tok.to(tl.int64))
        tl.store(LP + row, tl.load(base + tok) - lse)


def sample_rows(z: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (int64 ``[B]``) and their logprobs at temperature 1 (fp32 ``[B]``) of the rows of
    ``z`` (``[B, V]`` fp32, unit stride along V), each drawn at ``1 / inv_temperature[b]`` with
    uniform number ``u[b]`` (``inv_temperature == 0``: greedy). See the module doc."""
    if z.dim() != 2 or z.dtype != torch.float32 or z.stride(-1) != 1:
        raise ValueError(f"sample_rows needs fp32 [B, V] logits with unit stride, got {z.dtype} {tuple(z.shape)}")
    B, V = z.shape
    tok = torch.empty(B, dtype=torch.long, device=z.device)
    lp = torch.empty(B, dtype=torch.float32, device=z.device)
    if B:
        _sample_kernel[(B,)](z, inv_temperature, u, tok, lp, z.stride(0), V, BLOCK=BLOCK, num_warps=8)
    return tok, lp


def available(z: torch.Tensor) -> bool:
    """Whether :func:`sample_rows` runs for logits ``z`` (CUDA, or the Triton interpreter)."""
    return fused.use_triton(z)
