"""One engine over several processes: the :class:`~ember.engine.worker.Worker` of one rank
(:mod:`ember.engine.ranks` starts the ranks and keeps them making the same calls).

A training pass splits the step's sequences across the ranks that run different sequences
(balanced by tokens, the same split on every rank; the ranks of a tensor-parallel group run the
same share), each rank runs its share through its part of the model, and the per-token logprobs are gathered so that every rank
computes every request's loss (Tinker's losses may mix a request's tokens: group advantages,
custom losses); the backward keeps each rank's own rows. Gradients are then summed over the ranks
that share each factor (:mod:`ember.dist.adapters`). Sampling runs the same sequences on every
rank, with the experts' shares summed by an all-reduce (seeded draws then agree everywhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ember.core import checkpoint, peft_format
from ember.core.loading import load_model
from ember.core.optim import AdamParams
from ember.dist import adapters as dist_adapters
from ember.dist import comm, fsdp
from ember.dist.expert_parallel import set_mode
from ember.dist.mesh import Parallel
from ember.dist.parallelize import parallelize
from ember.engine.worker import InvalidRequest, Worker
from ember.types import ForwardBackwardInput, ForwardBackwardOutput


def assign(lengths: Sequence[int], world: int) -> list[int]:
    """The rank of each sequence: longest first, each to the rank with the fewest tokens so far
    (ties to the lowest rank); deterministic, so every rank computes the same split."""
    load = [0] * world
    owner = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += lengths[i]
    return owner


class ShardedWorker(Worker):
    """This rank's worker of a sharded engine (its block of experts; every adapter, with its
    block of expert factors)."""

    def __init__(self, model, parallel: Parallel, **kwargs):
        super().__init__(model, **kwargs)
        self.parallel = parallel
        self.ranks: dict | None = None  # rank 0: the engine's processes (start_rank), for ember status
        self._step_keys: list | None = None

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, parallel: Parallel, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
        expert_fsdp: bool = False, **kwargs,
    ) -> ShardedWorker:
        """``expert_fsdp``: also shard the experts over the ranks that hold the same ones, after
        loading (:func:`ember.dist.fsdp.shard_expert_weights`; ``ValueError`` where it cannot apply)."""
        model = load_model(model_dir, device, dtype, parallelize=lambda m: parallelize(m, parallel))
        if expert_fsdp:
            fsdp.shard_expert_weights(model, parallel)
        return cls(model, parallel, **kwargs)

    # -- training -------------------------------------------------------------------------------

    def _route(self, batch, bank):
        return bank.route(batch.groups, step_keys=self._step_keys)

    def _pass(self, sequences, keys, targets, inv_t, routes, weights=None):
        layout, group = self.parallel.layout, self.parallel.dp_group
        owner = assign([len(s) for s in sequences], layout.dp)  # the ranks of a TP group run the same share
        mine = [i for i, r in enumerate(owner) if r == layout.dp_rank]
        sizes = [sum(len(s) for s, r in zip(sequences, owner) if r == d) for d in range(layout.dp)]
        pick = mine or [0]  # a rank without sequences runs one token so it enters every collective
        self._step_keys = sorted(set(keys))
        try:
            local, flips = super()._pass(
                [sequences[i] for i in pick],
                [keys[i] for i in pick],
                [targets[i] for i in pick],
                [inv_t[i] for i in pick] if inv_t is not None else None,
                tuple([part[i] for i in pick] for part in routes) if routes is not None else None,
                weights,
            )
        finally:
            self._step_keys = None
        rows = torch.cat(local)[: sizes[layout.dp_rank]]
        full = comm.gather_rows(rows, sizes, group)
        full_flips = None
        if flips is not None:
            counts = torch.cat([torch.stack(f, dim=1) for f in flips])[: sizes[layout.dp_rank]]
            full_flips = comm.gather_rows(counts, sizes, group)
        # gathered rows: share by share, each share's sequences in order
        order = [i for d in range(layout.dp) for i in range(len(sequences)) if owner[i] == d]
        per_seq: list = [None] * len(sequences)
        per_flip: list = [None] * len(sequences)
        cursor = 0
        for i in order:
            n = len(sequences[i])
            per_seq[i] = full[cursor : cursor + n]
            if full_flips is not None:
                per_flip[i] = (full_flips[cursor : cursor + n, 0], full_flips[cursor : cursor + n, 1])
            cursor += n
        return per_seq, (per_flip if full_flips is not None else None)

    def forward_backward(self, requests: Sequence[ForwardBackwardInput]):
        results = super().forward_backward(requests)
        trained = sorted(
            {r.slot for r, out in zip(requests, results) if r.slot and not r.forward_only and isinstance(out, ForwardBackwardOutput)}
        )
        dist_adapters.reduce_gradients([self.bank.get(s) for s in trained], self.parallel)
        return results

    def optim_step(self, slot: int, params: AdamParams) -> dict[str, float]:
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return dist_adapters.optim_step(self.bank.get(slot), params, self.parallel)

    # -- sampling -------------------------------------------------------------------------------

    def sample(self, requests, detokenize=None):
        # with --expert-fsdp: every layer's experts gathered once for the whole run, not per step
        with fsdp.unsharded(self.model):
            set_mode(self.model, "replicated")
            try:
                return super().sample(requests, detokenize)
            finally:
                set_mode(self.model, "all_to_all")

    # -- checkpoints ----------------------------------------------------------------------------

    def save_adapter(self, slot, path, with_optimizer, metadata=None, overwrite=False) -> Path:
        whole = dist_adapters.gathered(self.bank.get(slot), self.parallel, with_optimizer)
        if self.parallel.rank == 0:
            meta = {"base_model": {"model_type": self.config.model_type, "vocab_size": self.config.vocab_size}}
            meta.update(metadata or {})
            checkpoint.save_adapter(whole, path, with_optimizer, meta, overwrite)
        return Path(path)

    def export_peft(self, slot, path, base_model, layout="peft") -> Path:
        whole = dist_adapters.gathered(self.bank.get(slot), self.parallel)
        if self.parallel.rank == 0:
            peft_format.export_peft(whole, path, base_model, layout)
        return Path(path)

    def _select(self, tensors):
        return dist_adapters.local_tensors(tensors, self.parallel)

    def load_adapter(self, path, with_optimizer) -> int:
        return checkpoint.load_adapter(self.bank, path, with_optimizer, select=self._select).slot

    def import_peft(self, path) -> int:
        return peft_format.import_peft(self.bank, path, select=self._select).slot
