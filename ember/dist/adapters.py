"""The adapter bank of a sharded engine.

Every rank holds every adapter, each factor as its rank's part of it: the routed experts' factors
of its own experts (expert parallelism), the split factors of tensor-parallel linears (see
:mod:`ember.dist.tensor_parallel`), the others whole. Tinker's losses are sums, so gradients are
summed (never averaged) over exactly the ranks whose contributions make up the whole:

==================================  ==============================  =========================
factor                              each rank's gradient            summed over
==================================  ==============================  =========================
whole (not split), dense            its own sequences               ``dp_group``
split by TP (column B, row A)       its own sequences, its shard    ``dp_group``
replicated factor of a TP linear    its shard's part                every rank
routed experts' (its experts)       every rank's rows of them       ``efsdp_group``
==================================  ==============================  =========================

After the reduction the parts that several ranks hold are equal on all of them, so AdamW keeps
them identical without further communication.
"""

from __future__ import annotations

import torch

from ember.core.adapters import Adapter
from ember.dist import comm
from ember.dist.mesh import Parallel
from ember.dist.tensor_parallel import PARTIAL, REPLICATED, SHARDED_COLS, SHARDED_ROWS

EXPERT = "expert"
_SHARDED_BY = {EXPERT: ("ep_group", 0), SHARDED_ROWS: ("tp_group", 0), SHARDED_COLS: ("tp_group", 1)}


def _base(name: str) -> str:
    """The factor an optimizer-state name belongs to (``….lora_A.exp_avg`` → ``….lora_A``)."""
    return name.rsplit(".", 1)[0] if name.endswith((".exp_avg", ".exp_avg_sq")) else name


def factor_kind(name: str, t: torch.Tensor, parallel: Parallel) -> str:
    """How ``name`` (``{module}.lora_A`` / ``.lora_B``, optionally ``.exp_avg``…) is split."""
    if name.endswith(".step"):  # Adam's step count: one number, the same everywhere
        return REPLICATED
    base = _base(name)
    kinds = getattr(parallel, "factor_kinds", {})
    if base in kinds:
        return kinds[base]
    return EXPERT if t.dim() == 3 else REPLICATED


def _index(adapter: Adapter, parallel: Parallel) -> dict[str, torch.Tensor]:
    """Positions in the adapter's flat vector of each kind of factor (cached on the adapter)."""
    cached = getattr(adapter, "_dist_index", None)
    if cached is not None:
        return cached
    parts: dict[str, list[torch.Tensor]] = {}
    offset = 0
    for name, t in adapter.tensors().items():
        n = t.numel()
        parts.setdefault(factor_kind(name, t, parallel), []).append(torch.arange(offset, offset + n))
        offset += n
    index = {k: torch.cat(v).to(adapter.flat.device) for k, v in parts.items()}
    adapter._dist_index = index
    return index


def _group(kind: str, parallel: Parallel):
    return {REPLICATED: parallel.dp_group, SHARDED_ROWS: parallel.dp_group, SHARDED_COLS: parallel.dp_group,
            PARTIAL: parallel.world_group,
            # experts: over the ranks that hold the same experts and ran other rows
            EXPERT: parallel.efsdp_group if parallel.layout.ep > 1 else parallel.dp_group}[kind]


def reduce_gradients(adapters: list[Adapter], parallel: Parallel) -> None:
    """Sum the accumulated gradients of ``adapters`` over the ranks that share each factor. Every
    rank calls it with the same adapters in the same order (an adapter that got no gradient on
    this rank takes part with zeros). One all-reduce per kind of factor for all the adapters."""
    if not adapters or parallel.world == 1:
        return
    for a in adapters:
        if a.flat.grad is None:
            a.flat.grad = torch.zeros_like(a.flat.detach())
    kinds = sorted({k for a in adapters for k in _index(a, parallel)})
    for kind in kinds:
        group = _group(kind, parallel)
        if torch.distributed.get_world_size(group) == 1:
            continue
        idx = [_index(a, parallel).get(kind) for a in adapters]
        buf = torch.cat([a.flat.grad[i] for a, i in zip(adapters, idx) if i is not None])
        comm.all_reduce_sum_(buf, group)
        for a, part in zip([a for a, i in zip(adapters, idx) if i is not None],
                           torch.split(buf, [len(i) for i in idx if i is not None])):
            a.flat.grad[_index(a, parallel)[kind]] = part


