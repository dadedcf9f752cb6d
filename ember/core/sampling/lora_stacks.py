"""Every bank slot's LoRA factors stacked per module, so one captured decode graph serves any mix of adapters.

:class:`LoraStacks` holds each adapted module's factors as ``[slots + 1, r, in]`` /
``[slots + 1, out, r]`` (the adapter's scale folded into ``B``; a shared-input group's members
stacked together, so one shrink and one expand serve the group) and routed experts' factors per
expert group. :class:`~ember.core.sampling.graphs.StaticDecoder` builds and syncs it;
:class:`~ember.core.sampling.static_route.StaticRoute` reads it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch

from ember.core.adapters import AdapterBank

RANK_MULTIPLE = 16
EXPERT_RANK_MULTIPLE = 8
_STACKS = itertools.count()


class LoraStacks:
    """The factors of every bank slot, stacked per adapted dense module (slot 0 = zeros).

    The modules of a shared-input group (``shared``: lists of module names, see
    :func:`~ember.core.sampling.packed_linears.shared_input_groups`) are stacked together, all of them once any is adapted:
    ``A`` side by side along r (``[slots + 1, members · r, in]``) and ``B`` block-diagonal
    (``[slots + 1, sum of outs, members · r]``), so one shrink and one expand serve the group
    (:attr:`fused`); each module's own ``A`` and ``B`` are views of its blocks.

    Routed experts' factors (:attr:`experts`) are stacked per expert group instead of per slot:
    group 0 holds zeros (rows without expert LoRA), then one group per synced slot whose adapter
    adapts experts (:attr:`expert_slots`, mapped from slots by :attr:`expert_group`), ranks padded
    to a multiple of :data:`EXPERT_RANK_MULTIPLE`."""

    def __init__(self, bank: AdapterBank, dtype: torch.dtype, shared: list[list[str]] = ()):
        self.uid = next(_STACKS)  # tells the stacks of different decoders apart (shrink windows)
        self.bank = bank
        self.dtype = dtype
        self.device = bank.device
        self.groups = bank.max_adapters + 1
        self.shapes = {t.name: (t.in_features, t.out_features) for t in bank.targets if t.num_experts is None}
        self.shared = [g for g in shared if all(n in self.shapes for n in g)]
        self.rank = 0
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # group -> (A, B) of all members
        self.splits: dict[str, tuple[int, ...]] = {}  # group -> its members' output widths (B's diagonal blocks)
        self.member: dict[str, tuple[str, int]] = {}  # module -> (group, index in the group)
        self.synced: dict[int, tuple[int, int]] = {}  # slot -> the adapter version its factors are of
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
        """Copy the current factors of ``slots`` (adapters of the bank) into the stacks, where they
        changed since the last copy (:attr:`~ember.core.adapters.Adapter.version`)."""
        adapters = [self.bank.get(s) for s in sorted(set(slots)) if s]
        adapters = [a for a in adapters if self.synced.get(a.slot) != a.version]
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
            previous, self.synced = self.synced, {}
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
        self.stacks, self.fused, self.member, self.splits = {}, {}, {}, {}
        grouped = [g for g in self.shared if set(g) <= names]
        singles = sorted(names - {n for g in grouped for n in g})
        for members in grouped + [[n] for n in singles]:
            i = self.shapes[members[0]][0]
            outs = [self.shapes[n][1] for n in members]
            A_all = torch.zeros(self.groups, len(members) * R, i, dtype=self.dtype, device=self.device)
            B_all = torch.zeros(self.groups, sum(outs), len(members) * R, dtype=self.dtype, device=self.device)
            self.fused[members[0]] = (A_all, B_all)
            self.splits[members[0]] = tuple(outs)
            o = 0
            for j, name in enumerate(members):
                cols = slice(j * R, (j + 1) * R)
                self.stacks[name] = (A_all[:, cols], B_all[:, o : o + outs[j], cols])
                self.member[name] = (members[0], j)
                o += outs[j]

    def _copy(self, adapter) -> None:
        s = adapter.slot
        for name, (A, B) in self.stacks.items():
            _put(A[s], B[s], adapter, name)
        if s in self.expert_slots:
            g = self.expert_slots.index(s)
            for name, (A, B) in self.experts.items():
                _put(A[:, g], B[:, g], adapter, name)
        self.synced[s] = adapter.version


def _put(A: torch.Tensor, B: torch.Tensor, adapter, name: str) -> None:
    """Module ``name``'s factors of ``adapter`` into its stack slices ``A`` ``[..., R, in]`` and ``B``
    ``[..., out, R]``: the module's scale folded into ``B``, the ranks past the adapter's zeroed (all
    of them where it does not adapt the module). Two to four launches: an adapter's copy is paid
    at every admission after it changed (optimizer steps between rollouts)."""
    w = adapter.weights.get(name)
    r = 0 if w is None else w.rank
    if r:
        A[..., :r, :].copy_(w.A)
        torch.mul(w.B, adapter.module_scale(name), out=B[..., :r])
    if r < A.shape[-2]:
        A[..., r:, :].zero_()
        B[..., r:].zero_()

