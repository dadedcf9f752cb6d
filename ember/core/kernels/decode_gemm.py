"""A GEMM for the few rows of a decode step: ``y = x @ W.T (+ bias) (+ each row's LoRA expand)``.

A decode step's products are memory-bound: ``x`` has 64..256 rows, so streaming ``W`` (``[N, K]``,
read once) is all their cost. cuBLAS reaches about 2.5 of the H100's 3.0 TB/s on them (the fourth
session's profile), and the LoRA expand that follows each one is a launch of its own (~3.5 us at
these sizes, mostly latency). This kernel is built for that shape:

* **Weight-major tiles.** A tile is ``W[n·BLOCK_N : (n+1)·BLOCK_N]`` (the MMA's long side) times
  the transposed rows ``x[m·BLOCK_M : ...]`` (``tl.dot(w, x.T)``, ``[BLOCK_N, BLOCK_M]`` in fp32),
  as cuBLAS lays out its decode tiles.
* **Split K, or stream-K**, where ``N / BLOCK_N`` tiles would leave SMs idle. The work is the
  tiles' K blocks laid end to end, and each program takes an equal run of them: a whole number of
  splits per tile (``split_k``), or runs that end anywhere (``programs``: stream-K, so every SM
  streams the same bytes whatever the tile count). The programs sharing a tile add their partial
  tiles into an fp32 workspace with atomic adds and count themselves in; the last to arrive reads
  the sum and leaves zeros (one atomic exchange), resets the tile's counter (so the next call, or
  the next replay of a CUDA graph, finds both clean) and runs the epilogue.
* **The epilogue** adds the bias and, with ``LORA``, each row group's ``h[rows] @ B[g][cols].T`` (the
  LoRA expand of :mod:`ember.core.kernels.lora_decode`: ``h`` the fp32 shrink output rounded to
  ``B``'s dtype, groups listed by :func:`~ember.core.kernels.lora_decode.active_groups`) to the
  fp32 tile and rounds once. The separate expand rounded the base product to bf16 first, then the
  sum: these values differ from it by that one rounding. A tile one program holds whole is
  finished there, without the workspace.
* **Programmatic dependent launch** (:mod:`ember.core.kernels.pdl`): the weights do not depend on
  the kernel before this one, so with ``PREFETCH`` a program first asks the copy engine to fetch
  the first ``PREFETCH`` bytes of each of its weight rows into L2 (``cp.async.bulk.prefetch.L2``),
  and only then waits for its predecessor. Its successor may launch as soon as every program has
  passed that wait, as the small kernels allow theirs; with ``LATE_LAUNCH`` only once every program
  has begun its last tile, so the next grid's programs do not sit on the SMs through the product.

:func:`decode_linear` picks the launch configuration (:func:`config`) and checks shapes;
:func:`supported` says where it can run. The split-K workspace (:class:`Workspace`) belongs to the
caller, so CUDA graphs keep pointing at live memory.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ember.core.kernels import fused, lora_decode, pdl

if fused.HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ember.core.kernels.lora_decode import _block_groups, _group_at
    from ember.core.kernels.pdl import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _tile_product(X, W, XD, WD, pid_m, pid_n, kb0, kb1, M, N, stride_xm, stride_wn,
                      BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREC: tl.constexpr, TMA: tl.constexpr):
        # W[n block] @ X[m block].T over the K blocks [kb0, kb1): [BLOCK_N, BLOCK_M] in fp32
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k = kb0 * BLOCK_K + tl.arange(0, BLOCK_K)
        w_ptr = W + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
        x_ptr = X + m.to(tl.int64)[:, None] * stride_xm + k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for kk in range(kb0 * BLOCK_K, kb1 * BLOCK_K, BLOCK_K):
            if TMA:  # the bulk tensor copy engine; rows past the edges read as zeros
                w = WD.load([pid_n * BLOCK_N, kk])
                x = XD.load([pid_m * BLOCK_M, kk])
            else:
                w = tl.load(w_ptr, mask=(n < N)[:, None], other=0.0)
                x = tl.load(x_ptr, mask=(m < M)[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=PREC)
            w_ptr += BLOCK_K
            x_ptr += BLOCK_K
        return acc

    @triton.jit
    def _finish(acc, pid_m, pid_n, Y, BIAS, H, B, OFFS, ROWS, ACTIVE, N_ACTIVE, M, N,
                stride_ym, stride_hm, stride_bg, stride_bn, R,
                HAS_BIAS: tl.constexpr, LORA: tl.constexpr, HAS_ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, R_PAD: tl.constexpr, PREC: tl.constexpr,
                G_PAD: tl.constexpr):
        # the epilogue of a whole tile: bias, each row group's LoRA expand, one rounding to Y
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        nmask = n < N
        if HAS_BIAS:
            acc += tl.load(BIAS + n, mask=nmask, other=0.0).to(tl.float32)[:, None]
        if LORA:
            r = tl.arange(0, R_PAD)
            rmask = r < R
            # the groups with rows in this tile, found at once (lora_decode._block_groups)
            j, gv, sv, ev, first, last = _block_groups(OFFS, ROWS, ACTIVE, N_ACTIVE, pid_m * BLOCK_M, BLOCK_M,
                                                       G_PAD, HAS_ROWS)
            for i in range(first, last + 1):
                g, sel = _group_at(j, gv, sv, ev, i, m)
                b_ptr = B + g.to(tl.int64) * stride_bg + n.to(tl.int64)[:, None] * stride_bn + r[None, :]
                b = tl.load(b_ptr, mask=nmask[:, None] & rmask[None, :], other=0.0)
                h_ptr = H + m.to(tl.int64)[:, None] * stride_hm + r[None, :]
                h = tl.load(h_ptr, mask=sel[:, None] & rmask[None, :], other=0.0).to(b.dtype)
                acc = tl.dot(b, tl.trans(h), acc, input_precision=PREC)
        y_ptr = Y + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=nmask[:, None] & (m < M)[None, :])

    @triton.jit
    def _decode_gemm_kernel(
        X, W, Y, BIAS, WS, CNT,
        H, B, OFFS, ROWS, ACTIVE, N_ACTIVE, XD, WD,
        M, N, K, TILES_M, PER,
        stride_xm, stride_wn, stride_ym, stride_hm, stride_bg, stride_bn, R,
        HAS_BIAS: tl.constexpr, LORA: tl.constexpr, HAS_ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        R_PAD: tl.constexpr, PREFETCH: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr = False,
        PDL: tl.constexpr = False, LATE_LAUNCH: tl.constexpr = False, G_PAD: tl.constexpr = 2,
    ):
        # The work is TILES x KI units (a tile of BLOCK_N weight rows by BLOCK_M rows, over one
        # BLOCK_K block of K); program p takes units [p · PER, (p + 1) · PER), tile by tile. A tile
        # whose units one program holds is finished there; a tile shared by several programs (a K
        # split when PER divides KI, stream-K otherwise) meets in the fp32 workspace.
        KI = K // BLOCK_K  # the host checks that BLOCK_K divides K
        total = TILES_M * tl.cdiv(N, BLOCK_N) * KI
        u = tl.program_id(0) * PER
        u_end = tl.minimum(u + PER, total)
        if PREFETCH > 0:  # this program's first weight bytes into L2, before waiting on anything
            n0 = (u // KI) // TILES_M * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                [W + tl.minimum(n0, N - 1).to(tl.int64) * stride_wn + (u % KI) * BLOCK_K,
                 tl.full([BLOCK_N], PREFETCH, tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1,
            )
        if PDL:  # launched early: wait for the grid before this one (kernels.pdl)
            gdc_wait()
            if not LATE_LAUNCH:
                gdc_launch_dependents()
        while u < u_end:
            tile = u // KI
            kb0 = u - tile * KI
            kb1 = tl.minimum(KI, kb0 + (u_end - u))
            if PDL and LATE_LAUNCH:  # noqa: SIM102 - compile-time test around a run-time one
                if u + (kb1 - kb0) >= u_end:  # this program's last tile: the next grid may launch
                    gdc_launch_dependents()
            pid_m = tile % TILES_M
            pid_n = tile // TILES_M
            acc = _tile_product(X, W, XD, WD, pid_m, pid_n, kb0, kb1, M, N, stride_xm, stride_wn,
                                BLOCK_N, BLOCK_M, BLOCK_K, PREC, TMA)
            # the programs holding this tile's units: (tile · KI) // PER to ((tile + 1) · KI - 1) // PER
            sharers = ((tile + 1) * KI - 1) // PER - (tile * KI) // PER + 1
            done = sharers == 1
            if sharers > 1:
                # partial sums meet in the workspace ([N, M] by the tile layout); the last sharer to
                # count itself in finishes the tile and leaves workspace and counter at zero
                n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                tile_mask = (n < N)[:, None] & (m < M)[None, :]
                ws_ptr = WS + n.to(tl.int64)[:, None] * M + m[None, :]
                tl.atomic_add(ws_ptr, acc, mask=tile_mask, sem="relaxed")
                arrived = tl.atomic_add(CNT + tile, 1, sem="acq_rel")
                done = arrived == sharers - 1
                if done:
                    # read the sum and leave zeros in one atomic exchange per element (as int32 bits:
                    # the interpreter has no float exchange); a load then a store, in two register
                    # layouts, raced between the program's threads and lost partial sums (H200)
                    bits = tl.atomic_xchg(ws_ptr.to(tl.pointer_type(tl.int32)),
                                          tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32), mask=tile_mask, sem="relaxed")
                    acc = bits.to(tl.float32, bitcast=True)
                    tl.store(CNT + tile, 0)
            if done:
                _finish(acc, pid_m, pid_n, Y, BIAS, H, B, OFFS, ROWS, ACTIVE, N_ACTIVE, M, N,
                        stride_ym, stride_hm, stride_bg, stride_bn, R,
                        HAS_BIAS, LORA, HAS_ROWS, BLOCK_N, BLOCK_M, R_PAD, PREC, G_PAD)
            u += kb1 - kb0


@dataclass(frozen=True)
class Config:
    """One launch of :func:`decode_linear`: tile sides; how the work is spread, ``split_k`` K
    splits of every tile, or with ``programs`` > 0 that many programs over the tiles' K blocks
    laid end to end (stream-K: equal shares, a tile split wherever a share ends); the pipeline
    depth; warps; the bytes of each weight row prefetched into L2 before the dependency wait (0:
    none; the prefetch is issued only under programmatic dependent launch); and whether the tiles
    are loaded through tensor descriptors (the bulk tensor copy engine, Hopper) instead of
    pointers; under programmatic dependent launch, whether the next grid may launch only once every
    program has begun its last tile (``late_launch``) rather than once all have started."""

    block_n: int = 128
    block_m: int = 64
    block_k: int = 128
    split_k: int = 1
    stages: int = 4
    warps: int = 4
    prefetch: int = 0
    tma: bool = False
    programs: int = 0
    late_launch: bool = False


def _layout(M: int, N: int, K: int, cfg: Config) -> tuple[int, int]:
    """``(programs, K blocks per program)`` of a launch (see :class:`Config`)."""
    ki = K // cfg.block_k
    units = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n) * ki
    per = triton.cdiv(units, min(cfg.programs, units)) if cfg.programs > 0 else ki // cfg.split_k
    return triton.cdiv(units, per), per


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


def wave_fill(M: int, N: int, K: int, cfg: Config, sms: int = 132) -> float:
    """How busy the launch keeps its slots (1: every resident program streams to the end): the K
    blocks of work over the waves of programs times the slots of a wave times a program's blocks,
    an SM holding as many programs as its shared memory (:data:`SM_SMEM`) fits."""
    slots = sms * max(1, SM_SMEM // ((cfg.block_n + cfg.block_m) * cfg.block_k * 2 * cfg.stages))
    programs, per = _layout(M, N, K, cfg)
    units = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n) * (K // cfg.block_k)
    return units / (triton.cdiv(programs, slots) * slots * per)


@functools.lru_cache(maxsize=256)
def heuristic(M: int, N: int, K: int, sms: int = 132) -> Config:
    """A launch for ``[M, K] x [N, K]^T`` on a GPU of ``sms`` multiprocessors, from a model of a
    memory-bound product: every row in one block up to 128 rows; for each tile width, the deepest
    pipeline up to 4 stages (at least 3) within :data:`SMEM`; and the tile width and layout (K
    splits, or stream-K over one wave of programs) with the fewest bytes (the weight, a third of the
    rows' re-reads from L2, once per tile column, and the shared tiles' fp32 partial sums) divided
    by :func:`wave_fill`. Ties go to the earlier layout (fewer splits). A model, not a measurement:
    measured choices (:data:`TUNED`) override it. Cached: a step asks it for every product."""
    block_m = max(16, min(128, _pow2(M)))
    block_k = next(b for b in (128, 64, 32, 16) if K % b == 0)  # supported() asks K % 16 == 0
    best = None
    for block_n in (64, 128, 256):
        stages = min(4, SMEM // ((block_n + block_m) * block_k * 2))
        if stages < 3:  # too few bytes in flight to hide the memory latency
            continue
        warps = 8 if block_n * block_m >= 128 * 128 else 4
        tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
        slots = sms * max(1, SM_SMEM // ((block_n + block_m) * block_k * 2 * stages))
        # K splits, then stream-K over one wave of programs (where it splits tiles at all)
        layouts = [Config(block_n, block_m, block_k, split, stages, warps) for split in (1, 2, 4, 8)
                   if K % (block_k * split) == 0 and K // split >= 2 * block_k]
        if tiles < slots and K // block_k >= 2:
            layouts.append(Config(block_n, block_m, block_k, 1, stages, warps, programs=slots))
        for cfg in layouts:
            # bytes: the weight, the rows re-read from L2 (a third), the shared tiles' fp32 sums
            # (added, then exchanged: about one per sharer of each tile)
            sharers = cfg.split_k if not cfg.programs else -(-cfg.programs // tiles) + 1
            sums = 4 * M * N * sharers if sharers > 1 else 0
            cost = (2 * N * K + 2 * M * K * triton.cdiv(N, block_n) / 3 + sums) / wave_fill(M, N, K, cfg, sms)
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

    def __init__(self, rows: int, cols: int, device: torch.device | str, tiles: int = 1 << 14):
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
        sms = _sms(x.device)
        cfg = config(M, N, K, sms) or heuristic(M, N, K, sms)
    if K % cfg.block_k or (cfg.programs == 0 and K % (cfg.block_k * cfg.split_k)):
        raise ValueError(f"decode_linear: K = {K} is not a multiple of block_k {cfg.block_k} x split {cfg.split_k}")
    tiles_m, tiles = triton.cdiv(M, cfg.block_m), triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    programs, per = _layout(M, N, K, cfg)
    shared = per % (K // cfg.block_k) != 0  # some tile's K blocks span several programs
    if shared and (workspace is None or not workspace.fits(M, N, tiles)):
        cfg = dataclasses.replace(cfg, split_k=1, programs=0)  # no workspace: one program a tile
        (programs, per), shared = _layout(M, N, K, cfg), False
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"decode_linear: bias {tuple(bias.shape)} for {N} outputs")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if y.shape != (M, N) or y.stride(-1) != 1:
        raise ValueError(f"decode_linear: out {tuple(y.shape)} for [{M}, {N}]")
    if lora is not None:
        h, B, offsets, n_rows, active = lora
        if h.shape[0] != M or B.dim() != 3 or B.shape[1] != N or B.shape[2] != h.shape[1] or B.stride(-1) != 1:
            raise ValueError(f"decode_linear: LoRA h {tuple(h.shape)}, B {tuple(B.shape)} for [{M}, {N}]")
        R = h.shape[1]
        lora_args = (h, B, offsets, n_rows if n_rows is not None else offsets, active.ids, active.count)
        lora_strides = (h.stride(0), B.stride(0), B.stride(1), R)
        g_pad = lora_decode.groups_pad(active)
    else:
        R, g_pad = 0, 2
        lora_args = (x, x, x, x, x, x)
        lora_strides = (0, 0, 0, 0)
    if cfg.tma and not all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, W)):
        cfg = dataclasses.replace(cfg, tma=False)  # the copy engine needs 16-byte aligned rows
    if cfg.tma:
        descs = (TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
                 TensorDescriptor.from_tensor(W, [cfg.block_n, cfg.block_k]))
    else:
        descs = (x, W)
    ws = workspace.sums if shared else y
    cnt = workspace.counters if shared else y
    opts = pdl.options()
    prefetch = min(cfg.prefetch, per * cfg.block_k * x.element_size()) // 16 * 16 if opts["PDL"] else 0
    _decode_gemm_kernel[(programs,)](
        x, W, y, bias if bias is not None else y, ws, cnt,
        *lora_args, *descs,
        M, N, K, tiles_m, per,
        x.stride(0), W.stride(0), y.stride(0), *lora_strides,
        HAS_BIAS=bias is not None, LORA=lora is not None, HAS_ROWS=lora is not None and lora[3] is not None,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        R_PAD=max(16, _pow2(R)), PREFETCH=prefetch,
        PREC="ieee" if W.dtype == torch.float32 else "tf32",  # fp32: exact products, as cuBLAS without TF32
        TMA=cfg.tma, LATE_LAUNCH=cfg.late_launch and opts["PDL"],
        G_PAD=g_pad,
        num_warps=cfg.warps, num_stages=cfg.stages, **opts,
    )
    return y
