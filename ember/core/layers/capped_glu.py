"""Softcapped SiTU-GLU experts (spec §1.2; transformers ``Inkling2SoftcappedSwiGLU``).

::

    a = β1·tanh(g/β1) · σ(g) · β2·tanh(u/β2)         (fp32; Inkling-2: β1 = 4, β2 = 25)

The sigmoid sees the raw gate; the caps only bound the gate's linear factor and ``up``. The
backward keeps ``g`` and ``u`` and recomputes the rest::

    da/dg = [(1 - tanh²(g/β1))·σ(g) + β1·tanh(g/β1)·σ(g)(1 - σ(g))] · β2·tanh(u/β2)
    da/du = β1·tanh(g/β1)·σ(g) · (1 - tanh²(u/β2))
"""

from __future__ import annotations

import torch

from ember.core.kernels.grouped import offsets_from_sizes
from ember.core.layers.lora import LoraRoute
from ember.core.layers.moe import Experts, Routing, _ExpertProjection


class _SiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, gate_cap: float, up_cap: float):
        ctx.save_for_backward(gate, up)
        ctx.caps = (gate_cap, up_cap)
        g, u = gate.float(), up.float()
        return (torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)).to(
            gate.dtype
        )

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        gate_cap, up_cap = ctx.caps
        g, u = gate.float(), up.float()
        tg, tu = torch.tanh(g / gate_cap), torch.tanh(u / up_cap)
        s = torch.sigmoid(g)
        capped_up = tu * up_cap
        dyf = dy.float()
        dgate = dyf * capped_up * ((1.0 - tg * tg) * s + gate_cap * tg * s * (1.0 - s))
        dup = dyf * (gate_cap * tg * s) * (1.0 - tu * tu)
        return dgate.to(gate.dtype), dup.to(up.dtype), None, None


def situ_glu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """``gate_cap·tanh(g/gate_cap)·σ(g) · up_cap·tanh(u/up_cap)``, in fp32, cast to ``gate``'s dtype."""
    return _SiTUGLU.apply(gate, up, gate_cap, up_cap)


class CappedGLUExperts(Experts):
    """Stacked experts with the softcapped SiTU-GLU activation: the weights, LoRA names and grouped
    dispatch of :class:`~ember.core.layers.moe.Experts` (whose forward hard-wires SwiGLU, hence the
    copy below with only the activation changed), plus the fp32 accumulation of the top-k outputs
    that transformers does."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, gate_cap: float, up_cap: float):
        super().__init__(hidden, intermediate, num_experts)
        self.gate_cap = gate_cap
        self.up_cap = up_cap

    def forward(self, x: torch.Tensor, routing: Routing, lora: LoraRoute | None) -> torch.Tensor:
        T = x.shape[0]
        k = routing.experts.shape[1]
        flat_expert = routing.experts.reshape(-1)
        flat_token = torch.arange(T, device=x.device).repeat_interleave(k)
        groups = len(lora.groups) if lora is not None else 1
        if groups > 1:
            row_group = lora.token_group()[flat_token]
            key = flat_expert * groups + row_group
        else:
            row_group = torch.zeros_like(flat_expert)
            key = flat_expert
        order = torch.argsort(key, stable=True)
        token = flat_token[order]
        row_group = row_group[order]
        expert_offsets = offsets_from_sizes(torch.bincount(flat_expert, minlength=self.num_experts), x.device)
        pair_offsets = expert_offsets
        if groups > 1:
            pair_offsets = offsets_from_sizes(torch.bincount(key, minlength=self.num_experts * groups), x.device)

        def project(inp, rows, in_scale, weight, suffix):
            factors = None
            if lora is not None:
                factors = lora.expert_factors(f"{self.lora_name}.{suffix}", row_group, inp.dtype)
            if factors is None:
                return _ExpertProjection.apply(inp, rows, in_scale, weight, expert_offsets, None, None, None, None)
            A, B, scale_rows = factors
            lora_offsets = expert_offsets if groups == 1 else pair_offsets
            return _ExpertProjection.apply(inp, rows, in_scale, weight, expert_offsets, lora_offsets, scale_rows, A, B)

        gate, up = project(x, token, None, self.gate_up_proj, "gate_up_proj").chunk(2, dim=-1)
        weights = routing.weights.reshape(-1)[order]
        # the routing weight scales the down projection's input rows (the same: it is linear)
        out = project(situ_glu(gate, up, self.gate_cap, self.up_cap), None, weights, self.down_proj, "down_proj")
        return x.new_zeros(x.shape, dtype=torch.float32).index_add_(0, token, out.float()).to(x.dtype)
