"""Shrink windows at Qwen3-8B's shapes: the base product of q/k/v, o and gate/up with each busy
adapter's LoRA ``A`` as extra rows (what the static decoder runs with ``SamplerConfig.shrink_windows``,
:class:`ember.core.sampling.packed_linears.PackedLinears`) against the base product followed by the
shrink kernel (``lora_decode.lora_shrink``, what it runs without). 36 layers of each product in one
CUDA graph, every layer's weights distinct (they stream from HBM, as in a step). Window rows are
timed as they are (``exact``) and rounded up to multiples of 128 and 256 rows.

    python3 bench/shrink_windows.py                  # 64 rows of one adapter, 256 rows of eight
    python3 bench/shrink_windows.py --cases 64:1:32,128:2:32 --out bench-out
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import graph_us, run_cases
from bench.lora_decode import GROUPS as SHAPES
from bench.lora_decode import HIDDEN, LAYERS
from ember.core.kernels import lora_decode as ld

# the groups whose shrink a window carries (the down projection's runs in the SwiGLU kernel):
# members, base rows; all read HIDDEN
GROUPS = {name: SHAPES[name][1:] for name in ("qkv", "o", "gate_up")}


def _round(rows: int, to: int) -> int:
    return -(-rows // to) * to


def group_us(x: torch.Tensor, groups: tuple, members: int, base_rows: int, busy: int, rank: int) -> dict[str, float]:
    """µs a step of one group's 36 products, each way."""
    offsets, n_rows, active = groups
    width = busy * members * rank
    most = _round(width, 256)
    Ws = [torch.randn(base_rows + most, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    As = [torch.randn(busy + 1, members * rank, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(LAYERS)]
    h = torch.zeros(x.shape[0], members * rank, dtype=torch.float32, device="cuda")

    def product(extra: int) -> list:
        return [lambda W=W: torch.mm(x, W[: base_rows + extra].t()) for W in Ws]

    shrink = [lambda W=W, A=A: (torch.mm(x, W[:base_rows].t()),
                                ld.lora_shrink(x, A, offsets, n_rows, True, out=h, active=active))
              for W, A in zip(Ws, As)]
    us = {
        "base": graph_us(product(0)),
        "base + shrink kernel": graph_us(shrink),
        "windows exact": graph_us(product(width)),
        "windows to 128": graph_us(product(_round(width, 128))),
        "windows to 256": graph_us(product(most)),
    }
    return {k: v * LAYERS for k, v in us.items()}


def case(rows: int, busy: int, rank: int) -> dict:
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    per = rows // busy
    offsets = torch.tensor([0] + [per * (i + 1) for i in range(busy - 1)] + [rows], dtype=torch.int32, device="cuda")
    n_rows = torch.tensor([rows], dtype=torch.int32, device="cuda")
    groups = (offsets, n_rows, ld.active_groups(offsets, n_rows, skip_first=True, bound=busy))
    out = {}
    for name, (members, base_rows) in GROUPS.items():
        out[name] = group_us(x, groups, members, base_rows, busy, rank)
        torch.cuda.empty_cache()
    out["step"] = {k: sum(out[g][k] for g in GROUPS) for k in out["qkv"]}
    return out


def main() -> None:
    run_cases(__doc__, "shrink_windows", case, LAYERS)


if __name__ == "__main__":
    main()
