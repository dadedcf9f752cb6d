"""The static decoder's LoRA route: what a decode step multiplies for each row's adapter.

:class:`StaticRoute` is the LoRA route of a static step over the packed base weights
(:class:`~ember.core.sampling.packed_linears.PackedLinears`) and the stacked factors
(:class:`~ember.core.sampling.lora_stacks.LoraStacks`). Rows are sorted by slot and find their
adapter through an ``offsets`` tensor, a configured-but-unused slot is an empty group (no work).
On the GPU the delta runs as the split-K Triton kernels of :mod:`ember.core.kernels.lora_decode`
(added into the base output in place), a SwiGLU block's LoRA work as one kernel
(:mod:`ember.core.kernels.swiglu_decode`) and an attention layer's q/k/v delta in the q/k/v kernel
(:mod:`ember.core.kernels.qkv_decode`); elsewhere as grouped products. Routed experts keep their
grouped products, with factors stacked per expert group.

:class:`~ember.core.sampling.graphs.StaticDecoder` builds them and runs the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.core.kernels import decode_gemm, fused, lora_decode
from ember.core.kernels.grouped import grouped_linear
from ember.core.kernels.qkv_decode import QkvLora
from ember.core.kernels.swiglu_decode import swiglu_lora
from ember.core.layers.lora import LoraLinear
from ember.core.sampling.lora_stacks import LoraStacks
from ember.core.sampling.packed_linears import PackedLinears


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
