"""Packing sequences of several adapters into one batch without padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def to_device(values: torch.Tensor | Sequence, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data as a tensor on ``device``, copied without waiting for the work queued there.
    ``torch.tensor(values, device=cuda)`` copies from pageable memory and synchronises the stream;
    in the middle of a pass that drains the GPU's queue, and the GPU then idles while the host
    launches the next kernels. Here the values go through pinned memory (PyTorch's caching host
    allocator keeps the block until the copy is done) and an asynchronous copy. Tensors already on
    a device, and non-CUDA targets, are moved as ``Tensor.to`` moves them."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        t = t.to(dtype)
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # not t.pin_memory(): no is_pinned query
    return pinned.copy_(t).to(device, non_blocking=True)


@dataclass
class PackedBatch:
    """Sequences concatenated in adapter-slot order (slot 0, the base model, first).

    ``starts[i]``/``lengths[i]`` locate original sequence ``i`` in the packed token axis;
    ``groups`` lists ``(key, start, end)`` runs of consecutive tokens that share a group key (the
    adapter slot, or any sortable key the caller groups by).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    doc_lengths: list[int]
    starts: list[int]
    lengths: list[int]
    groups: list[tuple[object, int, int]]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def gather(self, per_sequence: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate per-sequence tensors (in original order) into packed order."""
        order = sorted(range(len(self.starts)), key=lambda i: self.starts[i])
        return torch.cat([per_sequence[i] for i in order])

    def split(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence slices (in original order) of a tensor on the packed token axis."""
        return [packed[s : s + n] for s, n in zip(self.starts, self.lengths)]


def pack(sequences: Sequence[Sequence[int]], slots: Sequence, device: torch.device | str) -> PackedBatch:
    """Pack token sequences into one :class:`PackedBatch`, grouped (stably sorted) by ``slots``
    (one sortable key per sequence: an adapter slot, or e.g. ``(slot, detached)``)."""
    if len(sequences) != len(slots):
        raise ValueError("one slot per sequence")
    if any(len(s) == 0 for s in sequences):
        raise ValueError("empty sequence")
    order = sorted(range(len(sequences)), key=lambda i: slots[i])
    starts = [0] * len(sequences)
    lengths = [len(s) for s in sequences]
    ids, pos, groups, doc_lengths = [], [], [], []
    offset = 0
    for i in order:
        n = lengths[i]
        starts[i] = offset
        ids.append(torch.as_tensor(sequences[i], device="cpu").reshape(-1).long())  # not token by token in Python
        pos.append(torch.arange(n))
        doc_lengths.append(n)
        if groups and groups[-1][0] == slots[i]:
            groups[-1] = (slots[i], groups[-1][1], offset + n)
        else:
            groups.append((slots[i], offset, offset + n))
        offset += n
    return PackedBatch(
        input_ids=to_device(torch.cat(ids), device),
        positions=to_device(torch.cat(pos), device),
        doc_lengths=doc_lengths,
        starts=starts,
        lengths=lengths,
        groups=groups,
    )
