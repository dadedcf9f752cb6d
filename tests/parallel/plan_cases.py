"""Layouts too large to run here (32 ranks), checked on the meta device with a fake process group:
each rank's shapes, and the bytes it holds (the n-gram tables', in host memory, apart).
``python -m tests.parallel.plan_cases SHAPE WORLD EP RANK`` prints one JSON line (run in its own
process: it initialises torch.distributed)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from bench.common import SHAPES, ember_config
from ember.core.adapters import AdapterBank, _factor_shapes
from ember.core.layers.moe import Experts
from ember.core.layers.ngram_memory import NGramEmbedding
from ember.core.loading import build_empty
from ember.dist.mesh import Parallel
from ember.dist.parallelize import parallelize

# the released Qwen3.8-Flash-Next reads its n-gram table (PLE, 51.2 B parameters) at layer 2; the
# benchmark shape leaves it out (it does not fit one GPU's step), the plans check it
PLAN_SHAPES = {**SHAPES, "qwen3.8-flash-next-8l-ple": {**SHAPES["qwen3.8-flash-next-8l"], "ple_layer_ids": [2]}}


def _sizes(model) -> dict:
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    tables = [m.ngram_embedding.weight for m in model.modules() if isinstance(m, NGramEmbedding)]
    apart = {id(p) for m in experts for p in (m.gate_up_proj, m.down_proj)} | {id(t) for t in tables}
    bf16 = 2
    targets = AdapterBank(model, max_adapters=1, max_rank=32).targets
    rank32 = [_factor_shapes(t, 32) for t in targets if t.num_experts]
    return {
        "expert_blocks": sorted({(m.expert_start, m.num_experts, m.global_experts) for m in experts}),
        "expert_bytes": sum(p.numel() for m in experts for p in (m.gate_up_proj, m.down_proj)) * bf16,
        "dense_bytes": sum(p.numel() for p in model.parameters() if id(p) not in apart) * bf16,
        # the n-gram tables (host memory), their rows per rank
        "ngram_bytes": sum(t.numel() for t in tables) * bf16,
        "ngram_rows": [t.shape[0] for t in tables],
        "lora32_expert_bytes": sum(torch.Size(a).numel() + torch.Size(b).numel() for a, b in rank32) * 4,
    }


def plan(shape: str, world: int, ep: int, rank: int) -> dict:
    """This rank's sizes under the layout, and one process's (``whole``)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    cfg = ember_config(PLAN_SHAPES[shape])
    whole = _sizes(build_empty(cfg))
    mine = _sizes(parallelize(build_empty(cfg), Parallel(ep)))
    return {"shape": shape, "world": world, "ep": ep, "rank": rank, **mine, "whole": whole}


if __name__ == "__main__":
    shape, world, ep, rank = sys.argv[1], *map(int, sys.argv[2:5])
    print(json.dumps(plan(shape, world, ep, rank)))
