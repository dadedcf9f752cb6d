"""Routed experts plus a gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.8-Flash-Next; spec §3.7).

``y = Σ_k w_k Expert_k(x) + σ(shared_expert_gate(x)) · SharedExpert(x)``: the softmax top-k router and
the routed experts are :class:`~ember.core.layers.moe.SparseMoE`'s; the shared expert is a SwiGLU
(LoRA target, ``mlp``) scaled per token by a frozen scalar sigmoid gate.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.core.config import MoEConfig
from ember.core.layers.lora import LoraRoute
from ember.core.layers.mlp import SwiGLU
from ember.core.layers.moe import SparseMoE


class SharedExpertMoE(SparseMoE):
    """:class:`SparseMoE` plus ``shared_expert`` and its ``shared_expert_gate``."""

    def __init__(self, hidden: int, cfg: MoEConfig, layer: int):
        super().__init__(hidden, cfg, layer)
        self.shared_expert = SwiGLU(hidden, cfg.shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraRoute | None, routing=None) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora)
        return super().forward(x, lora, routing) + shared
