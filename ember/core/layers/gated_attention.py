"""Gated attention of Qwen3-Next and Qwen3.8-Flash-Next (spec §3.5; transformers ``Qwen3NextAttention``).

GQA with zero-centred RMSNorm on each head's queries and keys, partial RoPE (the first
``head_dim · partial_rotary_factor`` channels rotate), and a sigmoid output gate: ``q_proj`` yields
``[q_h | gate_h]`` per head and the output is ``o_proj(attn ⊙ σ(gate))``. Qwen3.8-Flash-Next adds the
QSA block indexer (:mod:`ember.core.layers.qsa`), which restricts long-context queries to selected
key blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ember.core.config import AttentionSpec, ModelConfig
from ember.core.layers.activations import sigmoid_gate
from ember.core.layers.lora import LoraLinear
from ember.core.layers.norms import RMSNorm
from ember.core.layers.qsa import QSAIndexer, selected_attention
from ember.core.layers.rope import RotaryEmbedding, norm_rope

if TYPE_CHECKING:
    from ember.core.models.base import ForwardContext


class GatedAttention(nn.Module):
    """``o_proj(attention(q, k, v) ⊙ σ(gate))``; q/k/v/o are LoRA targets (``attn``)."""

    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, indexer: QSAIndexer | None = None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer = layer
        self.head_dim = d
        self.spec = AttentionSpec("global")
        self.scale = d**-0.5
        self.rotary = rotary
        self.q_proj = LoraLinear(h, 2 * cfg.num_heads * d, cfg.attention_bias, "attn")
        self.k_proj = LoraLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, "attn")
        self.v_proj = LoraLinear(h, cfg.num_kv_heads * d, cfg.attention_bias, "attn")
        self.o_proj = LoraLinear(cfg.num_heads * d, h, cfg.attention_bias, "attn")
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centred=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zero_centred=True)
        self.indexer = indexer

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        selection = self.indexer(x, ctx, self.rotary) if self.indexer is not None else None
        q, gate = self.q_proj(x, ctx.lora).view(T, -1, 2 * d).chunk(2, dim=-1)
        k = self.k_proj(x, ctx.lora).view(T, -1, d)
        v = self.v_proj(x, ctx.lora).view(T, -1, d)
        cos, sin = ctx.rope(self.rotary, x.dtype)
        q, k = norm_rope(q, k, self.q_norm, self.k_norm, cos, sin)
        if selection is None:
            o = ctx.attend(self.layer, q, k, v, self.spec, self.scale)
        elif getattr(ctx.attend, "accepts_selection", False):
            o = ctx.attend(self.layer, q, k, v, self.spec, self.scale, selection=selection)
        elif ctx.state is None:
            o = selected_attention(q, k, v, ctx.seq_lens or [T], selection, self.scale)
        else:
            raise RuntimeError(
                f"layer {self.layer}: a decoding pass beyond the QSA dense threshold needs an attend that "
                "takes the block selection (attend.accepts_selection = True, keyword 'selection')"
            )
        o = sigmoid_gate(o, gate).reshape(T, -1)  # per head: no copy of the gate's strided view
        return self.o_proj(o, ctx.lora)
