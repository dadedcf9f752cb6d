"""The layout of a sharded engine: which rank holds what, and the process groups between them.

Two layouts exist today:

* **Expert parallelism** (``ep``): ranks are numbered ``rank = efsdp_index · ep + ep_rank``. EP
  borrows the data-parallel ranks (torchtitan's "EP borrows DP"): every rank runs its own share of
  the step's sequences through replicated dense weights, and the ``ep`` ranks of one expert group
  hold ``1/ep`` of every MoE layer's experts each. With ``world > ep`` there are ``world / ep``
  such groups; ranks with the same ``ep_rank`` hold the same experts (the ``efsdp`` group).
* **Tensor parallelism** (``tp``): ranks are numbered ``rank = dp_index · tp + tp_rank``; the
  ``tp`` ranks of a group (consecutive, so inside one machine) split the attention heads and the MLP
  width and run the same sequences; the ``world / tp`` groups run different sequences.

Both at once: the expert groups span whole TP groups (``ep`` a multiple of ``tp``); the ranks of
a TP group split their tokens before the experts' dispatch (torchtitan's "EP borrows TP"), so
every rank of an expert group sends distinct rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """World size, this rank, the expert- and tensor-parallel degrees (each divides ``world``)."""

    world: int
    rank: int
    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")
        for name, n in (("ep", self.ep), ("tp", self.tp)):
            if n < 1 or self.world % n:
                raise ValueError(f"--{name} {n} must divide the number of processes ({self.world})")
        if self.ep > 1 and self.tp > 1 and self.ep % self.tp:
            raise ValueError(f"--ep {self.ep} must be a multiple of --tp {self.tp} (expert groups span whole TP groups)")

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp(self) -> int:
        """How many groups of ranks run different sequences."""
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def efsdp(self) -> int:
        """How many ranks hold each expert."""
        return self.world // self.ep

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """``[start, end)`` of the experts this rank holds in a layer of ``num_experts``."""
        n = num_experts // self.ep
        return self.ep_rank * n, (self.ep_rank + 1) * n

    def tp_range(self, size: int) -> tuple[int, int]:
        """``[start, end)`` of this rank's part of a dimension of ``size`` split by TP."""
        n = size // self.tp
        return self.tp_rank * n, (self.tp_rank + 1) * n


class Parallel:
    """A layout with its process groups. Built by every rank together (``dist.new_group`` is a
    collective), after ``torch.distributed.init_process_group``."""

    def __init__(self, ep: int = 1, tp: int = 1, control_timeout: timedelta = timedelta(seconds=60)):
        self.layout = layout = Layout(dist.get_world_size(), dist.get_rank(), ep, tp)
        world = layout.world
        self.world_group = dist.group.WORLD
        self.ep_group = _subgroups([list(range(b, b + ep)) for b in range(0, world, ep)], layout.rank)
        self.efsdp_group = _subgroups([list(range(r, world, ep)) for r in range(ep)], layout.rank)
        self.tp_group = _subgroups([list(range(b, b + tp)) for b in range(0, world, tp)], layout.rank)
        # ranks that run different sequences and hold the same dense shards
        self.dp_group = _subgroups([list(range(r, world, tp)) for r in range(tp)], layout.rank)
        # every rank, on gloo and apart from the model's traffic, with a short timeout: the engine's
        # own handshakes (ember.engine.ranks)
        # (a fake process group, which plans layouts without running them, has no gloo)
        fake = dist.get_backend() == "fake"
        self.control_group = dist.group.WORLD if fake else dist.new_group(backend="gloo", timeout=control_timeout)

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
