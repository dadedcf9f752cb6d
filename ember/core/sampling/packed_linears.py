"""The static decoder's base weights packed by shared input: what a decode step's base products multiply.

:class:`PackedLinears` lays the base weights of each shared-input group (q/k/v, gate/up) side by
side, so a step runs one GEMM per group; after them, spare rows where a step of few adapters puts
their LoRA shrink factors, so the same GEMM computes the shrink (shrink windows).
:class:`~ember.core.sampling.graphs.StaticDecoder` builds it; :class:`~ember.core.sampling.static_route.StaticRoute`
multiplies through it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ember.core import rollout_precision
from ember.core.layers.lora import LoraLinear, side_by_side
from ember.core.models.base import CausalLM
from ember.core.sampling.lora_stacks import LoraStacks

WINDOW_POSITIONS = 8  # steps of at most this many adapters carry their shrinks in the base products
WINDOW_SHARE = 4  # the shrink windows take at most a quarter of a group's rows
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

