"""Qwen3.8-Flash-Next's gated hyper-connections (spec §3.3; transformers ``Qwen4ExpTextGatedResidual``).

The residual stream is ``n`` streams side by side (``X`` ``[T, n·H]``). Each sublayer reads one input
from them and writes its output back to all of them::

    X̂    = GroupedRMSNorm(X)                         (per stream, scale 1 + w)
    read = mean_j( σ(W_up · silu(W_down X̂ / n))_j ⊙ X̂_j )          [T, H]
    ι    = 2·σ(W_inj X̂ / n)                                        [T, n]
    X'   = X + [ι_0 y, …, ι_{n-1} y]                    (y = sublayer(read); X un-normalised)

The final mixer only reads. All weights are frozen (not LoRA targets, spec §3.9).

On CUDA the read and the write run as fused kernels with their own backward
(:mod:`ember.core.kernels.hyper`): eagerly they are a dozen elementwise passes over ``[T, n·H]``
each way, and elementwise kernels led the profile of a Qwen3.8-Flash-Next training step (``mul``
alone 19 % of its GPU time, more than the grouped expert GEMMs). The eager functions below are
the definition, the CPU path and the reference (``bench/gpu_checks.py hc`` compares the two on
the GPU; ``tests/unit/test_hyper_kernels.py`` on the CPU, under Triton's interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.kernels import fused
from ember.core.kernels.hyper import HyperRead, HyperWrite
from ember.core.layers.norms import RMSNorm


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of each of ``groups`` equal slices of ``x``'s last dimension (fp32),
    scaled by ``1 + weight`` (full width)."""
    xf = x.float().unflatten(-1, (groups, -1))
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (y * (1.0 + weight.float())).to(x.dtype)


def hc_read(x, norm_weight, down, up, inject, streams: int, eps: float):
    """``(read [T, H], gates [T, n] or None)`` of one site (module doc), weights as tensors."""
    n = streams
    normed = grouped_rms_norm(x, norm_weight, n, eps)
    mix = torch.sigmoid(F.linear(F.silu(F.linear(normed, down) / n), up))
    read = (mix.unflatten(-1, (n, -1)) * normed.unflatten(-1, (n, -1))).mean(-2)
    gates = None if inject is None else 2 * torch.sigmoid(F.linear(normed, inject) / n)
    return read, gates


def hc_write(x: torch.Tensor, y: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """``x + [gates_j · y]_j`` over the streams."""
    return x + (y[:, None, :] * gates[..., None]).flatten(-2)


class GroupedRMSNorm(RMSNorm):
    """Zero-centred RMSNorm over each of ``groups`` equal slices of the last dimension, with one
    weight of the full width (transformers ``Qwen4ExpTextRMSNorm(group_size=H)``)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__(dim, eps, zero_centred=True)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_rms_norm(x, self.weight, self.groups, self.eps)


class GatedResidual(nn.Module):
    """One hyper-connection site: ``read`` mixes the streams into a sublayer input; ``write`` adds the
    sublayer output back to every stream with its injection gate."""

    def __init__(self, hidden: int, streams: int, rank: int, eps: float, inject: bool = True):
        super().__init__()
        self.streams = streams
        self.hc_norm = GroupedRMSNorm(streams * hidden, streams, eps)
        self.input_mix_weight_down = nn.Linear(streams * hidden, rank, bias=False)
        self.input_mix_weight_up = nn.Linear(rank, streams * hidden, bias=False)
        self.block_inject_weight = nn.Linear(streams * hidden, streams, bias=False) if inject else None

    def read(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sublayer input ``[T, H]`` and the write gates ``[T, n]`` (``None`` for the final mixer)."""
        inject = self.block_inject_weight.weight if self.block_inject_weight is not None else None
        args = (x, self.hc_norm.weight, self.input_mix_weight_down.weight, self.input_mix_weight_up.weight, inject,
                self.streams, self.hc_norm.eps)
        if not fused.use_triton(x) or any(w is not None and w.requires_grad for w in args[1:5]):
            return hc_read(*args)  # the kernels give no weight gradients (the weights are frozen)
        read, gates = HyperRead.apply(*args)
        return read, (gates if inject is not None else None)

    @staticmethod
    def write(x: torch.Tensor, y: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``x + [gates_j · y]_j`` over the streams."""
        return HyperWrite.apply(x, y, gates) if fused.use_triton(x) else hc_write(x, y, gates)
