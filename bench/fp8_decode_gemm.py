"""Products at decode shapes on the GPU: the Triton blockwise fp8 kernel
(``ember.core.kernels.fp8_gemm``) against ``scaled_mm``'s blockwise recipe and bf16 ``F.linear``
(cuBLAS), at Qwen3-8B's projection shapes and decode row counts; and the routed experts' decode
kernel (``ember.core.kernels.expert_decode``, bf16 and fp8) against ``torch._grouped_mm``.

Each variant streams its weights from HBM: the timed CUDA graph cycles through enough copies of the
weight (different tensors, ``--pool`` MiB in all) that none is still in L2 when it is read again.
Times are GPU microseconds per product (graph replay, CUDA events), with the weight bytes' rate.
The fp8 products include the activation quantisation (one Triton launch) unless noted.

* ``check``: the kernel and ``scaled_mm`` against the fp64 product of the dequantised operands;
* ``sweep``: every launch shape (rows, columns, K splits, warps, stages) of the kernel on every
  projection; prints the best, the one :func:`fp8_gemm.config` picks, and ``scaled_mm`` and bf16;
* ``experts``: routed experts at decode (Qwen3-30B-A3B's and Qwen3-Next's shapes, random routing):
  ``torch._grouped_mm`` over the gathered rows against ``ember.core.kernels.expert_decode`` in
  bf16 and fp8; and with one adapter's LoRA on every expert (``--lora-rank``), the term in the
  kernel's epilogue against the grouped products after it (the path before). Each timing cycles
  through two copies of a layer's experts (each larger than L2).

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

from bench.common import graph_us, hardware_line
from ember.core import quant
from ember.core import rollout_precision as rp
from ember.core.kernels import fp8_gemm, fp8_quant

# Qwen3-8B (hidden 4096, 32/8 heads of 128, intermediate 12288): (name, N, K)
SHAPES = (("q/o", 4096, 4096), ("k/v", 1024, 4096), ("qkv packed", 6144, 4096),
          ("gate+up packed", 24576, 4096), ("down", 4096, 12288))


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


# routed experts at decode (name, experts, N, K, top-k): Qwen3-30B-A3B and Qwen3-Next-80B-A3B
EXPERT_SHAPES = (("30B-A3B gate_up", 128, 1536, 2048, 8), ("30B-A3B down", 128, 2048, 768, 8),
                 ("Next gate_up", 512, 1024, 2048, 10), ("Next down", 512, 2048, 512, 10))


def experts(tokens: list[int], dev, lora_rank: int = 0) -> dict:
    """Routed experts at decode: ``torch._grouped_mm`` over the gathered rows (the path before)
    against :mod:`ember.core.kernels.expert_decode` in bf16 and in fp8 (quantisation included),
    random routing of ``tokens`` tokens; errors against fp32 / the fp64 model."""
    out = {}
    for (name, E, N, K, k), T in itertools.product(EXPERT_SHAPES, tokens):
        out[f"{name} T={T}"] = experts_one(name, E, N, K, k, T, dev, lora_rank)
        torch.cuda.empty_cache()
    return out


def experts_one(name: str, E: int, N: int, K: int, k: int, T: int, dev, lora_rank: int = 0) -> dict:
    from ember.core.kernels import expert_decode
    from ember.core.kernels.grouped import grouped_linear

    g = torch.Generator(device=dev).manual_seed(0)
    ws = [torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, generator=g) * K**-0.5 for _ in range(2)]
    fp8 = [quant.quantize_fp8_block(w, fp8_gemm.BLOCK) for w in ws]
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16, generator=g)
    choice = torch.rand(T, E, device=dev, generator=g).topk(k, dim=-1).indices.flatten()
    order = torch.sort(choice, stable=True).indices
    rows = order // k
    offsets = torch.cumsum(torch.bincount(choice, minlength=E), 0).to(torch.int32)
    touched = int((torch.bincount(choice, minlength=E) > 0).sum())
    ref = grouped_linear(x[rows], ws[0], offsets).float()
    y = expert_decode.expert_linear(x, rows, ws[0], offsets).float()
    y8 = expert_decode.expert_linear(x, rows, fp8[0][0], offsets, fp8[0][1]).float()
    row = {"experts": E, "N": N, "K": K, "tokens": T, "top_k": k, "experts_touched": touched,
           "rel_err_bf16_kernel": float((y - ref).norm() / ref.norm()),
           "rel_err_fp8_vs_bf16": float((y8 - ref).norm() / ref.norm())}
    row["grouped_mm_us"] = graph_us([lambda w=w: grouped_linear(x[rows], w, offsets) for w in ws])
    for bn in (64, 128):
        row[f"kernel_bf16_bn{bn}_us"] = graph_us(
            [lambda w=w, bn=bn: expert_decode.expert_linear(x, rows, w, offsets, block_n=bn) for w in ws])
        row[f"kernel_fp8_bn{bn}_us"] = graph_us(
            [lambda q=q, s=s, bn=bn: expert_decode.expert_linear(x, rows, q, offsets, s, block_n=bn)
             for q, s in fp8])
    touched_bytes = touched * N * K
    best16 = min(row["kernel_bf16_bn64_us"], row["kernel_bf16_bn128_us"])
    best8 = min(row["kernel_fp8_bn64_us"], row["kernel_fp8_bn128_us"])
    if lora_rank:
        row.update(experts_lora(x, rows, ws, fp8, offsets, lora_rank, 64 if best16 == row["kernel_bf16_bn64_us"]
                                else 128, g))
    print(f"experts {name:16s} T={T:4d} ({touched}/{E} experts): grouped_mm {row['grouped_mm_us']:7.1f} us "
          f"({2 * touched_bytes / 1e3 / row['grouped_mm_us']:.0f} GB/s) | kernel bf16 {best16:7.1f} "
          f"({2 * touched_bytes / 1e3 / best16:.0f} GB/s) | kernel fp8 {best8:7.1f} "
          f"({touched_bytes / 1e3 / best8:.0f} GB/s) | rel err bf16 {row['rel_err_bf16_kernel']:.1e}, "
          f"fp8 vs bf16 {row['rel_err_fp8_vs_bf16']:.1e} | {row}", flush=True)
    return row


def experts_lora(x, rows, ws, fp8, offsets, rank: int, block_n: int, g) -> dict:
    """One adapter's LoRA of rank ``rank`` on every expert, in the static decoder's layout (two
    groups: rows without an adapter, then the adapter's; every row here has it): the kernel with
    the term in its epilogue against the kernel followed by the grouped products of the term (the
    path before: gather, shrink, scale, expand, add)."""
    from ember.core.kernels import expert_decode
    from ember.core.kernels.grouped import grouped_linear

    E, N, K = ws[0].shape
    G, R, dev = 2, rows.shape[0], x.device
    A = torch.randn(E * G, rank, K, device=dev, dtype=torch.bfloat16, generator=g) * K**-0.5
    B = torch.randn(E * G, N, rank, device=dev, dtype=torch.bfloat16, generator=g) * 0.1
    group = torch.ones(R, dtype=torch.long, device=dev)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    pair_ends = torch.cumsum(torch.stack([torch.zeros_like(counts), counts], 1).flatten(), 0).to(torch.int32)
    scale = torch.ones(R, dtype=torch.bfloat16, device=dev)
    lo = expert_decode.ExpertLora(A, B, scale, group, G, pair_ends)

    def before(w, s=None):
        y = expert_decode.expert_linear(x, rows, w, offsets, s, block_n=block_n)
        h = grouped_linear(x[rows], A, pair_ends) * scale[:, None]
        return y + grouped_linear(h, B, pair_ends)

    ref = before(ws[0]).float()
    fused = expert_decode.expert_linear(x, rows, ws[0], offsets, block_n=block_n, lora=lo).float()
    out = {"lora_rank": rank, "lora_rel_err_vs_before": float((fused - ref).norm() / ref.norm()),
           "lora_before_bf16_us": graph_us([lambda w=w: before(w) for w in ws]),
           "lora_fused_bf16_us": graph_us(
               [lambda w=w: expert_decode.expert_linear(x, rows, w, offsets, block_n=block_n, lora=lo) for w in ws]),
           "lora_before_fp8_us": graph_us([lambda q=q, s=s: before(q, s) for q, s in fp8]),
           "lora_fused_fp8_us": graph_us(
               [lambda q=q, s=s: expert_decode.expert_linear(x, rows, q, offsets, s, block_n=block_n, lora=lo)
                for q, s in fp8])}
    print(f"    + LoRA rank {rank}: bf16 {out['lora_before_bf16_us']:.1f} -> {out['lora_fused_bf16_us']:.1f} us, "
          f"fp8 {out['lora_before_fp8_us']:.1f} -> {out['lora_fused_fp8_us']:.1f} us (term in the epilogue), "
          f"rel err {out['lora_rel_err_vs_before']:.1e}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256", help="comma list of row counts (decode batch sizes)")
    ap.add_argument("--pool", type=int, default=256, help="MiB of fp8 weight copies each timing cycles through")
    ap.add_argument("--quick", action="store_true", help="fewer launch shapes in the sweep")
    ap.add_argument("--only", default="check,sweep,experts")
    ap.add_argument("--tokens", default="64,256", help="experts: tokens of the decode step")
    ap.add_argument("--lora-rank", type=int, default=8,
                    help="experts: rank of the LoRA on every expert (0: none; rank 32 over top-8 gives 4, which "
                         "the static decoder's stacks pad to 8 for the grouped products)")
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
    if "experts" in parts:
        out["experts"] = experts([int(t) for t in args.tokens.split(",")], dev, args.lora_rank)
    print(f"done in {time.time() - t0:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_decode_gemm.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
