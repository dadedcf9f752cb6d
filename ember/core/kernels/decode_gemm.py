"""A GEMM for the few rows of a decode step: ``y = x @ W.T (+ bias) (+ each row's LoRA expand)``.

A decode step's products are memory-bound: ``x`` has 64..256 rows, so streaming ``W`` (``[N, K]``,
read once) is all their cost. cuBLAS reaches about 2.5 of the H100's 3.0 TB/s on them (the fourth
session's profile), and the LoRA expand that follows each one is a launch of its own (~3.5 us at
these sizes, mostly latency). This kernel is built for that shape:

* **Weight-major tiles.** Program ``(m, n, s)`` multiplies ``W[n·BLOCK_N : (n+1)·BLOCK_N]`` (the
  MMA's long side) by the transposed rows ``x[m·BLOCK_M : ...]`` over its share of ``K``
  (``tl.dot(w, x.T)``, ``[BLOCK_N, BLOCK_M]`` in fp32), as cuBLAS lays out its decode tiles.
* **Split K** (``SPLIT_K`` > 1) where ``N / BLOCK_N`` tiles would leave SMs idle: each split adds
  its partial tile into an fp32 workspace with atomic adds and counts itself in; the last split of a
  tile to arrive reads the sum back, resets the workspace and its counter to zero (so the next call,
  or the next replay of a CUDA graph, finds them clean) and runs the epilogue.
* **The epilogue** adds the bias and, with ``LORA``, each row group's ``h[rows] @ B[g][cols].T`` (the
  LoRA expand of :mod:`ember.core.kernels.lora_decode`: ``h`` the fp32 shrink output rounded to
  ``B``'s dtype, groups listed by :func:`~ember.core.kernels.lora_decode.active_groups`) to the
  fp32 tile and rounds once. The separate expand rounded the base product to bf16 first, then the
  sum: these values differ from it by that one rounding.
* **Programmatic dependent launch** (:mod:`ember.core.kernels.pdl`): the weights do not depend on
  the kernel before this one, so with ``PREFETCH`` a program first asks the copy engine to fetch
  the first ``PREFETCH`` bytes of each of its weight rows into L2 (``cp.async.bulk.prefetch.L2``),
  and only then waits for its predecessor.

:func:`decode_linear` picks the launch configuration (:func:`config`) and checks shapes;
:func:`supported` says where it can run. The split-K workspace (:class:`Workspace`) belongs to the
caller, so CUDA graphs keep pointing at live memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ember.core.kernels import fused, pdl

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ember.core.kernels.lora_decode import _group_rows
    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _decode_gemm_kernel(
        X, W, Y, BIAS, WS, CNT,
        H, B, OFFS, ROWS, ACTIVE, N_ACTIVE, XD, WD,
        M, N, K,
        stride_xm, stride_wn, stride_ym, stride_hm, stride_bg, stride_bn, R,
        HAS_BIAS: tl.constexpr, LORA: tl.constexpr, HAS_ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        R_PAD: tl.constexpr, PREFETCH: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        kb = tl.arange(0, BLOCK_K)
        nmask = n < N
        mmask = m < M
        k_split = K // SPLIT_K  # the host checks that BLOCK_K · SPLIT_K divides K
        k0 = pid_k * k_split
        w_ptr = W + n.to(tl.int64)[:, None] * stride_wn + (k0 + kb)[None, :]
        if PREFETCH > 0:  # this program's first weight bytes into L2, before waiting on anything
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                [W + tl.minimum(n, N - 1).to(tl.int64) * stride_wn + k0, tl.full([BLOCK_N], PREFETCH, tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1,
            )
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        x_ptr = X + m.to(tl.int64)[:, None] * stride_xm + (k0 + kb)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kk in range(0, k_split, BLOCK_K):
            if TMA:  # the bulk tensor copy engine; rows past the edges read as zeros
                w = WD.load([pid_n * BLOCK_N, k0 + kk])
                x = XD.load([pid_m * BLOCK_M, k0 + kk])
            else:
                w = tl.load(w_ptr, mask=nmask[:, None], other=0.0)
                x = tl.load(x_ptr, mask=mmask[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=PREC)
            w_ptr += BLOCK_K
            x_ptr += BLOCK_K
        tile_mask = nmask[:, None] & mmask[None, :]
        last = True
        if SPLIT_K > 1:
            # partial sums meet in the fp32 workspace ([N, M] by the tile layout); the last split of
            # this tile to count itself in finishes it and leaves workspace and counter at zero
            ws_ptr = WS + n.to(tl.int64)[:, None] * M + m[None, :]
            tl.atomic_add(ws_ptr, acc, mask=tile_mask, sem="relaxed")
            tile = pid_n * tl.num_programs(0) + pid_m
            arrived = tl.atomic_add(CNT + tile, 1, sem="acq_rel")
            last = arrived == SPLIT_K - 1
            if last:
                # read the sum and leave zeros in one atomic exchange per element (as int32 bits: the
                # interpreter has no float exchange); a load then a store, in two register layouts,
                # raced between the program's threads and lost partial sums (H200)
                bits = tl.atomic_xchg(ws_ptr.to(tl.pointer_type(tl.int32)), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32),
                                      mask=tile_mask, sem="relaxed")
                acc = bits.to(tl.float32, bitcast=True)
                tl.store(CNT + tile, 0)
        if last:
            if HAS_BIAS:
                acc += tl.load(BIAS + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
            if LORA:
                r = tl.arange(0, R_PAD)
                rmask = r < R
                m_lo = pid_m * BLOCK_M
                for i in range(tl.load(N_ACTIVE)):
                    g = tl.load(ACTIVE + i)
                    start, end = _group_rows(OFFS, ROWS, g, HAS_ROWS)
                    if (tl.minimum(end, m_lo + BLOCK_M) > tl.maximum(start, m_lo)) & (end > start):
                        b_ptr = B + g.to(tl.int64) * stride_bg + n.to(tl.int64)[:, None] * stride_bn + r[None, :]
                        b = tl.load(b_ptr, mask=nmask[:, None] & rmask[None, :], other=0.0)
                        sel = (m >= start) & (m < end)
                        h_ptr = H + m.to(tl.int64)[:, None] * stride_hm + r[None, :]
                        h = tl.load(h_ptr, mask=sel[:, None] & rmask[None, :], other=0.0).to(b.dtype)
                        acc = tl.dot(b, tl.trans(h), acc, input_precision=PREC)
            y_ptr = Y + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
            tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=tile_mask)


@dataclass(frozen=True)
class Config:
    """One launch of :func:`decode_linear`: tile sides, the K split, the pipeline depth, warps, and
    the bytes of each weight row prefetched into L2 before the dependency wait (0: none; the
    prefetch is issued only under programmatic dependent launch), and whether the tiles are loaded
    through tensor descriptors (the bulk tensor copy engine, Hopper) instead of pointers."""

    block_n: int = 128
    block_m: int = 64
    block_k: int = 128
    split_k: int = 1
    stages: int = 4
    warps: int = 4
    prefetch: int = 0
    tma: bool = False


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


SMEM = 220 * 1024  # bytes of shared memory a pipeline may take (Hopper's 227 KB a block, less a margin)
SM_SMEM = 228 * 1024  # shared memory of one multiprocessor (Hopper), shared by its resident blocks

# measured launch choices (bench/decode_gemm.py --out writes them, load_tuned reads them): for an
# [N, K] weight, (largest rows, Config or None) pairs by rows; None: cuBLAS was faster there
TUNED: dict[tuple[int, int], list[tuple[int, Config | None]]] = {}


def load_tuned(path) -> None:
    """Read :data:`TUNED` entries from a ``bench/decode_gemm.py --out`` JSON file."""
    import json
    from pathlib import Path

    for r in json.loads(Path(path).read_text())["results"].values():
        entries = TUNED.setdefault((r["N"], r["K"]), [])
        entries.append((r["M"], Config(**r["config"]) if r["use"] else None))
        entries.sort(key=lambda e: e[0])


def wave_fill(M: int, N: int, cfg: Config, sms: int = 132) -> float:
    """How full the launch's last wave of programs is (1: every resident slot busy to the end):
    programs over the waves they take times the slots of a wave, an SM holding as many blocks as
    its shared memory (:data:`SM_SMEM`) fits."""
    slots = sms * max(1, SM_SMEM // ((cfg.block_n + cfg.block_m) * cfg.block_k * 2 * cfg.stages))
    programs = triton.cdiv(N, cfg.block_n) * triton.cdiv(M, cfg.block_m) * cfg.split_k
    return programs / (triton.cdiv(programs, slots) * slots)


def heuristic(M: int, N: int, K: int, sms: int = 132) -> Config:
    """A launch for ``[M, K] x [N, K]^T`` on a GPU of ``sms`` multiprocessors, from a model of a
    memory-bound product: every row in one block up to 128 rows; for each tile width, the deepest
    pipeline up to 4 stages (at least 3) within :data:`SMEM`; and the tile width and K split with
    the fewest bytes (the weight, a third of the rows' re-reads from L2, once per tile column, and
    the split's fp32 partial sums) divided by :func:`wave_fill`. Ties go to fewer splits. A model,
    not a measurement: measured choices (:data:`TUNED`) override it."""
    block_m = max(16, min(128, _pow2(M)))
    block_k = next(b for b in (128, 64, 32, 16) if K % b == 0)  # supported() asks K % 16 == 0
    best = None
    for block_n in (64, 128, 256):
        stages = min(4, SMEM // ((block_n + block_m) * block_k * 2))
        if stages < 3:  # too few bytes in flight to hide the memory latency
            continue
        warps = 8 if block_n * block_m >= 128 * 128 else 4
        for split in (1, 2, 4, 8):
            if K % (block_k * split) or K // split < 2 * block_k:
                continue
            cfg = Config(block_n, block_m, block_k, split, stages, warps)
            # bytes: the weight, the rows re-read from L2 (a third), the split's fp32 sums (added, then exchanged)
            sums = 4 * M * N * split if split > 1 else 0
            cost = (2 * N * K + 2 * M * K * triton.cdiv(N, block_n) / 3 + sums) / wave_fill(M, N, cfg, sms)
            if best is None or cost < best[0] * 0.98:
                best = (cost, cfg)
    if best is None:  # K too short to split, tiles too wide: the smallest launch
        return Config(block_n=64, block_m=block_m, block_k=min(block_k, 64), stages=2)
    return best[1]


def config(M: int, N: int, K: int, sms: int = 132) -> Config | None:
    """The launch for ``M`` rows of an ``[N, K]`` weight: the :data:`TUNED` entry of the fewest rows
    at or above ``M`` (its row block cut to ``M``), else the largest; :func:`heuristic` where no
    shape was measured. None: cuBLAS measured faster for this shape."""
    entries = TUNED.get((N, K))
    if not entries:
        return heuristic(M, N, K, sms)
    cfg = next((c for rows, c in entries if rows >= M), entries[-1][1])
    if cfg is None:
        return None
    return dataclasses.replace(cfg, block_m=min(cfg.block_m, max(16, _pow2(M))))


class Workspace:
    """The split-K scratch of :func:`decode_linear` on one device: an fp32 sum buffer and one
    arrival counter per tile, both zero between calls (each call leaves them so). Allocated once
    for the largest ``rows x cols`` and ``tiles`` it must serve; the caller keeps it alive as long
    as any CUDA graph that captured a call using it."""

    def __init__(self, rows: int, cols: int, device: torch.device | str, tiles: int = 4096):
        self.sums = torch.zeros(rows * cols, dtype=torch.float32, device=device)
        self.counters = torch.zeros(tiles, dtype=torch.int32, device=device)

    def fits(self, M: int, N: int, tiles: int) -> bool:
        return M * N <= self.sums.numel() and tiles <= self.counters.numel()


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def preferred(x: torch.Tensor, W: torch.Tensor) -> bool:
    """Whether :func:`decode_linear` should take this product: :func:`supported`, and not measured
    slower than cuBLAS at its shape (:data:`TUNED`)."""
    return supported(x, W) and config(x.shape[0], W.shape[0], W.shape[1], _sms(x.device)) is not None


def supported(x: torch.Tensor, W: torch.Tensor) -> bool:
    """Whether :func:`decode_linear` runs for these operands: Triton on their device, 2-D bf16/fp16
    (or fp32) with unit stride along K, one dtype, K a multiple of 16."""
    return (
        fused.use_triton(x, W)
        and x.dim() == 2
        and W.dim() == 2
        and x.shape[1] == W.shape[1]
        and x.shape[1] % 16 == 0
        and x.dtype == W.dtype
        and W.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and x.stride(-1) == 1
        and W.stride(-1) == 1
    )


def decode_linear(
    x: torch.Tensor,
    W: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: tuple | None = None,
    workspace: Workspace | None = None,
    cfg: Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` (``x`` ``[M, K]``, ``W`` ``[N, K]``) -> ``[M, N]`` in ``x``'s dtype, plus,
    with ``lora = (h, B, offsets, n_rows, active)``, ``h[rows of g] @ B[g].T`` for every active group
    ``g`` (``h`` fp32 ``[M, R]``, ``B`` ``[G, N, R]``, ``offsets``/``n_rows``/``active`` as for
    :func:`~ember.core.kernels.lora_decode.lora_expand_add`; ``n_rows`` may be None). A K split
    needs ``workspace``; without one (or one too small) the split is dropped. ``cfg`` replaces
    :func:`config`. ``out``: the ``[M, N]`` result to write, of any float dtype (fp32 logits from
    bf16 operands: the accumulator is rounded once, to it)."""
    if not supported(x, W):
        raise ValueError(f"decode_linear: unsupported operands x {x.dtype} {tuple(x.shape)}, W {W.dtype} {tuple(W.shape)}")
    M, K = x.shape
    N = W.shape[0]
    if cfg is None:
        cfg = config(M, N, K, _sms(x.device)) or heuristic(M, N, K, _sms(x.device))
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), cfg.split_k)
    if cfg.split_k > 1 and (workspace is None or not workspace.fits(M, N, grid[0] * grid[1])):
        cfg = dataclasses.replace(cfg, split_k=1)
        grid = (grid[0], grid[1], 1)
    if K % (cfg.block_k * cfg.split_k):
        raise ValueError(f"decode_linear: K = {K} is not a multiple of block_k {cfg.block_k} x split {cfg.split_k}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"decode_linear: bias {tuple(bias.shape)} for {N} outputs")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if y.shape != (M, N) or y.stride(-1) != 1:
        raise ValueError(f"decode_linear: out {tuple(y.shape)} for [{M}, {N}]")
    if lora is not None:
        h, B, offsets, n_rows, (ids, count) = lora
        if h.shape[0] != M or B.dim() != 3 or B.shape[1] != N or B.shape[2] != h.shape[1] or B.stride(-1) != 1:
            raise ValueError(f"decode_linear: LoRA h {tuple(h.shape)}, B {tuple(B.shape)} for [{M}, {N}]")
        R = h.shape[1]
        lora_args = (h, B, offsets, n_rows if n_rows is not None else offsets, ids, count)
        lora_strides = (h.stride(0), B.stride(0), B.stride(1), R)
    else:
        R = 0
        lora_args = (x, x, x, x, x, x)
        lora_strides = (0, 0, 0, 0)
    if cfg.tma and not all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, W)):
        cfg = dataclasses.replace(cfg, tma=False)  # the copy engine needs 16-byte aligned rows
    if cfg.tma:
        descs = (TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
                 TensorDescriptor.from_tensor(W, [cfg.block_n, cfg.block_k]))
    else:
        descs = (x, W)
    ws = workspace.sums if cfg.split_k > 1 else y
    cnt = workspace.counters if cfg.split_k > 1 else y
    opts = pdl.options()
    prefetch = min(cfg.prefetch, K // cfg.split_k * x.element_size()) // 16 * 16 if opts["PDL"] else 0
    _decode_gemm_kernel[grid](
        x, W, y, bias if bias is not None else y, ws, cnt,
        *lora_args, *descs,
        M, N, K,
        x.stride(0), W.stride(0), y.stride(0), *lora_strides,
        HAS_BIAS=bias is not None, LORA=lora is not None, HAS_ROWS=lora is not None and lora[3] is not None,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        R_PAD=max(16, _pow2(R)), PREFETCH=prefetch,
        PREC="ieee" if W.dtype == torch.float32 else "tf32",  # fp32: exact products, as cuBLAS without TF32
        TMA=cfg.tma,
        num_warps=cfg.warps, num_stages=cfg.stages, **opts,
    )
    return y
