"""LoRA for a batch that mixes adapters.

A packed batch holds the tokens of several adapters (and of the bare base model) in contiguous
groups, ordered by adapter. Each adaptable linear computes its frozen base product over all tokens
at once and adds each adapter's low-rank correction to that adapter's rows inside the product
epilogue (``addmm_``). MoE experts run grouped products (``torch._grouped_mm`` on Hopper) over
(expert, adapter) groups. Only the adapters present in the batch are touched, so configuring more
adapter slots costs nothing per step.

Factor layout follows PEFT: ``A`` is ``[r, in]`` and ``B`` is ``[out, r]`` (``[E, r, in]`` /
``[E, out, r]`` for MoE experts); the correction is ``scale * x @ A.T @ B.T`` with
``scale = alpha / r``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.batch import to_device


@dataclass
class LoraWeights:
    """The two factors of one adapted module (fp32 master copies; cast to the activation dtype)."""

    A: torch.Tensor
    B: torch.Tensor

    @property
    def rank(self) -> int:
        return self.A.shape[-2]


class AdapterWeights(Protocol):
    """What a route needs from an adapter: its factors by module name and its scale."""

    weights: dict[str, LoraWeights]
    scale: float


@dataclass
class TokenGroup:
    """A contiguous run ``[start, end)`` of tokens that use ``adapter`` (``None``: the base model)."""

    adapter: AdapterWeights | None
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


class _LoraLinearFn(torch.autograd.Function):
    """``x @ W.T + b`` plus, for each token span ``[s, e)`` of an adapter, ``scale * (x @ A.T) @ B.T``.

    The corrections are added inside the products' epilogues (``addmm_`` on the span's rows) in
    forward and backward, instead of as separate passes over ``[T, out]``; only the small ``x @ A.T``
    is kept for backward besides ``x``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, spans, *factors):
        y = F.linear(x, weight, bias)
        hs = []
        for i, (s, e, scale) in enumerate(spans):
            h = F.linear(x[s:e], factors[2 * i])
            y[s:e].addmm_(h, factors[2 * i + 1].t(), alpha=scale)
            hs.append(h)
        ctx.save_for_backward(x, weight, *factors, *hs)
        ctx.spans = spans
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, *rest = ctx.saved_tensors
        spans = ctx.spans
        factors, hs = rest[: 2 * len(spans)], rest[2 * len(spans) :]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gy @ weight if need_x else None
        gw = gy.t() @ x if need_w else None
        gbias = gy.sum(0) if need_b else None
        gfactors = []
        for i, (s, e, scale) in enumerate(spans):
            A, B, h = factors[2 * i], factors[2 * i + 1], hs[i]
            gys = gy[s:e]
            gh = (gys @ B) * scale
            if need_x:
                gx[s:e].addmm_(gh, A)
            gfactors += [gh.t() @ x[s:e], (gys.t() @ h) * scale]
        return (gx, gw, gbias, None, *gfactors)


