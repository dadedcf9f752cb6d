"""Triton kernels that sample a token per row and return its logprob (the plain rows of
:func:`ember.core.sampling.logits.sample_tokens`: greedy, or temperature without top-k/top-p).

Each row of the logits ``z`` (``[B, V]`` fp32, softcap already applied) is cut into ``S`` chunks of
whole ``BLOCK``-token blocks, and two launches draw the token:

1. ``_partials``, program ``(b, s)``: chunk ``s`` of row ``b``: its maximum ``m_s`` and first
   argmax, ``sum exp(z - m_s)`` (for the logprob at temperature 1) and its mass at temperature
   ``T``, ``w_s = sum exp((z - m_s) / T)`` (block sums in fp32, added in fp64);
2. ``_finish``, program ``b``: combines the chunks (the log-sum-exp, the first argmax for greedy
   rows, ``W = sum_s w_s exp((m_s - m) / T)``), finds the chunk where the cumulative mass reaches
   ``u · W`` (``u`` in (0, 1), the row's uniform number), and scans that chunk's blocks again,
   with the same block sums, for the first token that reaches it.

This is the inverse-CDF draw of the fp64 PyTorch version (:func:`~ember.core.sampling.logits.
_invert_cdf`) in two launches instead of a dozen and without ``[B, V]`` fp64 intermediates; the two
pick the same token unless ``u`` falls within rounding distance of a boundary of the cumulative
distribution. Each row depends only on its own logits, temperature and ``u`` (the chunking depends
on ``V`` alone), and the launches have static shapes, so the static decoder captures them in its
CUDA graph.
"""

from __future__ import annotations

import torch

from ember.core.kernels import fused, pdl

