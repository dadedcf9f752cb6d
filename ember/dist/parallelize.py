"""Apply a layout to a built model, in place, from outside the model code."""

from __future__ import annotations

from ember.core.models.base import CausalLM
from ember.dist.expert_parallel import shard_experts
from ember.dist.mesh import Parallel


def parallelize(model: CausalLM, parallel: Parallel) -> CausalLM:
    """Shard ``model`` for this rank of ``parallel``: its block of every MoE layer's experts
    (expert parallelism). Call it on the meta device, before loading, so that each rank reads
    only its own weights (:func:`ember.core.loading.load_model`'s ``parallelize``)."""
    if parallel.layout.ep > 1:
        shard_experts(model, parallel)
    return model
