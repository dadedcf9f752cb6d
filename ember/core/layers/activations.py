"""Gated activations with a lean backward (keeps the two inputs, recomputes the nonlinearity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.core.kernels import fused


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        g = gate.float()
        s = torch.sigmoid(g)
        silu = g * s
        dyf = dy.float()
        dgate = dyf * up.float() * (s * (1.0 + g * (1.0 - s)))
        dup = dyf * silu
        return dgate.to(gate.dtype), dup.to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``."""
    if fused.use_triton(gate, up):
        return fused.SiluMulFn.apply(gate, up)
    return _SiluMul.apply(gate, up)
