"""Model families, by Hugging Face ``model_type``."""

from __future__ import annotations

from ember.core.config import ModelConfig
from ember.core.models.base import CausalLM, ForwardContext, LoraTarget
from ember.core.models.llama import LlamaForCausalLM, Qwen3ForCausalLM

FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The family class for ``cfg.model_type``; a clear error for families we do not support."""
    try:
        return FAMILIES[cfg.model_type]
    except KeyError:
        raise ValueError(
            f"model_type {cfg.model_type!r} is not supported; supported: {sorted(FAMILIES)}"
        ) from None


__all__ = ["FAMILIES", "CausalLM", "ForwardContext", "LoraTarget", "model_class"]
