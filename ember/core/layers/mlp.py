"""SwiGLU feed-forward block."""

from __future__ import annotations

import torch
from torch import nn

from ember.core.layers.activations import silu_mul
from ember.core.layers.lora import LoraLinear, LoraRoute


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with LoRA-adaptable projections."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = LoraLinear(hidden, intermediate, bias, "mlp")
        self.up_proj = LoraLinear(hidden, intermediate, bias, "mlp")
        self.down_proj = LoraLinear(intermediate, hidden, bias, "mlp")

    def forward(self, x: torch.Tensor, lora: LoraRoute | None) -> torch.Tensor:
        act = lora.swiglu(self, x) if lora is not None else None  # the static decoder's one kernel
        if act is None:
            act = silu_mul(self.gate_proj(x, lora), self.up_proj(x, lora))
        return self.down_proj(act, lora)
