"""What every model family shares: the forward context and the causal-LM interface the engine uses."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from ember.core.config import AttentionSpec, ModelConfig
from ember.core.layers.lora import LoraLinear, LoraRoute
from ember.core.layers.moe import Experts, RoutingRecord, SoftmaxTopKRouter
from ember.core.layers.rope import RotaryEmbedding
from ember.core.layers.router import GroupLimitedSigmoidRouter
from ember.core.logprobs import VocabSplit

# attend(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv], spec, scale) -> [T, Hq, Dv]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionSpec, float], torch.Tensor]


class SequenceState(Protocol):
    """Per-sequence recurrent state of layers that are not attention (short-convolution windows,
    linear-attention states), carried between the passes of a decoding sequence.

    Values are stacked over the pass's sequences in packed order (``[N, ...]``). ``get`` returns
    ``None`` for sequences that start in this pass (state zero)."""

    def get(self, layer: int, name: str) -> torch.Tensor | None: ...

    def put(self, layer: int, name: str, value: torch.Tensor) -> None: ...


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input.

    * ``positions`` — position of each token within its sequence (``[T]``).
    * ``attend`` — how attention layers attend: packed documents in training and prefill, a KV cache
      when decoding. It owns any KV cache.
    * ``lora`` — the batch's LoRA route (``None``: base model only).
    * ``seq_lens`` — tokens of each sequence in this pass, in packed order (training: whole
      documents; decoding: usually one token each). Layers that mix along time (short
      convolutions, linear attention) must not cross these boundaries.
    * ``state`` — recurrent state carried between passes of decoding sequences (``None`` in
      training, where every sequence starts at position 0).
    * ``routing`` — MoE routing record/replay, or ``None``.
    * ``position_bound`` — an upper bound of ``positions`` the host knows (``None``: layers that need
      one read ``positions``, a device sync on a GPU). The static decoder sets it, so that a step
      decides on the host what a layer would otherwise decide from its positions (QSA's dense threshold).
    * ``prefetched`` — rows of host-resident tables fetched before the pass, by layer (the static
      decoder's n-gram memory rows; ``None``: layers look their rows up themselves).
    """

    positions: torch.Tensor
    attend: AttendFn
    lora: LoraRoute | None = None
    seq_lens: list[int] | None = None
    state: SequenceState | None = None
    routing: RoutingRecord | None = None
    position_bound: int | None = None
    prefetched: dict[int, torch.Tensor] | None = None
    _memo: dict = field(default_factory=dict, init=False, repr=False)  # a replace() starts empty

    def memo(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per pass for ``key`` (what every layer of a kind derives from
        the batch alone: rotary tables, sequence offsets on the device)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rope(self, rotary: RotaryEmbedding, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of this batch's positions for ``rotary``, computed once per forward."""
        return self.memo(("rope", id(rotary), dtype), lambda: rotary.cos_sin(self.positions, dtype))


@dataclass(frozen=True)
class LoraTarget:
    """An adaptable weight: a linear layer, or a stack of ``num_experts`` expert matrices (experts
    ``expert_start ..`` of ``global_experts`` when they are sharded across processes)."""

    name: str
    category: str  # attn | mlp | unembed
    in_features: int
    out_features: int
    num_experts: int | None = None
    expert_start: int = 0
    global_experts: int | None = None
    in_start: int = 0  # a linear split along its input holds columns in_start.. of full_in_features
    full_in_features: int | None = None


def set_padding_idx(embedding: nn.Module, cfg: ModelConfig) -> None:
    """Give the config's pad token row no gradient, as transformers' ``nn.Embedding(...,
    padding_idx)`` does (only full fine-tuning trains the embedding)."""
    pad = cfg.raw.get("pad_token_id")
    if isinstance(pad, int) and -cfg.vocab_size <= pad < cfg.vocab_size:
        embedding.padding_idx = pad % cfg.vocab_size


class CausalLM(nn.Module):
    """Base of every family: ``hidden_states`` maps token ids to final hidden states; the LM head
    is applied by :mod:`ember.core.logprobs` in chunks, so models never build full logits."""

    config: ModelConfig
    final_logit_softcap: float | None = None
    # the LM head split by vocabulary across processes (set from outside, by ember.dist); passed
    # to every logprob and logits computation of the head
    vocab_split: VocabSplit | None = None
    # what the sampler may do with the family (read by ember.core.sampling.engine):
    static_decode = False  # its decode step captures in a CUDA graph (graphs.StaticDecoder)
    chunked_prefill = False  # a prompt may be prefilled in chunks that continue from the cache and state store
    prefix_sharing = False  # a prompt may start from another's cached pages: no layer keeps recurrent state

    def attach(self, cfg: ModelConfig, decoder: nn.Module) -> None:
        """Finish a family's ``__init__``: set the config and the decoder (``model``), add the LM head
        (tied to the embedding if configured), freeze the base weights, name the LoRA modules."""
        self.config = cfg
        self.model = decoder
        set_padding_idx(decoder.embed_tokens, cfg)
        self.lm_head = LoraLinear(cfg.hidden_size, cfg.vocab_size, False, "unembed")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)
        self.name_lora_modules()

    def hidden_states(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final-normed hidden states ``[T, H]``; by default embedding, each layer, final norm.

        Without gradients, layers that have a ``step`` (Llama's
        :meth:`~ember.core.models.llama.DecoderLayer.step`) are chained through it: a layer's last
        residual add is done by the next one's first norm, the last one's by the final norm (the
        sampler's passes: one launch a layer fewer, the same values). With gradients each layer's
        ``forward`` runs (what activation checkpointing wraps). ``step`` is called instead of the
        layer's ``forward``, so hooks on the layer module itself do not run for it: a layer sharded
        by FSDP2 must register it as a forward method (``forward_methods`` of
        :func:`ember.dist.fsdp.shard_modules`; today only the experts are sharded, below the layer)."""
        x = self.model.embed_tokens(input_ids)
        layers = self.model.layers
        chain = all(hasattr(layer, "step") for layer in layers) and hasattr(self.model.norm, "add")
        if torch.is_grad_enabled() or not chain:
            for layer in layers:
                x = layer(x, ctx)
            return self.model.norm(x)
        r = None
        for layer in layers:
            x, r = layer.step(x, r, ctx)
        return self.model.norm(x) if r is None else self.model.norm.add(x, r)[1]

    def moe_routers(self) -> dict[int, nn.Module]:
        """The router of each MoE layer, by layer index (what a :class:`RoutingRecord` records and
        replays; each has ``top_k`` and a ``weight`` of one row per expert)."""
        routers = (SoftmaxTopKRouter, GroupLimitedSigmoidRouter)
        return {m.layer: m.gate for m in self.modules() if isinstance(getattr(m, "gate", None), routers)}

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
                out.append(
                    LoraTarget(
                        mod.lora_name, mod.category, mod.in_features, mod.out_features,
                        in_start=mod.in_start, full_in_features=mod.full_in_features,
                    )
                )
            elif isinstance(mod, Experts):
                for suffix, (i, o) in mod.lora_shapes().items():
                    out.append(
                        LoraTarget(
                            f"{mod.lora_name}.{suffix}", mod.category, i, o, mod.num_experts,
                            mod.expert_start, mod.global_experts,
                        )
                    )
        return out
