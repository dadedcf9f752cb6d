"""Qwen3-Next (``qwen3_next``): a hybrid of Gated DeltaNet linear attention and gated full attention
(every ``full_attention_interval``-th layer, 4 by default), pre-norm blocks with zero-centred RMSNorm,
partial RoPE, and an MoE with a gated shared expert (dense SwiGLU on ``mlp_only_layers``).

Module names mirror transformers (``Qwen3NextForCausalLM``) so checkpoints load by name; ``mtp.*``
weights are not part of this model and are skipped at load.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.core.config import ModelConfig
from ember.core.layers.gated_attention import GatedAttention
from ember.core.layers.gated_deltanet import GatedDeltaNet, GDNShape
from ember.core.layers.mlp import SwiGLU
from ember.core.layers.norms import RMSNorm
from ember.core.layers.rope import RotaryEmbedding
from ember.core.layers.shared_expert_moe import SharedExpertMoE
from ember.core.models.base import CausalLM, ForwardContext


def layer_types(cfg: ModelConfig, attention: str) -> list[str]:
    """``linear_attention`` or ``attention`` for each layer (``layer_types``, else every
    ``full_attention_interval``-th layer attends)."""
    types = cfg.raw.get("layer_types")
    if not types:
        every = int(cfg.raw.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else attention for i in range(cfg.num_layers)]
    out = []
    for i, t in enumerate(types[: cfg.num_layers]):
        if t == "linear_attention":
            out.append(t)
        elif t in ("full_attention", "indexed_attention"):
            out.append("attention")
        else:
            raise ValueError(f"layer_types[{i}] = {t!r} is not supported; expected linear_attention or {attention}")
    return out


class Qwen3NextDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``x + mlp(norm(x))``; the mixer is Gated DeltaNet or gated attention."""

    def __init__(self, cfg: ModelConfig, layer: int, kind: str, rotary: RotaryEmbedding):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, zero_centred=True)
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(h, GDNShape.from_hf(cfg.raw), layer, fused_projections=True)
        else:
            self.self_attn = GatedAttention(cfg, layer, rotary)
        self.post_attention_layernorm = RMSNorm(h, eps, zero_centred=True)
        if cfg.moe is not None and layer not in cfg.moe.dense_layers:
            self.mlp = SharedExpertMoE(h, cfg.moe, layer)
        else:
            self.mlp = SwiGLU(h, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, ctx) if self.linear else self.self_attn(h, ctx))
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SharedExpertMoE):
            return x + self.mlp(h, ctx.lora, ctx.routing)
        return x + self.mlp(h, ctx.lora)


class Qwen3NextDecoder(nn.Module):
    """Embedding, decoder layers, final norm (transformers' ``model.*``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kinds = layer_types(cfg, "full_attention")
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(cfg, i, kinds[i], self.rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=True)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next. LoRA targets: attention q/k/v/o, Gated DeltaNet ``in_proj_qkvz``/``in_proj_ba``/
    ``out_proj`` (``attn``), routed and shared experts and dense MLPs (``mlp``), the LM head."""

    # Gated DeltaNet continues from the state store (convolution window, delta-rule state), which
    # another prompt's pages do not hold: no prefix sharing
    static_decode = chunked_prefill = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attach(cfg, Qwen3NextDecoder(cfg))
