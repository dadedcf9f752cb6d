"""RMSNorm with a memory-lean backward.

A plain autograd RMSNorm keeps several fp32 copies of its input for the backward pass; at 16k tokens
that is gigabytes per layer. This one keeps the input (in its own dtype) and one fp32 scalar per row,
and recomputes the rest. Numerics follow Hugging Face: normalise in fp32, cast to the input dtype,
then multiply by the weight (``w * x̂``), or by ``1 + w`` for zero-centred norms (Qwen3-Next, Gemma);
``fp32_product`` multiplies by ``w`` in fp32 before the cast (Olmo's order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.kernels import fused
from ember.core.rebuild import rebuildable


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, zero_centred: bool, fp32_product: bool = False):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if zero_centred:
            y = (xf * rstd * (1.0 + weight.float())).to(x.dtype)
        elif fp32_product:
            y = (weight.float() * (xf * rstd)).to(x.dtype)
        else:
            y = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centred = zero_centred
        ctx.fp32_product = fp32_product or zero_centred
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        w = weight.float() + (1.0 if ctx.zero_centred else 0.0)
        dxhat = dy.float() * w
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        dw = None
        if ctx.needs_input_grad[1]:
            n = xhat if ctx.fp32_product else xhat.to(x.dtype).float()
            dw = (dy.float() * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dw, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False,
             fp32_product: bool = False) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` and scale by ``weight`` (or ``1 + weight``; in
    fp32 before the cast with ``fp32_product``)."""
    fn = fused.RMSNormFn.apply if fused.use_triton(x, weight) else _RMSNorm.apply
    # the output is made again for whoever saves it (the next LoRA product): the norm keeps x
    return rebuildable(fn(x, weight, eps, zero_centred, fp32_product), fn, x, weight, eps, zero_centred, fp32_product)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False,
                 fp32_product: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + r, rms_norm(x + r))``: a pre-norm block's residual add and the next norm. In a pass
    without gradients on the GPU (the sampler's) one kernel does both (a decode layer's launch
    fewer; the same values)."""
    if not torch.is_grad_enabled() and x.dtype == r.dtype and x.shape == r.shape and fused.use_triton(x, r, weight):
        return fused.add_rms_norm(x, r, weight, eps, zero_centred, fp32_product)
    s = x + r
    return s, rms_norm(s, weight, eps, zero_centred, fp32_product)


class _GatedRMSNorm(torch.autograd.Function):
    """The PyTorch gated norm (:func:`gated_rms_norm`), keeping ``x``, ``gate`` and one scalar per
    row, where autograd of the formula keeps several fp32 copies."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps: float, sigmoid: bool):
        f = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(f)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = weight * (xf * rstd).to(x.dtype)
        g = gate.to(f)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.sigmoid = sigmoid
        return (y * (torch.sigmoid(g) if sigmoid else F.silu(g))).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        f = rstd.dtype
        xhat = x.to(f) * rstd
        n = xhat.to(x.dtype)
        y = (weight * n).to(f)
        g = gate.to(f)
        s = torch.sigmoid(g)
        act, dact = (s, s * (1 - s)) if ctx.sigmoid else (g * s, s * (1 + g * (1 - s)))
        dyf = dy.to(f)
        dg = dyf * y * dact
        dn = dyf * act * weight.to(f)
        dx = rstd * (dn - xhat * (dn * xhat).mean(-1, keepdim=True))
        dw = None
        if ctx.needs_input_grad[2]:
            dw = (dyf * act * n.to(f)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dg.to(gate.dtype), dw, None, None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   sigmoid: bool = False) -> torch.Tensor:
    """``(w · RMSNorm(x)) · act(gate)`` over the last dimension, transformers' ``RMSNormGated``
    order: normalise in fp32, cast to ``x``'s dtype, scale by ``w``, then times ``silu(gate)``
    (``sigmoid``: ``σ(gate)``) in fp32 and cast back. One Triton kernel each way on CUDA. The output
    is made again for whoever saves it (the output projection: ember.core.rebuild)."""
    fn = fused.GatedRMSNormFn.apply if fused.use_triton(x, gate, weight) else _GatedRMSNorm.apply
    return rebuildable(fn(x, gate, weight, eps, sigmoid), fn, x, gate, weight, eps, sigmoid)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; ``zero_centred`` stores ``w`` with the scale ``1 + w``."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centred)

    def add(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + r, self(x + r))`` (:func:`add_rms_norm`)."""
        return add_rms_norm(x, r, self.weight, self.eps, self.zero_centred)
