"""Apply a layout to a built model, in place, from outside the model code."""

from __future__ import annotations

import torch

from ember.core.config import TP_FAMILIES
from ember.core.models.base import CausalLM
from ember.dist.expert_parallel import shard_experts
from ember.dist.host_table import shard_tables
from ember.dist.mesh import Parallel
from ember.dist.sequence_parallel import apply_sequence_parallel
from ember.dist.tensor_parallel import shard_linears


def parallelize(model: CausalLM, parallel: Parallel) -> CausalLM:
    """Shard ``model`` for this rank of ``parallel``: its block of every MoE layer's experts
    (expert parallelism), its part of the attention heads and MLP width (tensor parallelism).
    Call it on the meta device, before loading, so that each rank reads only its own weights
    (:func:`ember.core.loading.load_model`'s ``parallelize``). Records the kind of every split LoRA
    factor on ``parallel`` (``factor_kinds``, and ``factor_pieces`` for factors made of several
    pieces; read by :mod:`ember.dist.adapters`)."""
    parallel.factor_kinds, parallel.factor_pieces = {}, {}
    if parallel.layout.ep > 1:
        shard_experts(model, parallel)
        shard_tables(model, parallel)  # n-gram tables: rows split over the expert group, in host memory
    if parallel.layout.tp > 1:
        if model.config.model_type not in TP_FAMILIES:
            raise ValueError(f"--tp is built for {', '.join(TP_FAMILIES)} so far, not {model.config.model_type}")
        parallel.factor_kinds, parallel.factor_pieces = shard_linears(model, parallel)
        apply_sequence_parallel(model, parallel, parallel.factor_kinds)
    if parallel.world > 1:
        model.model.embed_tokens.register_forward_hook(_track_gradients)
    return model


def _track_gradients(module, inputs, out: torch.Tensor) -> torch.Tensor:
    """Under grad mode, the embedding's output requires grad on every rank. A rank whose own
    tokens reach no trainable factor before an MoE layer would otherwise leave that layer's
    all-to-alls out of its backward while the other ranks run them (and wait for it)."""
    if torch.is_grad_enabled() and not out.requires_grad:
        out = out.detach().requires_grad_()
    return out
