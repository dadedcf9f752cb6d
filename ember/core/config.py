"""Model configuration: one normalised view of a Hugging Face ``config.json``.

Every model family reads the fields it needs from :class:`ModelConfig`; family-specific extras stay in
``raw`` (the untouched ``config.json`` dict) so a new family does not need a new field here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# families whose attention and MLP ember.dist can split by tensor parallelism (here: torch-free, for
# ember serve's checks)
TP_FAMILIES = ("llama", "qwen3", "qwen3_moe", "olmo3", "deepseek_v3", "glm4_moe_lite", "qwen3_next",
               "qwen4_exp", "qwen4_exp_text", "inkling2", "inkling2_text")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters`` / legacy ``rope_theta`` + ``rope_scaling``)."""

    theta: float = 10000.0
    type: str = "default"  # default | llama3 | yarn | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MoEConfig:
    """Routed-expert settings of an MoE family."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    scoring: str = "softmax"  # softmax | sigmoid
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    # Layers that use a dense MLP instead of experts.
    dense_layers: frozenset[int] = frozenset()


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends: ``global`` causal attention or a causal ``sliding`` window (keys within
    ``window`` positions, the current token included)."""

    kind: str = "global"
    window: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a base model, as read from its ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    moe: MoEConfig | None = None
    layer_attention: tuple[AttentionSpec, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def attention_spec(self, layer: int) -> AttentionSpec:
        """The attention kind of ``layer`` (global when the config names none)."""
        if self.layer_attention:
            return self.layer_attention[layer]
        return AttentionSpec()


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**legacy, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    known = {
        "rope_theta", "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings", "partial_rotary_factor",
    }
    return RopeConfig(
        theta=float(theta),
        type=str(rope_type),
        factor=float(merged.get("factor", 1.0) or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        partial_rotary_factor=float(
            merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        ),
        extra={k: v for k, v in merged.items() if k not in known},
    )


def _layer_attention(cfg: dict[str, Any], num_layers: int) -> tuple[AttentionSpec, ...]:
    types = cfg.get("layer_types")
    window = cfg.get("sliding_window")
    if not types:
        return ()
    specs = []
    for t in types[:num_layers]:
        if t == "sliding_attention" and window:
            specs.append(AttentionSpec("sliding", int(window)))
        elif t in ("full_attention", "sliding_attention", "attention"):
            specs.append(AttentionSpec("global"))
        else:
            specs.append(AttentionSpec(str(t)))
    return tuple(specs)


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Normalise a Hugging Face ``config.json`` dict (text model) into a :class:`ModelConfig`."""
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg["model_type"])}
    model_type = cfg["model_type"]
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    moe = None
    num_experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    if num_experts and model_type in MOE_TYPES:
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        dense |= {i for i in range(num_layers) if (i + 1) % step != 0}
        dense |= set(range(int(cfg.get("first_k_dense_replace", 0) or 0)))
        sigmoid_router = model_type in SIGMOID_ROUTER_TYPES
        if model_type == "glm4_moe_lite":
            # transformers' Glm4MoeLite: mlp_layer_types alone decides (default: only layer 0 dense)
            types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
            dense = {i for i, t in enumerate(types[:num_layers]) if t == "dense"}
        shared = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
        if sigmoid_router and not shared:  # DeepSeek: n_shared_experts experts of moe_intermediate_size each
            shared = int(cfg.get("n_shared_experts", 0) or 0) * int(cfg["moe_intermediate_size"])
        moe = MoEConfig(
            num_experts=int(num_experts),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            scoring=str(cfg.get("scoring_func", "sigmoid" if sigmoid_router else "softmax")),
            num_shared_experts=int(cfg.get("n_shared_experts", 0) or 0),
            shared_intermediate_size=shared,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            dense_layers=frozenset(dense),
        )
    return ModelConfig(
        model_type=model_type,
        # token ids a request may use; Inkling-2 pads its embedding/head rows beyond the real vocabulary
        vocab_size=int(cfg.get("unpadded_vocab_size") or cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        moe=moe,
        layer_attention=_layer_attention(cfg, num_layers),
        eos_token_ids=_eos_ids(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        raw=dict(cfg),
    )


# DeepSeek-V3-style MoE: sigmoid noaux_tc router; shared experts of n_shared_experts × moe_intermediate_size
SIGMOID_ROUTER_TYPES = {"deepseek_v3", "glm4_moe_lite"}
MOE_TYPES = {
    "qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen4_exp", "qwen4_exp_text", "inkling2"
}


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` from a local Hugging Face model folder."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    with open(path) as f:
        return config_from_hf(json.load(f))
