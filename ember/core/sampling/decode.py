"""One decode step: one new token for each running sequence, through the paged KV cache.

:class:`DecodeBatch` is what the engine hands a decoder (sequences in adapter-slot order, so each
adapter owns a contiguous run of rows, as :class:`~ember.core.layers.lora.LoraRoute` requires).
:class:`EagerDecoder` runs it with the model's ordinary LoRA route; the static-shape decoder for
CUDA graphs is :class:`ember.core.sampling.graphs.StaticDecoder`. Both return raw fp32 logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ember.core.adapters import AdapterBank, AdapterView
from ember.core.kernels import fused
from ember.core.layers.lora import LoraRoute, TokenGroup
from ember.core.layers.rope import RotaryEmbedding
from ember.core.models.base import CausalLM, ForwardContext, RoutingRecord
from ember.core.sampling.attention import DecodeAttention, shared_prefix_groups
from ember.core.sampling.kv_cache import PagedKVCache, RecurrentStateStore
from ember.core.sampling.logits import head_logits


@dataclass
class DecodeBatch:
    """The rows of one decode step, in packed (slot) order.

    ``positions[i]`` is the position of ``input_ids[i]`` (the number of tokens already cached) and
    ``slot_mapping[i]`` the flat cache slot its keys and values go to.
    """

    seq_ids: list[int]
    slots: list[int]
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    record_routing: bool = False
    # plain draw of each row, where the decoder samples in its step (the static decoder): inverse
    # temperature (0: greedy) and uniform number; None: the decoder only returns logits
    inv_temperature: list[float] | None = None
    uniforms: Sequence[float] | None = None
    # > 0: that decoder also returns the head of each row's distribution (``head_record``), for
    # the stability record of untruncated sampling
    record_head: int = 0
    # each row's tokens so far as (prompt, generated), ``input_ids[i]`` the last of them; for
    # decoders that compute from a row's last tokens on the host (see :meth:`recent`)
    histories: list[tuple[Sequence[int], Sequence[int]]] | None = None

    def __len__(self) -> int:
        return len(self.seq_ids)

    def recent(self, n: int, fill: int) -> np.ndarray:
        """``[B, n]`` int64: each row's last ``n`` tokens, oldest first and ``input_ids[i]`` last,
        ``fill`` where a row has fewer (before its sequence's start)."""
        if self.histories is None:
            raise ValueError("this decode batch carries no token histories")
        out = np.full((len(self), n), fill, dtype=np.int64)
        for i, (prompt, generated) in enumerate(self.histories):
            tail = list(generated[-n:])
            if len(tail) < n:
                tail = list(prompt[max(0, len(prompt) - (n - len(tail))) :]) + tail
            if tail:
                out[i, n - len(tail) :] = tail
        return out

    def slot_runs(self) -> list[tuple[int, int, int]]:
        """``(slot, start, end)`` runs of consecutive rows with one slot."""
        runs: list[tuple[int, int, int]] = []
        for i, s in enumerate(self.slots):
            if runs and runs[-1][0] == s:
                runs[-1] = (s, runs[-1][1], i + 1)
            else:
                runs.append((s, i, i + 1))
        return runs


@dataclass
class DecodeContext(ForwardContext):
    """A forward context whose rotary cos/sin come from per-position tables computed once (so a
    decode step only gathers them: no host data, as CUDA-graph capture requires)."""

    rope_tables: dict = field(default_factory=dict, repr=False)
    max_positions: int = 0

    def rope(self, rotary: RotaryEmbedding, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(rotary), dtype)

        def gathered():
            table = self.rope_tables.get(key)
            if table is None:
                positions = torch.arange(self.max_positions, device=self.positions.device)
                table = self.rope_tables[key] = rotary.cos_sin(positions, dtype)
            return table[0].index_select(0, self.positions), table[1].index_select(0, self.positions)

        return self.memo(("rope", *key), gathered)


def block_table_array(tables: list[list[int]], width: int, out: np.ndarray | None = None) -> np.ndarray:
    """``[B, width]`` int32 block table, padded with the scratch page 0 (into ``out`` if given)."""
    if out is None:
        out = np.zeros((len(tables), width), dtype=np.int32)
    else:
        out[:] = 0
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def block_table_tensor(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """``[B, width]`` int32 block table, padded with the scratch page 0."""
    return torch.from_numpy(block_table_array(tables, width)).to(device)


class EagerDecoder:
    """Decode steps through the model's ordinary forward (any family, MoE and routing records
    included); tensors are built per step.

    Each adapter is cast to the activation dtype once when its request is admitted (:meth:`refresh`),
    not at every step: a step would otherwise re-read every adapter's fp32 factors. Beside a
    static decoder, which keeps the factors in its own stacks and leaves this one only the steps
    that record MoE routing, the cast is made at the first step that needs it (``create=False`` at
    admission): the adapters that never decode here are not held twice.

    ``shared_prefix``: rows that share a prefix's pages attend it together
    (:func:`~ember.core.sampling.attention.shared_prefix_groups`; the Triton kernel only).
    """

    def __init__(
        self,
        model: CausalLM,
        bank: AdapterBank,
        cache: PagedKVCache,
        states: RecurrentStateStore,
        max_positions: int,
        shared_prefix: bool = True,
    ):
        self.model = model
        self.shared_prefix = shared_prefix and fused.use_triton(torch.empty(0, device=cache.device))
        self.bank = bank
        self.cache = cache
        self.states = states
        self.max_positions = max_positions
        self.rope_tables: dict = {}
        self._views: dict[int, AdapterView] = {}
        self._versions: dict[int, tuple[int, int]] = {}  # slot -> the adapter version of its view

    def refresh(self, slots: Iterable[int], create: bool = True) -> None:
        """Take the current factors of ``slots`` (call when their requests are admitted), where they
        changed since they were last taken (:attr:`~ember.core.adapters.Adapter.version`);
        ``create=False``: only for slots that have a view (the others get theirs at their first
        step here)."""
        for s in set(slots) - {0}:
            if not create and s not in self._views:
                continue
            adapter = self.bank.get(s)
            if self._versions.get(s) != adapter.version:
                self._views[s] = adapter.view(self.bank.dtype, trainable=False)
                self._versions[s] = adapter.version

    def _route(self, batch: DecodeBatch) -> LoraRoute | None:
        runs = batch.slot_runs()
        for s in set(self._views) - {s for s, _, _ in runs}:
            del self._views[s], self._versions[s]  # no sequence of that adapter is left
        for s, _, _ in runs:
            if s and s not in self._views:
                self.refresh([s])
        groups = [TokenGroup(self._views[s] if s else None, a, b) for s, a, b in runs]
        route = LoraRoute(groups, self.cache.device)
        return route if route.adapted else None

    def run(self, batch: DecodeBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None, None]:
        """Raw fp32 logits ``[B, V]`` of the step and, if asked, the MoE routing record (no draw:
        the engine samples from the logits)."""
        device = self.cache.device
        positions = torch.tensor(batch.positions, dtype=torch.long, device=device)
        table = block_table_array(batch.block_tables, max(len(t) for t in batch.block_tables))
        prefix = None
        if self.shared_prefix:
            pre, members = shared_prefix_groups(table, np.asarray(batch.positions) + 1, self.cache.page_size)
            if len(members):
                prefix = (torch.from_numpy(pre).to(device), torch.from_numpy(members).to(device))
        attend = DecodeAttention(
            self.cache,
            torch.tensor(batch.slot_mapping, dtype=torch.long, device=device),
            torch.from_numpy(table).to(device),
            (positions + 1).to(torch.int32),
            prefix=prefix,
        )
        lora = self._route(batch)
        routing = RoutingRecord(record={}) if batch.record_routing else None
        ctx = DecodeContext(
            positions=positions,
            attend=attend,
            lora=lora,
            seq_lens=[1] * len(batch),
            state=self.states.view(batch.seq_ids),
            routing=routing,
            rope_tables=self.rope_tables,
            max_positions=self.max_positions,
        )
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=device)
        hidden = self.model.hidden_states(input_ids, ctx)
        logits = head_logits(hidden, self.model.unembed_weight, lora, vocab=self.model.vocab_split)
        return logits, (routing.record if routing is not None else None), None
