"""Qwen3.8-Flash-Next (``qwen4_exp``; its text model ``qwen4_exp_text``; spec §3).

Like Qwen3-Next, layers alternate Gated DeltaNet and gated attention (here with the QSA block
indexer) and every layer is an MoE with a gated shared expert. Unlike it, the residual stream is
``hc_count`` streams joined by gated hyper-connections, which replace the pre-norms (``X`` ``[T, n·H]``)::

    X = [embed(ids)] * n
    for each layer:  (PLE layers) X += PLE(X, ids)
                     a, ι = HC_attn.read(X);  X = X + ι ⊗ mixer(a)
                     a, ι = HC_mlp.read(X);   X = X + ι ⊗ moe(a)
    h = HC_final.read(X)           (no final norm; then the untied LM head)

The hashed n-gram memory (PLE), the QSA indexer, the hyper-connections, routers, norms, convolutions
and the MTP head (``mtp.*``, not loaded) are frozen; LoRA targets are attention q/k/v/o, Gated
DeltaNet ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``/``out_proj`` (``attn``), the
routed and shared experts (``mlp``) and the LM head (spec §3.9).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.core.config import ModelConfig
from ember.core.layers.gated_attention import GatedAttention
from ember.core.layers.gated_deltanet import GatedDeltaNet, GDNShape
from ember.core.layers.hyper_connections import GatedResidual
from ember.core.layers.ngram_memory import PLELayer
from ember.core.layers.qsa import QSAIndexer
from ember.core.layers.rope import RotaryEmbedding
from ember.core.layers.shared_expert_moe import SharedExpertMoE
from ember.core.models.base import CausalLM, ForwardContext
from ember.core.models.qwen3_next import layer_types


def _indexer(cfg: ModelConfig, layer: int) -> QSAIndexer | None:
    raw = cfg.raw
    if raw.get("indexer_n_heads") is None:
        return None  # no QSA configured: plain gated attention
    if int(raw.get("indexer_kv_heads", 1)) != 1:
        raise ValueError(f"indexer_kv_heads must be 1 for QSA, got {raw['indexer_kv_heads']}")
    head_dim = int(raw["indexer_head_dim"])
    if cfg.rope.partial_rotary_factor * cfg.head_dim > head_dim:
        raise ValueError(f"the rotary dimensions of head_dim {cfg.head_dim} must fit indexer_head_dim {head_dim}")
    return QSAIndexer(
        cfg.hidden_size, int(raw["indexer_n_heads"]), head_dim, int(raw["indexer_budget"]),
        int(raw["indexer_compress_ratio"]), cfg.rms_norm_eps, layer,
    )


def _eos(cfg: ModelConfig) -> int:
    if not cfg.eos_token_ids:
        raise ValueError("eos_token_id must be set when ple_layer_ids is not empty (the n-gram context stops at EOS)")
    return cfg.eos_token_ids[0]


class Qwen4ExpDecoderLayer(nn.Module):
    """Optional PLE read, then the token mixer and the MoE, each between a hyper-connection read and write."""

    def __init__(self, cfg: ModelConfig, layer: int, kind: str, rotary: RotaryEmbedding):
        super().__init__()
        raw, h, eps = cfg.raw, cfg.hidden_size, cfg.rms_norm_eps
        streams, rank = int(raw.get("hc_count", 4)), int(raw.get("hc_lowrank", 320))
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(h, GDNShape.from_hf(raw), layer, fused_projections=False)
        else:
            self.self_attn = GatedAttention(cfg, layer, rotary, _indexer(cfg, layer))
        self.mlp = SharedExpertMoE(h, cfg.moe, layer)
        ple_ids = sorted(set(raw.get("ple_layer_ids") or []))  # one-indexed
        self.ple = None
        if layer + 1 in ple_ids:
            if not self.linear:
                raise ValueError(f"ple_layer_ids: layer {layer + 1} must be a linear_attention layer")
            self.ple = PLELayer(raw, h, streams, eps, ple_ids.index(layer + 1), layer, _eos(cfg))
        self.attn_hyper_connection = GatedResidual(h, streams, rank, eps)
        self.mlp_hyper_connection = GatedResidual(h, streams, rank, eps)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.ple is not None:
            x = x + self.ple(x, input_ids, ctx)
        a, gates = self.attn_hyper_connection.read(x)
        y = self.linear_attn(a, ctx) if self.linear else self.self_attn(a, ctx)
        x = GatedResidual.write(x, y, gates)
        a, gates = self.mlp_hyper_connection.read(x)
        return GatedResidual.write(x, self.mlp(a, ctx.lora, ctx.routing), gates)


class Qwen4ExpDecoder(nn.Module):
    """Embedding, decoder layers and the final stream mixer (transformers' ``model.*``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.moe is None:
            raise ValueError("Qwen3.8-Flash-Next needs num_experts > 0")
        raw = cfg.raw
        self.streams = int(raw.get("hc_count", 4))
        if self.streams < 2:
            raise ValueError(f"hc_count must be > 1, got {self.streams}")
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kinds = layer_types(cfg, "indexed_attention")
        self.layers = nn.ModuleList(Qwen4ExpDecoderLayer(cfg, i, kinds[i], self.rotary) for i in range(cfg.num_layers))
        self.hyper_connection_mixer = GatedResidual(
            cfg.hidden_size, self.streams, int(raw.get("hc_lowrank", 320)), cfg.rms_norm_eps, inject=False
        )


class Qwen4ExpForCausalLM(CausalLM):
    """Qwen3.8-Flash-Next text model (transformers ``Qwen4ExpForCausalLM``)."""

    # whole prompts only: the QSA indexer's prefill selects over the pass's own index keys
    static_decode = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attach(cfg, Qwen4ExpDecoder(cfg))

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids).repeat(1, self.model.streams)
        for layer in self.model.layers:
            x = layer(x, input_ids, ctx)
        return self.model.hyper_connection_mixer.read(x)[0]
