"""An error on some ranks of a sharded engine: run on every rank by :mod:`tests.parallel.launch`,
with rank 0 a :class:`FanOut` and the others following, over a worker whose call fails on the
ranks it is told and enters a collective on the others."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ember.dist.mesh import Parallel
from ember.engine import ranks


class Flaky:
    def __init__(self, parallel: Parallel):
        self.parallel = parallel

    def forward_backward(self, fail: list[int]) -> float:
        if self.parallel.rank in fail:
            raise RuntimeError(f"failed on rank {self.parallel.rank}")
        t = torch.ones(1)
        dist.all_reduce(t)  # the ranks that did not fail wait here for the others
        return float(t)


def _start(rank: int, seconds: float):
    worker = Flaky(Parallel(control_timeout=timedelta(seconds=seconds)))
    if rank:
        ranks.follow(worker)
        return None
    return ranks.FanOut(worker)


def every_rank_fails(rank: int, world: int) -> None:
    """All ranks raise at the same point: they stay in step, rank 0 reports the error and the
    next call runs."""
    fan = _start(rank, 30)
    if fan is None:
        return
    with pytest.raises(RuntimeError, match="failed on rank 0"):
        fan.forward_backward(list(range(world)))
    assert fan.forward_backward([]) == world
    fan.stop()


def one_rank_fails(rank: int, world: int, failing: int) -> None:
    """Rank ``failing`` raises while the others wait in a collective: every rank exits (code 1)
    within the barrier's timeout."""
    fan = _start(rank, 3)
    if fan is not None:
        fan.forward_backward([failing])
        fan.stop()
