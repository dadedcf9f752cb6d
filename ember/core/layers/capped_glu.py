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

from ember.core.layers.moe import Experts
from ember.core.rebuild import rebuildable


class _SiTUGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, gate_cap: float, up_cap: float, scale=None):
        ctx.save_for_backward(gate, up, scale)
        ctx.caps = (gate_cap, up_cap)
        g, u = gate.float(), up.float()
        a = torch.tanh(g / gate_cap) * gate_cap * torch.sigmoid(g) * (torch.tanh(u / up_cap) * up_cap)
        return (a if scale is None else a * scale.float()[:, None]).to(gate.dtype)

    @staticmethod
    def backward(ctx, dy):
        gate, up, scale = ctx.saved_tensors
        gate_cap, up_cap = ctx.caps
        g, u = gate.float(), up.float()
        tg, tu = torch.tanh(g / gate_cap), torch.tanh(u / up_cap)
        s = torch.sigmoid(g)
        capped_up = tu * up_cap
        dyf = dy.float()
        dscale = None
        if scale is not None:
            if ctx.needs_input_grad[4]:
                dscale = (dyf * gate_cap * tg * s * capped_up).sum(-1).to(scale.dtype)
            dyf = dyf * scale.float()[:, None]
        dgate = dyf * capped_up * ((1.0 - tg * tg) * s + gate_cap * tg * s * (1.0 - s))
        dup = dyf * (gate_cap * tg * s) * (1.0 - tu * tu)
        return dgate.to(gate.dtype), dup.to(up.dtype), None, None, dscale


def situ_glu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float,
             scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gate_cap·tanh(g/gate_cap)·σ(g) · up_cap·tanh(u/up_cap)``, in fp32, cast to ``gate``'s dtype;
    with ``scale`` (``[rows]``) each row times its scale before the cast. The output is made again
    for whoever saves it (the down projection; the activation keeps its inputs: ember.core.rebuild)."""
    return rebuildable(_SiTUGLU.apply(gate, up, gate_cap, up_cap, scale), _SiTUGLU.apply, gate, up, gate_cap,
                       up_cap, scale)


class CappedGLUExperts(Experts):
    """Stacked experts with the softcapped SiTU-GLU activation, summing the top-k outputs in fp32 as
    transformers does; weights, LoRA names and grouped dispatch are :class:`Experts`'."""

    accumulate_fp32 = True

    def __init__(self, hidden: int, intermediate: int, num_experts: int, gate_cap: float, up_cap: float):
        super().__init__(hidden, intermediate, num_experts)
        self.gate_cap = gate_cap
        self.up_cap = up_cap

    def activation(self, gate_up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return situ_glu(*gate_up.chunk(2, dim=-1), self.gate_cap, self.up_cap, scale)
