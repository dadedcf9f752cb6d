"""Llama-style decoder (Llama 3, Qwen3, Qwen3-MoE): pre-norm blocks of GQA attention and a SwiGLU
MLP or a sparse MoE. Module names mirror transformers so checkpoints load by name.

Qwen3 differs from Llama only by RMSNorm on each head's queries and keys (``qk_norm``); Qwen3-MoE
replaces the MLP by routed experts on its sparse layers.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.core.config import ModelConfig
from ember.core.layers.attention import decode_qkv_attention
from ember.core.layers.lora import LoraLinear
from ember.core.layers.mlp import SwiGLU
from ember.core.layers.moe import SparseMoE
from ember.core.layers.norms import RMSNorm
from ember.core.layers.rope import RotaryEmbedding, norm_rope
from ember.core.models.base import CausalLM, ForwardContext


class Attention(nn.Module):
    """Grouped-query attention with rotary positions and optional per-head q/k RMSNorm."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer = layer
        self.head_dim = d
        self.spec = cfg.attention_spec(layer)
        self.scale = d**-0.5
        self.rotary = rotary
        self.q_proj = LoraLinear(h, cfg.num_heads * d, cfg.attention_bias, "attn")
        self.k_proj = LoraLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, "attn")
        self.v_proj = LoraLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, "attn")
        self.o_proj = LoraLinear(cfg.num_heads * d, h, cfg.attention_bias, "attn")
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        cos, sin = ctx.rope(self.rotary, x.dtype)
        o = decode_qkv_attention(self, x, ctx, cos, sin)  # the static decoder's step: one kernel to attention
        if o is None:
            q = self.q_proj(x, ctx.lora).view(T, -1, d)
            k = self.k_proj(x, ctx.lora).view(T, -1, d)
            v = self.v_proj(x, ctx.lora).view(T, -1, d)
            q, k = norm_rope(q, k, self.q_norm, self.k_norm, cos, sin)
            o = ctx.attend(self.layer, q, k, v, self.spec, self.scale)
        return self.o_proj(o.reshape(T, -1), ctx.lora)


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rotary, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe is not None and layer not in cfg.moe.dense_layers:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, layer)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, r = self.step(x, None, ctx)
        return x + r

    def step(self, x: torch.Tensor, r: torch.Tensor | None, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on input ``x + r`` (``r``: the previous layer's MLP output, not yet added; None:
        ``x`` alone), as ``(x', r')`` whose sum is its output: each residual add happens in the norm
        after it (:meth:`~ember.core.layers.norms.RMSNorm.add`, one kernel in the sampler's passes).
        :meth:`~ember.core.models.base.CausalLM.hidden_states` chains layers this way."""
        x, h = (x, self.input_layernorm(x)) if r is None else self.input_layernorm.add(x, r)
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, ctx))
        if isinstance(self.mlp, SparseMoE):
            return x, self.mlp(h, ctx.lora, ctx.routing)
        return x, self.mlp(h, ctx.lora)


class Decoder(nn.Module):
    """Embedding, decoder layers, final norm (transformers' ``model.*``)."""

    def __init__(self, cfg: ModelConfig, qk_norm: bool):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary, qk_norm) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama 3 (and, with ``qk_norm``, Qwen3 dense and MoE)."""

    qk_norm = False
    static_decode = chunked_prefill = prefix_sharing = True  # attention layers only

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attach(cfg, Decoder(cfg, self.qk_norm))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense and Qwen3-MoE: Llama with q/k RMSNorm (and sparse MoE layers when configured)."""

    qk_norm = True
