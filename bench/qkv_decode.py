"""The q/k/v kernel at Qwen3-8B's shapes: the packed q/k/v product followed by one launch that adds
its LoRA delta, normalises and rotates the queries and keys and stores the keys and values
(``kernels.qkv_decode``, what the static decoder runs with ``SamplerConfig.qkv_kernel``) against
the product followed by the three kernels it replaces (the LoRA expand, ``qk_norm_rope``,
``kv_write``). 36 layers in one CUDA graph, every layer's weights, factors and caches distinct (they
stream from HBM, as in a step), with programmatic dependent launch off and on (on Hopper), with the
adapters' LoRA and without any (the base model's rows: the norms, rotations and KV write alone).
Both ways run in the same process, alternating; the product alone is timed too, so the small
kernels' share of a step can be read off.

    python3 bench/qkv_decode.py                       # 64 rows of one adapter, 256 rows of eight
    python3 bench/qkv_decode.py --cases 64:1:32 --out bench-out
    python3 bench/qkv_decode.py --sweep               # and the kernel's rows a program and warps

``--sweep`` times the q/k/v kernel (with LoRA, dependent launch as the sampler's default) at each
launch choice of rows a program and warps, after checking that its queries equal the default
launch's (to a bf16 rounding); a choice that does not compile or differs is reported as such.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us, run_cases
from bench.lora_decode import HIDDEN, KV, LAYERS, Q
from ember.core.kernels import fused, pdl
from ember.core.kernels import lora_decode as ld
from ember.core.kernels import qkv_decode as qd
from ember.core.kernels.kv_write import kv_write
from ember.core.kernels.qkv_decode import QkvLora, qkv_rope_write
from ember.core.sampling.engine import SamplerConfig

D, PAGE = 128, 16
HQ, HK = Q // D, KV // D


def factors(busy: int, rank: int, dev: str) -> torch.Tensor:
    """A q/k/v group's ``B`` stack as ``LoraStacks`` lays it: block-diagonal over q, k and v, slot 0 zeros."""
    B = torch.zeros(busy + 1, Q + 2 * KV, 3 * rank, device=dev, dtype=torch.bfloat16)
    start = 0
    for j, width in enumerate((Q, KV, KV)):
        B[1:, start : start + width, j * rank : (j + 1) * rank] = torch.randn(busy, width, rank, device=dev) * rank**-0.5
        start += width
    return B


def case(rows: int, busy: int, rank: int, layers: int = LAYERS, dev: str = "cuda", time=graph_us,
         sweep: bool = False) -> dict:
    """µs a step (``layers`` layers) of each way, with and without LoRA, dependent launch off and on;
    ``sweep``: the q/k/v kernel's launch choices too."""
    x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    counts = torch.tensor([0] + [rows // busy] * busy)
    counts[-1] += rows - int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(dev)  # slot 0 empty, then the busy adapters'
    n_rows = torch.tensor([rows], dtype=torch.int32, device=dev)
    active = ld.active_groups(offsets, n_rows, skip_first=True, bound=busy)  # the static decoder's host bound
    pages = rows // PAGE + 2
    slots = torch.randperm(pages * PAGE, device=dev)[:rows]
    pos = torch.randint(0, 4096, (rows,), device=dev)
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    weights = []
    for _ in range(layers):
        W = torch.randn(Q + 2 * KV, HIDDEN, device=dev, dtype=torch.bfloat16) * HIDDEN**-0.5
        B = factors(busy, rank, dev)
        h = torch.randn(rows, 3 * rank, device=dev) * 0.1
        kc = torch.zeros(pages, PAGE, HK, D, device=dev, dtype=torch.bfloat16)
        norms = (1 + 0.1 * torch.randn(D, device=dev)).to(torch.bfloat16), (1 + 0.1 * torch.randn(D, device=dev)).to(
            torch.bfloat16), 1e-6, 1e-6, False
        weights.append((W, B, h, kc, torch.zeros_like(kc), norms))

    def three(lora: bool):
        def run(W, B, h, kc, vc, norms):
            y = torch.mm(x, W.t())
            if lora:
                ld.lora_expand_add(y, h, B, offsets, n_rows, True, active=active, splits=(Q, KV, KV))
            q, k = fused.qk_norm_rope(y[:, :Q].view(rows, HQ, D), y[:, Q : Q + KV].view(rows, HK, D), *norms, cos, sin)
            kv_write(kc, vc, k, y[:, Q + KV :].view(rows, HK, D), slots)
            return q
        return [lambda a=a: run(*a) for a in weights]

    def one(lora: bool):
        def run(W, B, h, kc, vc, norms):
            y = torch.mm(x, W.t())
            return qkv_rope_write(y, (HQ, HK), cos, sin, kc, vc, slots, norms,
                                  QkvLora(h, B, offsets, n_rows, active) if lora else None)
        return [lambda a=a: run(*a) for a in weights]

    out = {"product alone": time([lambda W=a[0]: torch.mm(x, W.t()) for a in weights]) * layers}
    for on in (False, True) if pdl.supported(x.device) else (False,):
        with pdl.launches(on):
            tag = "dependent launch" if on else "plain launch"
            for lora in (True, False):
                what = "LoRA" if lora else "no LoRA"
                for _ in range(2):  # alternating, twice each
                    for name, ways in (("three kernels", three), ("q/k/v kernel", one)):
                        us = time(ways(lora)) * layers
                        key = f"{tag}, {what}, {name}"
                        out[key] = min(out.get(key, us), us)
    if sweep:
        default = dict(qd._LAUNCH)
        with pdl.launches(SamplerConfig.dependent_launch and pdl.supported(x.device)):
            first = one(True)[0]
            want = first()
            for block_m, warps in itertools.product((16, 32), (2, 4, 8)):
                qd._LAUNCH.update(block_m=block_m, num_warps=warps)
                key = f"q/k/v kernel, LoRA, {block_m} rows a program, {warps} warps"
                try:
                    err = (first().float() - want.float()).abs().max() / want.float().abs().max()
                    if err > 1e-2:  # the same sums; only a bf16 rounding may differ
                        raise AssertionError(f"queries differ from the default launch's by {err:.1e}")
                    out[key] = time(one(True)) * layers
                except Exception as e:  # noqa: BLE001 - a choice that does not compile is reported, the rest run
                    print(f"  {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        qd._LAUNCH.update(default)
    return out


def main() -> None:
    run_cases(__doc__, "qkv_decode", case, LAYERS, flags={"sweep": "time the q/k/v kernel's launch choices too"})


if __name__ == "__main__":
    main()