BLOCK = 2048
CHUNKS = 16  # chunks per row (programs of the first launch per row)

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl

    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _chunk_mass(base, c0, c1, cols, m, inv_t, V, BLOCK: tl.constexpr):
        # sum over the blocks of [c0, c1) of exp((z - m) * inv_t): fp32 block sums added in fp64
        total = tl.zeros([], tl.float64)
        for v0 in range(c0, c1, BLOCK):
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < V, other=float("-inf"))
            p = tl.where(x > float("-inf"), tl.exp((x - m) * inv_t), 0.0)
            total += tl.sum(p, axis=0).to(tl.float64)
        return total

    @triton.jit
    def _partials(Z, INV_T, M, E1, ARG, W, stride_z, V, CHUNK, S, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        s = tl.program_id(1)
        base = Z + row.to(tl.int64) * stride_z
        cols = tl.arange(0, BLOCK)
        c0 = s * CHUNK
        c1 = tl.minimum(c0 + CHUNK, V)
        neg_inf = float("-inf")
        m = tl.full([], neg_inf, tl.float32)
        e1 = tl.zeros([], tl.float32)
        best = tl.zeros([], tl.int32) + c0
        for v0 in range(c0, c1, BLOCK):
            idx = v0 + cols
            x = tl.load(base + idx, mask=idx < c1, other=neg_inf)
            bm = tl.max(x, axis=0)
            barg = tl.min(tl.where(x == bm, idx, V), axis=0)
            best = tl.where(bm > m, barg, best)
            m_new = tl.maximum(m, bm)
            p = tl.where(x > neg_inf, tl.exp(x - m_new), 0.0)
            e1 = e1 * tl.where(m > neg_inf, tl.exp(m - m_new), 0.0) + tl.sum(p, axis=0)
            m = m_new
        inv_t = tl.load(INV_T + row).to(tl.float32)
        w = tl.zeros([], tl.float64)
        if (inv_t > 0) & (m > neg_inf):
            w = _chunk_mass(base, c0, c1, cols, m, inv_t, c1, BLOCK)
        out = row * S + s
        tl.store(M + out, m)
        tl.store(E1 + out, e1)
        tl.store(ARG + out, best)
        tl.store(W + out, w)

    @triton.jit
    def _finish(Z, INV_T, U, M, E1, ARG, W, TOK, LP, stride_z, V, CHUNK, S,
                S_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        base = Z + row.to(tl.int64) * stride_z
        neg_inf = float("-inf")
        sidx = tl.arange(0, S_PAD)
        smask = sidx < S
        ms = tl.load(M + row * S + sidx, mask=smask, other=neg_inf)
        m = tl.max(ms, axis=0)
        scale1 = tl.where(ms > neg_inf, tl.exp(ms - m), 0.0)
        lse = m + tl.log(tl.sum(tl.load(E1 + row * S + sidx, mask=smask, other=0.0) * scale1, axis=0))
        # greedy: the first chunk holding the maximum, its first argmax
        first_chunk = tl.min(tl.where(ms == m, sidx, S_PAD), axis=0)
        tok = tl.load(ARG + row * S + first_chunk)
        inv_t = tl.load(INV_T + row).to(tl.float32)
        if inv_t > 0:
            scale = tl.where(ms > neg_inf, tl.exp((ms - m) * inv_t), 0.0).to(tl.float64)
            w = tl.load(W + row * S + sidx, mask=smask, other=0.0) * scale
            cum = tl.cumsum(w, axis=0)
            target = tl.load(U + row).to(tl.float64) * tl.sum(w, axis=0)
            # the chunk where the cumulative mass reaches the target (the last one with mass if
            # rounding leaves the target above the sum)
            last_chunk = tl.max(tl.where(w > 0, sidx, -1), axis=0)
            c = tl.minimum(tl.min(tl.where((cum >= target) & (w > 0), sidx, S_PAD), axis=0), last_chunk)
            before = tl.sum(tl.where(sidx < c, w, 0.0), axis=0)
            m_c = tl.load(M + row * S + c)
            sc = tl.exp((m_c - m) * inv_t).to(tl.float64)
            local = (target - before) / sc  # the target in the chunk's own scale
            c0 = c * CHUNK
            c1 = tl.minimum(c0 + CHUNK, V)
            cols = tl.arange(0, BLOCK)
            acc = tl.zeros([], tl.float64)
            found = tl.zeros([], tl.int32)
            for v0 in range(c0, c1, BLOCK):
                if found == 0:
                    idx = v0 + cols
                    x = tl.load(base + idx, mask=idx < c1, other=neg_inf)
                    p = tl.where(x > neg_inf, tl.exp((x - m_c) * inv_t), 0.0)
                    bsum = tl.sum(p, axis=0).to(tl.float64)
                    if (acc + bsum >= local) | (v0 + BLOCK >= c1):
                        cs = acc + tl.cumsum(p, axis=0).to(tl.float64)
                        hit = tl.min(tl.where(cs >= local, idx, V), axis=0)
                        # rounding may leave the in-block sum below the target: never past the
                        # block's last token with mass
                        last = tl.max(tl.where(p > 0, idx, -1), axis=0)
                        tok = tl.where(last >= 0, tl.minimum(hit, last), tok)
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
    if B == 0:
        return tok, lp
    chunk = BLOCK * triton.cdiv(triton.cdiv(V, CHUNKS), BLOCK)
    S = triton.cdiv(V, chunk)
    m = torch.empty(B, S, dtype=torch.float32, device=z.device)
    e1 = torch.empty_like(m)
    arg = torch.empty(B, S, dtype=torch.int32, device=z.device)
    w = torch.empty(B, S, dtype=torch.float64, device=z.device)
    _partials[(B, S)](z, inv_temperature, m, e1, arg, w, z.stride(0), V, chunk, S, BLOCK=BLOCK, num_warps=8,
                      **pdl.options())
    _finish[(B,)](z, inv_temperature, u, m, e1, arg, w, tok, lp, z.stride(0), V, chunk, S,
                  S_PAD=max(2, triton.next_power_of_2(S)), BLOCK=BLOCK, num_warps=8, **pdl.options())
    return tok, lp


def available(z: torch.Tensor) -> bool:
    """Whether :func:`sample_rows` runs for logits ``z`` (CUDA, or the Triton interpreter)."""
    return fused.use_triton(z)
