"""Static-shape decode steps, captured as CUDA graphs on the GPU.

A decode step of a small batch is a few hundred kernel launches for a few milliseconds of memory
traffic; replaying a captured CUDA graph removes the launch overhead. Capture needs every shape and
every pointer fixed, so this decoder

* pads the batch to a size *bucket* (one graph per bucket, captured at first use);
* keeps its inputs in static buffers (token ids, positions, cache slots, block table, lengths),
  refilled before each replay; padded rows write their keys to the scratch page and have length 0;
* replaces the per-batch LoRA route by :class:`StaticRoute`: every bank slot's factors of a module
  live in one stack ``[slots + 1, r, in]`` / ``[slots + 1, out, r]`` (:class:`LoraStacks`, with the
  adapter's scale folded into ``B``), and rows find their adapter through an ``offsets`` tensor of
  the grouped product (rows are sorted by slot). One graph thus serves any mix of adapters, and a
  configured-but-unused slot is an empty group: no work. On the GPU the delta runs as the split-K
  Triton kernels of :mod:`ember.core.kernels.lora_decode` (added into the base output in place);
  elsewhere as two grouped products.

Routed experts keep their grouped products (routing, sort and group ends stay on the device, so
they capture too); their LoRA factors are stacked per expert group (one per slot with expert LoRA,
after a zero group for rows without one), so a bank of many slots costs an expert stack entry only
for the adapters that sample.

Recurrent state (short-convolution windows, Gated DeltaNet's delta-rule state, n-gram contexts) is
read and written through fixed rows of the engine's
:class:`~ember.core.sampling.kv_cache.RecurrentStateStore`
(:class:`~ember.core.sampling.kv_cache.StaticPassState`: one gather and one scatter per value, the
rows a static buffer, padding rows on the store's scratch row), and Inkling-2's relative attention
runs the paged decode kernel with its bias and sinks, so those families capture too.
Qwen3.8-Flash-Next's host-resident n-gram memory is read before the step: the host hashes each
row's last tokens (:meth:`~ember.core.sampling.decode.DecodeBatch.recent`) and copies the table rows
into a static buffer (``ctx.prefetched``). Its QSA indexer is told on the host whether the step is
past the dense threshold (``ctx.position_bound``; past it, a graph per power of two of the longest
row) and selects over a fixed-width table of every row's index keys, ties toward the lower block
(:meth:`~ember.core.layers.qsa.QSAIndexer.select_fixed`); the paged kernel reads only the chosen
blocks and the tail.

Everything but the capture itself runs eagerly on the CPU too, which is how the tests check it
against :class:`~ember.core.sampling.decode.EagerDecoder`. The engine decides which families use
it (``CausalLM.static_decode``; no MoE routing record); under tensor parallelism the split
projections' collectives run in the step (their modules' ``shard``) and the LM head's vocabulary
parts are gathered before the draw. The stacks are synced from the adapter bank
whenever a request is admitted, so sampling reads the weights the trainer last wrote.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ember.core import rollout_precision
from ember.core.adapters import AdapterBank
from ember.core.kernels import fused, lora_decode
from ember.core.kernels.grouped import grouped_linear
from ember.core.kernels.swiglu_decode import swiglu_lora
from ember.core.layers.lora import LoraLinear, side_by_side
from ember.core.layers.moe import Experts
from ember.core.layers.ngram_memory import NGramEmbedding
from ember.core.layers.qsa import QSAIndexer
from ember.core.logprobs import chunk_logits
from ember.core.models.base import CausalLM
from ember.core.sampling.attention import DecodeAttention
from ember.core.sampling.decode import DecodeBatch, DecodeContext
from ember.core.sampling.kv_cache import PagedKVCache, RecurrentStateStore
from ember.core.sampling.logits import capped, gather_vocab, head_record, sample_rows
from ember.core.sampling.prefetch import WeightPrefetch

RANK_MULTIPLE = 16
EXPERT_RANK_MULTIPLE = 8


def default_buckets(max_seqs: int) -> tuple[int, ...]:
    """Batch-size buckets up to ``max_seqs``: 1, 2, 4, 8, then steps of 8 to 64, 16 to 256, 32 after."""
    out, b = [1, 2, 4, 8], 8
    while b < max_seqs:
        b += 8 if b < 64 else 16 if b < 256 else 32
        out.append(b)
    return tuple(x for x in out if x < max_seqs) + (max_seqs,)


# modules that read the same input in a decoder layer (a group is named by its first member)
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shared_input_groups(model: CausalLM) -> list[list[LoraLinear]]:
    """The :data:`SHARED_INPUT` groups of ``model``'s LoRA linears (members with one input width;
    not in a module whose ``separate_inputs`` is true, as Inkling-2's global attention, whose q, k
    and v read three mixtures)."""
    groups = []
    for mod in model.modules():
        if getattr(mod, "separate_inputs", False):
            continue
        for names in SHARED_INPUT:
            members = [getattr(mod, n, None) for n in names]
            if all(isinstance(m, LoraLinear) for m in members) and len({m.in_features for m in members}) == 1:
                groups.append(members)
    return groups


class PackedLinears:
    """The base weights of each shared-input group laid side by side in one tensor (rows of the
    members in order), so a decode step runs one GEMM per group: at the batch sizes of decode the
    small k/v products alone reach a fifth of the memory bandwidth (``bench/sample_diag.py --only
    gemm``), the packed q/k/v product most of it.

    Packing makes each member's ``weight`` (and ``bias``) a view of the group's tensor: values,
    shapes and parameters are unchanged, so the trainer, which shares the model, sees no
    difference. :meth:`rows` re-checks that a weight is still that view before it is used."""

    def __init__(self, model: CausalLM):
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.member: dict[str, tuple[str, int, int]] = {}  # module -> (group, first row, end row)
        self.modules: dict[str, list[LoraLinear]] = {}  # group -> its members
        self._views: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for members in shared_input_groups(model):
                ws = [m.weight for m in members]
                biases = [m.bias for m in members]
                if len({(w.dtype, w.device) for w in ws}) != 1 or len({b is None for b in biases}) != 1:
                    continue
                key = members[0].lora_name
                W = side_by_side(ws)
                b = side_by_side(biases) if biases[0] is not None else None
                start = 0
                for m in members:
                    end = start + m.out_features
                    m.weight.data = W[start:end]
                    if b is not None:
                        m.bias.data = b[start:end]
                    self.member[m.lora_name] = (key, start, end)
                    self._views[m.lora_name] = m.weight
                    start = end
                self.weights[key] = (W, b)
                self.modules[key] = members

    def rows(self, name: str, weight: torch.Tensor) -> tuple[str, int, int] | None:
        """``(group, first row, end row)`` of module ``name`` if ``weight`` is still its packed view."""
        entry = self.member.get(name)
        if entry is None:
            return None
        W = self.weights[entry[0]][0]
        if weight.data_ptr() != W[entry[1] :].data_ptr() or weight.shape[0] != entry[2] - entry[1]:
            return None
        return entry

    def product(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Group ``key``'s base product ``x @ W.T + b``: through its members' rollout copies while
        they are in use (:func:`~ember.core.rollout_precision.group_product`, laid side by side as
        the weights are), else through the packed weights."""
        W, b = self.weights[key]
        members = self.modules[key]
        if members[0].rollout is not None and members[0].rollout.active:
            return rollout_precision.group_product(members, x, b)
        return F.linear(x, W, b)


