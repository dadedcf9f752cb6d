"""The layout of a sharded engine: which rank holds what, and the process groups between them.

Ranks are numbered ``rank = efsdp_index · ep + ep_rank``. Expert parallelism borrows the data
parallel ranks (torchtitan's "EP borrows DP"): every rank runs its own share of the step's
sequences through replicated dense weights, and the ``ep`` ranks of one expert group hold
``1/ep`` of every MoE layer's experts each. With ``world > ep`` there are ``world / ep`` such
groups; ranks with the same ``ep_rank`` hold the same experts (the ``efsdp`` group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """World size, this rank, and the expert-parallel degree (``ep`` divides ``world``)."""

    world: int
    rank: int
    ep: int = 1

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")
        if self.ep < 1 or self.world % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the number of processes ({self.world})")

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def efsdp(self) -> int:
        """How many ranks hold each expert."""
        return self.world // self.ep

    def ep_ranks(self) -> list[int]:
        """The ranks of this rank's expert group."""
        base = self.rank - self.ep_rank
        return list(range(base, base + self.ep))

    def efsdp_ranks(self) -> list[int]:
        """The ranks that hold the same experts as this one."""
        return list(range(self.ep_rank, self.world, self.ep))

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """``[start, end)`` of the experts this rank holds in a layer of ``num_experts``."""
        n = num_experts // self.ep
        return self.ep_rank * n, (self.ep_rank + 1) * n


class Parallel:
    """A layout with its process groups. Built by every rank together (``dist.new_group`` is a
    collective), after ``torch.distributed.init_process_group``."""

    def __init__(self, ep: int = 1):
        self.layout = Layout(dist.get_world_size(), dist.get_rank(), ep)
        self.world_group = dist.group.WORLD
        self.ep_group = _subgroups([list(range(b, b + ep)) for b in range(0, self.layout.world, ep)], self.layout.rank)
        self.efsdp_group = _subgroups(
            [list(range(r, self.layout.world, ep)) for r in range(ep)], self.layout.rank
        )

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def world(self) -> int:
        return self.layout.world


def _subgroups(partition: list[list[int]], rank: int):
    """Create every group of ``partition`` (all ranks must) and return the one holding ``rank``."""
    mine = None
    for ranks in partition:
        g = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine
