"""Rotary position embeddings (``rotate_half`` convention), with Llama-3 frequency scaling.

``inv_freq`` follows transformers' ``modeling_rope_utils`` so that positions rotate exactly as the
reference does; ``partial_rotary_factor`` rotates only the leading channels of each head.
"""

from __future__ import annotations

import math

import torch

from ember.core.batch import to_device
from ember.core.config import RopeConfig
from ember.core.kernels import fused
from ember.core.rebuild import rebuildable


def inv_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (fp32, length ``rotary_dim / 2``) and the attention scaling factor."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if rope.type in ("default", "linear"):
        if rope.type == "linear":
            inv_freq = inv_freq / rope.factor
        return inv_freq, 1.0
    if rope.type == "llama3":
        old_ctx = rope.original_max_position_embeddings or 8192
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise NotImplementedError(f"rope type {rope.type!r} is not supported yet")


class RotaryEmbedding:
    """cos/sin tables for the positions of a batch."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.inv_freq, self.scaling = inv_frequencies(rope, head_dim)
        self.rotary_dim = 2 * self.inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[T, rotary_dim]`` for integer ``positions`` ``[T]``, cast to ``dtype``
        (as the reference does before rotating)."""
        inv = to_device(self.inv_freq, positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``; only the first ``cos.shape[-1]`` channels rotate."""
    fn = fused.RopeFn.apply if fused.use_triton(x, cos) else _rotate
    # a rotated norm output (q/k norms) is made again from the norm's input for attention's backward
    return rebuildable(fn(x, cos, sin), fn, x, cos, sin, chained=True)


def norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope(q_norm(q)), rope(k_norm(k))`` for ``[T, heads, head_dim]`` queries and keys
    (:class:`~ember.core.layers.norms.RMSNorm` modules, or both None: the rotation alone). In a pass
    without gradients on the GPU (the sampler's: prefill and decode) one kernel does both norms and
    both rotations, reading the heads through their strides; a decode step's attention otherwise
    spent six launches here (two copies of the packed projection's strided heads, two norms, two
    rotations). The values are those of the separate kernels."""
    norms = qk_norms(q_norm, k_norm, q.dtype) if q.dtype == k.dtype else False
    if norms is not False and not torch.is_grad_enabled() and fused.use_triton(q, k, cos):
        return fused.qk_norm_rope(q, k, *(norms or (None, None, 0.0, 0.0, False)), cos, sin)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def qk_norms(q_norm, k_norm, dtype: torch.dtype) -> tuple | None | bool:
    """The q/k RMSNorms as the fused kernels take them, ``(q_weight, k_weight, eps_q, eps_k,
    zero_centred)``; ``None`` without norms; ``False`` where one kernel cannot do both (the norms
    differ in kind, or their weights are not in ``dtype``)."""
    if q_norm is None:
        return None
    w = q_norm.weight
    if q_norm.zero_centred != k_norm.zero_centred or not w.dtype == k_norm.weight.dtype == dtype:
        return False
    return w, k_norm.weight, q_norm.eps, k_norm.eps, q_norm.zero_centred


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos[:, None, :], sin[:, None, :]
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
