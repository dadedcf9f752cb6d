"""Multi-head latent attention (MLA) of DeepSeek-V2/V3 and GLM-4.7-Flash (spec §4.1).

Queries come from an optional low-rank latent (``q_a_proj`` → RMSNorm → ``q_b_proj``, or one
``q_proj``); keys and values from one compressed latent per token (``kv_a_proj_with_mqa`` → RMSNorm
→ ``kv_b_proj``) plus ONE rotary key head shared by all heads. Each head's query and key are
``[nope | rope]``; values have their own size ``v_head_dim``.

The layer attends through ``ctx.attend`` with per-head keys (the shared rotary part broadcast) and
values of a different head size, so packed training and any KV cache see an ordinary attention
layer. (The "absorbed" form that caches only the latent is an inference optimisation.)

Checkpoints store the rotary channels as interleaved pairs ``(x0, x1), (x2, x3), …``
(``rope_interleave``). We de-interleave them to ``[evens | odds]`` and rotate in the
``rotate_half`` convention, which is exactly transformers' ``apply_rotary_pos_emb_interleave``;
queries and keys share the permuted layout, so their dot products are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember.core.config import AttentionSpec
from ember.core.layers.lora import LoraLinear
from ember.core.layers.norms import RMSNorm
from ember.core.layers.rope import RotaryEmbedding, apply_rope
from ember.core.layers.rope_scaling import yarn_mscale

if TYPE_CHECKING:
    from ember.core.models.base import ForwardContext

# transformers builds the two latent norms with the RMSNorm default, not ``rms_norm_eps``
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """Shapes of an MLA layer, read from a DeepSeek-V3-style ``config.json``."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> MLAConfig:
        return cls(
            hidden_size=int(raw["hidden_size"]),
            num_heads=int(raw["num_attention_heads"]),
            q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") is not None else None,
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope_interleave=bool(raw.get("rope_interleave", True)),
        )


def mla_softmax_scale(qk_head_dim: int, rope_params: dict[str, Any]) -> float:
    """``d_qk^-1/2``, times ``mscale(factor, mscale_all_dim)²`` for scaled rope (DeepSeek's YaRN;
    transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    if (rope_params.get("rope_type") or rope_params.get("type") or "default") != "default":
        mscale_all_dim = rope_params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_mscale(rope_params["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, …)`` → ``(x0, x2, …, x1, x3, …)`` along the last dimension."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """MLA with LoRA-adaptable projections (``q_proj`` or ``q_a_proj``/``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``); names mirror transformers."""

    def __init__(self, cfg: MLAConfig, layer: int, rotary: RotaryEmbedding, spec: AttentionSpec, scale: float):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.rotary = rotary
        self.spec = spec
        self.scale = scale
        h, H = cfg.hidden_size, cfg.num_heads
        if cfg.q_lora_rank is None:
            self.q_proj = LoraLinear(h, H * cfg.qk_head_dim, False, "attn")
        else:
            self.q_a_proj = LoraLinear(h, cfg.q_lora_rank, cfg.attention_bias, "attn")
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = LoraLinear(cfg.q_lora_rank, H * cfg.qk_head_dim, False, "attn")
        self.kv_a_proj_with_mqa = LoraLinear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.attention_bias, "attn")
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LoraLinear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, "attn")
        self.o_proj = LoraLinear(H * cfg.v_head_dim, h, cfg.attention_bias, "attn")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c, T, lora = self.cfg, x.shape[0], ctx.lora
        if c.q_lora_rank is None:
            q = self.q_proj(x, lora)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, lora)), lora)
        q_nope, q_rot = q.view(T, c.num_heads, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x, lora).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent), lora).view(T, c.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], -1)
        k_rot = k_rot.view(T, 1, c.qk_rope_head_dim)
        if c.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        cos, sin = ctx.rope(self.rotary, x.dtype)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        q = torch.cat((q_nope, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(T, c.num_heads, c.qk_rope_head_dim)), dim=-1)
        o = ctx.attend(self.layer, q, k, v, self.spec, self.scale)
        return self.o_proj(o.reshape(T, -1), lora)