class LoraStacks:
    """The factors of every bank slot, stacked per adapted dense module (slot 0 = zeros).

    The modules of a shared-input group (``shared``: lists of module names, see
    :func:`shared_input_groups`) are stacked together, all of them once any is adapted:
    ``A`` side by side along r (``[slots + 1, members · r, in]``) and ``B`` block-diagonal
    (``[slots + 1, sum of outs, members · r]``), so one shrink and one expand serve the group
    (:attr:`fused`); each module's own ``A`` and ``B`` are views of its blocks.

    Routed experts' factors (:attr:`experts`) are stacked per expert group instead of per slot:
    group 0 holds zeros (rows without expert LoRA), then one group per synced slot whose adapter
    adapts experts (:attr:`expert_slots`, mapped from slots by :attr:`expert_group`), ranks padded
    to a multiple of :data:`EXPERT_RANK_MULTIPLE`."""

    def __init__(self, bank: AdapterBank, dtype: torch.dtype, shared: list[list[str]] = ()):
        self.bank = bank
        self.dtype = dtype
        self.device = bank.device
        self.groups = bank.max_adapters + 1
        self.shapes = {t.name: (t.in_features, t.out_features) for t in bank.targets if t.num_experts is None}
        self.shared = [g for g in shared if all(n in self.shapes for n in g)]
        self.rank = 0
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # group -> (A, B) of all members
        self.member: dict[str, tuple[str, int]] = {}  # module -> (group, index in the group)
        self.synced: set[int] = set()
        self.version = 0  # bumped when the stacks are reallocated (captured graphs become stale)
        # expert factors: one group per synced slot with expert LoRA, after group 0 (zeros, for rows
        # without one); expert_group maps a slot to its group (see moe_token_group)
        self.expert_shapes = {
            t.name: (t.num_experts, t.in_features, t.out_features) for t in bank.targets if t.num_experts is not None
        }
        self.expert_rank = 0
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # [E, G, R, in], [E, G, out, R]
        self.expert_slots: list[int] = [0]  # the slot of each expert group
        self.expert_group = torch.zeros(self.groups, dtype=torch.long, device=self.device)

    def sync(self, slots: Iterable[int]) -> None:
        """Copy the current factors of ``slots`` (adapters of the bank) into the stacks."""
        adapters = [self.bank.get(s) for s in sorted(set(slots)) if s]
        if not adapters:
            return
        dense = [[n for n in a.weights if n in self.shapes] for a in adapters]
        expert = [[n for n in a.weights if n in self.expert_shapes] for a in adapters]
        grown = False
        if any(dense):
            rank = max(a.weights[n].rank for a, ns in zip(adapters, dense) for n in ns)
            names = {n for ns in dense for n in ns}
            names |= {n for g in self.shared if names & set(g) for n in g}
            if rank > self.rank or not names <= set(self.stacks):
                self._allocate(max(rank, self.rank), names | set(self.stacks))
                grown = True
        if any(expert):
            rank = max(a.weights[n].rank for a, ns in zip(adapters, expert) for n in ns)
            names = {n for ns in expert for n in ns}
            new = [a.slot for a, ns in zip(adapters, expert) if ns and a.slot not in self.expert_slots]
            if rank > self.expert_rank or not names <= set(self.experts) or new:
                self._allocate_experts(max(rank, self.expert_rank), names | set(self.experts), new)
                grown = True
        if grown:  # new tensors: every synced adapter is copied again
            self.version += 1
            previous, self.synced = self.synced, set()
            again = {s for s in previous if s in self.bank} - {a.slot for a in adapters}
            adapters = [self.bank.get(s) for s in sorted(again)] + adapters
        with torch.no_grad():
            for a in adapters:
                self._copy(a)

    def _allocate_experts(self, rank: int, names: set[str], new_slots: list[int]) -> None:
        # grouped products need 16-byte rows: ranks of bf16 factors padded to a multiple of 8
        self.expert_rank = R = math.ceil(rank / EXPERT_RANK_MULTIPLE) * EXPERT_RANK_MULTIPLE
        self.expert_slots = self.expert_slots + sorted(new_slots)
        G = len(self.expert_slots)
        self.experts = {}
        for name in sorted(names):
            E, i, o = self.expert_shapes[name]
            A = torch.zeros(E, G, R, i, dtype=self.dtype, device=self.device)
            B = torch.zeros(E, G, o, R, dtype=self.dtype, device=self.device)
            self.experts[name] = (A, B)
        group = torch.zeros(self.groups, dtype=torch.long)
        group[self.expert_slots[1:]] = torch.arange(1, G)
        self.expert_group.copy_(group)  # in place: captured graphs read this tensor

    def _allocate(self, rank: int, names: set[str]) -> None:
        self.rank = R = math.ceil(rank / RANK_MULTIPLE) * RANK_MULTIPLE
        self.stacks, self.fused, self.member = {}, {}, {}
        grouped = [g for g in self.shared if set(g) <= names]
        singles = sorted(names - {n for g in grouped for n in g})
        for members in grouped + [[n] for n in singles]:
            i = self.shapes[members[0]][0]
            outs = [self.shapes[n][1] for n in members]
            A_all = torch.zeros(self.groups, len(members) * R, i, dtype=self.dtype, device=self.device)
            B_all = torch.zeros(self.groups, sum(outs), len(members) * R, dtype=self.dtype, device=self.device)
            self.fused[members[0]] = (A_all, B_all)
            o = 0
            for j, name in enumerate(members):
                cols = slice(j * R, (j + 1) * R)
                self.stacks[name] = (A_all[:, cols], B_all[:, o : o + outs[j], cols])
                self.member[name] = (members[0], j)
                o += outs[j]

    def _copy(self, adapter) -> None:
        s = adapter.slot
        for name, (A, B) in self.stacks.items():
            A[s].zero_()
            B[s].zero_()
            w = adapter.weights.get(name)
            if w is not None:
                r = w.rank
                A[s, :r].copy_(w.A)
                B[s, :, :r].copy_(w.B * adapter.scale)
        if s in self.expert_slots:
            g = self.expert_slots.index(s)
            for name, (A, B) in self.experts.items():
                A[:, g].zero_()
                B[:, g].zero_()
                w = adapter.weights.get(name)
                if w is not None:
                    r = w.rank
                    A[:, g, :r].copy_(w.A)
                    B[:, g, :, :r].copy_(w.B * adapter.scale)
        self.synced.add(s)


