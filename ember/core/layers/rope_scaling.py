"""Rotary tables from a raw Hugging Face rope-parameter dict, including YaRN.

:class:`~ember.core.layers.rope.RotaryEmbedding` covers the default, linear and Llama-3 rules from a
:class:`~ember.core.config.RopeConfig`. Families whose rope needs more than that (YaRN in DeepSeek-V3
and Olmo 3, per-layer-type rope parameters in Olmo 3) build their table here from the rope dict as
transformers stores it (``rope_parameters``, or one entry of it per layer type).

YaRN follows transformers 5.23 ``modeling_rope_utils._compute_yarn_parameters`` operation for
operation (Peng et al., arXiv:2309.00071), so the inverse frequencies are bit-identical.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ember.core.config import RopeConfig
from ember.core.layers.rope import RotaryEmbedding, inv_frequencies


class TableRotaryEmbedding(RotaryEmbedding):
    """A rotary embedding given directly by its inverse frequencies and cos/sin scaling."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float):
        self.inv_freq = inv_freq
        self.scaling = float(scaling)
        self.rotary_dim = 2 * inv_freq.numel()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 · mscale · ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_frequencies(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, truncate: bool = True
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies (fp32) and the cos/sin scaling (``attention_factor``)."""
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    orig = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor")
    if factor is None:  # DeepSeek-style configs: the ratio of the two context lengths
        factor = max_position_embeddings / orig
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def rotary_from_params(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, truncate: bool = True
) -> RotaryEmbedding:
    """The rotary embedding of one rope-parameter dict (``rope_type`` default, linear, llama3 or yarn).

    ``head_dim`` is the rotated head size before ``partial_rotary_factor``; ``truncate`` is
    transformers' top-level ``rope_parameters["truncate"]`` (YaRN only)."""
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "yarn":
        return TableRotaryEmbedding(*yarn_inv_frequencies(params, head_dim, max_position_embeddings, truncate))
    factor = params.get("factor")
    rope = RopeConfig(
        theta=float(params["rope_theta"]),
        type=str(rope_type),
        factor=float(factor) if factor is not None else 1.0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
    )
    return TableRotaryEmbedding(*inv_frequencies(rope, head_dim))
