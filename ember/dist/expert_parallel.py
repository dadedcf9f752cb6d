"""Expert parallelism: each rank holds a contiguous block of every MoE layer's experts.

:func:`shard_experts` narrows each :class:`~ember.core.layers.moe.Experts` module to this rank's
block (on the meta device before loading, so a rank only ever reads its own experts) and sets its
``dispatch``. The router, routing replay (R3) and the routing record stay on the rank that holds
the token; only (token, k) rows travel.

Two dispatchers, chosen per pass (:attr:`ExpertParallel.mode`):

* ``"all_to_all"`` (training, prefill): rows go to their expert's rank and back through
  autograd-aware all-to-alls (torchtitan's ``_token_dispatch``/``_token_combine``). Ranks first
  exchange a count matrix over (local expert, adapter group), so the receiver knows every
  segment and no per-row adapter ids travel; it costs one device→host copy of the counts.
* ``"gather"`` (decode): every rank's rows are all-gathered, each rank runs its own experts on
  the rows routed to them (the others get weight 0) and a reduce-scatter returns each rank's
  tokens. Shapes are static and nothing is read back to the host, so a decode step can be captured
  in a CUDA graph; every rank must hold the same number of tokens.
* ``"replicated"`` (sampling, where every rank runs the same sequences): each rank runs its own
  experts on the rows routed to them and an all-reduce sums the shares; static as ``"gather"``.

Every rank enters every MoE layer's collectives in the same order, also with no rows for it.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.core.layers.lora import LoraRoute
from ember.core.layers.moe import ExpertRows, Experts, Routing
from ember.dist import comm, tensor_parallel
from ember.dist.mesh import Parallel


class ExpertParallel:
    """The ``dispatch`` of sharded :class:`Experts` modules (one instance shared by all layers).
    ``sp``: the model's sequence parallelism, when applied (:mod:`ember.dist.sequence_parallel`)."""

    sp = None

    def __init__(self, parallel: Parallel):
        self.group = parallel.ep_group
        self.ep = parallel.layout.ep
        self.tp_group = parallel.tp_group
        self.tp, self.tp_rank = parallel.layout.tp, parallel.layout.tp_rank
        self.mode = "all_to_all"

    def __call__(self, experts: Experts, x: torch.Tensor, routing: Routing, lora: LoraRoute | None) -> torch.Tensor:
        if self.mode == "gather":
            return self._gather(experts, x, routing, lora)
        if self.mode == "replicated":
            return self._replicated(experts, x, routing, lora)
        return self._all_to_all(experts, x, routing, lora)

    def _all_to_all(self, experts, x, routing, lora):
        if self.sp is not None and self.sp.active:  # sequence parallel: x is this rank's rows
            group = None if lora is None else self.sp.local(lora.moe_token_group())
            return self._dispatch(experts, x, routing, lora, group)
        if self.tp == 1:
            return self._dispatch(experts, x, routing, lora, None)
        # the ranks of a TP group hold the same tokens: each dispatches its own slice of them, and
        # the slices' outputs are gathered back (the gather's backward keeps each rank's slice;
        # the copies' backward sums over the group the gradients of what every rank holds whole:
        # the input rows and the router's weights)
        T = x.shape[0]
        sizes = [len(part) for part in torch.arange(T).tensor_split(self.tp)]
        start = sum(sizes[: self.tp_rank])
        end = start + sizes[self.tp_rank]
        x = tensor_parallel.copy_to_group(x, self.tp_group)
        weights = tensor_parallel.copy_to_group(routing.weights, self.tp_group)
        token_group = None if lora is None else lora.moe_token_group()[start:end]
        part = Routing(routing.experts[start:end], weights[start:end])
        out = self._dispatch(experts, x[start:end], part, lora, token_group)
        return comm.gather_rows(out, sizes, self.tp_group)

    def _dispatch(self, experts, x, routing, lora, token_group):
        rows = ExpertRows.sort(routing, lora, token_group)
        G, local = rows.groups, experts.num_experts * rows.groups
        # rows are sorted by expert, so each destination rank's rows are contiguous
        counts = torch.bincount(rows.key, minlength=experts.global_experts * G).view(self.ep, local)
        received = comm.exchange_counts(counts, self.group)
        sizes = torch.stack([counts.sum(1), received.sum(1)]).tolist()
        send, recv = sizes
        got_x = comm.all_to_all(x[rows.token], recv, send, self.group)
        got_w = comm.all_to_all(rows.weight[:, None], recv, send, self.group)[:, 0]
        # received rows run (source rank, local expert, group); the experts want (expert, group, source)
        segment = torch.arange(local, device=x.device).repeat(self.ep).repeat_interleave(received.reshape(-1))
        perm = torch.argsort(segment, stable=True)
        key = segment[perm]
        out = experts.compute(got_x, perm, got_w[perm], key, key % G, G, lora)
        back = comm.all_to_all(out[torch.argsort(perm)], send, recv, self.group)
        return experts.combine(x, rows.token, back)

    def _gather(self, experts, x, routing, lora):
        group = _token_group(x, lora)
        partial = self._local(
            experts,
            comm.all_gather(x, self.group),
            comm.all_gather(routing.experts, self.group),
            comm.all_gather(routing.weights, self.group),
            comm.all_gather(group, self.group),
            lora,
        )
        return comm.reduce_scatter(partial, self.group)

    def _replicated(self, experts, x, routing, lora):
        partial = self._local(experts, x, routing.experts, routing.weights, _token_group(x, lora), lora)
        return comm.all_reduce_sum_(partial, self.group)

    @staticmethod
    def _local(experts, x, expert_ids, weights, token_group, lora):
        """This rank's experts' share of every row of ``x``: rows routed elsewhere ride along
        with the last local expert at weight 0, so the shapes never depend on the routing."""
        G = len(lora.moe_adapters) if lora is not None else 1
        local = expert_ids - experts.expert_start
        mine = (local >= 0) & (local < experts.num_experts)
        local = torch.where(mine, local, experts.num_experts - 1)
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        k = local.shape[1]
        row_group = token_group.repeat_interleave(k)
        key = local.reshape(-1) * G + row_group
        order = torch.argsort(key, stable=True)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(k)[order]
        out = experts.compute(x, token, weights.reshape(-1)[order], key[order], row_group[order], G, lora)
        return experts.combine(x, token, out)