def grad_norm(adapter: Adapter, parallel: Parallel) -> torch.Tensor:
    """The L2 norm of the whole adapter's (reduced) gradient: the parts every rank of a group
    holds counted once, the sharded parts summed over their group."""
    g = adapter.flat.grad
    total = g.new_zeros((), dtype=torch.float64)
    for kind, idx in sorted(_index(adapter, parallel).items()):
        sq = g[idx].double().square().sum()
        if kind in _SHARDED_BY:
            comm.all_reduce_sum_(sq, getattr(parallel, _SHARDED_BY[kind][0]))
        total = total + sq
    return total.sqrt().to(g.dtype)


def optim_step(adapter: Adapter, params, parallel: Parallel) -> dict[str, float]:
    """One AdamW step of a sharded adapter, clipped by the norm of the whole adapter."""
    return adapter.optimizer.step(params, grad_norm=lambda: grad_norm(adapter, parallel))


def full_tensors(values: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, torch.Tensor]:
    """An adapter's tensors by name (``tensors()``, ``grads()`` or optimizer state) with every
    split factor gathered whole. Every rank calls it; names are visited in sorted order."""
    out = {}
    for name in sorted(values):
        t = values[name]
        kind = factor_kind(name, t, parallel)
        if kind in _SHARDED_BY:
            group_name, dim = _SHARDED_BY[kind]
            group = getattr(parallel, group_name)
            t = comm.all_gather(t.transpose(0, dim).contiguous(), group).transpose(0, dim)
            pieces = getattr(parallel, "factor_pieces", {}).get(_base(name))
            if pieces:  # rank blocks of [piece 0 | piece 1 | …] → [piece 0 of every rank | …]
                blocks = [b.split(pieces) for b in t.chunk(parallel.layout.tp)]
                t = torch.cat([b[p] for p in range(len(pieces)) for b in blocks])
        out[name] = t
    return out


def local_tensors(values: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, torch.Tensor]:
    """The inverse of :func:`full_tensors`: this rank's part of every split factor."""
    out = {}
    for name, t in values.items():
        kind = factor_kind(name, t, parallel)
        if kind == EXPERT and parallel.layout.ep > 1:
            start, end = parallel.layout.expert_range(t.shape[0])
            t = t[start:end]
        elif kind in (SHARDED_ROWS, SHARDED_COLS):
            dim = _SHARDED_BY[kind][1]
            pieces = getattr(parallel, "factor_pieces", {}).get(_base(name))
            if pieces:
                tp, r = parallel.layout.tp, parallel.layout.tp_rank
                t = torch.cat([p.chunk(tp)[r] for p in t.split([n * tp for n in pieces])])
            else:
                start, end = parallel.layout.tp_range(t.shape[dim])
                t = t.narrow(dim, start, end - start)
        out[name] = t
    return out


def gathered(adapter: Adapter, parallel: Parallel, with_optimizer: bool = False) -> Adapter:
    """The whole adapter as one process would hold it, with its Adam state if asked: what a
    checkpoint or a PEFT export is written from. Every rank calls it."""
    full = full_tensors(adapter.tensors(), parallel)
    layout = [
        (name, tuple(full[f"{name}.lora_A"].shape), tuple(full[f"{name}.lora_B"].shape)) for name, _, _ in adapter.layout
    ]
    flat = torch.cat([full[f"{name}.{f}"].reshape(-1) for name, _, _ in layout for f in ("lora_A", "lora_B")])
    out = Adapter(adapter.slot, adapter.config, layout, flat.detach().clone())
    if with_optimizer:
        state = full_tensors(adapter.optimizer_state(), parallel)
        if state:
            out.load_optimizer_state(state)
    return out
