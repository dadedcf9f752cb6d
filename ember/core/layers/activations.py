"""Gated activations with a lean backward (keeps the two inputs, recomputes the nonlinearity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.core.kernels import fused
from ember.core.rebuild import rebuildable


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or wider if it is (fp64 references keep their precision)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _grads(gate, up, scale, dy, need_dscale: bool):
    """The gradients of ``silu(gate) · up · scale`` (wide: fp32, or fp64 for fp64 inputs)."""
    g = _wide(gate)
    s = torch.sigmoid(g)
    silu = g * s
    dyf = _wide(dy)
    dscale = None
    if scale is not None:
        if need_dscale:
            dscale = (dyf * silu * _wide(up)).sum(-1).to(scale.dtype)
        dyf = dyf * _wide(scale)[:, None]
    return dyf * _wide(up) * (s * (1.0 + g * (1.0 - s))), dyf * silu, dscale


def _forward(gate, up, scale):
    if scale is None:
        return F.silu(gate) * up
    return (F.silu(_wide(gate)) * _wide(up) * _wide(scale)[:, None]).to(gate.dtype)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, scale=None):
        ctx.save_for_backward(gate, up, scale)
        return _forward(gate, up, scale)

    @staticmethod
    def backward(ctx, dy):
        gate, up, scale = ctx.saved_tensors
        dgate, dup, dscale = _grads(gate, up, scale, dy, scale is not None and ctx.needs_input_grad[2])
        return dgate.to(gate.dtype), dup.to(up.dtype), dscale


class _SiluMulPacked(torch.autograd.Function):
    """:class:`_SiluMul` of one ``[..., 2·I]`` tensor (gate first), its gradient one tensor."""

    @staticmethod
    def forward(ctx, gate_up, scale=None):
        ctx.save_for_backward(gate_up, scale)
        return _forward(*gate_up.chunk(2, dim=-1), scale)

    @staticmethod
    def backward(ctx, dy):
        gate_up, scale = ctx.saved_tensors
        dgate, dup, dscale = _grads(*gate_up.chunk(2, dim=-1), scale, dy, scale is not None and ctx.needs_input_grad[1])
        return torch.cat([dgate, dup], dim=-1).to(gate_up.dtype), dscale


def silu_mul(gate: torch.Tensor, up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``; with ``scale`` (``[rows]`` of 2-D inputs) each row times its
    scale, rounded once (an MoE layer's routing weights, gradient included)."""
    fn = fused.SiluMulFn.apply if fused.use_triton(gate, up) else _SiluMul.apply
    # the output is made again for whoever saves it (the down projection): the activation keeps its inputs
    return rebuildable(fn(gate, up, scale), fn, gate, up, scale)


def silu_mul_packed(gate_up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`silu_mul` of the two halves of ``gate_up`` (``[..., 2·I]``, gate first), whose
    gradient comes back as one tensor (on CUDA the kernel writes both halves; a ``chunk`` before
    :func:`silu_mul` would copy them into one in the backward)."""
    fn = fused.SiluMulPackedFn.apply if fused.use_triton(gate_up) else _SiluMulPacked.apply
    return rebuildable(fn(gate_up, scale), fn, gate_up, scale)


def _gate_formula(o: torch.Tensor, gate: torch.Tensor, wide: bool) -> torch.Tensor:
    if not wide:
        return o * torch.sigmoid(gate)
    f = torch.promote_types(o.dtype, torch.float32)
    return (o.to(f) * torch.sigmoid(gate.to(f))).to(o.dtype)


class _SigmoidGate(torch.autograd.Function):
    """:func:`sigmoid_gate`, keeping ``o`` and ``gate`` (where autograd of the formula keeps
    ``σ(gate)`` too, and fp32 copies of both with ``wide``). The backward runs autograd's own ops
    of the formula on them, σ again: bit for bit autograd's gradients."""

    @staticmethod
    def forward(ctx, o, gate, wide: bool):
        ctx.save_for_backward(o, gate)
        ctx.wide = wide
        return _gate_formula(o, gate, wide)

    @staticmethod
    def backward(ctx, g):
        o, gate = ctx.saved_tensors
        if not ctx.wide:
            s = torch.sigmoid(gate)
            return g * s, torch.ops.aten.sigmoid_backward(g * o, s), None
        f = torch.promote_types(o.dtype, torch.float32)
        s, gf = torch.sigmoid(gate.to(f)), g.to(f)
        return (gf * s).to(o.dtype), torch.ops.aten.sigmoid_backward(gf * o.to(f), s).to(gate.dtype), None


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """An output gate ``o · σ(gate)``: in the inputs' dtype (Qwen3-Next's gated attention), or with
    ``wide`` in fp32, rounded once (Inkling-2's). Keeps only ``o`` and ``gate`` (the attention's
    output and a projection's, which their producers keep), and its output is made again for
    whoever saves it (the output projection: ember.core.rebuild)."""
    return rebuildable(_SigmoidGate.apply(o, gate, wide), _SigmoidGate.apply, o, gate, wide)
