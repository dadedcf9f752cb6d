"""The static decoder's LoRA route and weights: what a decode step multiplies.

* :class:`PackedLinears`: the base weights of each shared-input group (q/k/v, gate/up) laid side by
  side, so a step runs one GEMM per group; after them, spare rows where a step of few adapters
  puts their LoRA shrink factors, so the same GEMM computes the shrink (shrink windows).
* :class:`LoraStacks`: every bank slot's factors of a module in one stack ``[slots + 1, r, in]`` /
  ``[slots + 1, out, r]`` (the adapter's scale folded into ``B``; a shared-input group's members
  stacked together), so one captured graph serves any mix of adapters.
* :class:`StaticRoute`: the LoRA route of a static step. Rows are sorted by slot and find their
  adapter through an ``offsets`` tensor, a configured-but-unused slot is an empty group (no work).
  On the GPU the delta runs as the split-K Triton kernels of :mod:`ember.core.kernels.lora_decode`
  (added into the base output in place), and a SwiGLU block's LoRA work as one kernel
  (:mod:`ember.core.kernels.swiglu_decode`); elsewhere as grouped products. Routed experts keep
  their grouped products, with factors stacked per expert group.

:class:`~ember.core.sampling.graphs.StaticDecoder` builds them and runs the step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ember.core import rollout_precision
from ember.core.adapters import AdapterBank
from ember.core.kernels import decode_gemm, fused, lora_decode
from ember.core.kernels.grouped import grouped_linear
from ember.core.kernels.qkv_decode import QkvLora
from ember.core.kernels.swiglu_decode import swiglu_lora
from ember.core.layers.lora import LoraLinear, side_by_side
from ember.core.models.base import CausalLM

RANK_MULTIPLE = 16
EXPERT_RANK_MULTIPLE = 8
WINDOW_POSITIONS = 8  # steps of at most this many adapters carry their shrinks in the base products
WINDOW_SHARE = 4  # the shrink windows take at most a quarter of a group's rows
_STACKS = itertools.count()
_FILLS = [0]  # window fills that copied anything, by any decoder

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


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """Where ``t``'s storage is and how large (a packing with windows is recognised by it: its views
    keep it alive, so no other tensor can take its place)."""
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def window_groups(model: CausalLM) -> list[list[LoraLinear]]:
    """The groups :class:`PackedLinears` packs: the shared-input groups, then each attention output
    projection (``o_proj``) alone, whose shrink a window can carry too (the down projection's runs
    in the SwiGLU kernel)."""
    singles = [[mod.o_proj] for mod in model.modules() if isinstance(getattr(mod, "o_proj", None), LoraLinear)]
    return shared_input_groups(model) + singles


class PackedLinears:
    """The base weights of each shared-input group laid side by side in one tensor (rows of the
    members in order), so a decode step runs one GEMM per group: at the batch sizes of decode the
    small k/v products alone reach a fifth of the memory bandwidth (``bench/sample_diag.py --only
    gemm``), the packed q/k/v product most of it.

    Packing makes each member's ``weight`` (and ``bias``) a view of the group's tensor: values,
    shapes and parameters are unchanged, so the trainer, which shares the model, sees no
    difference. :meth:`rows` re-checks that a weight is still that view before it is used.

    **Shrink windows.** With ``window_rank`` (the adapter bank's largest rank), the groups whose
    modules the bank may adapt (:func:`window_groups`: the shared-input groups and the attention
    output projection, packed as a group of one) get :attr:`positions` windows of spare rows after
    their weights, ``members · window_rank`` rows each. A decode step of at most that many adapters
    copies the ``A`` factors of its ``i``-th adapter (in slot order, the order of
    :class:`~ember.core.kernels.lora_decode.ActiveGroups`) into window ``i`` (:meth:`fill_windows`,
    only where they changed) and multiplies the weights and its windows in one cuBLAS product
    (:meth:`window_product`): the LoRA shrink ``x @ A.T`` comes out beside the base output, with no
    launch of its own (a launch is about 3.4 µs of a decode step's latency, three a layer).
    Windows take at most ``1 / WINDOW_SHARE`` of a group's rows, and a step multiplies only the
    windows of its adapters, so a bank's unused slots cost nothing. Several decoders of one model
    share the windows; the record of what each window holds lives on the group's first module."""

    def __init__(self, model: CausalLM, window_rank: int = 0, targets: Iterable[str] = ()):
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.member: dict[str, tuple[str, int, int]] = {}  # module -> (group, first row, end row)
        self.modules: dict[str, list[LoraLinear]] = {}  # group -> its members
        self.windows: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # group -> weights and windows
        self._filled: tuple | None = None  # what fill_windows last found in place, and when
        targets = set(targets)
        groups = []
        for members in window_groups(model):
            ws = [m.weight for m in members]
            biases = [m.bias for m in members]
            if len({(w.dtype, w.device) for w in ws}) != 1 or len({b is None for b in biases}) != 1:
                continue
            windowed = window_rank > 0 and all(m.lora_name in targets for m in members)
            if len(members) > 1 or windowed:  # a single module is packed only for its windows
                groups.append((members, windowed))
        # one number of windows for every group (a step uses all of them or none): a power of two
        rows = [(sum(m.out_features for m in g), len(g)) for g, windowed in groups if windowed]
        fit = min((out // (WINDOW_SHARE * n * window_rank) for out, n in rows), default=0)
        self.positions = min(WINDOW_POSITIONS, 1 << (fit.bit_length() - 1)) if fit else 0
        with torch.no_grad():
            for members, windowed in groups:
                key = members[0].lora_name
                spare = self.positions * len(members) * window_rank if windowed else 0
                first = members[0]
                # rows after the weights in their storage are windows only where a packing here left them
                owned = getattr(first, "decode_windows_storage", None) == _storage(first.weight)
                W = side_by_side([m.weight for m in members], spare, owned)
                fresh = W.data_ptr() != first.weight.data_ptr()  # newly packed: its windows hold zeros
                b = side_by_side([m.bias for m in members], spare, owned) if first.bias is not None else None
                start = 0
                for m in members:
                    end = start + m.out_features
                    m.weight.data = W[start:end]
                    if b is not None:
                        m.bias.data = b[start:end]
                    self.member[m.lora_name] = (key, start, end)
                    start = end
                self.weights[key] = (W[:start], b[:start] if b is not None else None)
                self.modules[key] = members
                if spare:
                    self.windows[key] = (W, b)
                    record = getattr(first, "decode_windows", None)
                    if fresh or record is None:
                        first.decode_windows = [None] * self.positions
                    elif len(record) < self.positions:
                        record.extend([None] * (self.positions - len(record)))
                    first.decode_windows_storage = _storage(W)

    def window_product(self, key: str, x: torch.Tensor, cols: int) -> torch.Tensor:
        """``x`` times group ``key``'s weights and the first ``cols`` rows of its windows:
        ``[N, out + cols]``, the base output then the windows' shrinks."""
        W, b = self.windows[key]
        # exactly the step's windows: rounding their rows up to a multiple of 128 or 256 (computed,
        # never read) was level with this on an H100 (bench/shrink_windows.py, 2026-12-07)
        end = self.weights[key][0].shape[0] + cols
        return F.linear(x, W[:end], b[:end] if b is not None else None)

    def fill_windows(self, stacks: LoraStacks, slots: list[int]) -> None:
        """Copy into window ``i`` of every windowed group the shrink factors of ``slots[i]`` (a step's
        adapters in slot order, at most :attr:`positions`), where the window holds anything else:
        another slot, an older version of the adapter, factors of stacks since reallocated or of
        another decoder's stacks. One multi-tensor copy for the windows that changed."""
        if len(slots) > self.positions:
            raise ValueError(f"fill_windows: {len(slots)} adapters for {self.positions} windows")
        # most steps decode the adapters of the step before: nothing to compare window by window,
        # unless some decoder has filled windows since (they may be this model's)
        want = (stacks.uid, stacks.version, tuple((s, stacks.synced.get(s)) for s in slots))
        if self._filled == (want, _FILLS[0]):
            return
        dst, src = [], []
        for key, (W, _) in self.windows.items():
            stack = stacks.fused.get(key)
            if stack is None:
                continue
            A = stack[0]
            width, base = A.shape[1], self.weights[key][0].shape[0]
            record = self.modules[key][0].decode_windows
            for i, slot in enumerate(slots):
                holds = (stacks.uid, stacks.version, slot, stacks.synced.get(slot))
                if record[i] != holds:
                    dst.append(W[base + i * width : base + (i + 1) * width])
                    src.append(A[slot])
                    record[i] = holds
        if dst:
            _FILLS[0] += 1
            with torch.no_grad():
                torch._foreach_copy_(dst, src)
        self._filled = (want, _FILLS[0])

    def rows(self, name: str, weight: torch.Tensor) -> tuple[str, int, int] | None:
        """``(group, first row, end row)`` of module ``name`` if ``weight`` is still its packed view."""
        entry = self.member.get(name)
        if entry is None:
            return None
        W = self.weights[entry[0]][0]
        if weight.data_ptr() != W[entry[1] :].data_ptr() or weight.shape[0] != entry[2] - entry[1]:
            return None
        return entry

    def rollout(self, key: str) -> bool:
        """Whether group ``key`` multiplies through its members' rollout copies now."""
        first = self.modules[key][0]
        return first.rollout is not None and first.rollout.active

    def product(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Group ``key``'s base product ``x @ W.T + b``: through its members' rollout copies while
        they are in use (:func:`~ember.core.rollout_precision.group_product`, laid side by side as
        the weights are), else through the packed weights."""
        W, b = self.weights[key]
        if self.rollout(key):
            return rollout_precision.group_product(self.modules[key], x, b)
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
    the stacks' ``[E, G, R, in]`` / ``[E, G, out, R]`` seen as ``E·G`` pairs.

    ``gemm`` (a :class:`~ember.core.kernels.decode_gemm.Workspace`): the dense base products run as
    the decode GEMM (:mod:`ember.core.kernels.decode_gemm`) with the LoRA expand in its epilogue,
    the shrink first; rollout copies and shapes it does not take keep cuBLAS and the separate
    expand.

    ``max_active``: at most this many slots have real rows (the caller knows it from the step's
    rows; it must hold, see :class:`~ember.core.kernels.lora_decode.ActiveGroups`). The LoRA kernels'
    launches are sized by it, so a bank's unused slots do not widen them; ``None``: every slot may.

    ``kernels=False``: grouped products (``torch._grouped_mm``) instead of the decode kernels, which
    are made for a step's few rows: a prefill pass's route
    (:meth:`~ember.core.sampling.graphs.StaticDecoder.prefill_route`).

    ``qkv_kernel``: :meth:`qkv_product` hands an attention layer its packed q/k/v product with the
    LoRA delta not yet added, for the kernel that adds it on its way to the cache
    (:func:`~ember.core.layers.attention.decode_qkv_attention`); off: it answers ``None`` and the
    layer multiplies through :meth:`linear`."""

    def __init__(
        self,
        stacks: LoraStacks,
        offsets: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        packed: PackedLinears | None = None,
        lora: bool = True,
        rows: int | None = None,
        gemm: decode_gemm.Workspace | None = None,
        max_active: int | None = None,
        kernels: bool = True,
        windows: int = 0,
        qkv_kernel: bool = False,
    ):
        self.stacks = stacks
        self.offsets = offsets
        self.n_rows = n_rows
        self.packed = packed
        self.lora = lora
        self.rows = rows  # the padded row count (the routed experts' groups need it)
        self.gemm = gemm  # the decode GEMM's workspace; None: base products through cuBLAS
        self._token_group: torch.Tensor | None = None
        self._h: tuple[str, torch.Tensor, torch.Tensor] | None = None  # (group, input, h of the group)
        self._y: tuple[str, torch.Tensor, torch.Tensor] | None = None  # (group, input, packed output)
        self._workspace: torch.Tensor | None = None
        self._used = 0
        self.max_active = max_active  # at most this many slots have rows (None: any of the bank's)
        self.kernels = kernels  # the decode kernels where they run; False: grouped products
        self._active: lora_decode.ActiveGroups | None = None
        if windows and (max_active is None or windows < max_active or packed is None or windows > packed.positions):
            raise ValueError(f"StaticRoute: {windows} shrink windows for at most {max_active} adapters "
                             f"({packed.positions if packed is not None else 0} packed)")
        self.windows = windows  # shrink windows the packed products multiply (PackedLinears); 0: none
        self.qkv_kernel = qkv_kernel and kernels  # qkv_product serves the q/k/v kernel

    @property
    def active(self) -> lora_decode.ActiveGroups:
        """The slots with rows this step (:func:`~ember.core.kernels.lora_decode.active_groups`),
        bounded by ``max_active``, which sizes the LoRA kernels' launches."""
        if self._active is None:
            self._active = lora_decode.active_groups(self.offsets, self.n_rows, skip_first=True, bound=self.max_active)
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
        return self.kernels and lora_decode.triton_ok(*tensors) and fused.use_triton(self.offsets)

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

    def _windowed(self, key: str, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> bool:
        """Whether group ``key``'s shrink rides in its base product this step (shrink windows, see
        :class:`PackedLinears`): windows in use, the group has them, its weights (not rollout
        copies) are multiplied through cuBLAS, and the decode kernels run."""
        return (
            self.windows > 0
            and key in self.packed.windows
            and not self.packed.rollout(key)
            and not self._gemm_ok(x, self.packed.weights[key][0], B)
            and self._triton(x, A, B)
        )

    def _window_product(self, key: str, x: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``key``'s base output and its shrink, windowed (``[N, windows, members · r]``: the
        ``i``-th active slot's in window ``i``), from one product; the shrink is kept as the group's
        ``h`` (:meth:`_group_h`)."""
        width = A.shape[1]
        y = self.packed.window_product(key, x, self.windows * width)
        out = self.packed.weights[key][0].shape[0]
        h = y[:, out:].unflatten(1, (self.windows, width))
        self._h = (key, x, h)
        return y[:, :out], h

    def _expand(self, y: torch.Tensor, h: torch.Tensor, B: torch.Tensor, triton: bool,
                splits: tuple[int, ...] | None = None) -> torch.Tensor:
        if triton:  # splits: a packed group's member widths (its block-diagonal B)
            lora_decode.lora_expand_add(y, h, B, self.offsets, self.n_rows, True, active=self.active, splits=splits)
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
        h = self._group_h(key, x, triton)[..., j * R : (j + 1) * R]  # [N, r] or windowed [N, P, r]
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

    def _gemm_ok(self, x: torch.Tensor, weight: torch.Tensor, B: torch.Tensor | None) -> bool:
        """Whether the decode GEMM takes this product (with LoRA factors ``B``, if any)."""
        return (
            self.gemm is not None
            and decode_gemm.preferred(x, weight)
            and (B is None or (self._triton(x, B) and B.stride(-1) == 1))
        )

    def _gemm(self, key: str, j: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              B: torch.Tensor | None) -> torch.Tensor:
        """The decode GEMM of ``x`` and ``weight`` with, given ``B``, member ``j`` of group ``key``'s
        LoRA expand in its epilogue (the group's shrink runs first, once per input)."""
        lora = None
        if B is not None:
            R = B.shape[-1]
            h = self._group_h(key, x, True)[:, j * R : (j + 1) * R]
            lora = (h, B, self.offsets, self.n_rows, self.active)
        return decode_gemm.decode_linear(x, weight, bias, lora=lora, workspace=self.gemm)

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = self.packed.rows(name, weight) if self.packed is not None and x.dim() == 2 else None
        if rows is None:
            st = self.stacks.stacks.get(name) if self.lora else None
            B = st[1] if st is not None else None
            if self._gemm_ok(x, weight, B):
                key, j = self.stacks.member[name] if st is not None else (name, 0)
                return self._gemm(key, j, x, weight, bias, B)
            return self.add_delta(name, x, F.linear(x, weight, bias))
        key, start, end = rows
        if self._y is None or self._y[0] != key or self._y[1] is not x:
            y, h, triton = self._packed(key, x)
            if h is not None:
                y = self._expand(y, h, self.stacks.fused[key][1], triton, self.stacks.splits[key])
            self._y = (key, x, y)
        return self._y[2][:, start:end]

    def _packed(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Group ``key``'s packed base product and the shrink ``h`` of its LoRA delta, not yet expanded
        (None: no delta left to add, none or the decode GEMM's epilogue added it), and whether ``h``
        is for the Triton expand."""
        stacks = self.stacks.fused.get(key) if self.lora else None
        W, b = self.packed.weights[key]
        B = stacks[1] if stacks is not None else None
        if not self.packed.rollout(key) and self._gemm_ok(x, W, B):
            return self._gemm(key, 0, x, W, b, B), None, True
        if stacks is not None and self._windowed(key, x, *stacks):
            return *self._window_product(key, x, stacks[0]), True
        y = self.packed.product(key, x)
        if stacks is None:
            return y, None, True
        triton = self._triton(y, x, *stacks)
        return y, self._group_h(key, x, triton), triton

    def qkv_product(self, q_proj: LoraLinear, x: torch.Tensor) -> tuple[torch.Tensor, QkvLora | None] | None:
        """The packed q/k/v product of an attention layer whose ``q_proj`` is given (``[N, q, k and v
        outputs]``) and its LoRA delta, not yet added (None: nothing to add), for
        :func:`~ember.core.kernels.qkv_decode.qkv_rope_write`, which adds it on its way to the
        norms, rotations and the cache. ``None`` where q, k and v are not packed together in that
        order; a delta the Triton kernels cannot add is added here."""
        if not self.qkv_kernel:
            return None
        rows = self.packed.rows(q_proj.lora_name, q_proj.weight) if self.packed is not None and x.dim() == 2 else None
        if rows is None or rows[1] != 0 or len(self.packed.modules[rows[0]]) != 3:
            return None
        key = rows[0]
        y, h, triton = self._packed(key, x)
        if h is None:
            return y, None
        B = self.stacks.fused[key][1]
        if not triton:
            return self._expand(y, h, B, False, self.stacks.splits[key]), None
        return y, QkvLora(h, B, self.offsets, self.n_rows, self.active)

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
        W, b = self.packed.weights[key]
        if gu_stacks is not None and self._windowed(key, x, *gu_stacks):
            gu, h_gu = self._window_product(key, x, gu_stacks[0])
        else:
            gu = (self._gemm(key, 0, x, W, b, None) if not self.packed.rollout(key) and self._gemm_ok(x, W, None)
                  else self.packed.product(key, x))
            h_gu = self._group_h(key, x, True) if gu_stacks is not None else None
        gate_up = (h_gu, gu_stacks[1]) if gu_stacks is not None else None
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
