"""The engine worker: executes model operations for one base model on its device.

It owns the model, the adapter bank and the adapters' optimizers, and speaks Ember's internal
request types (:mod:`ember.types`), never Tinker wire formats. ``forward_backward`` takes the
requests of several adapters (and of the bare base model) and runs them as ONE packed pass: each
request's logprobs and each adapter's gradients are what that request would get alone.

Activation checkpointing (``activation_checkpointing``: ``auto`` | ``on`` | ``off``) applies to
training passes only (a ``forward_backward`` with at least one request that trains, so grad mode
is on); sampling and forward-only passes never checkpoint. ``on`` checkpoints every decoder layer
of every training pass (:mod:`ember.core.checkpointing`). ``auto`` (the default) decides per pass:
on CUDA, when the pass's estimated activation memory
(:func:`~ember.core.checkpointing.activation_bytes`, from the pass's tokens and the model's
shape, scaled by what earlier passes kept against their estimate) plus the gradients the
backward is yet to allocate exceed :data:`AUTO_FRACTION` of the memory still available on the
device, it first rebuilds the pass's norm and activation outputs in the backward
(:mod:`ember.core.rebuild`; a pass that fits keeps them: rebuilding costs a few percent), and
when even the rebuilt estimate exceeds it, it checkpoints the fewest layers that make up the difference
(:func:`~ember.core.checkpointing.layers_to_checkpoint`: the layers that keep the most first;
the rest keep their activations and are not recomputed), and runs a forward that ran out of
memory again with every layer checkpointed (one process only); on other devices it is off. A
sharded engine's ranks agree (they take the most layers any rank needs, in the same order: they
must recompute the same layers).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ember.core.adapters import Adapter, AdapterBank, LoraConfig
from ember.core.batch import PackedBatch, pack, to_device
from ember.core.checkpoint import FULL_FORMAT, checkpoint_format, load_adapter, save_adapter
from ember.core.checkpointing import (
    HEAD_BYTES,
    apply_checkpointing,
    available_bytes,
    checkpoint_order,
    kept_bytes,
    layers_to_checkpoint,
)
from ember.core.full_checkpoint import export_hf
from ember.core.layers.attention import PackedAttention
from ember.core.layers.moe import RoutingRecord
from ember.core.loading import load_model
from ember.core.logprobs import token_logprobs
from ember.core.losses import loss_sum
from ember.core.models import CausalLM, ForwardContext
from ember.core.optim import AdamParams
from ember.core.peft_format import export_peft, import_peft
from ember.core.rebuild import rebuilding
from ember.core.rollout_precision import check_precision
from ember.core.sampling import InvalidGeneration, SamplerConfig, SamplingEngine
from ember.core.sampling.requests import Detokenize
from ember.core.stable_reinforce import stable_reinforce
from ember.engine.custom_loss import LossProgram
from ember.engine.full_runs import FullRuns, NoRoom, Weights
from ember.engine.sampler import generation_request, sample_output
from ember.engine.warmup import keep_autotuning
from ember.engine_flags import CHECKPOINTING_MODES
from ember.lossdefs import LOSS_SPECS, LossSpec, resolve_loss_config
from ember.lossgraph import ProgramError
from ember.types import (
    Datum,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    InvalidRequest,
    RequestError,
    SampleInput,
    SampleOutput,
)

log = logging.getLogger("ember.engine.worker")

# ``auto`` checkpoints a training pass whose estimated memory exceeds this fraction of the
# available device memory (the estimate is within 12 % per layer on the measured shapes; the rest
# is headroom for the backward's transients and allocator fragmentation)
AUTO_FRACTION = 0.85
# the shortest training pass whose memory is measured for those estimates: in a shorter one what
# does not grow with the tokens (the first pass's cuBLAS workspaces, the head's chunk) would
# read as a large cost per token and checkpoint later long passes for nothing
MEASURE_MIN_TOKENS = 1024


class _Prepared:
    """A validated request, its datums as tensors."""

    def __init__(self, index: int, req: ForwardBackwardInput, config: dict[str, float],
                 program: LossProgram | None = None):
        self.index = index
        self.req = req
        self.config = config
        self.program = program  # loss_fn "custom"
        self.tokens: list[np.ndarray] = []
        self.targets: list[torch.Tensor] = []
        self.inputs: list[dict[str, torch.Tensor]] = []
        # stable_reinforce: per datum, the sampler's inverse temperature of each row and the
        # recorded experts of each input position ([N, L, k] over the model's MoE layers, -1: none)
        self.inv_t: list[torch.Tensor] = []
        self.routes: list[torch.Tensor | None] = []


class Worker:
    """One base model, its adapter bank, and the operations the service runs on them."""

    def __init__(
        self,
        model: CausalLM,
        max_adapters: int = 32,
        max_rank: int = 64,
        max_seq_len: int | None = None,
        logprob_chunk: int | None = None,
        sampler_config: SamplerConfig | None = None,
        activation_checkpointing: str = "auto",
        rollout_precision: str | None = None,
        full_finetune: bool = False,
        optimizer_offload: str = "none",
        optimizer_device_bytes: int = 0,
        max_prefill_tokens: int | None = None,
    ):
        if activation_checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(f"activation_checkpointing must be one of {CHECKPOINTING_MODES}, "
                             f"got {activation_checkpointing!r}")
        self.model = model
        self.config = model.config
        self.bank = AdapterBank(model, max_adapters=max_adapters, max_rank=max_rank)
        self.device = self.bank.device
        if self.device.type == "cuda":
            keep_autotuning()
        self.max_seq_len = max_seq_len or self.config.max_position_embeddings
        self.logprob_chunk = logprob_chunk
        if rollout_precision is not None:  # overrides sampler_config's (ember.core.rollout_precision)
            check_precision(rollout_precision)
            sampler_config = replace(sampler_config or SamplerConfig(), rollout_precision=rollout_precision)
        if max_prefill_tokens is not None:  # overrides sampler_config's (tokens per sampling step)
            sampler_config = replace(sampler_config or SamplerConfig(), max_prefill_tokens=max_prefill_tokens)
        self.sampler_config = sampler_config
        self._sampler: SamplingEngine | None = None
        self.activation_checkpointing = activation_checkpointing
        self.checkpointing = apply_checkpointing(model) if activation_checkpointing != "off" else None
        self._auto_on = False  # the last auto decision (logged when it turns on)
        # whether passes rebuild norm and activation outputs in the backward (ember.core.rebuild):
        # always, except that auto on CUDA keeps them where the pass fits (_checkpoint_pass)
        self._rebuild = True
        # what training forwards kept against their estimate (CUDA; None: none measured yet)
        self._kept_scale: float | None = None
        # full fine-tuning runs (rank 0) and their samplers, under negative slots (ember.engine.full_runs)
        self.full_finetune = full_finetune  # whether clients may start full runs (samplers of full weights: always)
        self.full = FullRuns(model, optimizer_offload, activation_checkpointing != "off", optimizer_device_bytes)
        self.model_dir: Path | None = None  # the base model's folder (from_pretrained): full-model exports read it
        self._full_sampler: tuple[tuple, SamplingEngine] | None = None  # the sampling engine of full weights

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, **kwargs
    ) -> Worker:
        """Load a local Hugging Face model folder and wrap it in a worker."""
        worker = cls(load_model(model_dir, device, dtype), **kwargs)
        worker.model_dir = Path(model_dir)
        return worker

    # -- adapters -------------------------------------------------------------------------------

    def validate(self, config: LoraConfig) -> None:
        """``ValueError`` if a model of ``config`` cannot be made here (rank 0: full fine-tuning)."""
        if config.rank == 0:
            if not self.full_finetune:
                raise ValueError("full fine-tuning (rank 0) is not enabled for this model; the server must serve "
                                 "it with --full-finetune")
            return
        self.bank.validate(config)

    def create_adapter(self, config: LoraConfig) -> int:
        """Fill a free slot with a new adapter, or (rank 0) start a full fine-tuning run; returns
        the slot (negative for a full run)."""
        if config.rank == 0:
            self.validate(config)
            return self.full.create()
        return self.bank.create(config).slot

    def reset_adapter(self, slot: int) -> None:
        self.bank.reset(slot)

    def free_adapter(self, slot: int) -> None:
        if slot < 0:
            self.full.free(slot)
            if self._full_sampler is not None and slot in self._full_sampler[0]:
                self._full_sampler = None
            return
        self.bank.free(slot)

    def adapter(self, slot: int) -> Adapter:
        return self.bank.get(slot)

    def snapshot_adapter(self, slot: int) -> int:
        """Copy ``slot``'s current weights into a new slot for a sampler (no optimizer state); the
        copy keeps sampling these weights while ``slot`` trains on. Returns the new slot. A full
        fine-tuning run's snapshot reads the run's weights until they change (full_runs)."""
        if slot < 0:
            return self.full.snapshot(slot)
        return self.bank.snapshot(slot).slot

    def is_full(self, slot: int) -> bool:
        """Whether ``slot`` is a full fine-tuning run (or a sampler of full weights)."""
        return slot < 0

    def _weights(self, slot: int) -> Weights:
        """What a training pass of ``slot`` runs on: the base model and the adapter bank, or a
        full fine-tuning run's own model."""
        if slot < 0:
            return self.full.weights(slot)
        return Weights(self.model, self.bank, self.checkpointing)

    # -- sampling -------------------------------------------------------------------------------

    @property
    def sampler(self) -> SamplingEngine:
        """The sampling engine (its KV cache is allocated at first use)."""
        if self._sampler is None:
            self._sampler = SamplingEngine(
                self.model, self.bank, self.sampler_config, self.max_seq_len, self.logprob_chunk
            )
        return self._sampler

    def release_sampler(self) -> None:
        """Free the sampler's KV cache and captured graphs (e.g. to give training the memory)."""
        self._sampler = None

    def sample(
        self, requests: Sequence[SampleInput], detokenize: Detokenize | None = None
    ) -> list[SampleOutput | RequestError]:
        """Generate for every valid request, all in shared decode steps (continuous batching over
        adapters and the base model); invalid ones fail alone with a message. ``detokenize(ids) ->
        str`` (the tokenizer's decode) is needed only for stop strings. Requests of full
        fine-tuned weights (negative slots) run after those, one set of weights at a time."""
        results: list[SampleOutput | RequestError | None] = [None] * len(requests)
        groups: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(min(req.slot, 0), []).append(i)
        for slot, idx in sorted(groups.items(), reverse=True):
            if slot == 0:
                outs = self._sample_on(None, [requests[i] for i in idx], detokenize)
            else:
                try:
                    weights, key = self.full.sampler_weights(slot)
                except (KeyError, ValueError, NoRoom) as e:
                    outs = [RequestError(str(e))] * len(idx)
                else:
                    if self._full_sampler is None or self._full_sampler[0] != key:
                        self._full_sampler = None  # its KV cache is freed before the next one takes memory
                        engine = SamplingEngine(weights.model, weights.bank, self.sampler_config, self.max_seq_len,
                                                self.logprob_chunk)
                        self._full_sampler = (key, engine)
                    outs = self._sample_on(self._full_sampler[1], [replace(requests[i], slot=0) for i in idx],
                                           detokenize)
            for i, out in zip(idx, outs):
                results[i] = out
        return results  # type: ignore[return-value]

    def _sample_on(
        self, engine: SamplingEngine | None, requests: Sequence[SampleInput], detokenize: Detokenize | None
    ) -> list[SampleOutput | RequestError]:
        """:meth:`sample` on one sampling engine (``None``: the base model's)."""
        results: list[SampleOutput | RequestError | None] = [None] * len(requests)
        full = engine is not None
        engine = engine or self.sampler
        valid, gens = [], []
        eos = tuple(self.config.eos_token_ids)
        moe = bool(self.model.moe_routers())
        for i, req in enumerate(requests):
            if req.record_stability and moe:
                req = replace(req, record_routing=True)  # the record holds the routes (R3)
            try:
                g = generation_request(req, eos, self.config.vocab_size, self.max_seq_len, detokenize)
                engine.check(g)
            except (InvalidRequest, InvalidGeneration) as e:
                results[i] = RequestError(str(e))
                continue
            valid.append(i)
            gens.append(g)
        if gens:
            try:
                outs = engine.generate(gens)
            except BaseException:
                # a failed run leaves requests half-done: start the next one fresh
                if full:
                    self._full_sampler = None
                else:
                    self._sampler = None
                raise
            for i, out in zip(valid, outs):
                results[i] = sample_output(out)
        return results  # type: ignore[return-value]

    # -- forward / backward ---------------------------------------------------------------------

    def _prepare(self, index: int, req: ForwardBackwardInput) -> _Prepared:
        program = None
        if req.loss_fn == "custom":
            if req.custom_loss is None:
                raise InvalidRequest("loss_fn 'custom' needs the loss program (create_custom_loss)")
            program = LossProgram(req.custom_loss, self.device)
            config, spec = {}, LossSpec(inputs=("target_tokens",), allows_2d_targets=program.inputs[0]["rank"] == 2)
        else:
            try:
                config = resolve_loss_config(req.loss_fn, req.loss_config)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
            spec = LOSS_SPECS[req.loss_fn]
        if req.slot > 0 and req.slot not in self.bank:
            raise InvalidRequest(f"adapter slot {req.slot} is empty")
        if req.slot < 0 and req.slot not in self.full.runs:
            raise InvalidRequest(f"full fine-tuning run {req.slot} is not loaded")
        if not req.slot and not req.forward_only:
            raise InvalidRequest("the base model (slot 0) cannot be trained; use forward_only")
        if not req.datums:
            raise InvalidRequest("no datums")
        prep = _Prepared(index, req, config, program)
        vocab = self.config.vocab_size
        for i, d in enumerate(req.datums):
            where = f"datum {i}"
            tokens = np.asarray(d.tokens)
            if tokens.ndim != 1 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
                raise InvalidRequest(f"{where}: model input must be a non-empty 1-D list of token ids")
            n = tokens.size
            if n > self.max_seq_len:
                raise InvalidRequest(f"{where}: {n} tokens exceed the maximum sequence length {self.max_seq_len}")
            if tokens.min() < 0 or tokens.max() >= vocab:
                raise InvalidRequest(f"{where}: token ids must be in [0, {vocab}), got {tokens.min()}..{tokens.max()}")
            missing = [k for k in spec.inputs if k not in d.loss_inputs]
            if missing:
                raise InvalidRequest(f"{where}: loss_fn {req.loss_fn!r} needs loss_fn_inputs {missing}")
            targets = np.asarray(d.loss_inputs["target_tokens"])
            if not np.issubdtype(targets.dtype, np.integer):
                raise InvalidRequest(f"{where}: target_tokens must be integers, got {targets.dtype}")
            two_d = targets.ndim == 2 and spec.allows_2d_targets
            if targets.shape[0:1] != (n,) or not (targets.ndim == 1 or two_d):
                allowed = "[N] or [N, K]" if spec.allows_2d_targets else "[N]"
                raise InvalidRequest(f"{where}: target_tokens shape {targets.shape} must be {allowed} with N={n}")
            if targets.size == 0 or targets.min() < 0 or targets.max() >= vocab:
                raise InvalidRequest(f"{where}: target_tokens must be in [0, {vocab})")
            inputs: dict[str, torch.Tensor] = {}
            for key in (*spec.inputs, *spec.optional_inputs):
                if key == "target_tokens" or key not in d.loss_inputs:
                    continue
                arr = np.asarray(d.loss_inputs[key])
                if arr.shape != targets.shape:
                    raise InvalidRequest(f"{where}: {key} shape {arr.shape} must equal target_tokens shape {targets.shape}")
                if not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr)):
                    raise InvalidRequest(f"{where}: {key} must hold finite numbers")
                inputs[key] = torch.as_tensor(arr, dtype=torch.float32)
            if "weights" in spec.optional_inputs and "weights" not in inputs:
                inputs["weights"] = torch.ones(targets.shape, dtype=torch.float32)
            if spec.needs_provenance:
                targets = self._support_targets(d, targets, inputs, where)
                prep.inv_t.append(torch.as_tensor(d.support.inv_temperature, dtype=torch.float32))
                prep.routes.append(self._datum_routes(d, n, where))
            if program is not None:
                if targets.ndim != program.inputs[0]["rank"]:
                    raise InvalidRequest(f"{where}: target_tokens has rank {targets.ndim}, but loss "
                                         f"{program.name!r} takes logprobs of rank {program.inputs[0]['rank']}")
                inputs = {x["name"]: _program_input(d.loss_inputs, x, where) for x in program.inputs[1:]}
            prep.tokens.append(tokens)
            prep.targets.append(torch.as_tensor(targets, dtype=torch.long))
            prep.inputs.append(inputs)
        return prep

    def _support_targets(self, d: Datum, targets: np.ndarray, inputs: dict, where: str) -> np.ndarray:
        """``[N, 1 + K]`` gather targets of a ``stable_reinforce`` datum (its target, then the
        recorded support ids; padding repeats the target) and its support tensors in ``inputs``."""
        sup = d.support
        if sup is None:
            raise InvalidRequest(f"{where}: stable_reinforce needs the datum's provenance (the sampler's record)")
        n = targets.shape[0]
        ids = np.asarray(sup.ids)
        arrays = {"kind": sup.kind, "inv_temperature": sup.inv_temperature, "mass": sup.mass, "logprob": sup.logprob}
        if ids.ndim != 2 or ids.shape[0] != n or np.asarray(sup.q).shape != ids.shape or any(
                np.asarray(a).shape != (n,) for a in arrays.values()):
            raise InvalidRequest(f"{where}: the support record's shapes do not match the datum's {n} targets")
        if ids.size and (ids.min() < -1 or ids.max() >= self.config.vocab_size):
            raise InvalidRequest(f"{where}: support ids must be -1 (none) or in [0, {self.config.vocab_size})")
        inv_t = np.asarray(sup.inv_temperature)
        if not np.all(np.isfinite(inv_t) & (inv_t > 0)):
            raise InvalidRequest(f"{where}: support inverse temperatures must be finite and > 0")
        valid = ids >= 0
        inputs["kind"] = torch.as_tensor(np.asarray(sup.kind), dtype=torch.long)
        inputs["valid"] = torch.as_tensor(valid)
        inputs["q"] = torch.as_tensor(np.asarray(sup.q), dtype=torch.float32)
        inputs["sampler_logprob"] = torch.as_tensor(np.asarray(sup.logprob), dtype=torch.float32)
        inputs["sampler_mass"] = torch.as_tensor(np.asarray(sup.mass), dtype=torch.float32)
        return np.concatenate([targets[:, None], np.where(valid, ids, targets[:, None])], axis=1)

    def _datum_routes(self, d: Datum, n: int, where: str) -> torch.Tensor | None:
        """A datum's recorded experts as ``[n, L, k]`` over the model's MoE layers (``-1``: none)."""
        if d.routes is None:
            return None
        routers = self.model.moe_routers()
        layers = sorted(routers)
        routes = np.asarray(d.routes)
        if tuple(d.route_layers) != tuple(layers):
            raise InvalidRequest(f"{where}: routes of layers {list(d.route_layers)}; this model routes in {layers}")
        k = {r.top_k for r in routers.values()}
        experts = min(r.weight.shape[0] for r in routers.values())
        if routes.shape != (n, len(layers), *k) or len(k) != 1:
            raise InvalidRequest(f"{where}: routes shape {routes.shape} must be [{n}, {len(layers)}, top_k]")
        if routes.size and (routes.min() < -1 or routes.max() >= experts):
            raise InvalidRequest(f"{where}: routed expert ids must be -1 (none) or in [0, {experts})")
        return torch.as_tensor(routes.astype(np.int64))

    def forward_backward(
        self, requests: Sequence[ForwardBackwardInput]
    ) -> list[ForwardBackwardOutput | RequestError]:
        """Run every valid request in one packed pass; invalid ones fail alone with a message."""
        results: list[ForwardBackwardOutput | RequestError | None] = [None] * len(requests)
        prepared: list[_Prepared] = []
        for i, req in enumerate(requests):
            try:
                prepared.append(self._prepare(i, req))
            except InvalidRequest as e:
                results[i] = RequestError(str(e))
        groups: dict[int, list[_Prepared]] = {}  # the base model's requests in one pass, each full run's in its own
        for p in prepared:
            groups.setdefault(min(0, p.req.slot), []).append(p)
        for slot, group in sorted(groups.items(), reverse=True):
            for p, out in zip(group, self._run(group, self._weights(slot))):
                results[p.index] = out
        return results  # type: ignore[return-value]

    def _run(self, prepared: list[_Prepared], weights: Weights) -> list[ForwardBackwardOutput | RequestError]:
        sequences, keys, owners = [], [], []
        for p in prepared:
            for j, tokens in enumerate(p.tokens):
                sequences.append(tokens)
                keys.append((max(p.req.slot, 0), not p.req.forward_only))
                owners.append((p, j))
        k_max = max(t.shape[1] if t.dim() == 2 else 1 for p in prepared for t in p.targets)
        targets = [_as_2d(p.targets[j], k_max) for p, j in owners]
        inv_t = None
        if any(p.inv_t for p in prepared):  # stable_reinforce rows read the sampler's temperature
            inv_t = [p.inv_t[j] if p.inv_t else torch.ones(len(p.tokens[j])) for p, j in owners]
        routes = self._routes(prepared, owners)
        train = any(not p.req.forward_only for p in prepared)
        outputs: list[ForwardBackwardOutput | RequestError | None] = []
        results = []  # (output index, loss, metrics, logprobs), read back once the backward is queued
        total = None
        with nullcontext() if train else torch.no_grad():
            per_seq, flips = self._pass(sequences, keys, targets, inv_t, routes, weights)
            cursor = 0
            for p in prepared:
                lps = [_match(per_seq[cursor + j], t) for j, t in enumerate(p.targets)]
                try:
                    loss, metrics, lps = _request_loss(p, lps, self.device)
                except ProgramError as e:  # a custom loss that fails at run time fails its own request
                    outputs.append(RequestError(str(e)))
                    cursor += len(lps)
                    continue
                if flips is not None and p.routes and any(r is not None for r in p.routes):
                    metrics.update(_flip_metrics([flips[cursor + j] for j in range(len(lps))]))
                cursor += len(lps)
                if not p.req.forward_only and loss.requires_grad:
                    total = loss if total is None else total + loss
                results.append((len(outputs), loss.detach(), metrics, [x.detach() for x in lps]))
                outputs.append(None)
            if total is not None:
                total.backward()
        # a read between the forward and the backward would drain the GPU's queue, which would then
        # idle while the host launches the backward's first kernels; after it, one read for all
        values = []
        for _, loss, metrics, lps in results:
            values += [loss, *(v for v in metrics.values() if isinstance(v, torch.Tensor)), *lps]
        host = iter(_to_host(values))
        for i, loss, metrics, lps in results:
            loss = float(next(host))
            metrics = {k: float(next(host)) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}
            outputs[i] = ForwardBackwardOutput(logprobs=[next(host).astype(np.float32) for _ in lps],
                                               metrics=metrics | {"loss:sum": loss})
        return outputs

    def _pass(
        self,
        sequences: list[torch.Tensor],
        keys: list,
        targets: list[torch.Tensor],
        inv_t: list[torch.Tensor] | None,
        routes: tuple[list[torch.Tensor], list[torch.Tensor]] | None,
        weights: Weights | None = None,
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """One packed pass over ``sequences`` (grouped by ``keys``) on ``weights`` (default: the
        base model and its adapters): each sequence's target logprobs (``targets[i]`` ``[n, K]``,
        rows scaled by ``inv_t[i]``) and, when ``routes`` (per sequence: reference and replayed
        experts ``[n, L, k]``) are given, its route-flip counts (flipped, compared layers per token)."""
        weights = weights or self._weights(0)
        batch = pack(sequences, keys, self.device)
        inv = batch.gather(inv_t) if inv_t is not None else None
        routing = None
        if routes is not None:
            layers = sorted(self.model.moe_routers())
            reference, replay = (batch.gather(r) for r in routes)
            replays = bool((replay >= 0).any())  # on the host, before the copies
            reference, replay = to_device(reference, self.device), to_device(replay, self.device)
            routing = RoutingRecord(
                replay={layer: replay[:, i] for i, layer in enumerate(layers)} if replays else None,
                reference={layer: reference[:, i] for i, layer in enumerate(layers)},
                flips={},
            )
        lp = self._checkpointed_logprobs(batch, keys, to_device(batch.gather(targets), self.device), inv, routing,
                                         weights)
        return batch.split(lp), _flip_counts(batch, routing)

    def _checkpointed_logprobs(self, batch: PackedBatch, keys: list, targets, inv, routing,
                               weights: Weights | None = None) -> torch.Tensor:
        """:meth:`logprobs` of a pass with its layers checkpointed or not (:meth:`_checkpoint_pass`).
        On CUDA a training pass of at least :data:`MEASURE_MIN_TOKENS` that keeps some layers'
        activations measures what its forward kept against the estimate for its checkpointed
        layers (:func:`~ember.core.checkpointing.kept_bytes`): the largest such ratio scales later
        ``auto`` decisions, below 1 too (the estimate was fitted before fla and the fused
        hyper-connections, and is high for them). Under ``auto``, a forward that runs out of memory
        in one process is run again with checkpointing (nothing has reached the gradients yet), and
        the ratio rises so that a pass of its size checkpoints from the start; a sharded engine's
        ranks cannot retry alone, so there it fails."""
        weights = weights or self._weights(0)
        tokens = batch.num_tokens
        on = self._checkpoint_pass(tokens, keys, weights)
        measure = (self.device.type == "cuda" and on is not True and torch.is_grad_enabled()
                   and tokens >= MEASURE_MIN_TOKENS)
        before = torch.cuda.memory_allocated(self.device) if measure else 0
        try:
            with _checkpointing(weights, on):
                lp = self.logprobs(batch, targets, inv, routing, weights)
        except torch.cuda.OutOfMemoryError:
            if on is True or self.activation_checkpointing != "auto" or getattr(self, "parallel", None) is not None:
                raise
            lp = None  # retried below, once the exception (and the tensors its frames hold) is gone
        if lp is None:
            estimate = max(kept_bytes(self.model, tokens, rebuilt=self._rebuild), 1)
            self._kept_scale = max(self._kept_scale or 1.0, available_bytes(self.device) / estimate)
            self._rebuild = True
            log.warning("activation checkpointing on: the pass ran out of memory without it; running it again",
                        extra={"tokens": tokens})
            self._auto_on = True
            with _checkpointing(weights, True):
                return self.logprobs(batch, targets, inv, routing, weights)
        if measure:
            estimate = kept_bytes(self.model, tokens, on or (), tp=self._tp(), rebuilt=self._rebuild)
            if estimate > 0:
                ratio = (torch.cuda.memory_allocated(self.device) - before) / estimate
                self._kept_scale = ratio if self._kept_scale is None else max(self._kept_scale, ratio)
        return lp

    def _tp(self) -> int:
        """This engine's tensor-parallel degree (1 in one process)."""
        parallel = getattr(self, "parallel", None)
        return parallel.layout.tp if parallel is not None else 1

    def _checkpoint_pass(self, tokens: int, keys: list, weights: Weights | None = None) -> bool | frozenset[int]:
        """Which layers this pass (``tokens`` tokens of ``keys``' (slot, trains) sequences, on
        ``weights``, default the base model's) checkpoints (the module doc's rule): ``False``
        (none), ``True`` (all) or the indices of some. Sets :attr:`_rebuild` for the pass: False
        only where ``auto`` on CUDA finds that the pass fits without rebuilding."""
        weights = weights or self._weights(0)
        mode = self.activation_checkpointing
        self._rebuild = True
        if mode == "off" or not torch.is_grad_enabled():
            return False
        if mode == "on":
            return True
        if self.device.type != "cuda":
            return False
        parallel = getattr(self, "parallel", None)
        tp = self._tp()
        scale = 1.0 if self._kept_scale is None else self._kept_scale
        if parallel is not None and parallel.world > 1:
            scale = max(scale, 1.0)  # ranks cannot retry a pass that runs out of memory: never below the estimate
        fixed = HEAD_BYTES
        trained = [self.bank.get(s).flat for s in {s for s, trains in keys if s and trains}]
        if weights.model is not self.model and any(trains for _, trains in keys):  # a full fine-tuning run
            trained = [p for p in weights.model.parameters() if p.requires_grad]
        for p in trained:  # gradients the backward allocates
            if p.grad is None:
                fixed += p.numel() * p.element_size()
        available = available_bytes(self.device)
        # a pass that fits keeps its norm and activation outputs (rebuilding them costs ~3 % of a
        # Qwen3-8B step on an H100); one that does not rebuilds them first, then checkpoints layers
        if int(kept_bytes(self.model, tokens, tp=tp, rebuilt=False) * scale) + fixed <= AUTO_FRACTION * available:
            self._rebuild = False
        need = int(kept_bytes(self.model, tokens, tp=tp) * scale) + fixed
        layers = layers_to_checkpoint(self.model, need - int(AUTO_FRACTION * available), tokens, tp=tp, scale=scale)
        if parallel is not None and parallel.world > 1:  # every rank must checkpoint the same layers
            layers = agreed_layers(self.model, layers, self.device)
        n = len(layers)
        on: bool | frozenset[int] = bool(n) if n in (0, len(self.model.model.layers)) else frozenset(layers)
        if n and not self._auto_on:
            log.info("activation checkpointing on: the pass would not fit",
                     extra={"tokens": tokens, "estimate_gib": round(need / 2**30, 1),
                            "available_gib": round(available / 2**30, 1), "layers": n})
        self._auto_on = bool(n)
        return on

    def _routes(self, prepared: list[_Prepared], owners) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The pass's R3 routing per sequence: the datums' recorded experts (compared with the live
        router everywhere: route flips), and the experts to replay where the request asks
        (``routing_replay``); ``-1`` rows route live."""
        if not any(r is not None for p in prepared for r in p.routes):
            return None
        layers = sorted(self.model.moe_routers())
        k = next(r.shape[2] for p in prepared for r in p.routes if r is not None)

        def rows(p, j, replay):
            r = p.routes[j] if p.routes else None
            if r is None or (replay and not p.config.get("routing_replay", 1.0)):
                return torch.full((len(p.tokens[j]), len(layers), k), -1, dtype=torch.long)
            return r

        return [rows(p, j, False) for p, j in owners], [rows(p, j, True) for p, j in owners]

    def _route(self, batch: PackedBatch, bank: AdapterBank):
        """The LoRA route of a training pass's batch."""
        return bank.route(batch.groups)

    def logprobs(
        self,
        batch: PackedBatch,
        targets: torch.Tensor,
        inv_temperature: torch.Tensor | None = None,
        routing: RoutingRecord | None = None,
        weights: Weights | None = None,
    ) -> torch.Tensor:
        """Target log-probabilities ``[T, K]`` of a packed batch (grad-tracking if enabled), with
        each row's logits scaled by ``inv_temperature`` (``[T]``) and MoE ``routing`` (R3), on
        ``weights`` (default: the base model and its adapters)."""
        weights = weights or self._weights(0)
        model = weights.model
        attention = PackedAttention(batch.doc_lengths, self.device)
        ctx = ForwardContext(
            positions=batch.positions,
            attend=lambda layer, q, k, v, spec, scale: attention(q, k, v, spec, scale),
            lora=self._route(batch, weights.bank),
            seq_lens=batch.doc_lengths,
            routing=routing,
        )
        with rebuilding(self._rebuild):  # norm and activation outputs saved as recipes (ember.core.rebuild)
            hidden = model.hidden_states(batch.input_ids, ctx)
            return token_logprobs(
                hidden,
                model.unembed_weight,
                targets,
                lora=ctx.lora,
                softcap=model.final_logit_softcap,
                chunk=self.logprob_chunk,
                inv_temperature=inv_temperature,
                vocab=model.vocab_split,
            )

    # -- optimizer ------------------------------------------------------------------------------

    def optim_step(self, slot: int, params: AdamParams) -> dict[str, float]:
        """One AdamW step on ``slot``'s adapter with the gradients accumulated since its last step."""
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if slot < 0:
            if self._full_sampler is not None and self._full_sampler[0][:2] == ("run", slot):
                self._full_sampler = None  # its prefix pages hold the weights this step replaces
            return self.full.step(slot, params)
        return self.bank.get(slot).optimizer.step(params)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_adapter(
        self, slot: int, path: str | Path, with_optimizer: bool, metadata: dict | None = None, overwrite: bool = False
    ) -> Path:
        """Save ``slot``'s adapter (and optionally its Adam state) to a checkpoint folder; a full
        fine-tuning run's weights as sharded safetensors (:mod:`ember.core.full_checkpoint`)."""
        meta = {"base_model": {"model_type": self.config.model_type, "vocab_size": self.config.vocab_size}}
        meta.update(metadata or {})
        if slot < 0:
            return self.full.save(slot, Path(path), with_optimizer, meta, overwrite)
        return save_adapter(self.bank.get(slot), path, with_optimizer, meta, overwrite)

    def load_adapter(self, path: str | Path, with_optimizer: bool) -> int:
        """Create an adapter (or, from a full checkpoint, a full fine-tuning run) from a checkpoint
        folder; returns its slot."""
        if checkpoint_format(path) == FULL_FORMAT:
            if not self.full_finetune:
                raise ValueError(f"{path} is a full fine-tuning checkpoint, and this model is not served with "
                                 "--full-finetune")
            return self.full.load(Path(path), with_optimizer)
        return load_adapter(self.bank, path, with_optimizer).slot

    def load_sampler(self, path: str | Path, persistent: bool = True) -> int:
        """A sampler's slot for the weights of a checkpoint folder (an adapter; or full weights,
        which read the run that wrote them while it has not changed: ``ember.engine.full_runs``;
        ``persistent``: the folder stays where it is, else a full checkpoint is copied)."""
        if checkpoint_format(path) == FULL_FORMAT:
            return self.full.load_sampler(Path(path), persistent)
        return self.load_adapter(path, with_optimizer=False)

    def checkpoint_kind_matches(self, slot: int, path: str | Path) -> bool:
        """Whether the checkpoint at ``path`` is of ``slot``'s kind (LoRA adapter or full weights)."""
        return (checkpoint_format(path) == FULL_FORMAT) == (slot < 0)

    def export_peft(self, slot: int, path: str | Path, base_model: str, layout: str = "peft") -> Path:
        """Export ``slot``'s adapter as a PEFT folder (``layout``: ``peft`` or ``tinker``); a full
        fine-tuning run as a whole Hugging Face model folder, completed from the base model's."""
        if slot < 0:
            if self.model_dir is None:
                raise ValueError("this engine has no base model folder to complete a full-model export from")
            run = self.full.get(slot)
            return export_hf(run.model, run.names, self.model_dir, Path(path))
        return export_peft(self.bank.get(slot), path, base_model, layout)

    def import_peft(self, path: str | Path) -> int:
        """Create an adapter from a PEFT folder; returns its slot."""
        return import_peft(self.bank, path).slot


def agreed_layers(model, layers: list[int], device: torch.device) -> list[int]:
    """The layers every rank of a sharded engine checkpoints, from each rank's own choice
    (``layers``, a prefix of :func:`~ember.core.checkpointing.checkpoint_order`, sorted): the most
    any rank needs, in that order (a collective over the default group)."""
    count = torch.tensor([len(layers)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    n = int(count.item())
    return layers if n == len(layers) else sorted(checkpoint_order(model)[:n])


def _checkpointing(weights: Weights, on: bool):
    return weights.checkpointing.on(on) if weights.checkpointing is not None else nullcontext()


def _as_2d(t: torch.Tensor, k: int) -> torch.Tensor:
    t = t if t.dim() == 2 else t[:, None]
    if t.shape[1] < k:
        t = torch.cat([t, t[:, :1].expand(-1, k - t.shape[1])], dim=1)
    return t


def _match(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cut the packed ``[N, K_max]`` logprobs back to the datum's target shape."""
    if targets.dim() == 1:
        return lp[:, 0]
    return lp[:, : targets.shape[1]]


def _to_host(tensors: list[torch.Tensor], device: torch.device | None = None) -> list[np.ndarray]:
    """``tensors`` as float64 arrays of their shapes, those on ``device`` (default: the first
    accelerator's) through one copy: read one by one, each would wait for the GPU and copy on its
    own (eight datums' logprobs, their losses and metrics: a dozen waits at the end of a training
    step). float64 holds fp32 and fp64 values exactly."""
    device = device or next((t.device for t in tensors if t.device.type != "cpu"), None)
    on_device = [t for t in tensors if t.device == device]
    flat = iter([])
    if on_device:
        host = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in on_device]).cpu().numpy()
        flat = iter(np.split(host, np.cumsum([t.numel() for t in on_device])[:-1]))
    return [next(flat).reshape(t.shape) if t.device == device else t.detach().to(torch.float64).numpy()
            for t in tensors]


def _request_loss(
    p: _Prepared, lps: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor], list[torch.Tensor]]:
    """The request's summed loss, its extra metrics (numbers or device scalars, read back after the
    backward) and the logprobs it returns. Built-in losses:
    over the concatenated datums when all are 1-D, else per datum (sums over tokens add up either
    way). A custom loss runs per datum; its ``:sum`` metrics add up over the datums and ``:mean``
    ones are averaged. ``stable_reinforce`` returns its replayed logprobs ``log p_S(y)``."""
    if p.req.loss_fn == "stable_reinforce":
        return _stable_reinforce_loss(p, lps, device)
    if p.program is not None:
        losses, sums = [], {}
        for lp, inp in zip(lps, p.inputs):
            loss, metrics = p.program(lp, [to_device(inp[name], device) for name in p.program.input_names])
            losses.append(loss.float())
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        n = len(lps)
        return torch.stack(losses).sum(), {k: v / n if k.endswith(":mean") else v for k, v in sums.items()}, lps
    if all(x.dim() == 1 for x in lps):
        inputs = {k: to_device(torch.cat([inp[k] for inp in p.inputs]), device) for k in p.inputs[0]}
        return loss_sum(p.req.loss_fn, torch.cat(lps), inputs, p.config), {}, lps
    parts = [
        loss_sum(p.req.loss_fn, x, {k: to_device(v, device) for k, v in inp.items()}, p.config)
        for x, inp in zip(lps, p.inputs)
    ]
    return torch.stack(parts).sum(), {}, lps


def _stable_reinforce_loss(p: _Prepared, lps: list[torch.Tensor], device: torch.device):
    """``stable_reinforce`` over the request's datums at once (:mod:`ember.core.stable_reinforce`;
    supports padded to the widest), with the stability metrics averaged over the positions that
    have a record."""
    width = max(lp.shape[1] for lp in lps)

    def cat(key: str, fill=0) -> torch.Tensor:
        parts = [inp[key] for inp in p.inputs]
        if parts[0].dim() == 2:
            parts = [torch.nn.functional.pad(x, (0, width - 1 - x.shape[1]), value=fill) for x in parts]
        return to_device(torch.cat(parts), device)

    lp = torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in lps])
    loss, logprobs, sums = stable_reinforce(
        lp, cat("kind"), cat("valid", False), cat("q"), cat("advantages"), cat("sampler_logprob"),
        cat("sampler_mass"), tis_cap=p.config["tis_cap"], kl_coeff=p.config["kl_coeff"],
    )
    sums = {k: v.detach() for k, v in sums.items()}  # device scalars: read back after the backward (Worker._run)
    n = torch.clamp(sums["tokens"], min=1.0)
    metrics = {f"stability/{key}:mean": sums[key] / n for key in ("gap", "sampler_mass", "trainer_mass")}
    metrics["stability/tokens:sum"] = sums["tokens"]
    return loss, metrics, list(logprobs.split([x.shape[0] for x in lps]))