class StaticRoute:
    """A LoRA route over :class:`LoraStacks` for rows sorted by slot: ``offsets[s]`` ends slot
    ``s``'s rows (int32, the last entry is the padded row count). ``n_rows`` (int32 ``[1]``, optional)
    counts the real rows: the padding after them joins the last group for the grouped products, but
    the Triton kernels skip it (and slot 0, whose factors are zeros), so an unused slot costs nothing.

    Shared-input groups: the first member called with an input computes the whole group's output,
    one base GEMM over the :class:`PackedLinears` weights plus one LoRA shrink and one expand over
    the group's stacks, and every member (called with the same tensor) returns its columns of it.
    Where the weights are not packed, the shrink is still shared and each member expands its own
    block. On the Triton path the fp32 ``h`` of every group lives in one workspace, zeroed once per
    step. ``lora=False``: base weights only (a batch without adapters).

    Routed experts (MoE layers) run their ordinary grouped products over (expert, group) pairs: a
    row's group is its slot's expert group (:attr:`LoraStacks.expert_group`), and the factors are
    the stacks' ``[E, G, R, in]`` / ``[E, G, out, R]`` seen as ``E·G`` pairs."""

    def __init__(
        self,
        stacks: LoraStacks,
        offsets: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        packed: PackedLinears | None = None,
        lora: bool = True,
        rows: int | None = None,
        prefetch: WeightPrefetch | None = None,
    ):
        self.stacks = stacks
        self.prefetch = prefetch
        self.offsets = offsets
        self.n_rows = n_rows
        self.packed = packed
        self.lora = lora
        self.rows = rows  # the padded row count (the routed experts' groups need it)
        self._token_group: torch.Tensor | None = None
        self._h: tuple[str, torch.Tensor, torch.Tensor] | None = None  # (group, input, h of the group)
        self._y: tuple[str, torch.Tensor, torch.Tensor] | None = None  # (group, input, packed output)
        self._workspace: torch.Tensor | None = None
        self._used = 0
        self._active: tuple[torch.Tensor, torch.Tensor] | None = None

    def _product(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Group ``key``'s packed base product (then the prefetch of the next product's weight)."""
        y = self.packed.product(key, x)
        if self.prefetch is not None:
            self.prefetch.after(self.packed.weights[key][0])
        return y

    @property
    def active(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots with rows this step (:func:`~ember.core.kernels.lora_decode.active_groups`)."""
        if self._active is None:
            self._active = lora_decode.active_groups(self.offsets, self.n_rows, skip_first=True)
        return self._active

    def _zeros(self, n: int, cols: int, device: torch.device) -> torch.Tensor:
        """A zeroed fp32 ``[n, cols]`` block of the step's workspace (a fresh one once it is used up)."""
        if self._workspace is None:
            total = sum(A.shape[1] for A, _ in self.stacks.fused.values())
            self._workspace = torch.zeros(n * total, dtype=torch.float32, device=device)
        if self._used + n * cols > self._workspace.numel():
            return torch.zeros(n, cols, dtype=torch.float32, device=device)
        out = self._workspace[self._used : self._used + n * cols].view(n, cols)
        self._used += n * cols
        return out

    def _triton(self, *tensors: torch.Tensor) -> bool:
        return lora_decode.triton_ok(*tensors) and fused.use_triton(self.offsets)

    def _group_h(self, key: str, x: torch.Tensor, triton: bool) -> torch.Tensor:
        """``x @ A.T`` of every member of group ``key`` (``[N, members · r]``), once per input."""
        if self._h is None or self._h[0] != key or self._h[1] is not x:
            A_all = self.stacks.fused[key][0]
            x2 = x.reshape(-1, x.shape[-1])
            if triton:
                out = self._zeros(x2.shape[0], A_all.shape[1], x.device)
                h = lora_decode.lora_shrink(
                    x2.contiguous(), A_all, self.offsets, self.n_rows, True, out=out, active=self.active
                )
            else:
                h = grouped_linear(x2, A_all, self.offsets)
            self._h = (key, x, h)
        return self._h[2]

    def _expand(self, y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, triton: bool) -> torch.Tensor:
        if triton:
            lora_decode.lora_expand_add(y, h, B, self.offsets, self.n_rows, True, active=self.active)
            return y
        return y + grouped_linear(h.contiguous(), B.contiguous(), self.offsets)

    def add_delta(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus module ``name``'s LoRA delta of ``x`` (in place on the Triton path)."""
        st = self.stacks.stacks.get(name) if self.lora else None
        if st is None:
            return y
        A, B = st
        key, j = self.stacks.member[name]
        y2 = y.view(-1, y.shape[-1]) if y.dim() != 2 else y
        triton = self._triton(y, x, A, B) and y2.stride(-1) == 1
        R = self.stacks.rank
        h = self._group_h(key, x, triton)[:, j * R : (j + 1) * R]
        return self._expand(y2, h, B, triton).view(y.shape)

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        st = self.stacks.stacks.get(name) if self.lora else None
        if st is None:
            return None
        y = torch.zeros(*x.shape[:-1], st[1].shape[1], dtype=x.dtype, device=x.device)
        return self.add_delta(name, x, y)

    def packs(self, module: LoraLinear, x: torch.Tensor) -> bool:
        """Whether :meth:`linear` multiplies ``module``'s shared-input group at once (its rollout
        copy, if any, included): a rollout copy then hands its product over to it."""
        return self.packed is not None and x.dim() == 2 and self.packed.rows(module.lora_name, module.weight) is not None

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = self.packed.rows(name, weight) if self.packed is not None and x.dim() == 2 else None
        if rows is None:
            y = F.linear(x, weight, bias)
            if self.prefetch is not None:
                self.prefetch.after(weight)
            return self.add_delta(name, x, y)
        key, start, end = rows
        if self._y is None or self._y[0] != key or self._y[1] is not x:
            y = self._product(key, x)
            stacks = self.stacks.fused.get(key) if self.lora else None
            if stacks is not None:
                triton = self._triton(y, x, *stacks)
                y = self._expand(y, self._group_h(key, x, triton), stacks[1], triton)
            self._y = (key, x, y)
        return self._y[2][:, start:end]

    def swiglu(self, mlp, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate(x)) · up(x)`` of a SwiGLU block (:class:`~ember.core.layers.mlp.SwiGLU`):
        the packed gate/up product, then one kernel for the gate/up LoRA expand, the activation and
        the down projection's LoRA shrink (:func:`~ember.core.kernels.swiglu_decode.swiglu_lora`),
        whose ``h`` the down projection then finds here. ``None`` where the block runs as its three
        modules: no packed gate/up, no adapter on the block, or no kernels (CPU without the
        interpreter)."""
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        if not self.lora or self.packed is None or x.dim() != 2:
            return None
        rows = self.packed.rows(gate.lora_name, gate.weight)
        if rows is None or self.packed.modules[rows[0]] != [gate, up] or self.packed.rows(up.lora_name, up.weight) is None:
            return None
        key = rows[0]
        gu_stacks = self.stacks.fused.get(key)
        down_key = self.stacks.member[down.lora_name][0] if down.lora_name in self.stacks.stacks else None
        down_A = self.stacks.fused[down_key][0] if down_key is not None else None
        if gu_stacks is None and down_A is None:
            return None
        tensors = [x, *(gu_stacks or ()), *((down_A,) if down_A is not None else ())]
        if not self._triton(*tensors) or (gu_stacks is not None and gu_stacks[1].shape[1] != 2 * gate.out_features):
            return None
        gu = self._product(key, x)
        gate_up = (self._group_h(key, x, True), gu_stacks[1]) if gu_stacks is not None else None
        h_down = self._zeros(x.shape[0], down_A.shape[1], x.device) if down_A is not None else None
        act = swiglu_lora(gu, self.offsets, self.active, self.n_rows, gate_up,
                          (down_A, h_down) if down_A is not None else None)
        if down_A is not None:
            self._h = (down_key, act, h_down)  # the down projection's shrink, done
        return act

    # -- routed experts (the interface of LoraRoute that ember.core.layers.moe uses) ---------------

    @property
    def moe_adapters(self) -> list[int]:
        """The slot of each expert row group (:attr:`LoraStacks.expert_slots`; one group, the base
        model's, without expert LoRA): only their number matters to the MoE layers."""
        return self.stacks.expert_slots if self.lora and self.stacks.experts else [0]

    def moe_token_group(self) -> torch.Tensor:
        """Every row's expert group, ``[rows]`` (long): its slot's, by binary search in ``offsets``
        (padding rows fall in the last slot; their outputs are dropped)."""
        if self._token_group is None:
            if self.rows is None:
                raise ValueError("StaticRoute(rows=...) is needed for routed experts")
            row = torch.arange(self.rows, dtype=self.offsets.dtype, device=self.offsets.device)
            slot = torch.searchsorted(self.offsets, row, right=True).clamp_(max=self.offsets.shape[0] - 1)
            self._token_group = self.stacks.expert_group[slot]
        return self._token_group

    def expert_factors(
        self, name: str, row_group: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The stacked factors of expert module ``name`` over (expert, group) pairs (``[E·G, R, in]``,
        ``[E·G, out, R]``, the scale folded into ``B``) and a row scale of ones; ``None`` when no
        synced adapter adapts it."""
        st = self.stacks.experts.get(name) if self.lora else None
        if st is None:
            return None
        A, B = st
        E, G, R = A.shape[:3]
        ones = torch.ones(row_group.shape[0], dtype=dtype, device=row_group.device)
        return A.view(E * G, R, A.shape[-1]), B.view(E * G, B.shape[2], R), ones


@dataclass
class _Buffers:
    """A bucket's static inputs: views of two packed device tensors (one copy each per step)."""

    longs: torch.Tensor  # int64 [4, bucket]: input_ids, positions, slot_mapping, state rows
    small: torch.Tensor  # int32 [bucket + groups + 1]: seq_lens, offsets, n_rows
    floats: torch.Tensor  # fp64 [2, bucket]: inverse temperature (0: greedy), uniform number
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    state_rows: torch.Tensor  # each row's row of the recurrent state store (padding: its scratch row)
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    offsets: torch.Tensor
    n_rows: torch.Tensor  # real (unpadded) rows, int32 [1]
    ngram_rows: dict[int, torch.Tensor]  # layer -> its n-gram memory rows [bucket, width], fetched before the step


class StaticDecoder:
    """Decode steps with static shapes per batch bucket; CUDA graphs when ``use_graphs``."""

    def __init__(
        self,
        model: CausalLM,
        bank: AdapterBank,
        cache: PagedKVCache,
        max_positions: int,
        buckets: tuple[int, ...],
        use_graphs: bool,
        states: RecurrentStateStore | None = None,
        prefetch_bytes: int = 0,
    ):
        self.model = model
        self.cache = cache
        self.states = states if states is not None else RecurrentStateStore()
        self.max_positions = max_positions
        self.buckets = tuple(sorted(buckets))
        self.width = math.ceil(max_positions / cache.page_size)
        self.packed = PackedLinears(model)
        shared = [[m.lora_name for m in g] for g in shared_input_groups(model)]
        self.stacks = LoraStacks(bank, next(model.parameters()).dtype, shared)
        self.use_graphs = use_graphs and cache.device.type == "cuda"
        self.rope_tables: dict = {}
        # host-resident n-gram tables: their rows are computed and fetched on the host before a step
        self.ngrams = [m for m in model.modules() if isinstance(m, NGramEmbedding)]
        # QSA: below this position every query attends densely (the step decides it on the host)
        indexers = [m for m in model.modules() if isinstance(m, QSAIndexer)]
        self.sparse_from = min(((m.block_topk + 1) * m.block_size - 1 for m in indexers), default=None)
        self._buffers: dict[int, _Buffers] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._graph_version = self._version()
        self._pool = None
        self._staging: dict[str, torch.Tensor] = {}
        self._staged: torch.cuda.Event | None = None  # marks the end of the last step's copies
        # L2 prefetch of the next product's weight: dense models only (a routed-expert layer's
        # products come between two dense ones and would evict it)
        dense = not any(isinstance(m, Experts) for m in model.modules())
        self.prefetch = WeightPrefetch(prefetch_bytes) if prefetch_bytes > 0 and dense else None

    def sync(self, slots: Iterable[int]) -> None:
        """Refresh the adapter stacks of ``slots`` (call when their requests are admitted)."""
        self.stacks.sync(slots)

    def _version(self) -> tuple[int, int, int]:
        """Changes when a tensor the captured graphs read is replaced: the adapter stacks, the
        rollout copies of the weights, the recurrent state's slabs."""
        return self.stacks.version, rollout_precision.version(self.model), self.states.version

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} exceeds the largest bucket {self.buckets[-1]}")

    def _buffers_for(self, bucket: int) -> _Buffers:
        if bucket not in self._buffers:
            d = self.cache.device
            longs = torch.zeros(4, bucket, dtype=torch.long, device=d)
            small = torch.zeros(bucket + self.stacks.groups + 1, dtype=torch.int32, device=d)
            floats = torch.zeros(2, bucket, dtype=torch.float64, device=d)
            floats[1] = 0.5
            ngram_rows = {}
            for m in self.ngrams:
                table = m.ngram_embedding.weight
                width = len(m.primes) * table.shape[1]
                ngram_rows[m.layer] = torch.zeros(bucket, width, dtype=table.dtype, device=d)
            self._buffers[bucket] = _Buffers(
                longs=longs,
                small=small,
                floats=floats,
                input_ids=longs[0],
                positions=longs[1],
                slot_mapping=longs[2],
                state_rows=longs[3],
                block_table=torch.zeros(bucket, self.width, dtype=torch.int32, device=d),
                seq_lens=small[:bucket],
                offsets=small[bucket:-1],
                n_rows=small[-1:],
                ngram_rows=ngram_rows,
            )
        return self._buffers[bucket]

    def _host(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer of at least ``numel`` elements (pinned on CUDA, so the copies to
        the device are asynchronous), shared by every bucket; :meth:`_fill` waits for the previous
        step's copies before it writes them again."""
        t = self._staging.get(name)
        if t is None or t.numel() < numel:
            t = torch.empty(numel, dtype=dtype, pin_memory=self.cache.device.type == "cuda")
            self._staging[name] = t
        return t[:numel]

    def _fill(self, buf: _Buffers, batch: DecodeBatch, bucket: int) -> None:
        """Copy the step's inputs into the bucket's static buffers: four host-to-device copies."""
        if self._staged is not None:  # the staging buffers are reused: the last copies must be done
            self._staged.synchronize()
        n = len(batch)
        longs = self._host("longs", 4 * bucket, torch.long).view(4, bucket)
        ln = longs.numpy()
        ln[:, n:] = 0  # padding rows: token 0 at position 0, keys to the scratch page, state row 0
        ln[0, :n] = batch.input_ids
        ln[1, :n] = batch.positions
        ln[2, :n] = batch.slot_mapping
        self.states.fill_rows(batch.seq_ids, ln[3])
        groups = self.stacks.groups
        small = self._host("small", bucket + groups + 1, torch.int32)
        sm = small.numpy()
        sm[:n] = np.asarray(batch.positions) + 1  # seq_lens (0 for padding rows)
        sm[n:bucket] = 0
        offsets = np.cumsum(np.bincount(np.asarray(batch.slots), minlength=groups))
        offsets[-1] = bucket  # padded rows join the last group; their outputs are dropped
        sm[bucket : bucket + groups] = offsets
        sm[-1] = n
        floats = self._host("floats", 2 * bucket, torch.float64).view(2, bucket)
        fl = floats.numpy()
        fl[0] = 0.0  # rows without sampling parameters (and padding): greedy
        fl[1] = 0.5
        if batch.inv_temperature is not None:
            fl[0, :n] = batch.inv_temperature
            fl[1, :n] = batch.uniforms
        width = max(len(t) for t in batch.block_tables)
        table = self._host("table", n * width, torch.int32).view(n, width)
        tn = table.numpy()
        tn[:] = 0
        for i, t in enumerate(batch.block_tables):
            tn[i, : len(t)] = t
        buf.longs.copy_(longs, non_blocking=True)
        buf.small.copy_(small, non_blocking=True)
        buf.floats.copy_(floats, non_blocking=True)
        # only the pages of real rows are read (length 0 rows read none): stale columns are harmless
        buf.block_table[:n, :width].copy_(table, non_blocking=True)
        if self.ngrams:  # padding rows keep stale rows: their outputs are dropped
            windows = {}
            pin = self.cache.device.type == "cuda"
            for m in self.ngrams:
                key = (m.ngram_size, m.eos)
                if key not in windows:
                    windows[key] = torch.from_numpy(batch.recent(m.ngram_size, m.eos))
                buf.ngram_rows[m.layer][:n].copy_(m.rows(m.window_ids(windows[key]), pin), non_blocking=True)
        if self.cache.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()

    def _feed(self, input_ids: torch.Tensor, chosen: torch.Tensor, src: Sequence[int]) -> None:
        """``input_ids[i] = chosen[0, src[i]]`` where ``src[i] >= 0``, on the device (queued behind
        the step that drew ``chosen``, before this one)."""
        idx = torch.as_tensor(np.asarray(src, dtype=np.int64))
        if input_ids.is_cuda:
            idx = idx.pin_memory().to(input_ids.device, non_blocking=True)
        drawn = chosen[0].index_select(0, idx.clamp(min=0)).to(input_ids.dtype)
        input_ids.copy_(torch.where(idx >= 0, drawn, input_ids))

    def _span(self, batch: DecodeBatch) -> int:
        """0 while every row of ``batch`` is below QSA's dense threshold (or the model has no QSA);
        past it, the keys the step's selection reads: a power of two above the longest row (at
        most the context length), so a graph serves many steps and selects over few spare keys."""
        if self.sparse_from is None or max(batch.positions) < self.sparse_from:
            return 0
        return min(self.max_positions, 1 << max(batch.positions).bit_length())

    def _forward(self, buf: _Buffers, use_lora: bool, head: int = 0, span: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        # the positions' host-known bound: below the span past QSA's threshold, below the threshold
        # in a dense step, below the context length without QSA
        bound = span - 1 if span else self.max_positions - 1 if self.sparse_from is None else self.sparse_from - 1
        # not while rollout copies are attached: the products read those, not the weights
        prefetch = self.prefetch if not rollout_precision.attached(self.model) else None
        if prefetch is not None:
            prefetch.begin()
        route = StaticRoute(self.stacks, buf.offsets, buf.n_rows, self.packed, lora=use_lora,
                            rows=buf.positions.shape[0], prefetch=prefetch)
        ctx = DecodeContext(
            positions=buf.positions,
            attend=DecodeAttention(self.cache, buf.slot_mapping, buf.block_table, buf.seq_lens, fixed_selection=True),
            lora=route,
            seq_lens=[1] * buf.positions.shape[0],
            state=self.states.static_view(buf.state_rows),
            position_bound=bound,
            prefetched=buf.ngram_rows if self.ngrams else None,
            rope_tables=self.rope_tables,
            max_positions=self.max_positions,
        )
        hidden = self.model.hidden_states(buf.input_ids, ctx)
        vocab = self.model.vocab_split  # the LM head split by vocabulary (tensor parallelism)
        weight = self.model.unembed_weight if vocab is None else vocab.local(self.model.unembed_weight)
        logits = chunk_logits(hidden, weight, [], 0, hidden.shape[0])
        if prefetch is not None:
            prefetch.after(weight)
        if use_lora:
            logits = route.add_delta("lm_head", hidden, logits)  # fp32 logits (fresh: in place is fine)
        logits = gather_vocab(logits, vocab)
        # every row's plain draw and its logprob, in the graph (one kernel); the engine uses the rows
        # whose parameters are plain (see DecodeBatch.inv_temperature)
        softcap = self.model.final_logit_softcap
        tokens, token_lp = sample_rows(capped(logits, softcap), buf.floats[0], buf.floats[1])
        chosen = torch.stack([tokens.to(torch.float64), token_lp.to(torch.float64)])
        if head:  # the stability record's head of every row, in the same graph and the same copy
            chosen = torch.cat([chosen, head_record(logits, softcap, buf.floats[0], tokens, head).T])
        if prefetch is not None:
            prefetch.end()
        return logits, chosen

    def run(self, batch: DecodeBatch, feed: tuple[torch.Tensor, Sequence[int]] | None = None
            ) -> tuple[torch.Tensor, None, torch.Tensor]:
        """Raw fp32 logits ``[B, V]`` of the step, no routing record (this path has none), and the
        plain draw of every row: fp64 ``[2, B]`` (token ids, their logprobs), followed, with
        ``batch.record_head``, by the rows' :func:`head_record` (``[2 + 2k + 2, B]``). The outputs
        are the bucket's buffers: the next step of the bucket overwrites them.

        ``feed`` ``(chosen, src)``: rows whose input token an earlier step drew and the host has not
        read: row ``i`` takes ``chosen[0, src[i]]`` where ``src[i] >= 0`` (``chosen`` that step's
        draws on the device; ``batch.input_ids[i]`` is then a placeholder)."""
        if batch.record_routing:
            raise ValueError("the static decoder records no MoE routing")
        bucket = self.bucket(len(batch))
        buf = self._buffers_for(bucket)
        self._fill(buf, batch, bucket)
        if feed is not None:
            self._feed(buf.input_ids[: len(batch)], *feed)
        use_lora = any(batch.slots)
        n = len(batch)
        head = batch.record_head
        span = self._span(batch)
        if not self.use_graphs:
            logits, chosen = self._forward(buf, use_lora, head, span)
            return logits[:n], None, chosen[:, :n]
        version = self._version()
        if version != self._graph_version:  # new stacks, rollout copies quantised again, new state slabs
            if self._graphs and torch.cuda.is_available():
                torch.cuda.synchronize()  # a queued step may still replay one of them
            self._graphs.clear()
            self._graph_version = version
        key = (bucket, use_lora, head, span)
        if key not in self._graphs:
            self._graphs[key] = self._capture(buf, use_lora, head, span)
        graph, (logits, chosen) = self._graphs[key]
        graph.replay()
        return logits[:n], None, chosen[:, :n]

    def _capture(self, buf: _Buffers, use_lora: bool, head: int = 0, span: int = 0
                 ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        # warm up on a side stream (Triton compilation, cuBLAS handles, rotary tables), then capture;
        # the warm-up writes the same keys and values the replay will write
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(buf, use_lora, head, span)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(buf, use_lora, head, span)
        return graph, out

    def capture_all(self, use_lora: bool = True) -> None:
        """Capture every bucket now (largest first, so smaller graphs reuse its memory pool)."""
        if not self.use_graphs:
            return
        for b in reversed(self.buckets):
            buf = self._buffers_for(b)
            buf.offsets.zero_()
            buf.offsets[-1] = b
            buf.n_rows.fill_(b)
            if (b, use_lora, 0, 0) not in self._graphs:
                self._graphs[(b, use_lora, 0, 0)] = self._capture(buf, use_lora)


def graphs_failed(err: Exception) -> None:
    warnings.warn(f"CUDA-graph decode failed ({type(err).__name__}: {err}); decoding eagerly", stacklevel=2)