def _token_group(x: torch.Tensor, lora: LoraRoute | None) -> torch.Tensor:
    if lora is None:
        return torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return lora.moe_token_group()


def shard_experts(model: nn.Module, parallel: Parallel) -> int:
    """Narrow every :class:`Experts` module of ``model`` to this rank's block, in place, and route
    its rows through one :class:`ExpertParallel`; returns the number of sharded modules. Works on
    meta-device models (before loading) and on loaded ones (the other experts are dropped)."""
    ep = parallel.layout.ep
    dispatch = ExpertParallel(parallel)
    blocks = model.__dict__.setdefault("param_blocks", {})  # read by load_model: what to read of each tensor
    sharded = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, Experts):
            continue
        total = mod.num_experts
        if total % ep:
            raise ValueError(f"--ep {ep} must divide the number of experts of every MoE layer ({name}: {total})")
        start, end = parallel.layout.expert_range(total)
        for pname in ("gate_up_proj", "down_proj"):
            p = getattr(mod, pname)
            setattr(mod, pname, nn.Parameter(p.data[start:end].clone(), requires_grad=False))
            blocks[f"{name}.{pname}"] = (0, start, end - start)
        mod.num_experts, mod.expert_start, mod.global_experts = end - start, start, total
        mod.dispatch = dispatch
        sharded += 1
    return sharded


MODES = ("all_to_all", "gather", "replicated")


def set_mode(model: nn.Module, mode: str) -> None:
    """Pick the dispatcher of every sharded MoE layer (one of :data:`MODES`); sequence
    parallelism is on for ``"all_to_all"`` (training passes) only."""
    if mode not in MODES:
        raise ValueError(f"unknown expert dispatch {mode!r}")
    sp = getattr(model, "sequence_parallel", None)
    if sp is not None:  # training passes only
        sp.active = mode == "all_to_all"
    for mod in model.modules():
        if isinstance(mod, Experts) and isinstance(mod.dispatch, ExpertParallel):
            mod.dispatch.mode = mode