def _pad_rank(w: LoraWeights, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    A, B = w.A.to(dtype), w.B.to(dtype)
    extra = rank - w.rank
    if extra:
        A = F.pad(A, (0, 0, 0, extra))
        B = F.pad(B, (0, extra))
    return A, B


@dataclass
class LoraRoute:
    """Which adapter each token of a packed batch uses, and the corrections that follow from it.

    MoE experts group their rows by (expert, adapter group). In one process those groups are the
    batch's own (``groups``). Under expert parallelism a rank also runs other ranks' rows through
    its experts, so every rank must agree on the step's groups: ``expert_adapters`` lists them (the
    same on every rank) and ``expert_group`` gives each local token's index in that list.
    """

    groups: list[TokenGroup]
    device: torch.device
    expert_adapters: list[AdapterWeights | None] | None = None
    expert_group: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        expect = 0
        for g in self.groups:
            if g.start != expect:
                raise ValueError("token groups must be contiguous and start at 0")
            expect = g.end
        self.num_tokens = expect

    @property
    def adapted(self) -> bool:
        """Whether any token (of any rank, under expert parallelism) uses an adapter."""
        return any(a is not None for a in self.moe_adapters)

    @property
    def moe_adapters(self) -> list[AdapterWeights | None]:
        """The adapter of each expert row group (``None``: the base model)."""
        if self.expert_adapters is not None:
            return self.expert_adapters
        return [g.adapter for g in self.groups]

    def moe_token_group(self) -> torch.Tensor:
        """Expert row group of every local token, ``[T]`` (long)."""
        return self.token_group() if self.expert_group is None else self.expert_group

    def token_group(self) -> torch.Tensor:
        """Group index of every token, ``[T]`` (long)."""
        if "token_group" not in self._cache:
            sizes = torch.tensor([g.size for g in self.groups])
            self._cache["token_group"] = to_device(torch.repeat_interleave(torch.arange(len(self.groups)), sizes),
                                                   self.device)
        return self._cache["token_group"]

    def _group_scales(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        scales = tuple(a.scale if a is not None and name in a.weights else 0.0 for a in self.moe_adapters)
        key = ("group_scales", scales, dtype)  # the same for every MoE layer of a pass: copied once
        if key not in self._cache:
            self._cache[key] = to_device(list(scales), self.device, dtype)
        return self._cache[key]

    def _active(self, name: str) -> list[LoraWeights | None]:
        return [a.weights.get(name) if a is not None else None for a in self.moe_adapters]

    def packs(self, module: LoraLinear, x: torch.Tensor) -> bool:
        """Whether :meth:`linear` multiplies ``module``'s shared-input group at once (the static
        decoder's route does): never here, each module is its own product."""
        return False

    def swiglu(self, mlp, x: torch.Tensor) -> torch.Tensor | None:
        """A SwiGLU block's activation computed by the route (the static decoder's does, in one
        kernel with its LoRA work): never here, the block runs its three modules."""
        return None

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` plus module ``name``'s LoRA correction on each adapter's tokens."""
        spans, factors = [], []
        for g in self.groups:
            w = g.adapter.weights.get(name) if g.adapter is not None else None
            if w is None or g.size == 0:
                continue
            spans.append((g.start, g.end, g.adapter.scale))
            factors += [w.A.to(x.dtype), w.B.to(x.dtype)]
        if not spans:
            return F.linear(x, weight, bias)
        return _LoraLinearFn.apply(x, weight, bias, tuple(spans), *factors)

    def expert_factors(
        self, name: str, row_group: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Stacked expert factors of module ``name`` for rows sorted by (expert, group), with the
        LoRA scale of every row; ``None`` when no adapter in the batch targets the module. Groups
        are :attr:`moe_adapters`'; ``row_group`` holds each row's group index.

        One group: the adapter's own ``A [E, r, in]``, ``B [E, out, r]`` (grouped by expert). Several:
        ``[E·G, R, in]`` / ``[E·G, out, R]`` over (expert, group) pairs, ranks padded to the largest
        and zeros for groups without this module (their rows get no correction)."""
        active = self._active(name)
        present = [w for w in active if w is not None]
        if not present:
            return None
        scales = self._group_scales(name, dtype)[row_group]
        G = len(active)
        if G == 1:
            return present[0].A.to(dtype), present[0].B.to(dtype), scales
        rank = max(w.rank for w in present)
        ref = present[0]
        num_experts = ref.A.shape[0]
        As, Bs = [], []
        for w in active:
            if w is None:
                As.append(ref.A.new_zeros(num_experts, rank, ref.A.shape[-1], dtype=dtype))
                Bs.append(ref.B.new_zeros(num_experts, ref.B.shape[1], rank, dtype=dtype))
            else:
                A, B = _pad_rank(w, rank, dtype)
                As.append(A)
                Bs.append(B)
        A_pairs = torch.stack(As, dim=1).reshape(num_experts * G, rank, -1)
        B_pairs = torch.stack(Bs, dim=1).reshape(num_experts * G, -1, rank)
        return A_pairs, B_pairs, scales


class LoraLinear(nn.Module):
    """A frozen linear layer that adds the batch's LoRA corrections for its tokens.

    ``lora_name`` is the module's path in the Hugging Face model (e.g.
    ``model.layers.0.self_attn.q_proj``), the key of its factors in every adapter; ``category`` is
    ``attn``, ``mlp`` or ``unembed`` (Tinker's ``train_attn`` / ``train_mlp`` / ``train_unembed``).

    ``shard`` (default ``None``) is set from outside when the weight is split across processes
    (:mod:`ember.dist.tensor_parallel`): ``shard(self, x, lora)`` then runs the product with the
    collectives its split needs. A module split along its input holds columns ``in_start ..`` of
    ``full_in_features``.

    ``rollout`` (default ``None``) is set from outside (:mod:`ember.core.rollout_precision`) to the
    sampler's quantised copy of the weight; while it is ``active`` (inside the sampler's passes) the
    base product uses that copy."""

    shard = None
    rollout = None

    def __init__(self, in_features: int, out_features: int, bias: bool, category: str):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.full_in_features = in_features
        self.in_start = 0
        self.category = category
        self.lora_name = ""
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, lora: LoraRoute | None) -> torch.Tensor:
        if self.shard is not None:
            return self.shard(self, x, lora)
        return self.product(x, lora, self.bias)

    def product(self, x: torch.Tensor, lora: LoraRoute | None, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` with the route's LoRA corrections, on this process's weight."""
        if self.rollout is not None and self.rollout.active:
            return self.rollout.product(self, x, lora, bias)
        if lora is None:
            return F.linear(x, self.weight, bias)
        return lora.linear(self.lora_name, x, self.weight, bias)


def side_by_side(parts: list[torch.Tensor], spare: int = 0, owned: bool = False) -> torch.Tensor:
    """``parts`` concatenated along rows (dim 0), followed by ``spare`` rows of zeros; the tensor
    they are views of if packed already (no copy). The static decoder lays a shared-input group's
    weights (and their rollout copies) side by side with it, and the spare rows hold the adapters'
    shrink factors that its base product multiplies too
    (:class:`~ember.core.sampling.packed_linears.PackedLinears`). ``owned``: the caller packed
    ``parts`` with spare rows before, so rows after them in their storage are its own (else an
    earlier packing must be exactly ``parts``: rows after them may be another tensor's)."""
    rows = sum(p.shape[0] for p in parts)
    base = _packed_base(parts, owned)
    if base is not None and base.shape[0] >= rows + spare:
        return base[: rows + spare]
    out = torch.zeros(rows + spare, *parts[0].shape[1:], dtype=parts[0].dtype, device=parts[0].device)
    torch.cat([p.data for p in parts], out=out[:rows])
    return out


def _packed_base(parts: list[torch.Tensor], tail: bool = False) -> torch.Tensor | None:
    """The tensor whose storage ``parts`` fill as consecutive row blocks in order from its start (an
    earlier packing), exactly or, with ``tail``, with any rows after them (all the storage's rows);
    else None."""
    storage = parts[0].untyped_storage()
    ptr = storage.data_ptr()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage.data_ptr() or p.data_ptr() != ptr or not p.is_contiguous():
            return None
        ptr += p.numel() * p.element_size()
    end = storage.data_ptr() + storage.nbytes()
    row_bytes = parts[0][:1].numel() * parts[0].element_size()
    if ptr != end and not (tail and row_bytes and storage.nbytes() % row_bytes == 0):
        return None
    rows = storage.nbytes() // row_bytes if ptr != end else sum(p.shape[0] for p in parts)
    return torch.empty(0, dtype=parts[0].dtype, device=parts[0].device).set_(storage, 0, (rows, *parts[0].shape[1:]))
