"""DeepSeek-V3 (``deepseek_v3``) and GLM-4.7-Flash (``glm4_moe_lite``): pre-norm blocks of
multi-head latent attention and either a dense SwiGLU MLP or an MoE of routed experts (sigmoid
``noaux_tc`` router) plus always-on shared experts. Module names mirror transformers
(``models/deepseek_v3``, ``models/glm4_moe_lite``), so checkpoints load by name; spec §4.

The two model types differ only in their config: which layers are dense (DeepSeek: the first
``first_k_dense_replace``; GLM: ``mlp_layer_types``, read into ``cfg.moe.dense_layers``), and
GLM's default rope honours ``partial_rotary_factor``. MTP layers (index ``>= num_hidden_layers``)
are not built; their checkpoint weights are ignored at load.

LoRA targets: every attention projection (``q_proj`` or ``q_a_proj``/``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``), dense and shared-expert MLPs, routed experts
(stacked ``gate_up_proj``/``down_proj``) and the LM head. The router and its correction bias stay
frozen.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ember.core.config import ModelConfig
from ember.core.layers.lora import LoraRoute
from ember.core.layers.mla import MLAConfig, MultiHeadLatentAttention, mla_softmax_scale
from ember.core.layers.mlp import SwiGLU
from ember.core.layers.moe import Experts, RoutingRecord, route
from ember.core.layers.norms import RMSNorm
from ember.core.layers.rope_scaling import rotary_from_params
from ember.core.layers.router import GroupLimitedSigmoidRouter
from ember.core.models.base import CausalLM, ForwardContext


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The single rope-parameter dict of a DeepSeek-style config (``rope_parameters``, or the
    legacy ``rope_theta`` + ``rope_scaling``)."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if raw.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default") or "default")
    return params


class DeepseekMoE(nn.Module):
    """Routed experts weighted by the ``noaux_tc`` router, plus shared experts added unweighted."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        raw, moe = cfg.raw, cfg.moe
        self.layer = layer
        self.gate = GroupLimitedSigmoidRouter(
            cfg.hidden_size,
            moe.num_experts,
            moe.top_k,
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=moe.norm_topk_prob,
            routed_scaling_factor=moe.routed_scaling_factor,
        )
        self.experts = Experts(cfg.hidden_size, moe.intermediate_size, moe.num_experts)
        self.shared_experts = SwiGLU(cfg.hidden_size, moe.shared_intermediate_size)

    def forward(self, x: torch.Tensor, lora: LoraRoute | None, routing: RoutingRecord | None = None) -> torch.Tensor:
        r = route(self.layer, self.gate, x, routing)
        return self.experts(x, r, lora) + self.shared_experts(x, lora)


class DecoderLayer(nn.Module):
    """``x + mla(norm(x))``, then ``x + mlp(norm(x))`` (dense or MoE)."""

    def __init__(self, cfg: ModelConfig, layer: int, attn: MultiHeadLatentAttention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer in cfg.moe.dense_layers:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mlp = DeepseekMoE(cfg, layer)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, DeepseekMoE):
            return x + self.mlp(h, ctx.lora, ctx.routing)
        return x + self.mlp(h, ctx.lora)


class Decoder(nn.Module):
    """Embedding, decoder layers, final norm (transformers' ``model.*``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        raw = cfg.raw
        mla = MLAConfig.from_hf(raw)
        params = rope_params(raw)
        if cfg.model_type == "deepseek_v3" and params["rope_type"] == "default":
            params.pop("partial_rotary_factor", None)  # DeepSeek's default rope rotates the whole rope head
        truncate = bool(params.get("truncate", True))
        self.rotary = rotary_from_params(params, mla.qk_rope_head_dim, cfg.max_position_embeddings, truncate)
        scale = mla_softmax_scale(mla.qk_head_dim, params)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, MultiHeadLatentAttention(mla, i, self.rotary, cfg.attention_spec(i), scale))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 and GLM-4.7-Flash (``glm4_moe_lite``)."""

    chunked_prefill = True  # a chunk attends over the cached latents

    # the router's correction bias decides near-ties between experts: fp32 as in transformers
    fp32_parameters = ("e_score_correction_bias",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.moe is None:
            raise ValueError(f"{cfg.model_type}: config has no routed experts (n_routed_experts)")
        if cfg.hidden_act != "silu":
            raise ValueError(f"{cfg.model_type}: hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        method = cfg.raw.get("topk_method", "noaux_tc")
        if method != "noaux_tc" or cfg.moe.scoring != "sigmoid":
            raise ValueError(
                f"{cfg.model_type}: router topk_method={method!r}, scoring_func={cfg.moe.scoring!r} is not "
                "supported (only noaux_tc with sigmoid scores)"
            )
        self.attach(cfg, Decoder(cfg))
