"""Static-shape decode steps, captured as CUDA graphs on the GPU.

A decode step of a small batch is a few hundred kernel launches for a few milliseconds of memory
traffic; replaying a captured CUDA graph removes the launch overhead. Capture needs every shape and
every pointer fixed, so this decoder

* pads the batch to a size *bucket* (one graph per bucket, captured at first use);
* keeps its inputs in static buffers (token ids, positions, cache slots, block table, lengths),
  refilled before each replay; padded rows write their keys to the scratch page and have length 0;
* replaces the per-batch LoRA route by a static one (:mod:`ember.core.sampling.static_route`):
  every bank slot's factors of a module live in one stack (:mod:`~ember.core.sampling.lora_stacks`),
  rows (sorted by slot) find their adapter through an ``offsets`` tensor, and each shared-input
  group's base weights are packed into one GEMM (:mod:`~ember.core.sampling.packed_linears`). One
  graph thus serves any mix of adapters, and a configured-but-unused slot is an empty group: no
  work;
* with ``dependent_launch``, on Hopper, launches the step's small Triton kernels with programmatic
  dependent launch, so each one's launch overlaps the kernel before it (:mod:`ember.core.kernels.pdl`);
* with ``shared_prefix``, attends a prefix that several rows share once for them (cascade attention,
  :func:`~ember.core.sampling.attention.shared_prefix_groups`): the groups are static buffers too,
  and a graph is keyed on their count to a power of two (a step without any launches no prefix
  kernel; one with a few launches none for the buffer's unused lines).

Routed experts keep their grouped products (routing, sort and group ends stay on the device, so
they capture too); their LoRA factors are stacked per expert group (one per slot with expert LoRA,
after a zero group for rows without one), so a bank of many slots costs an expert stack entry only
for the adapters that sample.

Recurrent state (short-convolution windows, Gated DeltaNet's delta-rule state, n-gram contexts) is
read and written through fixed rows of the engine's
:class:`~ember.core.sampling.kv_cache.RecurrentStateStore`
(:class:`~ember.core.sampling.kv_cache.StaticPassState`: one gather and one scatter per value, the
rows a static buffer, padding rows on the store's scratch row), and Inkling-2's relative attention
runs the paged decode kernel with its bias and sinks, so those families capture too.
Qwen3.8-Flash-Next's host-resident n-gram memory is read before the step: the host hashes each
row's last tokens (:meth:`~ember.core.sampling.decode.DecodeBatch.recent`) and copies the table rows
into a static buffer (``ctx.prefetched``). Its QSA indexer is told on the host whether the step is
past the dense threshold (``ctx.position_bound``; past it, a graph per power of two of the longest
row) and selects over a fixed-width table of every row's index keys, ties toward the lower block
(:meth:`~ember.core.layers.qsa.QSAIndexer.select_fixed`); the paged kernel reads only the chosen
blocks and the tail.

Everything but the capture itself runs eagerly on the CPU too, which is how the tests check it
against :class:`~ember.core.sampling.decode.EagerDecoder`. The engine decides which families use
it (``CausalLM.static_decode``; no MoE routing record); under tensor parallelism the split
projections' collectives run in the step (their modules' ``shard``) and the LM head's vocabulary
parts are gathered before the draw. The stacks are synced from the adapter bank
whenever a request is admitted, so sampling reads the weights the trainer last wrote.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ember.core import rollout_precision
from ember.core.adapters import AdapterBank
from ember.core.kernels import decode_gemm as decode_gemm_kernel
from ember.core.kernels import fused, lora_decode, pdl
from ember.core.layers.lora import LoraLinear
from ember.core.layers.ngram_memory import NGramEmbedding
from ember.core.layers.qsa import QSAIndexer
from ember.core.logprobs import chunk_logits
from ember.core.models.base import CausalLM
from ember.core.sampling.attention import PREFIX_GROUP, DecodeAttention, shared_prefix_groups
from ember.core.sampling.decode import DecodeBatch, DecodeContext, block_table_array
from ember.core.sampling.kv_cache import PagedKVCache, RecurrentStateStore
from ember.core.sampling.logits import capped, gather_vocab, head_record, sample_rows
from ember.core.sampling.lora_stacks import RANK_MULTIPLE, LoraStacks
from ember.core.sampling.packed_linears import PackedLinears, shared_input_groups
from ember.core.sampling.static_route import StaticRoute


def default_buckets(max_seqs: int) -> tuple[int, ...]:
    """Batch-size buckets up to ``max_seqs``: 1, 2, 4, 8, then steps of 8 to 64, 16 to 256, 32 after."""
    out, b = [1, 2, 4, 8], 8
    while b < max_seqs:
        b += 8 if b < 64 else 16 if b < 256 else 32
        out.append(b)
    return tuple(x for x in out if x < max_seqs) + (max_seqs,)


@dataclass
class _Buffers:
    """A bucket's static inputs: views of two packed device tensors (one copy each per step)."""

    longs: torch.Tensor  # int64 [4, bucket]: input_ids, positions, slot_mapping, state rows
    small: torch.Tensor  # int32 [bucket + groups + 1]: seq_lens, offsets, n_rows
    prefix: torch.Tensor  # int32 [bucket + lines * PREFIX_GROUP]: shared prefix tokens, group rows
    floats: torch.Tensor  # fp64 [2, bucket]: inverse temperature (0: greedy), uniform number
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    state_rows: torch.Tensor  # each row's row of the recurrent state store (padding: its scratch row)
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    offsets: torch.Tensor
    n_rows: torch.Tensor  # real (unpadded) rows, int32 [1]
    prefix_lens: torch.Tensor  # each row's shared prefix tokens (0: none)
    prefix_members: torch.Tensor  # [bucket // 2, PREFIX_GROUP] the prefix groups' rows, -1 after the last
    ngram_rows: dict[int, torch.Tensor]  # layer -> its n-gram memory rows [bucket, width], fetched before the step


