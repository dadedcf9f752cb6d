"""Qwen3.8-Flash-Next's gated hyper-connections (spec §3.3; transformers ``Qwen4ExpTextGatedResidual``).

The residual stream is ``n`` streams side by side (``X`` ``[T, n·H]``). Each sublayer reads one input
from them and writes its output back to all of them::

    X̂    = GroupedRMSNorm(X)                         (per stream, scale 1 + w)
    read = mean_j( σ(W_up · silu(W_down X̂ / n))_j ⊙ X̂_j )          [T, H]
    ι    = 2·σ(W_inj X̂ / n)                                        [T, n]
    X'   = X + [ι_0 y, …, ι_{n-1} y]                    (y = sublayer(read); X un-normalised)

The final mixer only reads. All weights are frozen (not LoRA targets, spec §3.9).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.layers.norms import RMSNorm


class GroupedRMSNorm(RMSNorm):
    """Zero-centred RMSNorm over each of ``groups`` equal slices of the last dimension, with one
    weight of the full width (transformers ``Qwen4ExpTextRMSNorm(group_size=H)``)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__(dim, eps, zero_centred=True)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (self.groups, -1))
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


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
        n = self.streams
        normed = self.hc_norm(x)
        mix = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / n)))
        read = (mix.unflatten(-1, (n, -1)) * normed.unflatten(-1, (n, -1))).mean(-2)
        if self.block_inject_weight is None:
            return read, None
        return read, 2 * torch.sigmoid(self.block_inject_weight(normed) / n)

    @staticmethod
    def write(x: torch.Tensor, y: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """``x + [gates_j · y]_j`` over the streams."""
        return x + (y[:, None, :] * gates[..., None]).flatten(-2)
