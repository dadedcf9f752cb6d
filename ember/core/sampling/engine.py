"""The sampling engine: generation with the trainer's model and adapters, over a paged KV cache.

Each :meth:`SamplingEngine.step`

1. admits waiting requests (:class:`~ember.core.sampling.scheduler.Scheduler`) and prefills the
   step's prompt chunks in ONE packed pass without padding (mixed adapters, ordered by slot). The
   step's token budget (``max_prefill_tokens``) counts one decode token per running sequence first;
   prompts get the rest. In families of ``CHUNK_FAMILIES`` a prompt longer than that is prefilled in
   chunks over several steps: a chunk continues the tokens already cached (attention over their
   pages, recurrent and convolution state carried by the state store), so the running sequences
   never stall behind a long prompt. Other families prefill whole prompts. When a prompt's last
   chunk has run, full-vocabulary logits are computed only where needed: its last position (the
   first sampled token of every sample) and the positions whose top-k prompt logprobs were asked
   for; plain prompt logprobs and target logprobs use the trainer's chunked
   :func:`~ember.core.logprobs.token_logprobs` (the hidden states of earlier chunks are kept for
   them). Samples of one prompt then fork its KV pages (full pages shared). With prefix sharing, a
   prompt that begins with whole pages already in the cache for the same adapter weights reuses
   them and the pass holds only its remaining tokens (:meth:`SamplingEngine._shareable`);
2. runs one decode step for every running sequence, whatever its adapter (the base model included),
   and samples each next token (:mod:`ember.core.sampling.logits`); finished sequences free their
   rows and pages at once, so waiting requests join in the next step (continuous batching). With
   ``overlap_decode`` the step is queued on the device and the one the previous engine step queued
   is read back while it runs (:meth:`SamplingEngine._decode`): an engine step's finished requests
   are then those of the decode step before.

``stats.steps`` records each step's prefill and decode tokens (:class:`StepRecord`).

Sampling runs under ``torch.no_grad`` on the trainer's own model and adapter bank (LoRA-native: no
weight sync). Decode steps use an adapter's factors as they were when a request for it was last
admitted (cast once to the activation dtype, or copied into the static decoder's stacks), so a
``generate`` call samples the weights current at its start. A sampler that must keep old weights
while training goes on samples a *snapshot* slot (``AdapterBank.snapshot``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ember.core import rollout_precision
from ember.core.adapters import AdapterBank
from ember.core.batch import pack
from ember.core.layers.lora import LoraLinear
from ember.core.layers.moe import Experts
from ember.core.logprobs import token_logprobs
from ember.core.models import FAMILIES
from ember.core.models.base import CausalLM, ForwardContext, RoutingRecord
from ember.core.sampling.attention import PrefillAttention
from ember.core.sampling.decode import DecodeBatch, EagerDecoder
from ember.core.sampling.graphs import StaticDecoder, default_buckets, graphs_failed
from ember.core.sampling.kv_cache import PagedKVCache, PrefixIndex, RecurrentStateStore
from ember.core.sampling.logits import (
    capped,
    chunked_rows,
    derive_seed,
    draw_tokens,
    head_logits,
    head_rows,
    head_support,
    log_softmax,
    plain,
    sample_rows,
    seeded_uniform,
    seeded_uniforms,
    topk_logprobs,
)
from ember.core.sampling.requests import (
    EMPTY_TOPK_ID,
    EMPTY_TOPK_LOGPROB,
    GenerationRequest,
    GenerationResult,
    InvalidGeneration,
    SequenceResult,
    TokenSupport,
)
from ember.core.sampling.scheduler import RequestState, Scheduler, SequenceState
from ember.lossdefs import STABILITY_SUPPORT_MAX as SUPPORT_MAX

# rows sampled at once from one prompt's logits (bounds the [rows, V] fp64 work of huge num_samples)
SAMPLE_ROWS = 256
ALT_SEED_INDEX = 1 << 40  # the prompt-alternative draws' seed: derive_seed(first sample seed, this)


@dataclass
class SamplerConfig:
    """Capacity and execution choices of a :class:`SamplingEngine`.

    * ``max_seqs``: sequences decoded together (rows of a decode step).
    * ``kv_tokens``: KV cache capacity in tokens. ``None``: on CUDA, ``kv_memory_fraction`` of the
      free device memory at construction; elsewhere ``max_seqs`` x min(context, 2048), at most 65536.
    * ``max_prefill_tokens``: tokens per engine step: one decode token per running sequence, the
      rest for prompts (at least one page). With ``chunked_prefill`` (families in
      ``CHUNK_FAMILIES``) it is the chunk budget: a longer prompt is prefilled in chunks over
      several steps, each step also decoding every running sequence, with the outputs of a whole
      prefill. Otherwise it limits the whole prompts admitted per step (the step's first prompt may
      exceed it).
    * ``chunked_prefill``: prefill prompts in chunks as above (``False``: always whole).
    * ``static_decode``: decode with static shapes (:mod:`ember.core.sampling.graphs`); ``None``:
      on CUDA for Llama, Qwen3 and Qwen3-MoE models in bf16 (not sharded). ``cuda_graphs``: capture
      those steps.
    * ``rollout_precision``: ``bf16`` (the model's weights), ``fp8`` or ``mxfp8``: the base projections
      and routed experts run a quantised copy in the sampler's passes only
      (:mod:`ember.core.rollout_precision`), the static decoder's too.
    * ``prefix_sharing``: a prompt beginning with whole KV pages already computed for the same
      adapter weights (another request's prompt, running or finished) reuses those pages and
      prefills only the rest. Families in ``PREFIX_FAMILIES`` only (their layers keep no recurrent
      state and attend plainly); requests that ask for prompt-side outputs (prompt logprobs, top-k
      or target prompt logprobs, prompt alternatives, routing records) compute their whole prompt.
      Pages kept for later prompts are reclaimed, least recently used first, when an allocation
      finds no free page.
    * ``shared_prefix_attention``: where running sequences share a prompt prefix's pages (prefix
      sharing, or the samples of one request), decode attention reads that prefix once for all of
      them (cascade attention: the Triton kernel, on CUDA) instead of once a sequence; the rest of
      each sequence is read as before and the two partial softmaxes merged. The same attention,
      summed in another order.
    * ``overlap_decode``: with the static decoder, queue each decode step before reading the
      previous one back, its rows' input tokens taken from the previous draws on the device, so
      the host's share of a step runs while the GPU decodes (:meth:`SamplingEngine._decode`; rows
      that sample with top-k/top-p or record anything from the logits or the routing make the
      step synchronous). The tokens are the same either way.
    * ``dependent_launch``: with the static decoder on a Hopper GPU, the step's small Triton kernels
      (norms, rotations, LoRA, KV write, attention, the draw) are launched with programmatic
      dependent launch: each launches while the one before it runs and waits on the device for
      it (:mod:`ember.core.kernels.pdl`). The tokens are the same either way (on by default:
      Qwen3-8B workload a 8.55 against 8.65 ms a step on an H100, ``docs/performance.md``).
    * ``decode_gemm``: with the static decoder, the dense base products (packed q/k/v, o, packed
      gate/up, down) run as Ember's decode GEMM (:mod:`ember.core.kernels.decode_gemm`) with each
      row's LoRA expand in its epilogue, instead of cuBLAS followed by a separate expand. Off by
      default until it is measured faster in a whole step (``bench/sample.py --decode-gemm 0,1``).
    * ``shrink_windows``: with the static decoder and its kernels, a step of few adapters multiplies
      their LoRA shrink factors in the base products of q/k/v, o and gate/up, laid as spare rows
      after the packed weights, instead of launching a shrink kernel for each
      (:class:`~ember.core.sampling.packed_linears.PackedLinears`; costs up to a quarter of those
      weights' memory, and nothing where the decode kernels do not run).
    * ``qkv_kernel``: with the static decoder and its kernels, a Llama-style attention layer's
      q/k/v LoRA expand, q/k norms and rotations and KV write run as one kernel after its packed
      q/k/v product (:mod:`ember.core.kernels.qkv_decode`) instead of three. The tokens are the
      same either way (on by default: Qwen3-8B workload a 7.82 against 8.18 ms a step and b 12.88
      against 13.09 on an H100, ``docs/performance.md``).
    """

    max_seqs: int = 256
    page_size: int = 16
    kv_tokens: int | None = None
    kv_memory_fraction: float = 0.3
    max_prefill_tokens: int = 16384
    chunked_prefill: bool = True
    static_decode: bool | None = None
    cuda_graphs: bool = True
    buckets: tuple[int, ...] | None = None
    rollout_precision: str = "bf16"
    prefix_sharing: bool = True
    shared_prefix_attention: bool = True
    overlap_decode: bool = True
    dependent_launch: bool = True
    decode_gemm: bool = False
    shrink_windows: bool = True
    qkv_kernel: bool = True


class StepRecord(NamedTuple):
    """One engine step: prompt tokens computed in its prefill pass, decode tokens (one per running
    sequence), prompts still being prefilled after it, and its host wall time."""

    prefill_tokens: int
    decode_tokens: int
    prefilling: int
    seconds: float


@dataclass
class EngineStats:
    """Counters and timings (host wall time; a decode step is timed from the start of the call
    that reads it back to its end: with ``overlap_decode`` that call also queues the next step)."""

    admit_seconds: float = 0.0  # admitting requests: their adapters' factors taken for the decoders
    prefill_passes: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefix_pages_reused: int = 0  # prompt pages taken from the prefix index instead of computed
    prefill_tokens_saved: int = 0  # the prompt tokens in them
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    step_times: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=1 << 16))  # (rows, s)
    steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=1 << 16))  # every engine step
    first_token_time: float | None = None  # perf_counter() when the first token was sampled


# What the sampler may do with each family, as its class declares (``CausalLM.static_decode``,
# ``chunked_prefill``, ``prefix_sharing``), by model_type:
# * static decode: the decode step has static shapes and captures in a CUDA graph;
# * chunked prefill: a chunk attends plainly (sliding windows and latent attention included) over the
#   tokens already cached, and recurrent layers (Qwen3-Next's Gated DeltaNet) continue from the
#   state store. Not Qwen3.8-Flash-Next (its QSA indexer's prefill keeps and selects over the pass's
#   own index keys only) nor Inkling-2 (its relative attention runs the trainer's packed call, from
#   position 0): PrefillAttention refuses a cached prefix for both, so they prefill whole prompts;
# * prefix sharing: only attention layers carry context. Hybrid families keep per-sequence
#   recurrent state that the pages do not hold, so their prompts never start from another's pages.
STATIC_FAMILIES = {t for t, cls in FAMILIES.items() if cls.static_decode}
CHUNK_FAMILIES = {t for t, cls in FAMILIES.items() if cls.chunked_prefill}
PREFIX_FAMILIES = {t for t, cls in FAMILIES.items() if cls.prefix_sharing}


class _Queued(NamedTuple):
    """A decode step queued on the device and not read back yet (``SamplingEngine._queue``)."""

    seqs: list[SequenceState]
    chosen: torch.Tensor  # the step's draws on the device, fp64 [2, rows]: token ids, logprobs
    drawn: torch.Tensor  # their host copy (pinned on CUDA), filled behind the step
    done: torch.cuda.Event | None  # recorded after the copy (None off CUDA: the copy is done)


class SamplingEngine:
    """Generation for one model and its adapter bank (see module doc)."""

    def __init__(
        self,
        model: CausalLM,
        bank: AdapterBank,
        config: SamplerConfig | None = None,
        max_seq_len: int | None = None,
        logprob_chunk: int | None = None,
    ):
        self.model = model
        self.bank = bank
        self.config = config = config or SamplerConfig()
        self.vocab = model.config.vocab_size
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        self.logprob_chunk = logprob_chunk
        self.softcap = model.final_logit_softcap
        self.device = bank.device
        dtype = next(model.parameters()).dtype
        kv_tokens = config.kv_tokens or self._default_kv_tokens(dtype)
        num_pages = math.ceil(kv_tokens / config.page_size) + 1
        self.cache = PagedKVCache(num_pages, config.page_size, dtype, self.device)
        self.states = RecurrentStateStore()
        self.scheduler = Scheduler(
            config.max_seqs,
            self.cache.usable_pages,
            config.page_size,
            config.max_prefill_tokens,
            chunked=config.chunked_prefill and model.chunked_prefill,
        )
        self.eager = EagerDecoder(model, bank, self.cache, self.states, self.max_seq_len,
                                  shared_prefix=config.shared_prefix_attention)
        # the sampler's quantised copy of the base weights (bf16: none; removes an earlier one)
        self.rollout_bytes = rollout_precision.attach(model, config.rollout_precision)
        static = config.static_decode
        if static is None:
            static = (
                self.device.type == "cuda"
                and dtype == torch.bfloat16
                and model.static_decode
                and not _sharded(model)
            )
        self.static = None
        if static:
            buckets = config.buckets or default_buckets(config.max_seqs)
            self.static = StaticDecoder(
                model, bank, self.cache, self.max_seq_len, buckets, config.cuda_graphs, self.states,
                dependent_launch=config.dependent_launch, decode_gemm=config.decode_gemm,
                shared_prefix=config.shared_prefix_attention, shrink_windows=config.shrink_windows,
                qkv_kernel=config.qkv_kernel,
            )
        self.stats = EngineStats()
        self.prefix: PrefixIndex | None = None
        if config.prefix_sharing and model.prefix_sharing:
            self.prefix = PrefixIndex(self.cache)
        self._next_handle = 0
        self._next_seq = 0
        self._inflight: _Queued | None = None  # the decode step queued and not read back (overlap_decode)

    def _default_kv_tokens(self, dtype: torch.dtype) -> int:
        cfg = self.config
        if self.device.type != "cuda":
            return min(cfg.max_seqs * min(self.max_seq_len, 2048), 1 << 16)
        # upper estimate (every layer with full K and V heads); layers are allocated at first write
        mc = self.model.config
        per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * torch.finfo(dtype).bits // 8
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(cfg.page_size, min(int(free * cfg.kv_memory_fraction) // per_token, cfg.max_seqs * self.max_seq_len))

    # -- requests --------------------------------------------------------------------------------

    def check(self, req: GenerationRequest) -> None:
        """Raise :class:`InvalidGeneration` naming the first field this engine cannot serve."""
        prompt = np.asarray(req.prompt)
        if prompt.ndim != 1 or prompt.size == 0:
            raise InvalidGeneration("prompt must be a non-empty 1-D list of token ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise InvalidGeneration(f"prompt must hold integer token ids, got {prompt.dtype}")
        if prompt.min() < 0 or prompt.max() >= self.vocab:
            raise InvalidGeneration(
                f"prompt token ids must be in [0, {self.vocab}), got {prompt.min()}..{prompt.max()}"
            )
        P = prompt.size
        if P > self.max_seq_len:
            raise InvalidGeneration(f"prompt of {P} tokens exceeds the context length {self.max_seq_len}")
        if not isinstance(req.max_tokens, (int, np.integer)) or req.max_tokens < 1:
            raise InvalidGeneration(f"max_tokens={req.max_tokens} must be an integer >= 1")
        if P + req.max_tokens > self.max_seq_len:
            raise InvalidGeneration(
                f"prompt of {P} tokens + max_tokens={req.max_tokens} exceeds the context length {self.max_seq_len}"
            )
        if len(req.seeds) < 1:
            raise InvalidGeneration("num_samples must be >= 1")
        if not (math.isfinite(req.temperature) and req.temperature >= 0):
            raise InvalidGeneration(f"temperature={req.temperature} must be a finite number >= 0")
        if not (0 < req.top_p <= 1):
            raise InvalidGeneration(f"top_p={req.top_p} must be in (0, 1]")
        if not isinstance(req.top_k, (int, np.integer)) or req.top_k < -1:
            raise InvalidGeneration(f"top_k={req.top_k} must be -1 (off) or a positive integer")
        if req.record_support:
            if not isinstance(req.record_support, (int, np.integer)) or not 0 < req.record_support <= self.vocab:
                raise InvalidGeneration(f"record_support={req.record_support} must be an integer in [1, {self.vocab}]")
            if not plain(req.temperature, req.top_k, req.top_p, self.vocab) and not 0 < req.top_k <= SUPPORT_MAX:
                raise InvalidGeneration(
                    f"recording the support of truncated sampling needs top_k between 1 and {SUPPORT_MAX} "
                    f"(got top_k={req.top_k}, top_p={req.top_p}): the kept set of every token is stored")
        for name in ("topk_prompt", "topk_sample", "prompt_alt_k"):
            k = getattr(req, name)
            if not isinstance(k, (int, np.integer)) or not 0 <= k <= self.vocab:
                raise InvalidGeneration(f"{name}={k} must be an integer in [0, {self.vocab}]")
        if req.prompt_logprobs_from is not None and req.prompt_logprobs_from < 0:
            raise InvalidGeneration(f"prompt_logprobs_from={req.prompt_logprobs_from} must be >= 0")
        if req.slot and req.slot not in self.bank:
            raise InvalidGeneration(f"adapter slot {req.slot} is empty")
        if req.prompt_targets is not None:
            t = np.asarray(req.prompt_targets)
            if t.ndim != 2 or t.shape[0] != P - 1 or not np.issubdtype(t.dtype, np.integer):
                raise InvalidGeneration(f"target_prompt_logprobs must be an integer array [{P - 1}, K], got {t.shape}")
            if t.size and (t.min() < -1 or t.max() >= self.vocab):
                raise InvalidGeneration(f"target_prompt_logprobs ids must be -1 (none) or in [0, {self.vocab})")
        try:
            self.scheduler.plan(-1, req)
        except ValueError as e:
            raise InvalidGeneration(str(e)) from None

    def submit(self, req: GenerationRequest) -> int:
        """Queue a request (checked first); returns its handle."""
        self.check(req)
        handle = self._next_handle
        self._next_handle += 1
        self.scheduler.add(self.scheduler.plan(handle, req))
        return handle

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run requests to completion (continuous batching); results in request order."""
        handles = [self.submit(r) for r in requests]
        done: dict[int, GenerationResult] = {}
        while not self.scheduler.idle:
            done.update(self.step())
        return [done[h] for h in handles]

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @torch.no_grad()
    def step(self) -> dict[int, GenerationResult]:
        """One engine step (admission, a prefill pass over the step's prompt chunks, then one decode
        step for every running sequence, queued ahead of the host with ``overlap_decode``);
        returns the requests that finished in it, by handle."""
        t0 = time.perf_counter()
        finished: dict[int, GenerationResult] = {}
        prefilled = decoded = 0
        with rollout_precision.sampling(self.model):
            admitted = self.scheduler.admit()
            if admitted:
                slots = [r.request.slot for r in admitted]
                self.eager.refresh(slots, create=self.static is None)
                if self.static is not None:
                    self.static.sync(slots)
                self.stats.admit_seconds += time.perf_counter() - t0
            chunks = self.scheduler.chunks()
            if chunks:
                prefilled = self._prefill(chunks, finished)
            if self.scheduler.running:
                decoded = self._decode(finished)
        dt = time.perf_counter() - t0
        self.stats.steps.append(StepRecord(prefilled, decoded, len(self.scheduler.prefilling), dt))
        return finished

    # -- prefill ---------------------------------------------------------------------------------

    def _prefill(self, chunks: list[tuple[RequestState, int]], finished: dict[int, GenerationResult]) -> int:
        """One packed pass over up to ``n`` more prompt tokens of each ``(request, n)``; requests
        whose prompt it completes sample their first tokens and start decoding. Returns the tokens
        computed."""
        t0 = time.perf_counter()
        ps = self.cache.page_size
        reqs = [r for r, _ in chunks]
        new = [r for r in reqs if not r.sequences]  # their first chunk
        keys = dict(zip(new, self._prefix_keys(new) or [None] * len(new)))
        # packed (slot) order, as pack() lays the chunks out
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i].request.slot, i))
        start = [0] * len(reqs)  # prompt tokens of each request cached before this pass
        count = [0] * len(reqs)  # and computed in it
        for i in order:
            r = reqs[i]
            if r in keys:
                self._start(r, keys[r])
            owner, prompt = r.sequences[0], r.request.prompt
            start[i] = owner.cached
            count[i] = min(chunks[i][1], len(prompt) - start[i])
            end = owner.cached = start[i] + count[i]
            owner.pages += [self.cache.allocate() for _ in range(math.ceil(end / ps) - len(owner.pages))]
            if r.prefix_key is not None:
                # later prompts of this pass may read these pages too: every layer writes the
                # pass's keys and values before any document attends
                self.prefix.insert(r.prefix_key, prompt, owner.pages, end // ps)
        batch = pack([reqs[i].request.prompt[start[i] : start[i] + count[i]] for i in range(len(reqs))],
                     [(r.request.slot, False) for r in reqs], self.device)
        slot_mapping: list[int] = []
        for i in order:
            slot_mapping += self.cache.slots(reqs[i].sequences[0].pages, start[i], count[i])
        positions = batch.positions
        if any(start):
            offsets = torch.tensor([start[i] for i in order], dtype=torch.long)
            counts = torch.tensor([count[i] for i in order], dtype=torch.long)
            positions = positions + torch.repeat_interleave(offsets, counts).to(positions.device)
        record = any(r.request.record_routing for r in reqs)
        ctx = ForwardContext(
            positions=positions,
            attend=PrefillAttention(
                self.cache,
                torch.tensor(slot_mapping, device=self.device),
                batch.doc_lengths,
                positions,
                relative_backend=getattr(self.model, "attention_backend", None),
                prefix_lens=[start[i] for i in order],
                block_tables=[reqs[i].sequences[0].pages for i in order],
            ),
            lora=(self.static.prefill_route(batch.groups, batch.num_tokens) if self.static is not None
                  else self.bank.route(batch.groups)),
            seq_lens=batch.doc_lengths,
            state=self.states.view([reqs[i].sequences[0].id for i in order]),
            routing=RoutingRecord(record={}) if record else None,
        )
        try:
            hidden = self.model.hidden_states(batch.input_ids, ctx)
        except BaseException:
            if self.prefix is not None:  # pages listed for this pass may never have been written
                self.prefix.clear()
            raise

        done = [i for i in order if start[i] + count[i] == len(reqs[i].request.prompt)]
        for i in order:
            r = reqs[i]
            if self._shareable(r.request):  # no prompt-side output asked for
                continue
            a, b = batch.starts[i], batch.starts[i] + count[i]
            if r.request.record_routing:
                r.routing_parts.append(_routing_array(ctx.routing.record, a, b - a))
                r.outputs["routing_layers"] = tuple(sorted(ctx.routing.record))
            if i not in done:  # a chunk: keep its hidden states for the prompt's outputs
                r.hidden.append(hidden[a:b].clone())
                continue
            h = torch.cat([*r.hidden, hidden[a:b]]) if r.hidden else hidden[a:b]
            r.hidden = []
            self._prompt_outputs(r, h)
            if r.request.record_routing:
                r.prompt_routing = np.concatenate(r.routing_parts)
                r.routing_parts = []

        if done:
            # logits of each completed prompt's last position, rows in packed (slot) order
            last = [batch.starts[i] + count[i] - 1 for i in done]
            route = self.bank.route(_runs([(reqs[i].request.slot, False) for i in done]))
            raw = head_logits(hidden[last], self.model.unembed_weight, route, vocab=self.model.vocab_split)
            seqs = [s for i in done for s in reqs[i].sequences]
            rows = [j for j, i in enumerate(done) for _ in reqs[i].sequences]
            self._sample_into(seqs, rows, raw)
        self.stats.prefill_passes += 1
        self.stats.prefill_tokens += batch.num_tokens
        self.stats.prefill_seconds += time.perf_counter() - t0

        for i in done:
            r = reqs[i]
            self.scheduler.prefilled(r)
            owner, P = r.sequences[0], len(r.request.prompt)
            for s in r.sequences[1:]:
                if s.stop_reason is None:
                    s.pages = self.cache.fork(owner.pages, P)
                    s.cached = P
                    self.states.fork(owner.id, s.id)
            for s in r.sequences:
                if s.stop_reason is None:
                    self.scheduler.running.append(s)
                else:
                    self._finish(s, finished)
        return batch.num_tokens

    def _start(self, r: RequestState, key) -> None:
        """Create the request's samples (its first one holds the prompt's pages while it is
        prefilled). With prefix sharing (``key``), the prompt starts from the longest run of its
        whole pages in the prefix index; at least its last token is computed (its hidden state
        gives the first sample)."""
        r.sequences = [self._new_sequence(r, j, seed) for j, seed in enumerate(r.request.seeds)]
        r.prefix_key = key
        if key is not None and self._shareable(r.request):
            owner, prompt, ps = r.sequences[0], r.request.prompt, self.cache.page_size
            owner.pages = [self.cache.share(p) for p in self.prefix.match(key, prompt, (len(prompt) - 1) // ps)]
            owner.cached = len(owner.pages) * ps
            self.stats.prefix_pages_reused += len(owner.pages)
            self.stats.prefill_tokens_saved += owner.cached

    @staticmethod
    def _shareable(req: GenerationRequest) -> bool:
        """Whether a request may start from cached prompt pages: not when it asks for outputs at
        prompt positions (they need the hidden states of the whole prompt)."""
        return (
            req.prompt_logprobs_from is None
            and not req.topk_prompt
            and req.prompt_targets is None
            and not req.prompt_alt_k
            and not req.record_routing
        )

    def _prefix_keys(self, reqs: list[RequestState]) -> list | None:
        """Each request's prefix-index key: its slot and the adapter's :attr:`~ember.core.adapters.
        Adapter.version` (the base model's weights are fixed). Keys of a slot that no longer match
        are dropped. ``None``: sharing is off."""
        if self.prefix is None:
            return None
        keys = [self._prefix_key(r.request.slot) for r in reqs]
        current = {k[0]: k for k in keys}
        for key in self.prefix.keys():  # noqa: SIM118 - a list: drop_key changes the index
            if key[0] in current and key != current[key[0]]:
                self.prefix.drop_key(key)
        return keys

    def _prefix_key(self, slot: int) -> tuple:
        return (slot, *self.bank.get(slot).version) if slot else (0,)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prompt page (e.g. after changing the base weights in place)."""
        if self.prefix is not None:
            self.prefix.clear()

    def _new_sequence(self, r: RequestState, index: int, seed: int) -> SequenceState:
        self._next_seq += 1
        return SequenceState(id=self._next_seq, request=r, index=index, seed=int(seed))

    def _route(self, slot: int, n: int):
        return self.bank.route([((slot, False), 0, n)])

    def _prompt_outputs(self, r: RequestState, h: torch.Tensor) -> None:
        """Prompt logprobs, top-k prompt logprobs and target logprobs from the prompt's hidden states
        (position ``i`` is predicted from hidden state ``i - 1``)."""
        req = r.request
        P = len(req.prompt)
        W = self.model.unembed_weight
        prompt = torch.as_tensor(np.asarray(req.prompt), dtype=torch.long, device=self.device)
        lo = max(1, req.prompt_logprobs_from or 1)
        if req.prompt_logprobs_from is not None:
            out = np.full(P, np.nan, dtype=np.float32)
            if lo < P:
                lps = token_logprobs(
                    h[lo - 1 : P - 1],
                    W,
                    prompt[lo:P],
                    lora=self._route(req.slot, P - lo),
                    softcap=self.softcap,
                    chunk=self.logprob_chunk,
                    vocab=self.model.vocab_split,
                )
                out[lo:] = lps.float().cpu().numpy()
            r.outputs["prompt_logprobs"] = out
        if req.topk_prompt:
            k = req.topk_prompt
            ids = np.full((P, k), EMPTY_TOPK_ID, dtype=np.int32)
            vals = np.full((P, k), EMPTY_TOPK_LOGPROB, dtype=np.float32)
            step = chunked_rows(P, self.vocab)
            for c0 in range(lo, P, step):
                c1 = min(P, c0 + step)
                raw = head_logits(h[c0 - 1 : c1 - 1], W, self._route(req.slot, c1 - c0), vocab=self.model.vocab_split)
                ids[c0:c1], vals[c0:c1] = topk_logprobs(log_softmax(raw, self.softcap), k)
            r.outputs["topk_prompt"] = (ids, vals)
        if req.prompt_targets is not None:
            t = np.asarray(req.prompt_targets)
            out = np.zeros(t.shape, dtype=np.float32)
            if P > 1 and t.shape[1]:
                tt = torch.as_tensor(np.where(t < 0, 0, t), dtype=torch.long, device=self.device)
                lps = token_logprobs(
                    h[: P - 1], W, tt, lora=self._route(req.slot, P - 1), softcap=self.softcap, chunk=self.logprob_chunk,
                    vocab=self.model.vocab_split,
                )
                out = np.where(t < 0, 0.0, lps.float().cpu().numpy()).astype(np.float32)
            r.outputs["target_prompt_logprobs"] = out
        if req.prompt_alt_k:
            r.outputs["prompt_alt"] = self._prompt_alternatives(r, h)

    def _prompt_alternatives(self, r: RequestState, h: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """``prompt_alt_k`` draws at each prompt position ``1..P-1`` (request temperature, plain: no
        top-k/top-p) and their logprobs, ``[P-1, k]`` each. Draw ``j`` at position ``i`` uses the
        uniform number of step ``i·k + j`` of a seed derived from the request's first sample seed,
        so the draws are reproducible and independent of the batch."""
        req = r.request
        P, k = len(req.prompt), req.prompt_alt_k
        tokens = np.zeros((P - 1, k), dtype=np.int64)
        logprobs = np.zeros((P - 1, k), dtype=np.float32)
        seed = derive_seed(req.seeds[0], ALT_SEED_INDEX)
        inv_t = 1.0 / req.temperature if req.temperature > 0 else 0.0
        step = chunked_rows(P - 1, self.vocab)
        for c0 in range(1, P, step):
            c1 = min(P, c0 + step)
            raw = head_logits(h[c0 - 1 : c1 - 1], self.model.unembed_weight, self._route(req.slot, c1 - c0),
                              vocab=self.model.vocab_split)
            z = capped(raw, self.softcap).contiguous()
            inv = torch.full((c1 - c0,), inv_t, dtype=torch.float64, device=z.device)
            for j in range(k):
                u = [seeded_uniform(seed, i * k + j) for i in range(c0, c1)]
                tok, lp = sample_rows(z, inv, torch.tensor(u, dtype=torch.float64, device=z.device))
                tokens[c0 - 1 : c1 - 1, j] = tok.cpu().numpy()
                logprobs[c0 - 1 : c1 - 1, j] = lp.float().cpu().numpy()
        return tokens, logprobs

    # -- decode ----------------------------------------------------------------------------------

    def _decode(self, finished: dict[int, GenerationResult]) -> int:
        """One decode step of the running sequences; returns the tokens it added.

        With ``overlap_decode`` (the static decoder, every row plain) the step is queued before the
        host reads the previous one back: its rows that were in the previous step take that step's
        draws on the device, and the host's share of a step (reading the draws, stop rules,
        bookkeeping, the next step's inputs) runs while the GPU decodes. So each call completes the
        step queued by the call before and queues the next; a row whose previous token ends it by
        length is not queued again, one that a stop token ends has computed one step for nothing
        (its keys go to its own pages, within its reservation, and its draw is dropped)."""
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        seqs = sorted(self.scheduler.running, key=lambda s: (s.slot, s.id))
        nxt = None
        if self._overlaps(seqs):
            if prev is not None:
                pending = {id(s) for s in prev.seqs}
                seqs = [s for s in seqs
                        if not (id(s) in pending and len(s.tokens) + 1 >= s.request.request.max_tokens)]
            if seqs:
                nxt = self._queue(seqs, prev)
        if prev is not None:
            n = self._complete(prev, finished)
        elif nxt is None:
            n = self._step_now(seqs, finished)
        else:
            n = 0  # the first step of a run is only queued
        if nxt is not None and any(s.stop_reason is None for s in nxt.seqs):
            self._inflight = nxt
        if n:
            dt = time.perf_counter() - t0
            self.stats.decode_steps += 1
            self.stats.decode_tokens += n
            self.stats.decode_seconds += dt
            self.stats.step_times.append((n, dt))
        return n

    def _overlaps(self, seqs: list[SequenceState]) -> bool:
        """Whether the step of ``seqs`` may be queued ahead of the host: the static decoder draws
        every row's token in its step (plain sampling, nothing the host must compute from the
        logits or the routing) and reads no token history (n-gram memory)."""
        if not (self.config.overlap_decode and self.static is not None and not self.static.ngrams):
            return False
        return all(
            not (q.record_routing or q.record_support or q.topk_sample)
            and plain(q.temperature, q.top_k, q.top_p, self.vocab)
            for q in (s.request.request for s in seqs)
        )

    def _batch(self, seqs: list[SequenceState], ahead: list[int]) -> DecodeBatch:
        """The decode batch of ``seqs``; ``ahead[i]`` = 1 where row ``i``'s input token is a draw
        still on the device (its position and uniform number one further than the host knows)."""
        ps = self.cache.page_size
        positions = [s.cached + a for s, a in zip(seqs, ahead)]
        for s, p in zip(seqs, positions):
            if p == len(s.pages) * ps:
                s.pages.append(self.cache.allocate())
        reqs = [s.request.request for s in seqs]
        return DecodeBatch(
            seq_ids=[s.id for s in seqs],
            slots=[s.slot for s in seqs],
            input_ids=[0 if a else s.tokens[-1] for s, a in zip(seqs, ahead)],
            positions=positions,
            slot_mapping=[s.pages[p // ps] * ps + p % ps for s, p in zip(seqs, positions)],
            block_tables=[s.pages for s in seqs],
            record_routing=any(q.record_routing for q in reqs),
            inv_temperature=[1.0 / q.temperature if q.temperature > 0 else 0.0 for q in reqs],
            uniforms=seeded_uniforms([s.seed for s in seqs], [len(s.tokens) + a for s, a in zip(seqs, ahead)]),
            record_head=max((q.record_support for q in reqs
                             if q.record_support and plain(q.temperature, q.top_k, q.top_p, self.vocab)), default=0),
            histories=[(q.prompt, s.tokens) for q, s in zip(reqs, seqs)],
        )

    def _step_now(self, seqs: list[SequenceState], finished: dict[int, GenerationResult]) -> int:
        """A decode step run and read back at once (any decoder, any sampling parameters)."""
        batch = self._batch(seqs, [0] * len(seqs))
        raw, record, chosen = self._run_decoder(batch)
        for s in seqs:
            s.cached += 1
        if record is not None:
            arr = _routing_array(record, 0, len(seqs))
            for i, s in enumerate(seqs):
                if s.request.request.record_routing:
                    s.routing.append(arr[i : i + 1])
        self._sample_into(seqs, list(range(len(seqs))), raw, chosen)
        for s in seqs:
            if s.stop_reason is not None:
                self._finish(s, finished)
        return len(seqs)

    def _queue(self, seqs: list[SequenceState], prev: _Queued | None) -> _Queued | None:
        """Queue the static decoder's step of ``seqs`` without waiting for it (None if the decoder
        failed: it is then off and the rows decode eagerly from the next step). Rows of ``prev``
        take their input token from its draws on the device; the draws of this step are copied to
        the host behind it."""
        where = {id(s): i for i, s in enumerate(prev.seqs)} if prev is not None else {}
        src = [where.get(id(s), -1) for s in seqs]
        batch = self._batch(seqs, [int(i >= 0) for i in src])
        try:
            _, _, chosen = self.static.run(batch, None if prev is None else (prev.chosen, src))
        except Exception as e:  # a GPU-only path: keep sampling, eagerly
            if self.device.type != "cuda":
                raise
            graphs_failed(e)
            self.static = None
            return None
        chosen = chosen[:2]
        on_gpu = chosen.is_cuda
        drawn = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=on_gpu)
        drawn.copy_(chosen, non_blocking=on_gpu)
        done = None
        if on_gpu:
            done = torch.cuda.Event()
            done.record()
        return _Queued(seqs, chosen, drawn, done)

    def _complete(self, q: _Queued, finished: dict[int, GenerationResult]) -> int:
        """Read a queued step back: its rows' tokens, stop rules, finished sequences. Rows whose
        sequence ended at the step before are dropped."""
        if q.done is not None:
            q.done.synchronize()
        rows = [i for i, s in enumerate(q.seqs) if s.stop_reason is None]
        seqs = [q.seqs[i] for i in rows]
        for s in seqs:
            s.cached += 1
        self._sample_into(seqs, rows, None, q.drawn.numpy())
        for s in seqs:
            if s.stop_reason is not None:
                self._finish(s, finished)
        return len(seqs)

    def _run_decoder(self, batch: DecodeBatch):
        if self.static is not None and not batch.record_routing:
            if self.device.type != "cuda":
                return self.static.run(batch)
            try:
                return self.static.run(batch)
            except Exception as e:  # noqa: BLE001 - a GPU-only path: keep sampling, eagerly
                graphs_failed(e)
                self.static = None
        return self.eager.run(batch)

    # -- sampling and results --------------------------------------------------------------------

    def _sample_into(
        self, seqs: list[SequenceState], rows: list[int], raw: torch.Tensor | None,
        chosen: torch.Tensor | np.ndarray | None = None,
    ) -> None:
        """Sample the next token of each sequence from raw logits row ``rows[i]`` and record it.
        ``chosen`` (fp64 ``[2, rows]``: token ids, logprobs), from a decoder that drew every row's
        plain sample in its step, is taken for the rows whose parameters are plain (``raw`` may
        then be None when every row is plain and records nothing from the logits)."""
        reqs = [s.request.request for s in seqs]
        n = len(seqs)
        tokens: list[int] = [0] * n
        token_lp: list[float] = [0.0] * n
        supports: dict[int, tuple] = {}  # row -> (SupportRows, row), for requests that record them
        todo = list(range(n))
        picked = None
        if chosen is not None:
            picked = chosen if isinstance(chosen, np.ndarray) else chosen.cpu().numpy()
            todo = []
            for i, q in enumerate(reqs):
                if plain(q.temperature, q.top_k, q.top_p, self.vocab):
                    tokens[i], token_lp[i] = int(picked[0, rows[i]]), float(picked[1, rows[i]])
                else:
                    todo.append(i)
        for c0 in range(0, len(todo), SAMPLE_ROWS):
            part = todo[c0 : c0 + SAMPLE_ROWS]
            idx = torch.tensor([rows[i] for i in part], device=raw.device)
            sub = raw.index_select(0, idx)
            tok, kept = draw_tokens(
                capped(sub, self.softcap),
                [reqs[i].temperature for i in part],
                [reqs[i].top_k for i in part],
                [reqs[i].top_p for i in part],
                [seeded_uniform(seqs[i].seed, len(seqs[i].tokens)) for i in part],
                [reqs[i].record_support > 0 for i in part],
            )
            lps = log_softmax(sub, self.softcap).gather(1, tok[:, None])[:, 0]
            for i, t, l in zip(part, tok.tolist(), lps.tolist()):
                tokens[i], token_lp[i] = t, l
            supports.update({part[j]: sup for j, sup in kept.items()})
        heads = [i for i, q in enumerate(reqs) if q.record_support and i not in supports]
        if heads:  # untruncated rows: the head of the distribution each token was drawn from
            sel = [rows[i] for i in heads]
            inv_t = np.array([1.0 / reqs[i].temperature if reqs[i].temperature > 0 else 0.0 for i in heads])
            drawn = [tokens[i] for i in heads]
            if picked is not None and picked.shape[0] > 2:  # the decoder's graph computed the heads
                rec = head_rows(picked[2:, sel].T, self.softcap, inv_t, np.asarray(drawn))
            else:
                idx = torch.tensor(sel, device=raw.device)
                rec = head_support(raw.index_select(0, idx), self.softcap, inv_t,
                                   torch.tensor(drawn, device=raw.device), max(reqs[i].record_support for i in heads))
            supports.update({i: (rec, r) for r, i in enumerate(heads)})
        k_max = max(q.topk_sample for q in reqs)
        if k_max:
            top_ids, top_vals = topk_logprobs(log_softmax(raw, self.softcap), k_max)
        if self.stats.first_token_time is None:
            self.stats.first_token_time = time.perf_counter()
        for i, (s, req, r_i, t, l) in enumerate(zip(seqs, reqs, rows, tokens, token_lp)):
            s.tokens.append(t)
            s.logprobs.append(l)
            if req.record_support:
                s.support.append(supports[i])
            if req.topk_sample:
                s.topk_ids.append(top_ids[r_i, : req.topk_sample])
                s.topk_logprobs.append(top_vals[r_i, : req.topk_sample])
            if req.stop.matches(s.tokens):
                s.stop_reason = "stop"
            elif len(s.tokens) >= req.max_tokens:
                s.stop_reason = "length"

    def _finish(self, s: SequenceState, finished: dict[int, GenerationResult]) -> None:
        key = s.request.prefix_key
        ps = self.cache.page_size
        live = key is not None and (not s.slot or s.slot in self.bank)
        if live and s.cached >= ps and self._prefix_key(s.slot) == key:
            # the finished sequence's full pages (prompt and generated tokens fed back) serve a
            # later prompt that continues it (the next turn of an episode), unless the adapter's
            # weights moved while it decoded
            prompt = s.request.request.prompt
            tokens = [*prompt, *s.tokens[: s.cached - len(prompt)]]
            self.prefix.insert(key, tokens, s.pages, s.cached // ps)
        self.cache.release(s.pages)
        s.pages = []
        self.states.free(s.id)
        if self.scheduler.finish_sequence(s):
            r = s.request
            finished[r.handle] = self._result(r)

    def _result(self, r: RequestState) -> GenerationResult:
        req = r.request
        seqs = []
        for s in r.sequences:
            k = req.topk_sample
            seqs.append(
                SequenceResult(
                    tokens=np.asarray(s.tokens, dtype=np.int32),
                    logprobs=np.asarray(s.logprobs, dtype=np.float32),
                    stop_reason=s.stop_reason,
                    topk_ids=np.stack(s.topk_ids).astype(np.int32) if k else None,
                    topk_logprobs=np.stack(s.topk_logprobs).astype(np.float32) if k else None,
                    routing=np.concatenate([r.prompt_routing, *s.routing]) if req.record_routing else None,
                    support=TokenSupport.stack(not plain(req.temperature, req.top_k, req.top_p, self.vocab), s.support,
                                               req.record_support) if req.record_support else None,
                )
            )
        topk = r.outputs.get("topk_prompt")
        alt = r.outputs.get("prompt_alt")
        return GenerationResult(
            sequences=seqs,
            prompt_logprobs=r.outputs.get("prompt_logprobs"),
            topk_prompt_ids=topk[0] if topk else None,
            topk_prompt_logprobs=topk[1] if topk else None,
            target_prompt_logprobs=r.outputs.get("target_prompt_logprobs"),
            prompt_alt_tokens=alt[0] if alt else None,
            prompt_alt_logprobs=alt[1] if alt else None,
            routing_layers=r.outputs.get("routing_layers", ()),
        )


def _runs(keys: list) -> list[tuple[object, int, int]]:
    """``(key, start, end)`` runs of equal consecutive keys."""
    runs: list[tuple[object, int, int]] = []
    for i, k in enumerate(keys):
        if runs and runs[-1][0] == k:
            runs[-1] = (k, runs[-1][1], i + 1)
        else:
            runs.append((k, i, i + 1))
    return runs


def _routing_array(record: dict[int, torch.Tensor], start: int, n: int) -> np.ndarray:
    """Rows ``[start, start + n)`` of a routing record as ``[n, layers, k]`` int32 (layers sorted)."""
    layers = sorted(record)
    if not layers:
        return np.zeros((n, 0, 0), dtype=np.int32)
    return torch.stack([record[i][start : start + n] for i in layers], dim=1).to(torch.int32).cpu().numpy()


def _sharded(model: CausalLM) -> bool:
    """Whether some projection, or some layer's experts, is split across processes. The static
    decoder runs such a model correctly (the split projections' collectives and the experts'
    all-reduce run in its step, the LM head's vocabulary parts are gathered before the draw;
    ``tests/parallel``, gloo), but it is not the default there until capturing those collectives in
    CUDA graphs has been run on several GPUs (``static_decode=True`` forces it:
    ``bench/parallel_check.py --static-decode``)."""
    return any(
        (isinstance(m, LoraLinear) and m.shard is not None) or (isinstance(m, Experts) and m.dispatch is not None)
        for m in model.modules()
    )
