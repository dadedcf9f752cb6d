"""What every model family shares: the forward context and the causal-LM interface the engine uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ember.core.config import AttentionSpec, ModelConfig
from ember.core.layers.lora import LoraLinear, LoraRoute
from ember.core.layers.moe import Experts
from ember.core.layers.rope import RotaryEmbedding

# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], spec, scale) -> [T, Hq, Dv]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionSpec, float], torch.Tensor]


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input: token positions, how to attend (packed documents
    for training, a KV cache for decoding), and the batch's LoRA route."""

    positions: torch.Tensor
    attend: AttendFn
    lora: LoraRoute | None = None
    _rope: dict = field(default_factory=dict, repr=False)

    def rope(self, rotary: RotaryEmbedding, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this batch's positions for ``rotary``, computed once per forward."""
        key = (id(rotary), dtype)
        if key not in self._rope:
            self._rope[key] = rotary.cos_sin(self.positions, dtype)
        return self._rope[key]


@dataclass(frozen=True)
class LoraTarget:
    """An adaptable weight: a linear layer, or a stack of ``num_experts`` expert matrices."""

    name: str
    category: str  # attn | mlp | unembed
    in_features: int
    out_features: int
    num_experts: int | None = None


class CausalLM(nn.Module):
    """Base of every family: ``hidden_states`` maps token ids to final hidden states; the LM head
    is applied by :mod:`ember.core.logprobs` in chunks, so models never build full logits."""

    config: ModelConfig
    final_logit_softcap: float | None = None

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        raise NotImplementedError

    @property
    def unembed_weight(self) -> torch.Tensor:
        """The LM head matrix ``[V, H]``."""
        return self.lm_head.weight

    def name_lora_modules(self) -> None:
        """Give every adaptable module its Hugging Face path as its LoRA name."""
        for name, mod in self.named_modules():
            if isinstance(mod, (LoraLinear, Experts)):
                mod.lora_name = name

    def lora_targets(self) -> list[LoraTarget]:
        """All adaptable weights of the model, in a fixed order."""
        out = []
        for _, mod in self.named_modules():
            if isinstance(mod, LoraLinear):
                out.append(LoraTarget(mod.lora_name, mod.category, mod.in_features, mod.out_features))
            elif isinstance(mod, Experts):
                for suffix, (i, o) in mod.lora_shapes().items():
                    out.append(LoraTarget(f"{mod.lora_name}.{suffix}", mod.category, i, o, mod.num_experts))
        return out
