"""Inkling's residual short convolutions ("sconv", spec §1.5) over packed documents.

Depthwise causal convolutions with ``K`` taps (4 for Inkling), computed in fp32, residual and
rescaled (transformers ``Inkling2ShortConvolution`` / ``Inkling2DynamicShortConvolution``)::

    static:   y_t = (x_t + Σ_{j<K} w[c, K-1-j] · x_{t-j})                / sqrt(K + 1)
    dynamic:  y_t = (x_t + Σ_{j<K} (s[j, c] + d_t[head(c), j]) · x_{t-j}) / sqrt(2K + 1)

``w`` is a ``Conv1d`` weight ``[C, 1, K]`` (tap ``K-1`` is the current token); ``s`` a static tap
table ``[K, C]`` indexed by backward distance and ``d_t = weight_proj(u_t)`` per-token taps shared
by the channels of one key/value head (full-attention keys and values).

A token only sees its own document (``seq_lens``); a decoding sequence continues from the last
``K - 1`` inputs of its previous passes, read from and written to ``state`` under ``(layer, name)``
(:mod:`ember.core.layers.packed_conv` does the packing).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ember.core.layers.packed_conv import causal_conv, extend_with_history


def _history(state, layer: int, name: str) -> torch.Tensor | None:
    if state is None:
        return None
    h = state.get(layer, name)
    return None if h is None else h.float()


class ShortConvolution(nn.Module):
    """Residual depthwise causal convolution with static taps."""

    def __init__(self, channels: int, kernel: int, layer: int, name: str):
        super().__init__()
        self.kernel = kernel
        self.layer = layer
        self.name = name
        # a Conv1d only as the holder of the [C, 1, K] weight, so checkpoints load by name
        self.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=False)

    def forward(self, x: torch.Tensor, seq_lens: list[int], state=None) -> torch.Tensor:
        xf = x.float()
        w = self.conv1d.weight.float()[:, 0, :]
        y, tail = causal_conv(xf, w, seq_lens, _history(state, self.layer, self.name))
        if state is not None:
            state.put(self.layer, self.name, tail)
        return ((y + xf) / math.sqrt(self.kernel + 1)).to(x.dtype)


class DynamicShortConvolution(nn.Module):
    """Residual causal convolution whose taps add per-token, per-head taps (projected from
    ``tap_input``) to static per-channel taps."""

    def __init__(self, channels: int, input_size: int, num_heads: int, kernel: int, layer: int, name: str):
        super().__init__()
        self.kernel = kernel
        self.num_heads = num_heads
        self.layer = layer
        self.name = name
        self.static_weight = nn.Parameter(torch.zeros(kernel, channels))  # [j] weights the token j back
        self.weight_proj = nn.Linear(input_size, num_heads * kernel, bias=False)

    def forward(self, x: torch.Tensor, tap_input: torch.Tensor, seq_lens: list[int], state=None) -> torch.Tensor:
        T, C = x.shape
        H, K = self.num_heads, self.kernel
        taps = self.weight_proj(tap_input).float().view(T, H, 1, K)
        static = self.static_weight.float().view(K, H, C // H)
        xf = x.float()
        ext, index, last = extend_with_history(xf, seq_lens, _history(state, self.layer, self.name), K - 1)
        y = torch.zeros_like(xf).view(T, H, C // H)
        for j in range(K):
            y = y + ext[index - j].view(T, H, C // H) * (static[j] + taps[..., j])
        if state is not None:
            state.put(self.layer, self.name, ext[last])
        return ((y.reshape(T, C) + xf) / math.sqrt(2 * K + 1)).to(x.dtype)
