"""Static-shape decode steps, captured as CUDA graphs on the GPU.

A decode step of a small batch is a few hundred kernel launches for a few milliseconds of memory
traffic; replaying a captured CUDA graph removes the launch overhead. Capture needs every shape and
every pointer fixed, so this decoder

* pads the batch to a size *bucket* (one graph per bucket, captured at first use);
* keeps its inputs in static buffers (token ids, positions, cache slots, block table, lengths),
  refilled before each replay; padded rows write their keys to the scratch page and have length 0;
* replaces the per-batch LoRA route by :class:`StaticRoute`: every bank slot's factors of a module
  live in one stack ``[slots + 1, r, in]`` / ``[slots + 1, out, r]`` (:class:`LoraStacks`, with the
  adapter's scale folded into ``B``), and rows find their adapter through an ``offsets`` tensor of
  the grouped product (rows are sorted by slot). One graph thus serves any mix of adapters, and a
  configured-but-unused slot is an empty group: no work.

Everything but the capture itself runs eagerly on the CPU too, which is how the tests check it
against :class:`~ember.core.sampling.decode.EagerDecoder`. Used for dense families without
recurrent state or MoE routing (the engine decides); the stacks are synced from the adapter bank
whenever a request is admitted, so sampling reads the weights the trainer last wrote.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.core.adapters import AdapterBank
from ember.core.kernels.grouped import grouped_linear
from ember.core.logprobs import chunk_logits
from ember.core.models.base import CausalLM
from ember.core.sampling.attention import DecodeAttention
from ember.core.sampling.decode import DecodeBatch, DecodeContext
from ember.core.sampling.kv_cache import PagedKVCache

RANK_MULTIPLE = 16


def default_buckets(max_seqs: int) -> tuple[int, ...]:
    """Batch-size buckets up to ``max_seqs``: 1, 2, 4, 8, then steps of 8 to 64, 16 to 256, 32 after."""
    out, b = [1, 2, 4, 8], 8
    while b < max_seqs:
        b += 8 if b < 64 else 16 if b < 256 else 32
        out.append(b)
    return tuple(x for x in out if x < max_seqs) + (max_seqs,)


class LoraStacks:
    """The factors of every bank slot, stacked per adapted dense module (slot 0 = zeros)."""

    def __init__(self, bank: AdapterBank, dtype: torch.dtype):
        self.bank = bank
        self.dtype = dtype
        self.device = bank.device
        self.groups = bank.max_adapters + 1
        self.shapes = {t.name: (t.in_features, t.out_features) for t in bank.targets if t.num_experts is None}
        self.rank = 0
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.synced: set[int] = set()
        self.version = 0  # bumped when the stacks are reallocated (captured graphs become stale)

    def sync(self, slots: Iterable[int]) -> None:
        """Copy the current factors of ``slots`` (adapters of the bank) into the stacks."""
        adapters = [self.bank.get(s) for s in sorted(set(slots)) if s]
        if not adapters:
            return
        for a in adapters:
            expert = [n for n in a.weights if n not in self.shapes]
            if expert:
                raise ValueError(f"static decode has no expert LoRA (adapter {a.slot} adapts {expert[0]})")
        rank = max(a.config.rank for a in adapters)
        names = set(self.stacks) | {n for a in adapters for n in a.weights}
        if rank > self.rank or names != set(self.stacks):
            self._allocate(max(rank, self.rank), names)
        with torch.no_grad():
            for a in adapters:
                self._copy(a)

    def _allocate(self, rank: int, names: set[str]) -> None:
        self.rank = math.ceil(rank / RANK_MULTIPLE) * RANK_MULTIPLE
        self.stacks = {}
        for name in sorted(names):
            i, o = self.shapes[name]
            A = torch.zeros(self.groups, self.rank, i, dtype=self.dtype, device=self.device)
            B = torch.zeros(self.groups, o, self.rank, dtype=self.dtype, device=self.device)
            self.stacks[name] = (A, B)
        self.version += 1
        previous, self.synced = self.synced, set()
        with torch.no_grad():
            for s in previous:
                if s in self.bank:
                    self._copy(self.bank.get(s))

    def _copy(self, adapter) -> None:
        s = adapter.slot
        for name, (A, B) in self.stacks.items():
            A[s].zero_()
            B[s].zero_()
            w = adapter.weights.get(name)
            if w is not None:
                r = w.rank
                A[s, :r].copy_(w.A)
                B[s, :, :r].copy_(w.B * adapter.scale)
        self.synced.add(s)


class StaticRoute:
    """A LoRA route over :class:`LoraStacks` for rows sorted by slot: ``offsets[s]`` ends slot
    ``s``'s rows (int32, the last entry is the padded row count)."""

    def __init__(self, stacks: LoraStacks, offsets: torch.Tensor):
        self.stacks = stacks
        self.offsets = offsets

    def delta(self, name: str, x: torch.Tensor) -> torch.Tensor | None:
        st = self.stacks.stacks.get(name)
        if st is None:
            return None
        return grouped_linear(grouped_linear(x, st[0], self.offsets), st[1], self.offsets)

    def linear(self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        d = self.delta(name, x)
        return y if d is None else y + d

    def expert_delta(self, *args, **kwargs):
        raise NotImplementedError("static decode has no expert LoRA; MoE models decode eagerly")


@dataclass
class _Buffers:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    offsets: torch.Tensor


class StaticDecoder:
    """Decode steps with static shapes per batch bucket; CUDA graphs when ``use_graphs``."""

    def __init__(
        self,
        model: CausalLM,
        bank: AdapterBank,
        cache: PagedKVCache,
        max_positions: int,
        buckets: tuple[int, ...],
        use_graphs: bool,
    ):
        self.model = model
        self.cache = cache
        self.max_positions = max_positions
        self.buckets = tuple(sorted(buckets))
        self.width = math.ceil(max_positions / cache.page_size)
        self.stacks = LoraStacks(bank, next(model.parameters()).dtype)
        self.use_graphs = use_graphs and cache.device.type == "cuda"
        self.rope_tables: dict = {}
        self._buffers: dict[int, _Buffers] = {}
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_version = self.stacks.version
        self._pool = None

    def sync(self, slots: Iterable[int]) -> None:
        """Refresh the adapter stacks of ``slots`` (call when their requests are admitted)."""
        self.stacks.sync(slots)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} exceeds the largest bucket {self.buckets[-1]}")

    def _buffers_for(self, bucket: int) -> _Buffers:
        if bucket not in self._buffers:
            d = self.cache.device
            self._buffers[bucket] = _Buffers(
                input_ids=torch.zeros(bucket, dtype=torch.long, device=d),
                positions=torch.zeros(bucket, dtype=torch.long, device=d),
                slot_mapping=torch.zeros(bucket, dtype=torch.long, device=d),
                block_table=torch.zeros(bucket, self.width, dtype=torch.int32, device=d),
                seq_lens=torch.zeros(bucket, dtype=torch.int32, device=d),
                offsets=torch.zeros(self.stacks.groups, dtype=torch.int32, device=d),
            )
        return self._buffers[bucket]

    def _fill(self, buf: _Buffers, batch: DecodeBatch, bucket: int) -> None:
        n = len(batch)
        pad = bucket - n
        ids = torch.tensor(batch.input_ids + [0] * pad, dtype=torch.long)
        pos = torch.tensor(batch.positions + [0] * pad, dtype=torch.long)
        slots = torch.tensor(batch.slot_mapping + [0] * pad, dtype=torch.long)  # padding -> scratch page
        lens = torch.tensor([p + 1 for p in batch.positions] + [0] * pad, dtype=torch.int32)
        width = max(len(t) for t in batch.block_tables)
        table = torch.zeros(n, width, dtype=torch.int32)
        for i, t in enumerate(batch.block_tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        counts = torch.bincount(torch.tensor(batch.slots), minlength=self.stacks.groups)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        offsets[-1] = bucket  # padded rows join the last group; their outputs are dropped
        buf.input_ids.copy_(ids)
        buf.positions.copy_(pos)
        buf.slot_mapping.copy_(slots)
        buf.seq_lens.copy_(lens)
        # only the pages of real rows are read (length 0 rows read none): stale columns are harmless
        buf.block_table[:n, :width].copy_(table)
        buf.offsets.copy_(offsets)

    def _forward(self, buf: _Buffers, use_lora: bool) -> torch.Tensor:
        route = StaticRoute(self.stacks, buf.offsets) if use_lora else None
        ctx = DecodeContext(
            positions=buf.positions,
            attend=DecodeAttention(self.cache, buf.slot_mapping, buf.block_table, buf.seq_lens),
            lora=route,
            seq_lens=[1] * buf.positions.shape[0],
            rope_tables=self.rope_tables,
            max_positions=self.max_positions,
        )
        hidden = self.model.hidden_states(buf.input_ids, ctx)
        logits = chunk_logits(hidden, self.model.unembed_weight, [], 0, hidden.shape[0])
        if route is not None:
            d = route.delta("lm_head", hidden)
            if d is not None:
                logits = logits + d.float()
        return logits

    def run(self, batch: DecodeBatch) -> tuple[torch.Tensor, None]:
        """Raw fp32 logits ``[B, V]`` of the step (no routing record on this path)."""
        if batch.record_routing:
            raise ValueError("the static decoder records no MoE routing")
        bucket = self.bucket(len(batch))
        buf = self._buffers_for(bucket)
        self._fill(buf, batch, bucket)
        use_lora = any(batch.slots)
        if not self.use_graphs:
            return self._forward(buf, use_lora)[: len(batch)], None
        if self.stacks.version != self._graph_version:
            self._graphs.clear()
            self._graph_version = self.stacks.version
        key = (bucket, use_lora)
        if key not in self._graphs:
            self._graphs[key] = self._capture(buf, use_lora)
        graph, out = self._graphs[key]
        graph.replay()
        return out[: len(batch)], None

    def _capture(self, buf: _Buffers, use_lora: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # warm up on a side stream (Triton compilation, cuBLAS handles, rotary tables), then capture;
        # the warm-up writes the same keys and values the replay will write
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(buf, use_lora)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(buf, use_lora)
        return graph, out

    def capture_all(self, use_lora: bool = True) -> None:
        """Capture every bucket now (largest first, so smaller graphs reuse its memory pool)."""
        if not self.use_graphs:
            return
        for b in reversed(self.buckets):
            buf = self._buffers_for(b)
            buf.offsets.zero_()
            buf.offsets[-1] = b
            if (b, use_lora) not in self._graphs:
                self._graphs[(b, use_lora)] = self._capture(buf, use_lora)


def graphs_failed(err: Exception) -> None:
    warnings.warn(f"CUDA-graph decode failed ({type(err).__name__}: {err}); decoding eagerly", stacklevel=2)
