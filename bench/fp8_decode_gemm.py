"""fp8 products at decode shapes on the GPU: the Triton blockwise kernel
(``ember.core.kernels.fp8_gemm``) against ``scaled_mm``'s blockwise recipe and bf16 ``F.linear``
(cuBLAS), at Qwen3-8B's projection shapes and decode row counts.

Each variant streams its weights from HBM: the timed CUDA graph cycles through enough copies of the
weight (different tensors, ``--pool`` MiB in all) that none is still in L2 when it is read again.
Times are GPU microseconds per product (graph replay, CUDA events), with the weight bytes' rate.
The fp8 products include the activation quantisation (one Triton launch) unless noted.

* ``check``: the kernel and ``scaled_mm`` against the fp64 product of the dequantised operands;
* ``sweep``: every launch shape (rows, columns, K splits, warps, stages) of the kernel on every
  projection; prints the best, the one :func:`fp8_gemm.config` picks, and ``scaled_mm`` and bf16.

    python3 bench/fp8_decode_gemm.py --out $OUT
    python3 bench/fp8_decode_gemm.py --rows 64 --quick      # fewer launch shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import hardware_line
from ember.core import quant
from ember.core import rollout_precision as rp
from ember.core.kernels import fp8_gemm, fp8_quant

# Qwen3-8B (hidden 4096, 32/8 heads of 128, intermediate 12288): (name, N, K)
SHAPES = (("q/o", 4096, 4096), ("k/v", 1024, 4096), ("qkv packed", 6144, 4096),
          ("gate+up packed", 24576, 4096), ("down", 4096, 12288))


def graph_us(fns: list, iters: int = 20) -> float:
    """GPU µs per call of the callables ``fns`` (called in turn), replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:3]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * len(fns))


def weights(N: int, K: int, copies: int, dev) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``copies`` random bf16 weights with their fp8 copies: (bf16, e4m3, tile scales)."""
    out = []
    for _ in range(copies):
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        q, s = quant.quantize_fp8_block(w, fp8_gemm.BLOCK)
        out.append((w, q, s))
    return out


def fp8_product(x, q, s, cfg=None):
    xq, xs = fp8_quant.quantize_act_fp8(x)
    return fp8_gemm.fp8_linear(xq, xs, q, s, x.dtype, cfg)


def check(rows: list[int], dev) -> dict:
    out = {}
    for (name, N, K), M in itertools.product(SHAPES, rows):
        ((_, q, s),) = weights(N, K, 1, dev)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        xq, xs = fp8_quant.quantize_act_fp8(x)
        xd = (xq.double().reshape(M, K // 128, 128) * xs.double()[..., None]).reshape(M, K)
        ref = xd @ quant.dequant_fp8_block(q, s).double().t()
        errs = {}
        for label, y in (("triton", fp8_gemm.fp8_linear(xq, xs, q, s, torch.float32)),
                         ("scaled_mm", rp._scaled_mm_fp8(x, q, s, torch.float32))):
            errs[label] = float((y.double() - ref).norm() / ref.norm())
        out[f"{name} M={M}"] = errs
        print(f"check {name:15s} M={M:4d}: rel err vs fp64 of the dequantised operands: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    return out


def sweep(rows: list[int], pool_mib: int, quick: bool, dev) -> dict:
    results = {}
    for (name, N, K), M in itertools.product(SHAPES, rows):
        results[f"{name} M={M}"] = sweep_one(name, N, K, M, pool_mib, quick, dev)
        torch.cuda.empty_cache()
    return results


def sweep_one(name: str, N: int, K: int, M: int, pool_mib: int, quick: bool, dev) -> dict:
    """One projection at ``M`` rows: bf16, scaled_mm, and the kernel at every launch shape."""
    copies = max(2, -(-pool_mib * 2**20 // (N * K)))  # fp8 bytes; bf16 reads twice the pool
    ws = weights(N, K, copies, dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    xq, xs = fp8_quant.quantize_act_fp8(x)
    gb_fp8, gb_bf16 = N * K / 1e3, N * K * 2 / 1e3  # bytes per µs = GB/s * 1e-3

    def kernel_us(cfg):
        return graph_us([lambda q=q, s=s: fp8_gemm.fp8_linear(xq, xs, q, s, x.dtype, cfg) for _, q, s in ws])

    row = {"N": N, "K": K, "M": M, "copies": copies}
    row["bf16_us"] = graph_us([lambda w=w: F.linear(x, w) for w, _, _ in ws])
    try:
        row["scaled_mm_us"] = graph_us([lambda q=q, s=s: rp._scaled_mm_fp8(x, q, s, x.dtype) for _, q, s in ws])
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  scaled_mm failed: {e}")
        row["scaled_mm_us"] = float("nan")
    row["quant_us"] = graph_us([lambda: fp8_quant.quantize_act_fp8(x)] * 8)
    picked = fp8_gemm.config(M, N, K, dev)
    block_ms = sorted({picked.block_m, max(16, min(128, picked.block_m * 2))})
    space = itertools.product(block_ms, (64, 128) if quick else (32, 64, 128), (1, 2, 4, 8, 16),
                              (4,) if quick else (4, 8), (4,) if quick else (3, 4, 5))
    timings = []
    for bm, bn, split, warps, stages in space:
        if split > K // 128:
            continue
        cfg = fp8_gemm.Config(bm, bn, split, warps, stages)
        try:
            timings.append((kernel_us(cfg), cfg))
        except Exception as e:  # noqa: BLE001 - a shape Triton cannot compile (registers, shared memory)
            print(f"  {cfg}: {type(e).__name__}")
    timings.sort(key=lambda t: t[0])
    best_us, best = timings[0]
    row["picked"] = picked.__dict__
    row["picked_us"] = next((us for us, c in timings if c == picked), None) or kernel_us(picked)
    row["best"] = best.__dict__
    row["best_us"] = best_us
    row["top5"] = [(round(us, 2), c.__dict__) for us, c in timings[:5]]
    row["triton_with_quant_us"] = graph_us([lambda q=q, s=s: fp8_product(x, q, s) for _, q, s in ws])
    print(f"{name:15s} M={M:4d} N={N:6d} K={K:6d}: bf16 {row['bf16_us']:7.1f} us ({gb_bf16 / row['bf16_us']:.0f} GB/s) | "
          f"scaled_mm+quant {row['scaled_mm_us']:7.1f} | quant {row['quant_us']:5.1f} | "
          f"triton picked {row['picked_us']:7.1f} ({gb_fp8 / row['picked_us']:.0f} GB/s) {picked} | "
          f"best {best_us:7.1f} ({gb_fp8 / best_us:.0f} GB/s) {best} | picked+quant {row['triton_with_quant_us']:7.1f}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256", help="comma list of row counts (decode batch sizes)")
    ap.add_argument("--pool", type=int, default=256, help="MiB of fp8 weight copies each timing cycles through")
    ap.add_argument("--quick", action="store_true", help="fewer launch shapes in the sweep")
    ap.add_argument("--only", default="check,sweep")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    hw = hardware_line()
    print(hw, "torch", torch.__version__, flush=True)
    t0 = time.time()
    out = {"hardware": hw, "torch": torch.__version__}
    parts = args.only.split(",")
    if "check" in parts:
        out["check"] = check(rows, dev)
    if "sweep" in parts:
        out["sweep"] = sweep(rows, args.pool, args.quick, dev)
    print(f"done in {time.time() - t0:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_decode_gemm.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
