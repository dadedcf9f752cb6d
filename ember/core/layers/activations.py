"""Gated activations with a lean backward (keeps the two inputs, recomputes the nonlinearity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.core.kernels import fused
from ember.core.rebuild import rebuildable


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or wider if it is (fp64 references keep their precision)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, scale=None):
        ctx.save_for_backward(gate, up, scale)
        if scale is None:
            return F.silu(gate) * up
        return (F.silu(_wide(gate)) * _wide(up) * _wide(scale)[:, None]).to(gate.dtype)

    @staticmethod
    def backward(ctx, dy):
        gate, up, scale = ctx.saved_tensors
        g = _wide(gate)
        s = torch.sigmoid(g)
        silu = g * s
        dyf = _wide(dy)
        dscale = None
        if scale is not None:
            if ctx.needs_input_grad[2]:
                dscale = (dyf * silu * _wide(up)).sum(-1).to(scale.dtype)
            dyf = dyf * _wide(scale)[:, None]
        dgate = dyf * _wide(up) * (s * (1.0 + g * (1.0 - s)))
        dup = dyf * silu
        return dgate.to(gate.dtype), dup.to(up.dtype), dscale


def silu_mul(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``; with ``scale`` (``[rows]`` of 2-D inputs) each row times its
    scale, rounded once (an MoE layer's routing weights, gradient included)."""
    fn = fused.SiluMulFn.apply if fused.use_triton(gate, up) else _SiluMul.apply
    # the output is made again for whoever saves it (the down projection): the activation keeps its inputs
    return rebuildable(fn(gate, up, scale), fn, gate, up, scale)
