"""The decode GEMM (``ember.core.kernels.decode_gemm``) against cuBLAS at Qwen3-8B's decode shapes.

For each product of a decode step (packed q/k/v, o, packed gate/up, down, the LM head) and each row
count, every layer's weight is a distinct tensor (so each call streams it from HBM, as in a step)
and the calls of all layers are captured in one CUDA graph (``common.graph_us``). Printed per
launch configuration: microseconds a call, the bandwidth of the bytes it must move, and its share of
the copy bandwidth; then, at the best configuration, the product with its LoRA expand in the
epilogue against cuBLAS followed by ``lora_decode.lora_expand_add`` (what the step runs today), with
and without programmatic dependent launch. ``--out``: the best configuration of each shape as JSON (``decode_gemm.json``, which
``decode_gemm.load_tuned`` and ``bench/sample.py --gemm-configs`` read).

The sweep's kernels are compiled first in ``--compile-workers`` processes (Triton compiles one
kernel at a time per process; 314 launch shapes took 20 s on 16 cores), then timed.

    python3 bench/decode_gemm.py                          # 64 and 256 rows, every shape
    python3 bench/decode_gemm.py --rows 64 --shapes o,down --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, graph_us, hardware_line
from bench.lora_decode import row_groups
from ember.core.kernels import decode_gemm as dg
from ember.core.kernels import lora_decode as ld
from ember.core.kernels import pdl

HIDDEN, INTER, Q, KV, VOCAB, LAYERS = 4096, 12288, 4096, 1024, 151936, 36
# shape -> (N, K, LoRA members (0: none))
SHAPES = {
    "qkv": (Q + 2 * KV, HIDDEN, 3),
    "o": (HIDDEN, Q, 1),
    "gate_up": (2 * INTER, HIDDEN, 2),
    "down": (HIDDEN, INTER, 1),
    "lm_head": (VOCAB, HIDDEN, 0),
}


def candidates(M: int, N: int, K: int, sms: int, quick: bool) -> list[dg.Config]:
    """Launch configurations worth timing: the pipeline fits shared memory; K split 1, 2, 4 or 8
    times with between half a wave and eight waves of programs, or stream-K over one wave of
    programs. With ``quick``: row blocks of 128 or all rows, 64-column K blocks only where 128 leave
    fewer than 3 stages, the deepest pipeline up to 4 stages, and launches that keep at least 3/4 of
    their slots busy (``decode_gemm.wave_fill``). Each with pointer and with tensor-descriptor
    loads; the heuristic's choice is always among them."""
    out = {dg.heuristic(M, N, K, sms)}
    block_ms = sorted({max(16, min(b, dg._pow2(M))) for b in ((128, 256) if quick else (64, 128, 256))})
    for bn, bm, bk in itertools.product((64, 128, 256), block_ms, (64, 128)):
        deepest = min(5, dg.SMEM // ((bn + bm) * bk * 2))
        if quick and bk == 64 and dg.SMEM // ((bn + bm) * 128 * 2) >= 3:
            continue  # quick: 64-column K blocks only where 128 allow fewer than 3 stages
        if K % bk or deepest < 2 or bn * bm > 128 * 256:
            continue  # (a 256 x 256 fp32 accumulator would not fit 8 warps' registers)
        for stages in (min(4, deepest),) if quick else range(min(3, deepest), deepest + 1):
            warps = 8 if bn * bm >= 128 * 128 else 4
            slots = sms * max(1, dg.SM_SMEM // ((bn + bm) * bk * 2 * stages))
            layouts = [dg.Config(bn, bm, bk, split, stages, warps) for split in (1, 2, 4, 8)
                       if K % (bk * split) == 0 and sms // 2 <= -(-N // bn) * -(-M // bm) * split <= 8 * sms]
            layouts.append(dg.Config(bn, bm, bk, 1, stages, warps, programs=slots))
            for cfg in layouts:
                if quick and dg.wave_fill(M, N, K, cfg, sms) < 0.75:
                    continue
                out |= {cfg, dataclasses.replace(cfg, tma=True)}
    return sorted(out, key=lambda c: (c.block_n, c.block_m, c.block_k, c.split_k, c.programs, c.stages, c.tma))


def _compile(job: tuple[str, int, list[dg.Config]]) -> int:
    """In a worker process: launch every configuration of ``job`` once at its shape, so Triton's
    disk cache holds its binary when the timing process asks for it. Returns how many compiled."""
    name, M, cfgs = job
    N, K, _ = SHAPES[name]
    x = torch.zeros(M, K, device="cuda", dtype=torch.bfloat16)
    W = torch.zeros(N, K, device="cuda", dtype=torch.bfloat16)
    ws = dg.Workspace(256, VOCAB, "cuda", tiles=1 << 16)  # as the timing process's: same specialisation
    done = 0
    for cfg in cfgs:
        try:
            dg.decode_linear(x, W, workspace=ws, cfg=cfg)
            done += 1
        except Exception:  # noqa: BLE001, S110 - the timing process reports it
            pass
    torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple[str, int, list[dg.Config]]], workers: int) -> None:
    """Compile the sweep's kernels in ``workers`` processes (Triton compiles one kernel at a time
    per process, about a second each; the sweep has hundreds)."""
    import concurrent.futures
    import multiprocessing
    import time

    t0 = time.perf_counter()
    chunks = [(name, M, cfgs[i::4]) for name, M, cfgs in jobs for i in range(4)]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        n = sum(pool.map(_compile, chunks))
    print(f"compiled {n} configurations in {workers} processes in {time.perf_counter() - t0:.0f} s", flush=True)


def lora_stacks(N: int, members: int, rank: int, busy: int) -> torch.Tensor:
    R = members * rank
    B = torch.randn(busy + 1, N, R, device="cuda", dtype=torch.bfloat16) * R**-0.5
    B[0] = 0
    return B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--busy", default="1,8", help="adapters with rows, one per --rows entry")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--quick", action="store_true", help="time only 4-stage pipelines")
    ap.add_argument("--prefetch", default="0,512,2048", help="bytes per weight row prefetched into L2 (with PDL)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes that compile the sweep's kernels first (1: compile as timed)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_gemm.py times CUDA kernels: it needs a GPU")
    print(f"hardware: {hardware_line()}; torch {torch.__version__}")
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs")
    torch.manual_seed(0)
    best: dict[str, dict] = {}
    ws = dg.Workspace(256, VOCAB, "cuda", tiles=1 << 16)
    wrong: list[str] = []
    plan = list(zip(map(int, args.rows.split(",")), map(int, args.busy.split(","))))
    if args.compile_workers > 1:
        precompile([(name, M, candidates(M, *SHAPES[name][:2], sms, args.quick))
                    for M, _ in plan for name in args.shapes.split(",")], args.compile_workers)
    for M, busy in plan:
        offs, n_rows, active = row_groups(M, busy)
        for name in args.shapes.split(","):
            N, K, members = SHAPES[name]
            L = 2 if name == "lm_head" else args.layers
            Ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5 for _ in range(L)]
            xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(L)]
            nbytes = 2 * (N * K + M * K + M * N)
            print(f"\n== {name}: [{M}, {K}] x [{N}, {K}]^T, {nbytes / 1e6:.1f} MB a call, floor {nbytes / bw * 1e6:.1f} us ==")
            ref = F.linear(xs[0], Ws[0]).float()

            def rate(us: float, nbytes: int = nbytes) -> str:
                return f"{us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s  {nbytes / us / 1e6 / (bw / 1e12):4.0%} of copy"

            cublas = graph_us([lambda x=x, W=W: F.linear(x, W) for x, W in zip(xs, Ws)], iters=10)
            print(f"  cuBLAS                                           {rate(cublas)}")
            results = []
            for cfg in candidates(M, N, K, sms, args.quick):
                try:
                    y = dg.decode_linear(xs[0], Ws[0], workspace=ws, cfg=cfg)
                    err = float((y.float() - ref).abs().max() / ref.abs().max())
                    us = graph_us([lambda x=x, W=W, c=cfg: dg.decode_linear(x, W, workspace=ws, cfg=c)
                                   for x, W in zip(xs, Ws)], iters=10)
                except Exception as e:  # noqa: BLE001 - e.g. Triton's OutOfResources for a large tile
                    print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                if err > 2e-2:  # reported, never chosen; the run fails at the end
                    print(f"  WRONG {cfg}: max error {err:.2e} against cuBLAS")
                    wrong.append(f"{name}/{M} {cfg}")
                    continue
                results.append((us, cfg))
            results.sort(key=lambda r: r[0])
            default = dg.heuristic(M, N, K, sms)
            for us, cfg in results[:8] + [r for r in results[8:] if r[1] == default]:
                mark = " (default)" if cfg == default else ""
                layout = f"stream-K x{cfg.programs:3}" if cfg.programs else f"split {cfg.split_k}      "
                print(f"  bn {cfg.block_n:3} bm {cfg.block_m:3} bk {cfg.block_k:3} {layout} "
                      f"stages {cfg.stages} warps {cfg.warps} tma {int(cfg.tma)}   {rate(us)}{mark}")
            # the best few with programmatic dependent launch, and the weights' first bytes prefetched
            pdl_results = []
            if pdl.supported(torch.device("cuda")):
                for (_, cfg), pf, late in itertools.product(results[:3], map(int, args.prefetch.split(",")), (False, True)):
                    c = dg.Config(**{**cfg.__dict__, "prefetch": pf, "late_launch": late})
                    with pdl.launches(True):
                        us = graph_us([lambda x=x, W=W, c=c: dg.decode_linear(x, W, workspace=ws, cfg=c)
                                       for x, W in zip(xs, Ws)], iters=10)
                    pdl_results.append((us, c))
                    print(f"  PDL, prefetch {pf:4} B/row, late launch {int(late)}, bn {c.block_n} bm {c.block_m} bk {c.block_k} "
                          f"split {c.split_k} programs {c.programs} st {c.stages} tma {int(c.tma)}  {rate(us)}")
            ranked = sorted(results + pdl_results, key=lambda r: r[0])
            if members:
                B = [lora_stacks(N, members, args.rank, busy) for _ in range(L)]
                hs = [torch.randn(M, members * args.rank, device="cuda") for _ in range(L)]
                # the fused epilogue equals the base product plus the separate expand; the fastest
                # launch whose epilogue fits (a wide row block can need more shared memory than there is)
                y0 = F.linear(xs[0], Ws[0])
                sep = ld.lora_expand_add(y0.clone(), hs[0], B[0], offs, n_rows, True, active=active).float()
                for at, (us, cfg) in enumerate(ranked):
                    try:
                        fused_y = dg.decode_linear(xs[0], Ws[0], lora=(hs[0], B[0], offs, n_rows, active),
                                                   workspace=ws, cfg=cfg)
                        break
                    except OutOfResources as e:
                        print(f"  with LoRA, launch {at + 1} does not fit: {str(e)[:90]}")
                else:
                    raise SystemExit(f"{name}/{M}: no launch fits the LoRA epilogue")
            else:
                us, cfg = ranked[0]
            best[f"{name}/{M}"] = {"M": M, "N": N, "K": K, "config": cfg.__dict__, "us": us, "cublas_us": cublas,
                                   "bytes": nbytes, "speedup": cublas / us, "use": us < cublas}
            print(f"  best: {cublas / us:.2f}x cuBLAS")
            if members:
                err = float((fused_y.float() - sep).abs().max() / sep.abs().max())
                assert err < 2e-2, f"LoRA epilogue: max error {err:.2e}"
                lines = {}
                for on in (False, True) if pdl.supported(torch.device("cuda")) else (False,):
                    with pdl.launches(on):
                        lines[f"cuBLAS + expand, PDL {int(on)}"] = graph_us(
                            [lambda x=x, W=W, h=h, b=b, o=offs, n=n_rows, a=active:
                             ld.lora_expand_add(F.linear(x, W), h, b, o, n, True, active=a)
                             for x, W, h, b in zip(xs, Ws, hs, B)], iters=10)
                        lines[f"decode GEMM, expand in the epilogue, PDL {int(on)}"] = graph_us(
                            [lambda x=x, W=W, lo=(h, b, offs, n_rows, active), c=cfg:
                             dg.decode_linear(x, W, lora=lo, workspace=ws, cfg=c)
                             for x, W, h, b in zip(xs, Ws, hs, B)], iters=10)
                print(f"  with LoRA ({busy} adapter(s), rank {args.rank} x {members}; error {err:.1e}):")
                for k, v in lines.items():
                    print(f"    {k:48} {v:7.1f} us")
                best[f"{name}/{M}"]["lora_us"] = lines
                # the step multiplies with its LoRA: take the kernel where product + expand is faster
                on = int(pdl.supported(torch.device("cuda")))
                best[f"{name}/{M}"]["use"] = (lines[f"decode GEMM, expand in the epilogue, PDL {on}"]
                                              < lines[f"cuBLAS + expand, PDL {on}"])
                del B, hs
            del Ws, xs
            torch.cuda.empty_cache()
            if args.out:  # after every shape: a run cut short keeps what it measured
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "decode_gemm.json").write_text(json.dumps({"hardware": hardware_line(), "results": best}, indent=1))
    print("\nsummary: best decode GEMM against cuBLAS (us a call; use: the choice load_tuned makes)")
    for key, r in best.items():
        print(f"  {key:14} {r['us']:7.1f} against {r['cublas_us']:7.1f}  {r['speedup']:.2f}x  use {int(r['use'])}  {r['config']}")
    if wrong:
        raise SystemExit("configurations with wrong results:\n  " + "\n  ".join(wrong))


if __name__ == "__main__":
    main()
