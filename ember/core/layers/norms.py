"""RMSNorm with a memory-lean backward.

A plain autograd RMSNorm keeps several fp32 copies of its input for the backward pass; at 16k tokens
that is gigabytes per layer. This one keeps the input (in its own dtype) and one fp32 scalar per row,
and recomputes the rest. Numerics follow Hugging Face: normalise in fp32, cast to the input dtype,
then multiply by the weight (``w * x̂``), or by ``1 + w`` for zero-centred norms (Qwen3-Next, Gemma);
``fp32_product`` multiplies by ``w`` in fp32 before the cast (Olmo's order).
"""

from __future__ import annotations

import torch
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


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; ``zero_centred`` stores ``w`` with the scale ``1 + w``."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centred: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centred = zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centred)
