"""Olmo 3 (``olmo3``): post-norm blocks (``x + norm(attn(x))``, ``x + norm(mlp(x))``), RMSNorm over
the whole query and key projections, sliding-window attention on three layers of four, and rope
parameters per layer type (YaRN on the full-attention layers of the long-context checkpoints).
Module names mirror transformers ``models/olmo3`` so checkpoints load by name.

LoRA targets: ``q/k/v/o_proj``, ``gate/up/down_proj`` and the LM head, as for Llama.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember.core.config import AttentionSpec, ModelConfig
from ember.core.layers.lora import LoraLinear
from ember.core.layers.mlp import SwiGLU
from ember.core.layers.norms import RMSNorm, rms_norm
from ember.core.layers.rope import RotaryEmbedding, apply_rope
from ember.core.layers.rope_scaling import rotary_from_params
from ember.core.models.base import CausalLM, ForwardContext
from ember.core.rebuild import rebuildable

DEFAULT_THETA = 500000.0  # transformers' Olmo3Config.default_theta
LAYER_TYPES = ("sliding_attention", "full_attention")


class Olmo3RMSNorm(RMSNorm):
    """RMSNorm over the last dimension, weight applied in fp32 before the cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, fp32_product=True)


def rope_params_by_layer_type(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rope parameters of each layer type, as ``Olmo3Config.convert_rope_params_to_dict`` builds them:
    a legacy ``rope_scaling`` applies to full-attention layers only, and a legacy ``rope_theta``
    reaches only those too (sliding layers keep the default theta)."""
    nested = raw.get("rope_parameters") or {}  # flat keys here are ignored, as transformers does
    out = {}
    theta = raw.get("rope_theta", DEFAULT_THETA)
    for t in LAYER_TYPES:
        params = dict(nested.get(t) or {"rope_type": "default"})
        if t == "full_attention" and raw.get("rope_scaling"):
            params.update(raw["rope_scaling"])
        params.setdefault("rope_theta", theta if t == "full_attention" else DEFAULT_THETA)
        params.setdefault("rope_type", params.get("type", "default") or "default")
        out[t] = params
    return out


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in fp32, back in ``x``'s dtype (made again from the q/k norm's input for
    attention's backward: ``ember.core.rebuild``)."""
    return apply_rope(x.float(), cos, sin).to(x.dtype)


class Attention(nn.Module):
    """GQA attention with RMSNorm over the full q and k projections and per-layer-type rope."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, spec: AttentionSpec):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer = layer
        self.head_dim = d
        self.spec = spec
        self.scale = d**-0.5
        self.rotary = rotary
        self.q_proj = LoraLinear(h, cfg.num_heads * d, cfg.attention_bias, "attn")
        self.k_proj = LoraLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, "attn")
        self.v_proj = LoraLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, "attn")
        self.o_proj = LoraLinear(cfg.num_heads * d, h, cfg.attention_bias, "attn")
        self.q_norm = Olmo3RMSNorm(cfg.num_heads * d, cfg.rms_norm_eps)
        self.k_norm = Olmo3RMSNorm(cfg.num_kv_heads * d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x, ctx.lora)).view(T, -1, d)
        k = self.k_norm(self.k_proj(x, ctx.lora)).view(T, -1, d)
        v = self.v_proj(x, ctx.lora).view(T, -1, d)
        # transformers keeps Olmo 3's cos/sin in fp32 and rotates in fp32 before casting back
        cos, sin = ctx.rope(self.rotary, torch.float32)
        q, k = (rebuildable(_rotated(t, cos, sin), _rotated, t, cos, sin, chained=True) for t in (q, k))
        o = ctx.attend(self.layer, q, k, v, self.spec, self.scale)
        return self.o_proj(o.reshape(T, -1), ctx.lora)


class DecoderLayer(nn.Module):
    """``x + norm(attn(x))``, then ``x + norm(mlp(x))``."""

    post_norm = True  # the LoRA products read the residual stream (ember.core.checkpointing's estimate)

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, spec: AttentionSpec):
        super().__init__()
        self.self_attn = Attention(cfg, layer, rotary, spec)
        self.post_attention_layernorm = Olmo3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = Olmo3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, ctx))
        return x + self.post_feedforward_layernorm(self.mlp(x, ctx.lora))


def layer_types(cfg: ModelConfig) -> list[str]:
    """Each layer's type (``sliding_attention`` / ``full_attention``); transformers' default is
    sliding except every fourth layer."""
    types = cfg.raw.get("layer_types")
    if types:
        return list(types[: cfg.num_layers])
    return ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(cfg.num_layers)]


class Decoder(nn.Module):
    """Embedding, decoder layers, final norm (transformers' ``model.*``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        rotaries = {
            t: rotary_from_params(p, cfg.head_dim, cfg.max_position_embeddings)
            for t, p in rope_params_by_layer_type(cfg.raw).items()
        }
        window = cfg.raw.get("sliding_window", 4096)
        specs = {
            "sliding_attention": AttentionSpec("sliding", int(window)) if window else AttentionSpec(),
            "full_attention": AttentionSpec(),
        }
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotaries[t], specs[t]) for i, t in enumerate(layer_types(cfg)))
        self.norm = Olmo3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Olmo3ForCausalLM(CausalLM):
    """Olmo 3 dense decoder."""

    chunked_prefill = True  # a chunk attends plainly, sliding layers included

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"olmo3: hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        self.attach(cfg, Decoder(cfg))
