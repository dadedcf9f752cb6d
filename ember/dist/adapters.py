"""The adapter bank under expert parallelism.

Every rank holds every adapter: the dense factors (attention, dense MLP, shared experts, LM head)
replicated, and the routed experts' factors of its own experts only (the adapter's flat vector
keeps the dense part first: :attr:`~ember.core.adapters.Adapter.dense_numel`). Tinker's losses are
sums, so gradients are summed (never averaged) over exactly the ranks that share a factor:

* dense factors: over all ranks (each ran its own share of the step's tokens);
* expert factors: over the ranks holding the same experts (``efsdp``); within an expert group
  every row already came to its expert's rank.

After the reduction every rank holds the same dense gradient, so AdamW keeps the replicated
parts identical on every rank without further communication.
"""

from __future__ import annotations

import torch

from ember.core.adapters import Adapter
from ember.dist import comm
from ember.dist.mesh import Parallel


def reduce_gradients(adapters: list[Adapter], parallel: Parallel) -> None:
    """Sum the accumulated gradients of ``adapters`` over the ranks that share each factor. Every
    rank calls it with the same adapters in the same order (an adapter that got no gradient on
    this rank takes part with zeros)."""
    if not adapters or parallel.world == 1:
        return
    for a in adapters:
        if a.flat.grad is None:
            a.flat.grad = torch.zeros_like(a.flat.detach())
    dense = torch.cat([a.flat.grad[: a.dense_numel] for a in adapters])
    comm.all_reduce_sum_(dense, parallel.world_group)
    for a, part in zip(adapters, torch.split(dense, [a.dense_numel for a in adapters])):
        a.flat.grad[: a.dense_numel] = part
    if parallel.layout.efsdp > 1:
        experts = torch.cat([a.flat.grad[a.dense_numel :] for a in adapters])
        comm.all_reduce_sum_(experts, parallel.efsdp_group)
        sizes = [a.flat.numel() - a.dense_numel for a in adapters]
        for a, part in zip(adapters, torch.split(experts, sizes)):
            a.flat.grad[a.dense_numel :] = part


def grad_norm(adapter: Adapter, parallel: Parallel) -> torch.Tensor:
    """The L2 norm of the whole adapter's (reduced) gradient: its dense part, which every rank
    holds, and the expert parts of one expert group."""
    g = adapter.flat.grad
    dense = g[: adapter.dense_numel].double().square().sum()
    experts = g[adapter.dense_numel :].double().square().sum()
    comm.all_reduce_sum_(experts, parallel.ep_group)
    return (dense + experts).sqrt().to(g.dtype)


def optim_step(adapter: Adapter, params, parallel: Parallel) -> dict[str, float]:
    """One AdamW step of a sharded adapter, clipped by the norm of the whole adapter."""
    return adapter.optimizer.step(params, grad_norm=lambda: grad_norm(adapter, parallel))


def full_tensors(values: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, torch.Tensor]:
    """An adapter's tensors by name (``tensors()``, ``grads()`` or optimizer moments) with every
    expert factor (``[E_local, ...]``) gathered over the expert group into ``[E, ...]``. Every rank
    calls it; names are visited in sorted order."""
    out = {}
    for name in sorted(values):
        t = values[name]
        out[name] = comm.all_gather(t, parallel.ep_group) if _is_expert(t) and parallel.layout.ep > 1 else t
    return out


def local_tensors(values: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, torch.Tensor]:
    """The inverse of :func:`full_tensors`: this rank's block of every expert factor."""
    out = {}
    for name, t in values.items():
        if _is_expert(t) and parallel.layout.ep > 1:
            start, end = parallel.layout.expert_range(t.shape[0])
            t = t[start:end]
        out[name] = t
    return out


def _is_expert(t: torch.Tensor) -> bool:
    return t.dim() == 3


def gathered(adapter: Adapter, parallel: Parallel, with_optimizer: bool = False) -> Adapter:
    """The whole adapter as one process would hold it (every expert), with its Adam state if
    asked: what a checkpoint or a PEFT export is written from. Every rank calls it."""
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
