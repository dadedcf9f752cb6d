"""The decode step's LoRA kernels (``ember.core.kernels.lora_decode``) at Qwen3-8B's shapes: the
shrink and the expand of each shared-input group (q/k/v, o, gate/up, down) of 36 layers, captured
in one CUDA graph as in a decode step (each layer's stacks distinct, so they stream from HBM), for
a sweep of launch configurations. Prints GPU microseconds per step for each configuration and the
bytes each kernel must move.

    python3 bench/lora_decode.py                       # workload a (64 rows, 1 adapter) and b (256 rows, 8)
    python3 bench/lora_decode.py --rows 64 --busy 1 --rank 32
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import copy_bandwidth, graph_us, hardware_line
from ember.core.kernels import lora_decode as ld

HIDDEN, INTER, Q, KV, LAYERS = 4096, 12288, 4096, 1024, 36
# shared-input group -> (in, members, out): the stacks' A is [G, members · r, in], B [G, out, members · r]
GROUPS = {"qkv": (HIDDEN, 3, Q + 2 * KV), "o": (Q, 1, HIDDEN), "gate_up": (HIDDEN, 2, 2 * INTER), "down": (INTER, 1, HIDDEN)}


def stacks(K: int, members: int, out: int, rank: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    R = members * rank
    A = torch.randn(slots + 1, R, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    B = torch.zeros(slots + 1, out, R, device="cuda", dtype=torch.bfloat16)
    o = 0
    for j in range(members):  # block-diagonal, as LoraStacks builds a shared-input group's B
        width = out // members
        B[:, o : o + width, j * rank : (j + 1) * rank] = torch.randn(slots + 1, width, rank, device="cuda") * rank**-0.5
        o += width
    A[0] = 0
    B[0] = 0
    return A, B


def row_groups(rows: int, busy: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``rows`` rows sorted over ``busy`` adapters (slots 1..busy, slot 0 empty), as a decode step
    gives them to the kernels: ``(offsets, n_rows, active groups)``."""
    counts = torch.zeros(busy + 1, dtype=torch.long)
    counts[1:] = rows // busy
    counts[-1] += rows - int(counts.sum())
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    n_rows = torch.tensor([rows], dtype=torch.int32, device="cuda")
    return offs, n_rows, ld.active_groups(offs, n_rows, skip_first=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--busy", default="1,8", help="adapters with rows, one per --rows entry")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/lora_decode.py times CUDA kernels: it needs a GPU")
    print(f"hardware: {hardware_line()}; torch {torch.__version__}")
    tbps = copy_bandwidth() / 1e12
    torch.manual_seed(0)
    for N, busy in zip(map(int, args.rows.split(",")), map(int, args.busy.split(","))):
        print(f"\n== {N} rows over {busy} adapter(s), rank {args.rank}, {args.layers} layers ==")
        offs, n_rows, active = row_groups(N, busy)
        total = {"shrink": 0.0, "expand": 0.0}
        best_total = {"shrink": 0.0, "expand": 0.0}
        for name, (K, members, out) in GROUPS.items():
            R = members * args.rank
            layers = [stacks(K, members, out, args.rank, busy) for _ in range(args.layers)]
            xs = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in layers]
            ys = [torch.randn(N, out, device="cuda", dtype=torch.bfloat16) for _ in layers]
            hs = [torch.zeros(N, R, device="cuda") for _ in layers]
            # correctness of every configuration against fp64, on layer 0
            exact = torch.zeros(N, R, dtype=torch.float64, device="cuda")
            start = 0
            for g, end in enumerate(offs.tolist()):
                if g and end > start:
                    exact[start:end] = xs[0][start:end].double() @ layers[0][0][g].double().T
                start = end
            read_s = 2 * (N * K + busy * R * K)
            read_e = 2 * (busy * out * R + 2 * N * out) + 4 * N * R
            floor_s = args.layers * read_s / (tbps * 1e6)
            floor_e = args.layers * read_e / (tbps * 1e6)
            default = ld.shrink_config(K, R, N)
            r_pad = max(16, 1 << (R - 1).bit_length())
            configs = {default}
            for bk, rb in itertools.product((64, 128, 256, 512), (16, 32, r_pad)):
                if rb <= r_pad and K % bk == 0:
                    configs.add((bk, rb))
            results = []
            for cfg in sorted(configs):
                h = torch.zeros(N, R, device="cuda")
                try:
                    ld.lora_shrink(xs[0], layers[0][0], offs, n_rows, True, out=h, active=active, config=cfg)
                except Exception as e:  # noqa: BLE001 - e.g. Triton's OutOfResources for a large tile
                    print(f"  config {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                err = float((h.double() - exact).norm() / exact.norm())
                calls = [
                    lambda x=x, A=A, h=h, c=cfg, o=offs, n=n_rows, a=active: ld.lora_shrink(x, A, o, n, True, out=h, active=a, config=c)
                    for x, (A, _), h in zip(xs, layers, hs)
                ]
                us = graph_us(calls, iters=10) * args.layers
                results.append((us, cfg, err))
            # programs per split across the active groups (each walks every GP-th group): the default
            # against one program per busy adapter and more
            for gp in (g for g in (8, 16) if busy > ld.GROUP_PROGRAMS and g <= 2 * busy):
                calls = [
                    lambda x=x, A=A, h=h, o=offs, n=n_rows, a=active, gp=gp:
                    ld.lora_shrink(x, A, o, n, True, out=h, active=a, group_programs=gp)
                    for x, (A, _), h in zip(xs, layers, hs)
                ]
                gp_us = graph_us(calls, iters=10) * args.layers
                print(f"  group_programs {gp} (default {ld.GROUP_PROGRAMS}), default blocks: {gp_us:7.1f} us per step")
            print(f"{name}: shrink [{N}, {K}] x [{R}, {K}]^T, floor {floor_s:.1f} us per step ({read_s / 1e6:.2f} MB a layer)")
            for us, cfg, err in sorted(results)[:6] + [r for r in results if r[1] == default]:
                mark = " (default)" if cfg == default else ""
                print(f"  block_k {cfg[0]:>3} r_block {cfg[1]:>3} splits {K // cfg[0]:>3}: "
                      f"{us:7.1f} us per step, err {err:.1e}{mark}")
            assert max(e for _, _, e in results) < 1e-2, "a shrink configuration is wrong"
            total["shrink"] += next(us for us, cfg, _ in results if cfg == default)
            best_total["shrink"] += min(us for us, _, _ in results)
            h = torch.randn(N, R, device="cuda")
            results = []
            for bo in (None, 32, 64, 128, 256):  # None: lora_decode.expand_block's choice
                calls = [
                    lambda y=y, B=B, bo=bo, h=h, o=offs, n=n_rows, a=active: ld.lora_expand_add(y, h, B, o, n, True, active=a, block_o=bo)
                    for y, (_, B) in zip(ys, layers)
                ]
                results.append((graph_us(calls, iters=10) * args.layers, f"block_o {bo or 'default'}"))
            if members > 1:  # B's diagonal blocks member by member (lora_expand_add's splits): the step's choice
                # for q/k/v (gate/up's expand runs inside the SwiGLU kernel, which does the same)
                splits = (out // members,) * members
                calls = [
                    lambda y=y, B=B, h=h, o=offs, n=n_rows, a=active, sp=splits: ld.lora_expand_add(y, h, B, o, n, True, active=a, splits=sp)
                    for y, (_, B) in zip(ys, layers)
                ]
                results.insert(0, (graph_us(calls, iters=10) * args.layers, "member by member (splits; the step's for q/k/v)"))
            print(f"{name}: expand [{N}, {R}] x [{out}, {R}]^T into y, floor {floor_e:.1f} us per step")
            for us, label in results:
                print(f"  {label}: {us:7.1f} us per step")
            for gp in (g for g in (8, 16) if busy > ld.GROUP_PROGRAMS and g <= 2 * busy):
                calls = [
                    lambda y=y, B=B, h=h, o=offs, n=n_rows, a=active, gp=gp:
                    ld.lora_expand_add(y, h, B, o, n, True, active=a, group_programs=gp)
                    for y, (_, B) in zip(ys, layers)
                ]
                gp_us = graph_us(calls, iters=10) * args.layers
                print(f"  group_programs {gp} (default {ld.GROUP_PROGRAMS}), default block_o: {gp_us:7.1f} us per step")
            total["expand"] += results[0][0]
            best_total["expand"] += min(us for us, _ in results)
            del layers, xs, ys, hs
            torch.cuda.empty_cache()
        print(f"step total, defaults: shrink {total['shrink']:.1f} us + expand {total['expand']:.1f} us; "
              f"best of each sweep: {best_total['shrink']:.1f} + {best_total['expand']:.1f} us")


if __name__ == "__main__":
    main()