class _Kind(NamedTuple):
    """What a step's graph depends on beyond its bucket."""

    use_lora: bool
    head: int = 0  # the stability record's head width (0: none)
    span: int = 0  # past QSA's dense threshold: the keys its selection reads
    adapters: int | None = None  # the LoRA kernels' sizing (StaticDecoder._adapters)
    prefix: int = 0  # prefix groups' lines the step launches for (a power of two; 0: no rows share one)


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
        states: RecurrentStateStore | None = None,
        dependent_launch: bool = False,
        decode_gemm: bool = False,
        shared_prefix: bool = True,
        shrink_windows: bool = True,
        qkv_kernel: bool = False,
    ):
        self.model = model
        self.qkv_kernel = qkv_kernel
        self.shared_prefix = shared_prefix and fused.use_triton(torch.empty(0, device=cache.device))
        self.cache = cache
        self.states = states if states is not None else RecurrentStateStore()
        self.max_positions = max_positions
        self.buckets = tuple(sorted(buckets))
        self.width = math.ceil(max_positions / cache.page_size)
        shared = [[m.lora_name for m in g] for g in shared_input_groups(model)]
        self.stacks = LoraStacks(bank, next(model.parameters()).dtype, shared)
        # shrink windows after the packed weights, where the decode kernels run (PackedLinears)
        window_rank = (math.ceil(bank.max_rank / RANK_MULTIPLE) * RANK_MULTIPLE
                       if shrink_windows and fused.use_triton(torch.empty(0, device=cache.device)) else 0)
        self.packed = PackedLinears(model, window_rank, [t.name for t in bank.targets if t.num_experts is None])
        self.use_graphs = use_graphs and cache.device.type == "cuda"
        self.rope_tables: dict = {}
        # host-resident n-gram tables: their rows are computed and fetched on the host before a step
        self.ngrams = [m for m in model.modules() if isinstance(m, NGramEmbedding)]
        # QSA: below this position every query attends densely (the step decides it on the host)
        indexers = [m for m in model.modules() if isinstance(m, QSAIndexer)]
        self.sparse_from = min(((m.block_topk + 1) * m.block_size - 1 for m in indexers), default=None)
        self._buffers: dict[int, _Buffers] = {}
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._graph_version = self._version()
        self._pool = None
        self._staging: dict[str, torch.Tensor] = {}
        self._staged: torch.cuda.Event | None = None  # marks the end of the last step's copies
        # the step's small Triton kernels launched programmatically dependent (Hopper; kernels.pdl)
        self.dependent_launch = dependent_launch and pdl.supported(cache.device)
        # the decode GEMM's split-K workspace, for every bucket's rows and the widest dense product
        self.gemm = None
        if decode_gemm and fused.use_triton(torch.empty(0, device=cache.device)):
            widest = max([m.out_features for m in model.modules() if isinstance(m, LoraLinear) and m is not getattr(model, "lm_head", None)]
                         + [W.shape[0] for W, _ in self.packed.weights.values()], default=0)
            self.gemm = decode_gemm_kernel.Workspace(self.buckets[-1], widest, cache.device)

    def sync(self, slots: Iterable[int]) -> None:
        """Refresh the adapter stacks of ``slots`` (call when their requests are admitted)."""
        self.stacks.sync(slots)

    def prefill_route(self, groups: list[tuple[object, int, int]], rows: int) -> StaticRoute:
        """The LoRA route of a prefill pass of ``rows`` tokens sorted by slot (``groups``:
        :func:`~ember.core.batch.pack`'s ``(slot or (slot, trainable), start, end)`` runs) over the
        decode steps' stacks and packed weights, through grouped products: one shrink and one
        expand a module (a shared-input group) for any number of adapters in the pass, where a
        product per adapter launched two per adapter and module. The pass's adapters are synced
        first (a no-op unless they changed since their admission)."""
        slots = [key[0] if isinstance(key, tuple) else key for key, _, _ in groups]
        if slots != sorted(slots):
            raise ValueError(f"prefill_route: rows must be sorted by slot, got slots {slots}")
        self.sync(slots)
        counts = np.zeros(self.stacks.groups, dtype=np.int64)
        for slot, (_, a, b) in zip(slots, groups, strict=True):
            counts[slot] += b - a
        offsets = torch.from_numpy(np.cumsum(counts).astype(np.int32)).to(self.cache.device)
        return StaticRoute(self.stacks, offsets, packed=self.packed, lora=bool(counts[1:].any()), rows=rows,
                           kernels=False)

    def _version(self) -> tuple[int, int, int]:
        """Changes when a tensor the captured graphs read is replaced: the adapter stacks, the
        rollout copies of the weights, the recurrent state's slabs."""
        return self.stacks.version, rollout_precision.version(self.model), self.states.version

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch of {n} exceeds the largest bucket {self.buckets[-1]}")

    def _buffers_for(self, bucket: int) -> _Buffers:
        if bucket not in self._buffers:
            d = self.cache.device
            longs = torch.zeros(4, bucket, dtype=torch.long, device=d)
            small = torch.zeros(bucket + self.stacks.groups + 1, dtype=torch.int32, device=d)
            floats = torch.zeros(2, bucket, dtype=torch.float64, device=d)
            floats[1] = 0.5
            lines = max(bucket // 2, 1)  # a group has two rows or more
            prefix = torch.zeros(bucket + lines * PREFIX_GROUP, dtype=torch.int32, device=d)
            ngram_rows = {}
            for m in self.ngrams:
                table = m.ngram_embedding.weight
                width = len(m.primes) * table.shape[1]
                ngram_rows[m.layer] = torch.zeros(bucket, width, dtype=table.dtype, device=d)
            self._buffers[bucket] = _Buffers(
                longs=longs,
                small=small,
                prefix=prefix,
                floats=floats,
                input_ids=longs[0],
                positions=longs[1],
                slot_mapping=longs[2],
                state_rows=longs[3],
                block_table=torch.zeros(bucket, self.width, dtype=torch.int32, device=d),
                seq_lens=small[:bucket],
                offsets=small[bucket:-1],
                n_rows=small[-1:],
                prefix_lens=prefix[:bucket],
                prefix_members=prefix[bucket:].view(lines, PREFIX_GROUP),
                ngram_rows=ngram_rows,
            )
        return self._buffers[bucket]

    def _host(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer of at least ``numel`` elements (pinned on CUDA, so the copies to
        the device are asynchronous), shared by every bucket; :meth:`_fill` waits for the previous
        step's copies before it writes them again."""
        t = self._staging.get(name)
        if t is None or t.numel() < numel:
            t = torch.empty(numel, dtype=dtype, pin_memory=self.cache.device.type == "cuda")
            self._staging[name] = t
        return t[:numel]

    def _fill(self, buf: _Buffers, batch: DecodeBatch, bucket: int) -> int:
        """Copy the step's inputs into the bucket's static buffers: four host-to-device copies (five
        where rows share a prefix). Returns the prefix groups' lines to launch for: their count to a
        power of two (0: none), so the prefix kernel launches no idle programs for most of the
        buffer's lines and a few graphs serve every step."""
        if self._staged is not None:  # the staging buffers are reused: the last copies must be done
            self._staged.synchronize()
        n = len(batch)
        longs = self._host("longs", 4 * bucket, torch.long).view(4, bucket)
        ln = longs.numpy()
        ln[:, n:] = 0  # padding rows: token 0 at position 0, keys to the scratch page, state row 0
        ln[0, :n] = batch.input_ids
        ln[1, :n] = batch.positions
        ln[2, :n] = batch.slot_mapping
        self.states.fill_rows(batch.seq_ids, ln[3])
        groups = self.stacks.groups
        small = self._host("small", bucket + groups + 1, torch.int32)
        sm = small.numpy()
        sm[:n] = np.asarray(batch.positions) + 1  # seq_lens (0 for padding rows)
        sm[n:bucket] = 0
        offsets = np.cumsum(np.bincount(np.asarray(batch.slots), minlength=groups))
        offsets[-1] = bucket  # padded rows join the last group; their outputs are dropped
        sm[bucket : bucket + groups] = offsets
        sm[-1] = n
        floats = self._host("floats", 2 * bucket, torch.float64).view(2, bucket)
        fl = floats.numpy()
        fl[0] = 0.0  # rows without sampling parameters (and padding): greedy
        fl[1] = 0.5
        if batch.inv_temperature is not None:
            fl[0, :n] = batch.inv_temperature
            fl[1, :n] = batch.uniforms
        width = max(len(t) for t in batch.block_tables)
        table = self._host("table", n * width, torch.int32).view(n, width)
        tn = block_table_array(batch.block_tables, width, out=table.numpy())
        shared = 0
        if self.shared_prefix:
            pre, members = shared_prefix_groups(tn, sm[:n], self.cache.page_size)
            if len(members):
                shared = min(1 << (len(members) - 1).bit_length(), buf.prefix_members.shape[0])
                lines = buf.prefix_members.shape[0]
                prefix = self._host("prefix", buf.prefix.numel(), torch.int32)
                px = prefix.numpy()
                px[:n] = pre
                px[n:bucket] = 0
                px[bucket:] = -1
                px[bucket:].reshape(lines, PREFIX_GROUP)[: len(members)] = members
                buf.prefix.copy_(prefix, non_blocking=True)
        buf.longs.copy_(longs, non_blocking=True)
        buf.small.copy_(small, non_blocking=True)
        buf.floats.copy_(floats, non_blocking=True)
        # only the pages of real rows are read (length 0 rows read none): stale columns are harmless
        buf.block_table[:n, :width].copy_(table, non_blocking=True)
        if self.ngrams:  # padding rows keep stale rows: their outputs are dropped
            windows = {}
            pin = self.cache.device.type == "cuda"
            for m in self.ngrams:
                key = (m.ngram_size, m.eos)
                if key not in windows:
                    windows[key] = torch.from_numpy(batch.recent(m.ngram_size, m.eos))
                buf.ngram_rows[m.layer][:n].copy_(m.rows(m.window_ids(windows[key]), pin), non_blocking=True)
        if self.cache.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        return shared

    def _feed(self, input_ids: torch.Tensor, chosen: torch.Tensor, src: Sequence[int]) -> None:
        """``input_ids[i] = chosen[0, src[i]]`` where ``src[i] >= 0``, on the device (queued behind
        the step that drew ``chosen``, before this one)."""
        idx = torch.as_tensor(np.asarray(src, dtype=np.int64))
        if input_ids.is_cuda:
            idx = idx.pin_memory().to(input_ids.device, non_blocking=True)
        drawn = chosen[0].index_select(0, idx.clamp(min=0)).to(input_ids.dtype)
        input_ids.copy_(torch.where(idx >= 0, drawn, input_ids))

    def _span(self, batch: DecodeBatch) -> int:
        """0 while every row of ``batch`` is below QSA's dense threshold (or the model has no QSA);
        past it, the keys the step's selection reads: a power of two above the longest row (at
        most the context length), so a graph serves many steps and selects over few spare keys."""
        if self.sparse_from is None or max(batch.positions) < self.sparse_from:
            return 0
        return min(self.max_positions, 1 << max(batch.positions).bit_length())

    def _adapters(self, batch: DecodeBatch) -> int:
        """How many adapters' rows a step of ``batch`` may hold: its adapters' count to a power of two
        up to the LoRA kernels' programs per split, every slot of the bank beyond that. It sizes the
        LoRA kernels' launches (:class:`~ember.core.kernels.lora_decode.ActiveGroups`), so it is part
        of a graph's key: few busy adapters in a bank of many slots launch no idle programs, and a
        few graphs serve every mix."""
        busy = len(set(batch.slots) - {0})
        slots = max(self.stacks.groups - 1, 1)
        return slots if busy > lora_decode.GROUP_PROGRAMS else min(1 << (busy - 1).bit_length(), slots)

    def _windows(self, use_lora: bool, adapters: int | None) -> int:
        """The shrink windows a step multiplies (:class:`PackedLinears`): as many as the LoRA
        kernels' bound on its adapters, where that many fit; else 0 (the shrink kernels)."""
        if not use_lora or adapters is None or adapters > self.packed.positions:
            return 0
        return adapters

    def _forward(self, buf: _Buffers, kind: _Kind) -> tuple[torch.Tensor, torch.Tensor]:
        with pdl.launches(self.dependent_launch):
            return self._step(buf, kind)

    def _step(self, buf: _Buffers, kind: _Kind) -> tuple[torch.Tensor, torch.Tensor]:
        use_lora, head, span, adapters, prefix = kind
        # the positions' host-known bound: below the span past QSA's threshold, below the threshold
        # in a dense step, below the context length without QSA
        bound = span - 1 if span else self.max_positions - 1 if self.sparse_from is None else self.sparse_from - 1
        route = StaticRoute(self.stacks, buf.offsets, buf.n_rows, self.packed, lora=use_lora,
                            rows=buf.positions.shape[0], gemm=self.gemm, max_active=adapters,
                            windows=self._windows(use_lora, adapters), qkv_kernel=self.qkv_kernel)
        if use_lora and fused.use_triton(buf.offsets):
            # the active-group list at the step's start: the LoRA kernels read it before their
            # grid-dependency wait (kernels.pdl, "read early"), so no kernel close before them may write it
            route.active  # noqa: B018 - computed and kept by the route
        ctx = DecodeContext(
            positions=buf.positions,
            attend=DecodeAttention(self.cache, buf.slot_mapping, buf.block_table, buf.seq_lens, fixed_selection=True,
                                   prefix=(buf.prefix_lens, buf.prefix_members[:prefix]) if prefix else None),
            lora=route,
            seq_lens=[1] * buf.positions.shape[0],
            state=self.states.static_view(buf.state_rows),
            position_bound=bound,
            prefetched=buf.ngram_rows if self.ngrams else None,
            rope_tables=self.rope_tables,
            max_positions=self.max_positions,
        )
        hidden = self.model.hidden_states(buf.input_ids, ctx)
        vocab = self.model.vocab_split  # the LM head split by vocabulary (tensor parallelism)
        weight = self.model.unembed_weight if vocab is None else vocab.local(self.model.unembed_weight)
        if self.gemm is not None and vocab is None and decode_gemm_kernel.preferred(hidden, weight):
            # fp32 logits straight from the kernel's accumulator, as chunk_logits gives them
            logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=torch.float32, device=hidden.device)
            decode_gemm_kernel.decode_linear(hidden, weight, out=logits, workspace=self.gemm)
        else:
            logits = chunk_logits(hidden, weight, [], 0, hidden.shape[0])
        if use_lora:
            logits = route.add_delta("lm_head", hidden, logits)  # fp32 logits (fresh: in place is fine)
        logits = gather_vocab(logits, vocab)
        # every row's plain draw and its logprob, in the graph (one kernel); the engine uses the rows
        # whose parameters are plain (see DecodeBatch.inv_temperature)
        softcap = self.model.final_logit_softcap
        tokens, token_lp = sample_rows(capped(logits, softcap), buf.floats[0], buf.floats[1])
        chosen = torch.stack([tokens.to(torch.float64), token_lp.to(torch.float64)])
        if head:  # the stability record's head of every row, in the same graph and the same copy
            chosen = torch.cat([chosen, head_record(logits, softcap, buf.floats[0], tokens, head).T])
        return logits, chosen

    def run(self, batch: DecodeBatch, feed: tuple[torch.Tensor, Sequence[int]] | None = None
            ) -> tuple[torch.Tensor, None, torch.Tensor]:
        """Raw fp32 logits ``[B, V]`` of the step, no routing record (this path has none), and the
        plain draw of every row: fp64 ``[2, B]`` (token ids, their logprobs), followed, with
        ``batch.record_head``, by the rows' :func:`head_record` (``[2 + 2k + 2, B]``). The outputs
        are the bucket's buffers: the next step of the bucket overwrites them.

        ``feed`` ``(chosen, src)``: rows whose input token an earlier step drew and the host has not
        read: row ``i`` takes ``chosen[0, src[i]]`` where ``src[i] >= 0`` (``chosen`` that step's
        draws on the device; ``batch.input_ids[i]`` is then a placeholder)."""
        if batch.record_routing:
            raise ValueError("the static decoder records no MoE routing")
        bucket = self.bucket(len(batch))
        buf = self._buffers_for(bucket)
        shared = self._fill(buf, batch, bucket)
        if feed is not None:
            self._feed(buf.input_ids[: len(batch)], *feed)
        use_lora = any(batch.slots)
        n = len(batch)
        kind = _Kind(use_lora, batch.record_head, self._span(batch), self._adapters(batch) if use_lora else None,
                     shared)
        if self._windows(use_lora, kind.adapters):  # the step's adapters' shrink factors, where they changed
            self.packed.fill_windows(self.stacks, sorted(set(batch.slots) - {0}))
        if not self.use_graphs:
            logits, chosen = self._forward(buf, kind)
            return logits[:n], None, chosen[:, :n]
        version = self._version()
        if version != self._graph_version:  # new stacks, rollout copies quantised again, new state slabs
            if self._graphs and torch.cuda.is_available():
                torch.cuda.synchronize()  # a queued step may still replay one of them
            self._graphs.clear()
            self._graph_version = version
        key = (bucket, *kind)
        if key not in self._graphs:
            self._graphs[key] = self._capture(buf, kind)
        graph, (logits, chosen) = self._graphs[key]
        graph.replay()
        return logits[:n], None, chosen[:, :n]

    def _capture(self, buf: _Buffers, kind: _Kind) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]:
        # warm up on a side stream (Triton compilation, cuBLAS handles, rotary tables), then capture;
        # the warm-up writes the same keys and values the replay will write
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(buf, kind)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(buf, kind)
        return graph, out


def graphs_failed(err: Exception) -> None:
    warnings.warn(f"CUDA-graph decode failed ({type(err).__name__}: {err}); decoding eagerly", stacklevel=2)
