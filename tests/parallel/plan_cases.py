"""Layouts too large to run here (32 ranks), checked on the meta device with a fake process group:
each rank's shapes, and the bytes it holds. ``python -m tests.parallel.plan_cases SHAPE WORLD EP RANK``
prints one JSON line (run in its own process: it initialises torch.distributed)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from bench.common import SHAPES, ember_config
from ember.core.adapters import AdapterBank, _factor_shapes
from ember.core.layers.moe import Experts
from ember.core.loading import build_empty
from ember.dist.mesh import Parallel
from ember.dist.parallelize import parallelize


def _sizes(model) -> dict:
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    expert_params = {id(p) for m in experts for p in (m.gate_up_proj, m.down_proj)}
    bf16 = 2
    targets = AdapterBank(model, max_adapters=1, max_rank=32).targets
    rank32 = [_factor_shapes(t, 32) for t in targets if t.num_experts]
    return {
        "expert_blocks": sorted({(m.expert_start, m.num_experts, m.global_experts) for m in experts}),
        "expert_bytes": sum(p.numel() for m in experts for p in (m.gate_up_proj, m.down_proj)) * bf16,
        "dense_bytes": sum(p.numel() for p in model.parameters() if id(p) not in expert_params) * bf16,
        "lora32_expert_bytes": sum(torch.Size(a).numel() + torch.Size(b).numel() for a, b in rank32) * 4,
    }


def plan(shape: str, world: int, ep: int, rank: int) -> dict:
    """This rank's sizes under the layout, and one process's (``whole``)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    cfg = ember_config(SHAPES[shape])
    whole = _sizes(build_empty(cfg))
    mine = _sizes(parallelize(build_empty(cfg), Parallel(ep)))
    return {"shape": shape, "world": world, "ep": ep, "rank": rank, **mine, "whole": whole}


if __name__ == "__main__":
    shape, world, ep, rank = sys.argv[1], *map(int, sys.argv[2:5])
    print(json.dumps(plan(shape, world, ep, rank)))
