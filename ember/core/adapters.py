"""The adapter bank: many LoRA adapters over one frozen base model.

Slot 0 is the base model itself; slots ``1..max_adapters`` hold adapters, each with its own rank
(``<= max_rank``), alpha, targets and seed. An adapter's factors are fp32 leaf tensors allocated when
the slot is filled and dropped when it is freed, so configured-but-empty slots cost nothing.
Initialisation follows PEFT: ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` from the adapter's seed, ``B = 0``, so a
new adapter reproduces the base model exactly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ember.core.layers.lora import LoraRoute, LoraWeights, TokenGroup
from ember.core.models.base import CausalLM, LoraTarget
from ember.core.optim import AdapterOptimizer

CATEGORIES = ("attn", "mlp", "unembed")


class _CastSplit(torch.autograd.Function):
    """``flat.to(dtype).split(sizes)`` whose backward casts each piece's gradient straight into
    its slice of one vector in ``flat``'s dtype. Autograd's own backward of the split and the cast
    concatenates the pieces' gradients in ``dtype`` and then casts that: one more pass over every
    factor of the adapter, on the step's critical path at the end of the backward (746 M factors
    for Qwen3-Next-8l's LoRA on its experts: a 1.1 ms concatenation before 2.3 ms of casts on an
    H100, trace of 2026-12-06)."""

    @staticmethod
    def forward(ctx, flat, dtype, sizes):
        ctx.sizes, ctx.flat_dtype = sizes, flat.dtype
        ctx.set_materialize_grads(False)  # a piece no product used sends None: its slice is zeroed
        return tuple(flat.to(dtype).split(sizes))

    @staticmethod
    def backward(ctx, *grads):
        device = next((g.device for g in grads if g is not None), None)
        if device is None:
            return None, None, None
        out = torch.empty(sum(ctx.sizes), dtype=ctx.flat_dtype, device=device)
        for piece, g in zip(out.split(ctx.sizes), grads):
            if g is None:
                piece.zero_()
            else:
                piece.copy_(g.reshape(-1))  # the cast, into place
        return out, None, None


def cast_split(flat: torch.Tensor, dtype: torch.dtype, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """``flat`` in ``dtype``, cut into pieces of ``sizes`` elements (one cast for all of them); the
    gradients of the pieces come back as one gradient of ``flat`` in its own dtype."""
    if dtype == flat.dtype or not (flat.requires_grad and torch.is_grad_enabled()):
        return torch.split(flat.to(dtype), sizes)
    return _CastSplit.apply(flat, dtype, sizes)


class AdapterBankFull(RuntimeError):
    """Every adapter slot is in use."""


@dataclass(frozen=True)
class LoraConfig:
    """Shape of one adapter: rank, alpha (scale = alpha / rank), targeted module categories, seed.

    ``normalize_moe_lora`` (Megatron-Bridge's flag, spec §3.9): routed-expert adapters get rank
    ``rank / top_k`` and scale ``alpha / (rank / top_k)``, so the top-k experts of a token together
    hold about a rank-``rank`` correction; the rank must be a multiple of the router's top-k."""

    rank: int = 32
    alpha: float = 32.0
    targets: frozenset[str] = frozenset(CATEGORIES)
    seed: int = 0
    normalize_moe_lora: bool = False

    def to_dict(self) -> dict:
        d = {"rank": self.rank, "alpha": self.alpha, "targets": sorted(self.targets), "seed": self.seed}
        if self.normalize_moe_lora:
            d["normalize_moe_lora"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LoraConfig:
        return cls(
            rank=int(d["rank"]),
            alpha=float(d.get("alpha", 32.0)),
            targets=frozenset(d.get("targets", CATEGORIES)),
            seed=int(d.get("seed", 0)),
            normalize_moe_lora=bool(d.get("normalize_moe_lora", False)),
        )


@dataclass
class AdapterView:
    """An adapter's factors as one forward pass uses them (cast to the activation dtype; detached
    for tokens that must not send gradients to the adapter)."""

    weights: dict[str, LoraWeights]
    scale: float


class Adapter:
    """One filled slot: all LoRA factors of the adapter in ONE flat fp32 parameter.

    Module factors are views into that vector, so a forward pass casts the adapter once
    (:meth:`view`), its backward produces one gradient, and its optimizer updates one tensor; the
    cost per adapter does not grow with the number of adapted modules."""

    def __init__(self, slot: int, config: LoraConfig, layout: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
                 flat: torch.Tensor):
        self.slot = slot
        self.config = config
        self.layout = layout
        self.serial = next(_SERIALS)  # tells this adapter apart from any other that held the slot
        self.flat = flat.requires_grad_()
        self._sizes = [math.prod(shape) for _, a, b in layout for shape in (a, b)]
        self.weights = self._views(flat.detach())
        self.optimizer = AdapterOptimizer([self.flat])
        # modules whose rank is below config.rank (normalize_moe_lora experts) use scale
        # alpha / their rank: view() multiplies their B by rank / their rank
        self.scale_multipliers = {
            name: config.rank / a[-2] for name, a, _ in layout if config.normalize_moe_lora and a[-2] != config.rank
        }

    def _views(self, flat: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, LoraWeights]:
        pieces = cast_split(flat, dtype or flat.dtype, self._sizes)
        out = {}
        for i, (name, a, b) in enumerate(self.layout):
            out[name] = LoraWeights(pieces[2 * i].view(a), pieces[2 * i + 1].view(b))
        return out

    @property
    def scale(self) -> float:
        return self.config.alpha / self.config.rank

    def module_scale(self, name: str) -> float:
        """The LoRA scale of module ``name`` (:attr:`scale`, times its multiplier under
        ``normalize_moe_lora``)."""
        return self.scale * self.scale_multipliers.get(name, 1.0)

    @property
    def version(self) -> tuple[int, int]:
        """Changes whenever the factors may have: another adapter in the slot, or any in-place write
        to the flat vector (optimizer steps, loads; views and detached aliases share its version
        counter). Copies of the factors (the sampler's) are refreshed when it no longer matches."""
        return self.serial, self.flat._version

    def view(self, dtype: torch.dtype, trainable: bool = True) -> AdapterView:
        """The factors for one forward pass, in ``dtype`` (one cast for the whole adapter)."""
        flat = self.flat if trainable else self.flat.detach()
        weights = self._views(flat, dtype)
        for name, mult in self.scale_multipliers.items():
            weights[name] = LoraWeights(weights[name].A, weights[name].B * mult)
        return AdapterView(weights, self.scale)

    def parameters(self) -> list[torch.Tensor]:
        """The trainable tensors (the flat factor vector)."""
        return [self.flat]

    def _named(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, w in self._views(flat).items():
            out[f"{name}.lora_A"] = w.A
            out[f"{name}.lora_B"] = w.B
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """Factor values by name, ``{module}.lora_A`` / ``{module}.lora_B`` (views: writable)."""
        return self._named(self.flat.detach())

    def grads(self) -> dict[str, torch.Tensor] | None:
        """Accumulated gradients by factor name, or ``None`` when none have accumulated."""
        return None if self.flat.grad is None else self._named(self.flat.grad)

    def num_parameters(self) -> int:
        return self.flat.numel()

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """Adam moments by factor name (``{factor}.exp_avg`` / ``.exp_avg_sq`` / ``.step``)."""
        st = self.optimizer.opt.state.get(self.flat)
        if not st:
            return {}
        out = {}
        step = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
        for key in ("exp_avg", "exp_avg_sq"):
            for name, t in self._named(st[key]).items():
                out[f"{name}.{key}"] = t
        for name in self._named(self.flat.detach()):
            out[f"{name}.step"] = step
        return out

    def load_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore moments saved by :meth:`optimizer_state` (factors missing there start at zero)."""
        names = list(self._named(self.flat.detach()))
        if not any(f"{n}.exp_avg" in state for n in names):
            self.optimizer.opt.state.clear()
            return
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            parts = [state.get(f"{n}.{key}") for n in names]
            flat = torch.zeros_like(self.flat.detach())
            for dst, src in zip(self._named(flat).values(), parts):
                if src is not None:
                    dst.copy_(src.reshape(dst.shape))
            moments[key] = flat
        step = next(state[f"{n}.step"] for n in names if f"{n}.step" in state)
        self.optimizer.load_state({"step": step, **moments})


_SERIALS = itertools.count(1)


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
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
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
        top_k = self._expert_top_k(config)
        if top_k and config.rank % top_k:
            raise ValueError(
                f"normalize_moe_lora gives routed experts rank = rank / top_k: rank {config.rank} must be a "
                f"multiple of the router top-k {top_k}"
            )

    def _expert_top_k(self, config: LoraConfig) -> int | None:
        """The router top-k that divides the experts' rank under ``normalize_moe_lora`` (else None)."""
        moe = getattr(self.model.config, "moe", None)
        if not config.normalize_moe_lora or moe is None:
            return None
        if not any(t.num_experts and t.category in config.targets for t in self.targets):
            return None
        return moe.top_k

    def _new_flat(self, config: LoraConfig) -> tuple[list, torch.Tensor]:
        """Fresh factors, laid out with every dense factor before the expert ones. ``A`` of sharded
        experts (or of a linear split along its input) is drawn whole and sliced, so every layout
        starts from the same adapter."""
        gen = torch.Generator().manual_seed(config.seed)
        top_k = self._expert_top_k(config)
        dense, expert = [], []
        for t in self.targets:
            if t.category not in config.targets:
                continue
            rank = config.rank // top_k if top_k and t.num_experts else config.rank
            a_shape, b_shape = _factor_shapes(t, rank)
            fan_in = t.full_in_features or t.in_features
            if t.num_experts is None:
                drawn = (rank, fan_in)
            else:
                drawn = (t.global_experts or t.num_experts, *a_shape[1:])
            A = (torch.rand(drawn, generator=gen) * 2 - 1) / math.sqrt(fan_in)
            if t.num_experts is not None:
                A = A[t.expert_start : t.expert_start + t.num_experts]
            else:
                A = A[:, t.in_start : t.in_start + t.in_features]
            (dense if t.num_experts is None else expert).append(
                ((t.name, a_shape, b_shape), [A.reshape(-1), torch.zeros(math.prod(b_shape))])
            )
        layout = [entry for entry, _ in dense + expert]
        flat = torch.cat([p for _, parts in dense + expert for p in parts])
        return layout, flat.to(self.device)

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
        layout, flat = self._new_flat(config)
        adapter = Adapter(slot, config, layout, flat)
        self._adapters[slot] = adapter
        return adapter

    def reset(self, slot: int) -> Adapter:
        """Re-initialise an adapter in place: fresh factors, no gradients, no optimizer state."""
        old = self.get(slot)
        del self._adapters[slot]
        return self.create(old.config, slot)

    def snapshot(self, slot: int, into: int | None = None) -> Adapter:
        """A frozen-in-time copy of ``slot``'s factors in a new slot (the lowest free, or ``into``),
        without gradients or optimizer state: a sampler made from it keeps these weights while the
        original trains on. One device copy of the flat factor vector, no disk round-trip."""
        src = self.get(slot)
        if into is None:
            free = self.free_slots()
            if not free:
                raise AdapterBankFull(f"all {self.max_adapters} adapter slots are in use")
            into = free[0]
        elif into in self._adapters or not 1 <= into <= self.max_adapters:
            raise ValueError(f"slot {into} is not free")
        adapter = Adapter(into, src.config, list(src.layout), src.flat.detach().clone())
        self._adapters[into] = adapter
        return adapter

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

    def route(
        self, groups: list[tuple[object, int, int]], dtype: torch.dtype | None = None, step_keys: list | None = None
    ) -> LoraRoute | None:
        """The LoRA route of a packed batch whose ``(key, start, end)`` runs are ``groups``; a key is
        a slot, or ``(slot, trainable)`` where ``trainable=False`` detaches the adapter's factors.
        Factors are cast once per adapter to ``dtype`` (default: the model's). ``None`` when every
        token uses the base model.

        ``step_keys`` (expert parallelism): the keys of the whole step, in the same order on every
        rank; MoE experts then group rows by them (:attr:`LoraRoute.expert_adapters`), and the
        route is ``None`` only when no rank's token uses an adapter."""
        dtype = dtype or self.dtype
        views: dict[tuple[int, bool], AdapterView] = {}

        def view(key) -> AdapterView | None:
            slot, trainable = key if isinstance(key, tuple) else (key, True)
            if not slot:
                return None
            if (slot, trainable) not in views:
                views[(slot, trainable)] = self.get(slot).view(dtype, trainable)
            return views[(slot, trainable)]

        route = LoraRoute([TokenGroup(view(key), a, b) for key, a, b in groups], self.device)
        if step_keys is not None:
            index = {key: i for i, key in enumerate(step_keys)}
            route.expert_adapters = [view(key) for key in step_keys]
            route.expert_group = torch.repeat_interleave(
                torch.tensor([index[key] for key, _, _ in groups], dtype=torch.long),
                torch.tensor([b - a for _, a, b in groups], dtype=torch.long),
            ).to(self.device)
        return route if route.adapted else None
