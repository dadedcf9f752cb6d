"""Times of an MoE layer's row operations at Qwen3-30B-A3B's training shape (8 x 2048 tokens,
top-8, hidden 2048, expert width 768), each against the plain PyTorch form it replaces (GPU;
information only)::

    python3 bench/moe_parts.py

* combine: each token's sum of its k rows, ``sum_rows`` (one Triton kernel on CUDA) against
  PyTorch's gather + sum and ``embedding_bag``; and of two tensors' rows (the expert products and
  their LoRA correction, also the input gradient's two parts) against ``a + b``, gather and sum;
* weighted activation: ``silu(g)·u·w`` of the packed gate_up (its gradient written as one tensor),
  against the same after a ``chunk`` (whose backward copies the two halves' gradients into one) and
  against silu_mul then a row scale, forward and backward (with the scale's gradient).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import event_time_ms
from ember.core.layers.activations import silu_mul, silu_mul_packed
from ember.core.layers.moe import sum_rows


def main() -> None:
    T, k, H, I = 16384, 8, 2048, 768
    dev, dt = "cuda", torch.bfloat16
    rows = torch.randn(T * k, H, device=dev, dtype=dt)
    correction = torch.randn(T * k, H, device=dev, dtype=dt)
    inverse = torch.randperm(T * k, device=dev)
    bags = inverse.view(T, k)
    row_gb = rows.numel() * 2 / 1e9
    for name, fn, gb in (
        ("sum_rows (kernel)", lambda: sum_rows(rows, inverse, T), row_gb * (1 + 1 / k)),
        ("gather + sum", lambda: rows[inverse].view(T, k, H).sum(1), row_gb * (3 + 1 / k)),
        ("embedding_bag", lambda: torch.nn.functional.embedding_bag(bags, rows, mode="sum"), row_gb * (1 + 1 / k)),
        ("sum_rows of rows + correction (kernel)", lambda: sum_rows(rows, inverse, T, extra=correction),
         row_gb * (2 + 1 / k)),
        ("rows + correction, gather + sum", lambda: (rows + correction)[inverse].view(T, k, H).sum(1),
         row_gb * (6 + 1 / k)),
    ):
        ms = event_time_ms(fn, 3, 20)
        print(f"combine {name}: {ms:.3f} ms, {gb:.2f} GB moved at least: {gb / ms:.2f} TB/s")
    want = (rows.float() + correction.float())[inverse].view(T, k, H).sum(1)
    got = sum_rows(rows, inverse, T, extra=correction).float()
    print(f"  kernel against fp32: {((got - want).norm() / want.norm()).item():.2e} (bf16 rounding once)")

    gu = torch.randn(T * k, 2 * I, device=dev, dtype=dt, requires_grad=True)
    w = torch.rand(T * k, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(T * k, I, device=dev, dtype=dt)

    def packed():
        silu_mul_packed(gu, w).backward(dy)

    def fused():
        g, u = gu.chunk(2, -1)
        silu_mul(g, u, w).backward(dy)

    def separate():
        g, u = gu.chunk(2, -1)
        a = silu_mul(g, u)
        y = a * w[:, None]
        y.backward(dy)

    for name, fn in (("packed gate_up (one gradient), fused row scale", packed),
                     ("chunk, fused row scale (the chunk's backward copies both halves)", fused),
                     ("chunk, silu_mul, then the scale", separate)):
        ms = event_time_ms(fn, 3, 20)
        print(f"weighted activation fwd+bwd {name}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
