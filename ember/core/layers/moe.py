"""Mixture-of-experts block: router, grouped expert products, per-expert LoRA.

Tokens are dispatched as (token, k) rows sorted by expert; the experts run as one grouped product per
projection (``torch._grouped_mm`` on Hopper). When the batch mixes adapters the rows are sorted by
(expert, adapter group) so that each expert's rows stay contiguous for the base product and each
(expert, adapter) pair is contiguous for its LoRA product.

Weights follow the transformers 5 layout: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
``down_proj`` ``[E, H, I]``; expert LoRA adapts those two stacked parameters (PEFT's
``target_parameters``), with factors ``A`` ``[E, r, in]`` and ``B`` ``[E, out, r]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.config import MoEConfig
from ember.core.kernels.grouped import grouped_linear, offsets_from_sizes
from ember.core.layers.activations import silu_mul
from ember.core.layers.lora import LoraRoute

if TYPE_CHECKING:
    from ember.core.models.base import RoutingRecord


@dataclass
class Routing:
    """The experts chosen for each token (``[T, k]``) and their mixing weights."""

    experts: torch.Tensor
    weights: torch.Tensor


class SoftmaxTopKRouter(nn.Module):
    """Qwen-style router: softmax over all experts in fp32, top-k, optional renormalisation."""

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        """Route ``x``; with ``replay`` (``[T, k]`` expert ids) keep those experts and take their
        weights from the live probabilities, so gradients still reach the router (R3)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if replay is not None:
            idx = replay.to(device=x.device, dtype=torch.long)
            top = probs.gather(1, idx)
        else:
            top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(experts=idx, weights=top.to(logits.dtype))


class Experts(nn.Module):
    """Stacked SwiGLU experts, run as grouped products."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.lora_name = ""
        self.category = "mlp"

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each adaptable stacked parameter, keyed by its LoRA name suffix."""
        E, two_i, h = self.gate_up_proj.shape
        return {"gate_up_proj": (h, two_i), "down_proj": (two_i // 2, h)}

    def forward(self, x: torch.Tensor, routing: Routing, lora: LoraRoute | None) -> torch.Tensor:
        T = x.shape[0]
        k = routing.experts.shape[1]
        flat_expert = routing.experts.reshape(-1)
        flat_token = torch.arange(T, device=x.device).repeat_interleave(k)
        groups = len(lora.groups) if lora is not None else 1
        if groups > 1:
            row_group_all = lora.token_group()[flat_token]
            key = flat_expert * groups + row_group_all
        else:
            key = flat_expert
        order = torch.argsort(key, stable=True)
        token = flat_token[order]
        xs = x[token]
        expert_offsets = offsets_from_sizes(torch.bincount(flat_expert, minlength=self.num_experts), x.device)
        row_group = pair_offsets = None
        if lora is not None and groups > 1:
            row_group = row_group_all[order]
            pair_offsets = offsets_from_sizes(torch.bincount(key, minlength=self.num_experts * groups), x.device)

        def project(inp, weight, suffix):
            y = grouped_linear(inp, weight, expert_offsets)
            if lora is not None:
                d = lora.expert_delta(f"{self.lora_name}.{suffix}", inp, row_group, expert_offsets, pair_offsets)
                if d is not None:
                    y = y + d
            return y

        gate, up = project(xs, self.gate_up_proj, "gate_up_proj").chunk(2, dim=-1)
        out = project(silu_mul(gate, up), self.down_proj, "down_proj")
        out = out * routing.weights.reshape(-1)[order][:, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)


class SparseMoE(nn.Module):
    """Router + routed experts (Qwen3-MoE)."""

    def __init__(self, hidden: int, cfg: MoEConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.gate = SoftmaxTopKRouter(hidden, cfg)
        self.experts = Experts(hidden, cfg.intermediate_size, cfg.num_experts)

    def forward(self, x: torch.Tensor, lora: LoraRoute | None, routing: RoutingRecord | None = None) -> torch.Tensor:
        replay = routing.replay.get(self.layer) if routing is not None and routing.replay else None
        r = self.gate(x, replay)
        if routing is not None and routing.record is not None:
            routing.record[self.layer] = r.experts.detach()
        return self.experts(x, r, lora)
