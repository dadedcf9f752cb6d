"""Model families, by Hugging Face ``model_type``."""

from __future__ import annotations

from ember.core.config import ModelConfig
from ember.core.models.base import CausalLM, ForwardContext, LoraTarget
from ember.core.models.deepseek_v3 import DeepseekV3ForCausalLM
from ember.core.models.inkling2 import Inkling2ForCausalLM
from ember.core.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from ember.core.models.olmo3 import Olmo3ForCausalLM
from ember.core.models.qwen3_next import Qwen3NextForCausalLM
from ember.core.models.qwen4_exp import Qwen4ExpForCausalLM

FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "inkling2": Inkling2ForCausalLM,
    "inkling2_text": Inkling2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe_lite": DeepseekV3ForCausalLM,
    "olmo3": Olmo3ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen4_exp": Qwen4ExpForCausalLM,
    "qwen4_exp_text": Qwen4ExpForCausalLM,
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
