"""The adapter bank: many LoRA adapters over one frozen base model.

Slot 0 is the base model itself; slots ``1..max_adapters`` hold adapters, each with its own rank
(``<= max_rank``), alpha, targets and seed. An adapter's factors are fp32 leaf tensors allocated when
the slot is filled and dropped when it is freed, so configured-but-empty slots cost nothing.
Initialisation follows PEFT: ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` from the adapter's seed, ``B = 0``, so a
new adapter reproduces the base model exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ember.core.layers.lora import LoraRoute, LoraWeights, TokenGroup
from ember.core.models.base import CausalLM, LoraTarget
from ember.core.optim import AdapterOptimizer

CATEGORIES = ("attn", "mlp", "unembed")


class AdapterBankFull(RuntimeError):
    """Every adapter slot is in use."""


@dataclass(frozen=True)
class LoraConfig:
    """Shape of one adapter: rank, alpha (scale = alpha / rank), targeted module categories, seed."""

    rank: int = 32
    alpha: float = 32.0
    targets: frozenset[str] = frozenset(CATEGORIES)
    seed: int = 0

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": sorted(self.targets), "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict) -> LoraConfig:
        return cls(
            rank=int(d["rank"]),
            alpha=float(d.get("alpha", 32.0)),
            targets=frozenset(d.get("targets", CATEGORIES)),
            seed=int(d.get("seed", 0)),
        )


@dataclass
class Adapter:
    """One filled slot: the LoRA factors of every targeted module, and their optimizer."""

    slot: int
    config: LoraConfig
    weights: dict[str, LoraWeights]
    optimizer: AdapterOptimizer = field(repr=False)

    @property
    def scale(self) -> float:
        return self.config.alpha / self.config.rank

    def parameters(self) -> list[torch.Tensor]:
        """All factors, in a fixed order (A then B of each module)."""
        return [t for w in self.weights.values() for t in (w.A, w.B)]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Factors by name: ``{module}.lora_A`` / ``{module}.lora_B``."""
        out = {}
        for name, w in self.weights.items():
            out[f"{name}.lora_A"] = w.A
            out[f"{name}.lora_B"] = w.B
        return out

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.parameters())

    def frozen_view(self) -> FrozenAdapter:
        """The same factors, detached: for tokens that must not send gradients to this adapter."""
        return FrozenAdapter({k: LoraWeights(w.A.detach(), w.B.detach()) for k, w in self.weights.items()}, self.scale)


@dataclass
class FrozenAdapter:
    """An adapter's factors without gradient tracking (forward-only requests, sampling)."""

    weights: dict[str, LoraWeights]
    scale: float


def _factor_shapes(t: LoraTarget, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if t.num_experts is None:
        return (rank, t.in_features), (t.out_features, rank)
    return (t.num_experts, rank, t.in_features), (t.num_experts, t.out_features, rank)


class AdapterBank:
    """Adapter slots over one base model."""

    def __init__(self, model: CausalLM, max_adapters: int = 32, max_rank: int = 64):
        if max_adapters < 1 or max_rank < 1:
            raise ValueError("max_adapters and max_rank must be >= 1")
        self.model = model
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.targets = model.lora_targets()
        self.device = next(model.parameters()).device
        self._adapters: dict[int, Adapter] = {}

    def validate(self, config: LoraConfig) -> None:
        """Raise ``ValueError`` for a config this bank cannot hold."""
        if not 1 <= config.rank <= self.max_rank:
            raise ValueError(f"rank {config.rank} is outside 1..{self.max_rank} (max_rank)")
        if not (config.alpha > 0 and math.isfinite(config.alpha)):
            raise ValueError(f"alpha {config.alpha} must be a positive number")
        unknown = set(config.targets) - set(CATEGORIES)
        if unknown or not config.targets:
            raise ValueError(f"targets must be a non-empty subset of {list(CATEGORIES)}, got {sorted(config.targets)}")

    def _new_weights(self, config: LoraConfig) -> dict[str, LoraWeights]:
        gen = torch.Generator().manual_seed(config.seed)
        weights = {}
        for t in self.targets:
            if t.category not in config.targets:
                continue
            a_shape, b_shape = _factor_shapes(t, config.rank)
            bound = 1.0 / math.sqrt(t.in_features)
            A = (torch.rand(a_shape, generator=gen) * 2 - 1) * bound
            weights[t.name] = LoraWeights(
                A=A.to(self.device).requires_grad_(),
                B=torch.zeros(b_shape, device=self.device, requires_grad=True),
            )
        return weights

    def free_slots(self) -> list[int]:
        return [s for s in range(1, self.max_adapters + 1) if s not in self._adapters]

    def create(self, config: LoraConfig, slot: int | None = None) -> Adapter:
        """Fill a free slot (the lowest, or ``slot``) with a freshly initialised adapter."""
        self.validate(config)
        if slot is None:
            free = self.free_slots()
            if not free:
                raise AdapterBankFull(f"all {self.max_adapters} adapter slots are in use")
            slot = free[0]
        elif slot in self._adapters or not 1 <= slot <= self.max_adapters:
            raise ValueError(f"slot {slot} is not free")
        weights = self._new_weights(config)
        adapter = Adapter(slot, config, weights, AdapterOptimizer([t for w in weights.values() for t in (w.A, w.B)]))
        self._adapters[slot] = adapter
        return adapter

    def reset(self, slot: int) -> Adapter:
        """Re-initialise an adapter in place: fresh factors, no gradients, no optimizer state."""
        old = self.get(slot)
        del self._adapters[slot]
        return self.create(old.config, slot)

    def free(self, slot: int) -> None:
        """Empty a slot, releasing its weights and optimizer state."""
        self.get(slot)
        del self._adapters[slot]

    def get(self, slot: int) -> Adapter:
        try:
            return self._adapters[slot]
        except KeyError:
            raise KeyError(f"adapter slot {slot} is empty") from None

    def __contains__(self, slot: int) -> bool:
        return slot in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def route(self, groups: list[tuple[object, int, int]]) -> LoraRoute | None:
        """The LoRA route of a packed batch whose ``(key, start, end)`` runs are ``groups``; a key is
        a slot, or ``(slot, trainable)`` where ``trainable=False`` detaches the adapter's factors.
        ``None`` when every token uses the base model."""
        token_groups = []
        for key, a, b in groups:
            slot, trainable = key if isinstance(key, tuple) else (key, True)
            adapter = None
            if slot:
                adapter = self.get(slot) if trainable else self.get(slot).frozen_view()
            token_groups.append(TokenGroup(adapter, a, b))
        route = LoraRoute(token_groups, self.device)
        return route if route.adapted else None