def _flip_counts(batch: PackedBatch, routing: RoutingRecord | None) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Per sequence: (flipped layers, compared layers) of each token, from a pass's route flips."""
    if routing is None or not routing.flips:
        return None
    layers = sorted(routing.flips)
    flipped = torch.stack([routing.flips[i] for i in layers], dim=1).long()
    compared = torch.stack([routing.reference[i][:, 0] >= 0 for i in layers], dim=1).long()
    return list(zip(batch.split(flipped.sum(1)), batch.split(compared.sum(1))))


def _flip_metrics(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """``stability/route_flips:mean`` (of the (token, MoE layer) pairs with a record, the fraction
    whose live routing differs from the recorded one) and ``stability/route_flip_tokens:mean``
    (the fraction of recorded tokens with a differing layer)."""
    flipped = torch.cat([f for f, _ in parts])
    compared = torch.cat([c for _, c in parts])
    tokens = compared > 0
    if not tokens.any():
        return {}
    return {
        "stability/route_flips:mean": float(flipped.sum() / compared.sum()),
        "stability/route_flip_tokens:mean": float((flipped[tokens] > 0).float().mean()),
    }


def _program_input(loss_inputs: dict, spec: dict, where: str) -> torch.Tensor:
    """A custom loss's input ``spec["name"]`` of one datum, at its declared rank (a rank-0 input
    arrives as one value)."""
    name, rank = spec["name"], spec["rank"]
    if name not in loss_inputs:
        raise InvalidRequest(f"{where}: the custom loss takes loss_fn_inputs[{name!r}], which the datum lacks")
    arr = np.asarray(loss_inputs[name])
    if rank == 0 and arr.size == 1:
        arr = arr.reshape(())
    if arr.ndim != rank:
        raise InvalidRequest(f"{where}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}; the loss declared rank {rank}")
    if arr.dtype.kind in "iub":
        return torch.as_tensor(arr.astype(np.int64))
    if arr.dtype.kind != "f" or not np.all(np.isfinite(arr)):
        raise InvalidRequest(f"{where}: loss_fn_inputs[{name!r}] must hold finite numbers")
    return torch.as_tensor(arr, dtype=torch.float32)
