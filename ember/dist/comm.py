"""The collectives of a sharded engine, in one module (``torch.distributed`` c10d calls).

Every function here is a collective: each rank of ``group`` must call it, in the same order.
The autograd-aware ones move gradients back the way their forward moved values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _all_to_all(g, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Send rows ``x[sum(in_splits[:j]) : …+in_splits[j]]`` to rank ``j`` of ``group``; receive
    ``out_splits[j]`` rows from rank ``j``. Backward sends the gradients back the same way."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Row ``j`` of ``counts`` (``[ranks, n]``, int) to rank ``j``; the result's row ``j`` came
    from rank ``j``."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def _gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's rows (rank ``i`` holds ``sizes[i]``) concatenated in rank order (no autograd)."""
    width = max(sizes)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((len(sizes) * width, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return torch.cat([out[i * width : i * width + n] for i, n in enumerate(sizes)])


def _reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """``x`` (``[sum(sizes), ...]``, a partial sum on every rank) summed over the ranks; this rank
    keeps its ``sizes[rank]`` rows (no autograd)."""
    width, rank = max(sizes), dist.get_rank(group)
    padded = x.new_zeros((len(sizes) * width, *x.shape[1:]))
    start = 0
    for i, n in enumerate(sizes):
        padded[i * width : i * width + n] = x[start : start + n]
        start += n
    out = x.new_empty((width, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[: sizes[rank]]


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows, concatenated in rank order. Backward: this rank's slice of
    the gradient, for computations that every rank then repeats identically (its gradient is the
    same on every rank, so summing it over ranks would count it ``world`` times)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        rank = dist.get_rank(group)
        ctx.bounds = (sum(sizes[:rank]), sum(sizes[: rank + 1]))
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        start, end = ctx.bounds
        return g[start:end], None, None


class _GatherTokens(torch.autograd.Function):
    """Forward: every rank's rows in rank order. Backward: the gradients summed over the ranks,
    this rank's rows kept (each rank's work on the gathered rows gives a part of their gradient)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_rows(g.contiguous(), ctx.sizes, ctx.group), None, None


class _ScatterTokens(torch.autograd.Function):
    """Forward: partial sums over every row added over the ranks, this rank's rows kept.
    Backward: every rank's gradient rows gathered."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(x.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_rows(g.contiguous(), ctx.sizes, ctx.group), None, None


def gather_tokens(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's rows of ``x`` (rank ``i`` holds ``sizes[i]``) in rank order; backward: a
    reduce-scatter (sequence parallelism entering a split projection)."""
    return _GatherTokens.apply(x, list(sizes), group)


def scatter_tokens(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """``x``'s partial sums added over the ranks, this rank's ``sizes[rank]`` rows kept; backward:
    an all-gather (sequence parallelism leaving a row-parallel projection)."""
    return _ScatterTokens.apply(x, list(sizes), group)


def gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's ``x`` (rank ``i`` holds ``sizes[i]`` rows), concatenated in rank order; the
    backward keeps this rank's rows (see :class:`_GatherRows`)."""
    return _GatherRows.apply(x, list(sizes), group)


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-shaped ``x`` of every rank concatenated along dim 0 (no autograd)."""
    n = dist.get_world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` (``[ranks · n, ...]``) over the ranks and keep this rank's ``n`` rows (no autograd)."""
    n = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def all_reduce_sum_(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group``, in place."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def broadcast_object(obj, group=None, src: int = 0):
    """``obj`` of rank ``src`` on every rank (pickled; for plans and requests, not tensors)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """:func:`all_to_all` without autograd (ids, frozen table rows): rows
    ``x[sum(in_splits[:j]) : …+in_splits[j]]`` to rank ``j``, ``out_splits[j]`` rows from it."""
    return _all_to_all(x, out_splits, in_splits, group)
