"""The engine process: one per base model, the owner of its device.

It polls the store for queued requests of its base model, asks the scheduler
(:mod:`ember.engine.scheduler`) what to run, executes that on its :class:`~ember.engine.worker.Worker`
(forward_backward requests of different models in ONE packed pass) and writes the results back.
It reads and writes Ember's internal encodings (:mod:`ember.store.payload`), never Tinker's wire
formats. Run it with ``python -m ember.engine.service --help`` (``ember serve`` starts it for you).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from sqlalchemy.exc import InterfaceError, OperationalError

from ember.core.adapters import AdapterBankFull, LoraConfig
from ember.core.optim import AdamParams
from ember.doorbell import RESULT_KEY_SETTING, Doorbell, ring_results
from ember.engine import scheduler
from ember.engine.full_runs import NoRoom
from ember.engine.stability import StabilityRecord, StabilityStore, resolve_datum
from ember.engine.warmup import wants_warm_up, warm_up
from ember.engine.worker import Worker
from ember.engine_flags import CHECKPOINTING_MODES, WARMUP_MODES, engine_flag_errors, flag_values
from ember.jsonlog import setup_logging
from ember.storage import Storage
from ember.store import Store
from ember.store.payload import decode, encode
from ember.store.repo import PendingFuture, utcnow
from ember.types import (
    Datum,
    ForwardBackwardInput,
    InvalidRequest,
    RequestError,
    SampleInput,
    SampleOutput,
    SamplingParams,
)

log = logging.getLogger("ember.engine")
STAGE_PREFIX = ".stage-"  # + pid: a checkpoint folder being written
DB_RETRY_S = 300.0  # how long the engine waits for an unreachable database before it gives up

Outcome = tuple[str, bytes | None, str | None, str | None]  # (future id, result, error, category)



def memory_in_use(device: torch.device) -> int:
    """Bytes the engine holds: allocated accelerator memory, or resident memory on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def finite_metrics(metrics: dict) -> dict[str, float]:
    """A result's scalar metrics that a JSON column can hold (``run_metrics``)."""
    out = {}
    for k, v in (metrics or {}).items():
        try:
            v = float(v)
        except (TypeError, ValueError):
            continue
        if np.isfinite(v):
            out[str(k)] = v
    return out

class UserError(Exception):
    """A request that failed because of what the client asked for (category ``user``)."""


class EngineService:
    """Runs the queued requests of one base model on one worker."""

    def __init__(
        self,
        store: Store,
        storage: Storage,
        base_model: str,
        worker: Worker,
        *,
        token_budget: int = 16384,
        sample_budget: int = 8192,
        gap_timeout_s: float = 300.0,
        max_idle_poll_s: float = 0.02,
        model_path: str | Path | None = None,
        doorbell: Doorbell | None = None,
        stability: StabilityStore | None = None,
    ):
        self.store = store
        self.storage = storage
        self.base_model = base_model
        self.worker = worker
        self.token_budget = token_budget
        self.sample_budget = sample_budget
        self.gap_timeout_s = gap_timeout_s
        self.max_idle_poll_s = max_idle_poll_s
        self.slots: dict[str, int] = {}  # model id -> adapter slot
        self.sampler_slots: dict[str, int] = {}  # sampler id -> adapter slot (0: the base model)
        # Samplers whose adapter was moved out of the bank to make room (see _allocate):
        # sampler id -> a folder with its weights (snapshots) or None (reloaded from its checkpoint).
        self.parked: dict[str, Path | None] = {}
        self._sampler_used: dict[str, float] = {}  # sampler id -> last use, for least-recently-used parking
        self._snapshots: set[str] = set()  # samplers over in-memory snapshots (parking must save them)
        self._park_dir: tempfile.TemporaryDirectory | None = None  # removed when the engine exits
        self.model_path = model_path
        self.doorbell = doorbell
        self.stability = stability if stability is not None else StabilityStore()
        self._last_expiry = time.monotonic()
        self._detokenize = None
        self._last_beat = 0.0
        self._listeners: tuple[float, list[int]] = (-1e9, [])  # (read at, ports) of result listeners
        # HMAC key of the result datagrams (ember.doorbell.result_datagrams), shared through the store
        self._result_key = bytes.fromhex(store.setting(RESULT_KEY_SETTING, lambda: secrets.token_hex(32)))

    # -- main loop --------------------------------------------------------------------------------

    def remove_stale_staging(self) -> int:
        """Delete the staging folders of engines that died mid-write (their pid is gone): what a
        ``kill -9`` during a checkpoint save leaves beside the checkpoints. Never a checkpoint: a
        staged folder only becomes one by its final rename."""
        if not self.storage.is_local:
            return 0
        removed = 0
        for stage in Path(self.storage.root).expanduser().glob(f"**/{STAGE_PREFIX}*"):
            pid = stage.name[len(STAGE_PREFIX):].split("-", 1)[0]
            if stage.is_dir() and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(stage, ignore_errors=True)
                removed += 1
        if removed:
            log.info("removed stale checkpoint staging folders", extra={"count": removed})
        return removed

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Poll and execute until ``should_stop()``. Without a doorbell, idle polling backs off
        from 1 ms to ``max_idle_poll_s``; with one, the API rings it after every submit, so an
        idle engine polls only every ``max_idle_poll_s`` (for submits nobody rang about) and spends
        no CPU on empty reads meanwhile (on a small machine, CPU the API process needs)."""
        self.remove_stale_staging()
        self.store.engine_ready(self.base_model)
        log.info("engine ready", extra={"base_model": self.base_model, "pid": os.getpid()})
        idle = self.max_idle_poll_s if self.doorbell is not None else 0.001
        while not should_stop():
            if self.step():
                if self.doorbell is None:
                    idle = 0.001
                continue
            now = time.monotonic()
            if now - self._last_expiry > 10.0:
                self.stability.expire()
                self._last_expiry = now
            if now - self._last_beat > 2.0:
                self._durable(self.store.engine_progress, self.base_model, 0, 0, 0.0, *self._memory())
                self._last_beat = now
            if self.doorbell is not None:
                self.doorbell.wait(idle)
            else:
                time.sleep(idle)
                idle = min(self.max_idle_poll_s, idle * 1.5)

    def step(self) -> bool:
        """Plan and run one batch of work; returns whether there was any. Reading the queue,
        planning and claiming what the plan runs is one store transaction (``Store.take``)."""

        def choose(pending, cursors):
            work = scheduler.plan(
                pending, cursors, utcnow(), self.token_budget, self.sample_budget, self.gap_timeout_s
            )
            return work, [f.id for f in work.ops + work.passes + work.samples]

        work, payloads = self._durable(self.store.take, self.base_model, choose)
        if not work:
            return False
        if work.dead or work.skip:
            for mid, seq in work.skip.items():
                log.warning("seq_id gap skipped", extra={"model_id": mid, "next_seq": seq})
            self._finish(
                [(f.id, None, why, "user") for f, why in work.dead],
                advance={**{f.model_id: f.seq_id + 1 for f, _ in work.dead if f.seq_id is not None}, **work.skip},
            )
        todo = work.ops + work.passes + work.samples
        if not todo:
            return bool(work.dead or work.skip)
        # Creations first, so models created in this tick exist for the rest of it.
        for f in sorted(work.ops, key=lambda f: f.op not in ("create_model", "load_model")):
            self._run_op(f, payloads.get(f.id))
        if work.passes:
            self._run_pass(work.passes, payloads)
        if work.samples:
            self._run_samples(work.samples, payloads)
        return True

    def _finish(self, outcomes: list[Outcome], **kwargs) -> list[tuple[PendingFuture, bytes | None]]:
        """``Store.finish`` (returning what it claimed with ``claim_next``), then a datagram to
        every API process on this host that registered a result doorbell (``result_listeners``)
        with the committed outcomes (``ember.doorbell.ring_results``), so its long-polls answer at
        once without reading them back. The store is the record; a lost datagram only means the
        API finds the result at its next poll."""
        claimed = self._durable(self.store.finish, outcomes, **kwargs)
        if outcomes:
            for port in self._listener_ports():
                ring_results(port, self._result_key, outcomes)
        return claimed

    def _durable(self, call: Callable, *args, **kwargs):
        """``call`` retried while the database is unreachable (a restart, a network blip), for up to
        ``DB_RETRY_S``: the engine keeps its models and, for ``finish``, the outcomes it holds in
        memory, instead of dying and losing both. A transaction that failed is rolled back, so a
        retry runs it once."""
        deadline = time.monotonic() + DB_RETRY_S
        delay = 0.1
        while True:
            try:
                return call(*args, **kwargs)
            except (OperationalError, InterfaceError) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("database unavailable; retrying", extra={"call": getattr(call, "__name__", "?"),
                                                                     "error": str(e).splitlines()[0][:200]})
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _memory(self) -> tuple[int, dict | None]:
        """For the heartbeat: the bytes the engine holds, and its ranks' record (``engine_ranks``)
        when it should be rewritten, else None. An engine on Ray actors reports what its actors
        hold, each its own figure (``RayFanOut.memory_report``); any other, this process."""
        report = getattr(self.worker, "memory_report", None)
        if report is not None:
            return report()
        return memory_in_use(self.worker.device), None

    def _listener_ports(self) -> list[int]:
        now = time.monotonic()
        if now - self._listeners[0] > 2.0:
            try:
                self._listeners = (now, self.store.result_listeners(socket.gethostname()))
            except Exception:  # noqa: BLE001 - notifications are an optimisation
                self._listeners = (now, [])
        return self._listeners[1]

    # -- forward_backward ---------------------------------------------------------------------------

    def _run_pass(self, futures: list[PendingFuture], payloads: dict[str, bytes | None]) -> None:
        requests: list[ForwardBackwardInput | str | None] = []  # str: the request failed before the pass
        outcomes: list[Outcome] = []
        metrics: list[tuple[str, int, str, dict[str, float]]] = []
        for f in futures:
            slot = self.slots.get(f.model_id)  # type: ignore[arg-type]
            if slot is None:
                requests.append(None)
                continue
            p = decode(payloads[f.id])  # type: ignore[arg-type]
            try:
                datums = self._datums(p)
            except InvalidRequest as e:  # a span that names no record fails its own request
                requests.append(str(e))
                continue
            requests.append(ForwardBackwardInput(slot, datums, p["loss_fn"], p["loss_config"], p["forward_only"],
                                                 p.get("custom_loss")))
        ready = [r for r in requests if isinstance(r, ForwardBackwardInput)]
        # from the newest request's submission (the API's clock, same host or synchronised) to now
        queued_ms = (utcnow() - max(f.created_at for f in futures)).total_seconds() * 1e3
        t0 = time.perf_counter()
        try:
            results = iter(self.worker.forward_backward(ready)) if ready else iter(())
            error = None
        except Exception as e:
            log.exception("forward_backward pass failed")
            results, error = iter(()), f"the forward/backward pass failed: {type(e).__name__}: {e}"
        seconds = time.perf_counter() - t0
        for f, req in zip(futures, requests):
            if req is None:
                outcomes.append((f.id, None, f"model {f.model_id} is not loaded in this engine", "server"))
            elif isinstance(req, str):
                outcomes.append((f.id, None, req, "user"))
            elif error is not None:
                outcomes.append((f.id, None, error, "server"))
            else:
                out = next(results)
                if isinstance(out, RequestError):
                    outcomes.append((f.id, None, out.message, out.category))
                else:
                    result = {"logprobs": [np.asarray(x, np.float32) for x in out.logprobs], "metrics": out.metrics}
                    outcomes.append((f.id, encode(result), None, None))
                    op = "forward" if req.forward_only else "forward_backward"
                    metrics.append((f.model_id, f.seq_id, op, finite_metrics(out.metrics)))  # type: ignore[arg-type]
        advance: dict[str, int] = {}
        for f in futures:
            advance[f.model_id] = max(advance.get(f.model_id, 0), f.seq_id + 1)  # type: ignore[index, operator]
        tokens = sum(f.n_tokens for f in futures)
        # The finish also claims each model's next request when it is an op (the optim_step the
        # SDK sends right after a forward_backward, usually queued while the pass ran): it runs
        # now, not after another tick's reads and claim.
        follow = self._finish(outcomes, advance=advance, claim_next=True, metrics=metrics,
                              progress=(self.base_model, 1, tokens, seconds, *self._memory()))
        self._last_beat = time.monotonic()
        log.info(
            "packed pass",
            extra={"requests": len(futures), "models": len({f.model_id for f in futures}), "tokens": tokens,
                   "losses": sorted({r.loss_fn for r in ready}), "seconds": round(seconds, 4),
                   "queued_ms": round(queued_ms, 3)},
        )
        for f, payload in follow:
            self._run_op(f, payload)

    def _datums(self, p: dict) -> list[Datum]:
        """A request's datums; those of ``stable_reinforce`` resolved against the stability records
        their provenance spans name (``InvalidRequest`` naming the datum and span otherwise)."""
        datums = [Datum(np.asarray(d["tokens"]), dict(d["loss_inputs"])) for d in p["datums"]]
        if p["loss_fn"] != "stable_reinforce":
            return datums
        return [
            resolve_datum(self.stability, p["session_id"], datum, d["input_spans"], d["target_spans"], f"data[{i}]")
            for i, (datum, d) in enumerate(zip(datums, p["datums"]))
        ]

    # -- sampling -----------------------------------------------------------------------------------

    def _sampler_slot(self, sampler_id: str, p: dict, keep: frozenset[str] = frozenset()) -> int:
        """The slot a sampler reads: 0 for the base model, else its adapter, loaded from its
        checkpoint on first use (or back from where it was parked); ``keep``: samplers of the
        batch being assembled, which must not be parked to make room."""
        self._sampler_used[sampler_id] = time.monotonic()
        slot = self.sampler_slots.get(sampler_id)
        if slot is not None:
            return slot
        uri = p.get("weights_uri")
        folder = self.parked.pop(sampler_id, None)
        if folder is not None:  # a parked snapshot comes back from its folder
            slot = self._allocate(lambda: self.worker.load_adapter(folder, with_optimizer=False), keep)
            shutil.rmtree(folder, ignore_errors=True)
            self.sampler_slots[sampler_id] = slot
            return slot
        if p.get("kind") == "snapshot":
            raise UserError(f"sampler {sampler_id}'s weight snapshot is gone (the engine restarted); "
                            "call save_weights_and_get_sampling_client again")
        if uri is None:
            slot = 0
        else:
            persistent = self.storage.local_path(uri) is not None
            with self._local_copy(uri) as path:
                try:
                    slot = self._allocate(lambda: self.worker.load_sampler(path, persistent), keep)
                except (ValueError, FileNotFoundError) as e:
                    raise UserError(f"cannot load the sampler's weights {p.get('model_path')}: {e}") from None
        self.sampler_slots[sampler_id] = slot
        return slot

    def _allocate(self, fill: Callable[[], int], keep: frozenset[str] = frozenset()) -> int:
        """Run ``fill`` (which takes a free adapter slot); while the bank is full, park the least
        recently used sampler adapter outside ``keep`` and try again.

        Every ``save_weights_and_get_sampling_client`` makes a snapshot sampler, and the SDK has no
        call that releases one before its session ends, so an RL loop (one snapshot per step) would
        otherwise fill the bank after ``--max-adapters`` steps. Parking keeps every sampler valid:
        a snapshot's weights go to a local folder and come back on its next request; a sampler
        loaded from a checkpoint is simply reloaded from it. Training adapters are never parked."""
        while True:
            try:
                return fill()
            except NoRoom:  # memory for full weights: parking adapters would not make any
                raise
            except AdapterBankFull:
                idle = [sid for sid, slot in self.sampler_slots.items() if slot and sid not in keep]
                if not idle:
                    raise
                self._park(min(idle, key=lambda sid: self._sampler_used.get(sid, 0.0)))

    def _park(self, sampler_id: str) -> None:
        slot = self.sampler_slots.pop(sampler_id)
        folder = None
        if sampler_id in self._snapshots:
            if self._park_dir is None:
                self._park_dir = tempfile.TemporaryDirectory(prefix="ember-parked-samplers-")
            folder = Path(self._park_dir.name) / sampler_id.replace("/", "_")
            self.worker.save_adapter(slot, folder, with_optimizer=False, overwrite=True)
        self.worker.free_adapter(slot)
        self.parked[sampler_id] = folder
        log.info("sampler parked", extra={"sampler_id": sampler_id, "slot": slot})

    def detokenize(self, ids) -> str:
        """The model's tokenizer decode (for stop strings), loaded on first use."""
        if self._detokenize is None:
            if self.model_path is None:
                raise UserError("stop strings need the model's tokenizer, which this engine does not have")
            self._detokenize = tokenizer_decode(str(self.model_path))
        return self._detokenize(ids)

    def _run_samples(self, futures: list[PendingFuture], payloads: dict[str, bytes | None]) -> None:
        inputs: list[tuple[PendingFuture, SampleInput]] = []
        sessions: dict[str, str] = {}  # future id -> session of a request that records stability info
        outcomes: list[Outcome] = []
        for f in futures:
            p = decode(payloads[f.id])  # type: ignore[arg-type]
            try:
                in_batch = frozenset(g.sampler_id for g, _ in inputs)  # type: ignore[misc]
                slot = self._sampler_slot(f.sampler_id, p, in_batch)  # type: ignore[arg-type]
            except (UserError, AdapterBankFull) as e:
                outcomes.append((f.id, None, str(e), "user"))
                continue
            params = SamplingParams(**p["params"])
            inputs.append((f, SampleInput(
                slot=slot, prompt=np.asarray(p["prompt"], np.int64), params=params, num_samples=p["num_samples"],
                prompt_logprobs=p["prompt_logprobs"], prompt_logprobs_last_n=p["prompt_logprobs_last_n"],
                topk_prompt_logprobs=p["topk_prompt_logprobs"], topk_sample_logprobs=p["topk_sample_logprobs"],
                target_prompt_logprobs=p.get("target_prompt_logprobs"),
                prompt_alt_tokens_k=p.get("prompt_alt_tokens_k", 0),
                record_stability=bool(p.get("record_stability")),
            )))
            if p.get("record_stability"):
                sessions[f.id] = p["session_id"]
        t0 = time.perf_counter()
        if inputs:
            try:
                results = self.worker.sample([i for _, i in inputs], detokenize=self.detokenize)
            except Exception as e:
                log.exception("sampling batch failed")
                results = [RequestError(f"sampling failed: {type(e).__name__}: {e}", "server")] * len(inputs)
            for (f, inp), out in zip(inputs, results):
                if isinstance(out, RequestError):
                    outcomes.append((f.id, None, out.message, out.category))
                    continue
                if inp.record_stability:
                    self._keep_records(f, sessions[f.id], inp, out)
                outcomes.append((f.id, encode(_sample_result(out)), None, None))
        self._finish(outcomes)
        log.info("sampled", extra={"requests": len(futures), "seconds": round(time.perf_counter() - t0, 4)})

    def _keep_records(self, f: PendingFuture, session_id: str, inp: SampleInput, out: SampleOutput) -> None:
        """The stability record of every sequence of a finished request, under the
        ``sequence_id`` the API gave it (``{request id}:{index}``)."""
        for i, seq in enumerate(out.sequences):
            record = StabilityRecord.of_sample(session_id, f.sampler_id, inp, seq, out.routing_layers)  # type: ignore[arg-type]
            self.stability.put(f"{f.id}:{i}", record)

    # -- other operations ---------------------------------------------------------------------------

    def _finish_one(
        self,
        f: PendingFuture,
        result: dict | None,
        error: str | None,
        category: str | None,
        model_status: tuple[str, str | None] | None = None,
        checkpoint: tuple[str, tuple[str, int | None]] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        self._finish(
            [(f.id, encode(result) if error is None else None, error, category)],
            advance={f.model_id: f.seq_id + 1} if f.model_id and f.seq_id is not None else None,
            model_status={f.model_id: model_status} if model_status and f.model_id else None,
            checkpoints=dict([checkpoint]) if checkpoint else None,
            metrics=[(f.model_id, f.seq_id, f.op, metrics)] if metrics is not None else (),  # type: ignore[list-item]
        )

    def _run_op(self, f: PendingFuture, payload: bytes | None) -> None:
        p = decode(payload) if payload else {}
        handler = getattr(self, f"_op_{f.op}", None)
        ckpt_path = p.get("tinker_path")
        t0 = time.perf_counter()
        try:
            if handler is None:
                raise UserError(f"unknown operation {f.op!r}")
            result, status = handler(f, p)
        except (UserError, InvalidRequest, AdapterBankFull) as e:
            self._op_failed(f, str(e), "user", ckpt_path)
            return
        except Exception as e:
            log.exception("operation failed", extra={"op": f.op, "request_id": f.id})
            self._op_failed(f, f"{f.op} failed: {type(e).__name__}: {e}", "server", ckpt_path)
            return
        size = result.get("size_bytes") if isinstance(result, dict) else None
        metrics = None
        if f.op == "optim_step":  # a point of the run's curves: the step, its learning rate and metrics
            metrics = {**finite_metrics(result.get("metrics")), "learning_rate": float(p["adam"]["learning_rate"])}
        self._finish_one(
            f, result, None, None, model_status=status, checkpoint=(ckpt_path, ("ready", size)) if ckpt_path else None,
            metrics=metrics,
        )
        log.info("operation", extra={"op": f.op, "model_id": f.model_id, "seconds": round(time.perf_counter() - t0, 4)})

    def _op_failed(self, f: PendingFuture, error: str, category: str, ckpt_path: str | None) -> None:
        status = ("failed", error) if f.op in ("create_model", "load_model") else None
        self._finish_one(
            f, None, error, category, model_status=status, checkpoint=(ckpt_path, ("failed", None)) if ckpt_path else None
        )

    def _slot(self, model_id: str | None) -> int:
        slot = self.slots.get(model_id)  # type: ignore[arg-type]
        if slot is None:
            raise UserError(f"model {model_id} is not loaded in this engine")
        return slot

    def _op_create_model(self, f: PendingFuture, p: dict):
        config = LoraConfig.from_dict(p["lora"])
        try:
            self.worker.validate(config)
        except ValueError as e:
            raise UserError(str(e)) from None
        if f.model_id in self.slots:  # an engine restart never reuses ids; be safe anyway
            self.worker.free_adapter(self.slots.pop(f.model_id))  # type: ignore[arg-type]
        self.slots[f.model_id] = self._allocate(lambda: self.worker.create_adapter(config))  # type: ignore[index]
        return {}, ("active", None)

    def _op_load_model(self, f: PendingFuture, p: dict):
        with self._local_copy(p["uri"]) as path:
            try:
                self.slots[f.model_id] = self._allocate(  # type: ignore[index]
                    lambda: self.worker.load_adapter(path, p["with_optimizer"]))
            except (ValueError, FileNotFoundError) as e:
                raise UserError(f"cannot load {p.get('source_path')}: {e}") from None
        return {}, ("active", None)

    def _op_load_weights(self, f: PendingFuture, p: dict):
        """Legacy in-place load (``TrainingClient.load_state``): the model's adapter is replaced."""
        slot = self._slot(f.model_id)
        with self._local_copy(p["uri"]) as path:
            try:
                same = self.worker.checkpoint_kind_matches(slot, path)
            except (ValueError, FileNotFoundError) as e:
                raise UserError(f"cannot load {p.get('source_path')}: {e}") from None
        if not same:
            kinds = ("a full fine-tuning checkpoint", "a LoRA run") if slot > 0 else ("a LoRA checkpoint",
                                                                                      "a full fine-tuning run")
            raise UserError(f"cannot load {p.get('source_path')}: it is {kinds[0]} and {f.model_id} is {kinds[1]}")
        self.worker.free_adapter(slot)
        del self.slots[f.model_id]  # type: ignore[arg-type]
        return self._op_load_model(f, p)

    def _op_rejected(self, f: PendingFuture, p: dict):
        """A request the API refused: it only holds its seq_id so later requests can run."""
        raise UserError(p.get("error", "rejected by the API"))

    def _op_unload_model(self, f: PendingFuture, p: dict):
        slot = self.slots.pop(f.model_id, None)  # type: ignore[arg-type]
        if slot is not None:
            self.worker.free_adapter(slot)
        return {}, None

    def _op_snapshot_sampler(self, f: PendingFuture, p: dict):
        """``save_weights_and_get_sampling_client``: freeze the model's current weights for a sampler."""
        source = self._slot(f.model_id)
        sid = p["sampler_id"]
        self.sampler_slots[sid] = self._allocate(lambda: self.worker.snapshot_adapter(source))
        self._snapshots.add(sid)
        self._sampler_used[sid] = time.monotonic()
        return {"sampling_session_id": sid}, None

    def _op_unload_sampler(self, f: PendingFuture, p: dict):
        self.stability.drop_sampler(f.sampler_id, "its session ended")  # type: ignore[arg-type]
        slot = self.sampler_slots.pop(f.sampler_id, None)  # type: ignore[arg-type]
        if slot:
            self.worker.free_adapter(slot)
        folder = self.parked.pop(f.sampler_id, None)  # type: ignore[arg-type]
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        self._snapshots.discard(f.sampler_id)  # type: ignore[arg-type]
        self._sampler_used.pop(f.sampler_id, None)  # type: ignore[arg-type]
        return {}, None

    def _op_optim_step(self, f: PendingFuture, p: dict):
        metrics = self.worker.optim_step(self._slot(f.model_id), AdamParams(**p["adam"]))
        return {"metrics": metrics}, None

    def _op_save_weights(self, f: PendingFuture, p: dict):
        slot = self._slot(f.model_id)
        with self._staging(p["uri"]) as out:
            self.worker.save_adapter(slot, out, p["with_optimizer"], p.get("metadata"))
        return {"size_bytes": self.storage.size(p["uri"])}, None

    def _op_save_external(self, f: PendingFuture, p: dict):
        slot = self._slot(f.model_id)
        with self._staging(p["uri"]) as out:
            self.worker.export_peft(slot, out, base_model=p["base_model"], layout="tinker")
            if p.get("recipients"):
                _age_encrypt_folder(out, p["recipients"])
        return {"size_bytes": self.storage.size(p["uri"])}, None

    # -- storage helpers ----------------------------------------------------------------------------

    @contextmanager
    def _staging(self, uri: str) -> Iterator[Path]:
        """A path (not yet existing) to write a checkpoint folder into; on success it becomes
        ``uri`` (a rename for a local root, an upload for fsspec)."""
        local = self.storage.local_path(uri)
        if local is not None:
            local.parent.mkdir(parents=True, exist_ok=True)
        base = Path(tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=local.parent if local is not None else None))
        out = base / "out"
        try:
            yield out
            if local is not None:
                if local.exists():
                    os.rename(local, base / "old")
                os.rename(out, local)
            else:
                self.storage.upload_dir(out, uri)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    @contextmanager
    def _local_copy(self, uri: str) -> Iterator[Path]:
        local = self.storage.local_path(uri)
        if local is not None:
            yield local
            return
        with tempfile.TemporaryDirectory(prefix="ember-load-") as tmp:
            yield self.storage.download_dir(uri, Path(tmp) / "ckpt")


@functools.cache
def tokenizer_decode(model_path: str) -> Callable[[Sequence[int]], str]:
    """The decode of the tokenizer in a model folder (loaded once per process)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    return lambda ids: tok.decode(list(ids))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _sample_result(out: SampleOutput) -> dict:
    """The stored (internal) form of a sampling result."""
    seqs = [
        {"tokens": np.asarray(q.tokens, np.int64), "logprobs": np.asarray(q.logprobs, np.float32),
         "stop_reason": q.stop_reason,
         "topk_ids": None if q.topk_ids is None else np.asarray(q.topk_ids, np.int64),
         "topk_logprobs": None if q.topk_logprobs is None else np.asarray(q.topk_logprobs, np.float32)}
        for q in out.sequences
    ]
    arrays = {k: getattr(out, k) for k in ("prompt_logprobs", "topk_prompt_ids", "topk_prompt_logprobs",
                                             "target_prompt_logprobs", "prompt_alt_tokens", "prompt_alt_logprobs")}
    return {"sequences": seqs, **{k: None if v is None else np.asarray(v) for k, v in arrays.items()}}


def _age_encrypt_folder(folder: Path, recipients: list[str]) -> None:
    """Replace every file with its age encryption (``name.age``) for ``recipients``."""
    import pyrage

    parsed = []
    for r in recipients:
        try:
            parsed.append(pyrage.ssh.Recipient.from_str(r) if r.startswith("ssh-") else pyrage.x25519.Recipient.from_str(r))
        except Exception as e:  # noqa: BLE001 - pyrage raises its own error types
            raise UserError(f"age_encryption_recipients: {r[:20]}… is not an age or SSH public key ({e})") from None
    for f in sorted(folder.iterdir()):
        f.with_name(f.name + ".age").write_bytes(pyrage.encrypt(f.read_bytes(), parsed))
        f.unlink()


# -- process entry point ------------------------------------------------------------------------------


def cpu_threads(requested: int | None = None) -> int:
    """Torch threads of an engine on the CPU: ``requested``, else all usable cores but one.

    The engine shares the machine with the API process (and often the clients). Torch's CPU kernels
    split work over their threads and wait for the slowest one, so with as many threads as cores a
    single busy core (a request being parsed, a store transaction) stalls the whole pass; on a
    2-core machine that made a step several times slower than the same pass run alone."""
    if requested:
        return max(1, requested)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ember.engine.service``."""
    ap = argparse.ArgumentParser(prog="python -m ember.engine.service", description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", required=True, help="the name clients use for this model")
    ap.add_argument("--model-path", required=True, help="local Hugging Face model folder")
    ap.add_argument("--database-url", required=True)
    ap.add_argument("--storage", required=True, help="checkpoint root: a folder or an fsspec URL")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bfloat16 on CUDA, else float32)")
    ap.add_argument("--max-adapters", type=int, default=32)
    ap.add_argument("--max-rank", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=16384, help="tokens per packed forward/backward pass")
    ap.add_argument("--gap-timeout", type=float, default=300.0, help="seconds before a missing seq_id is skipped")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process (the server) is gone")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="torch threads on --device cpu (default: all cores but one; see cpu_threads)")
    ap.add_argument("--stability-memory-mb", type=int, default=2048,
                    help="host memory for stability records (record_stability_info) before they spill to disk")
    ap.add_argument("--stability-disk-mb", type=int, default=16384,
                    help="local disk for spilled stability records before the least recently used are dropped")
    ap.add_argument("--stability-ttl", type=float, default=3600.0,
                    help="seconds a stability record is kept without use")
    ap.add_argument("--stability-dir", default=None, help="folder for spilled stability records (default: a temp dir)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--log-format", default="auto", choices=("auto", "text", "json"),
                    help="text (readable) or json lines on stderr; auto: text on a terminal")
    ap.add_argument("--nproc", type=int, default=1, help="processes of this engine (ember.engine.sharded)")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides --nproc)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (divides --nproc)")
    ap.add_argument("--expert-fsdp", action="store_true",
                    help="shard each block of experts over the --nproc/--ep ranks that hold it (FSDP2, "
                    "ember.dist.fsdp); needs MoE layers and --nproc > --ep")
    ap.add_argument("--activation-checkpointing", default="auto", choices=CHECKPOINTING_MODES,
                    help="recompute each decoder layer's activations in backward (training passes only): on, "
                    "off, or auto (the default): in a pass whose estimated activations would not fit in the free "
                    "device memory, first rebuild norm and activation outputs in the backward, then checkpoint the "
                    "fewest layers that make up what is still missing (CUDA; off elsewhere)")
    ap.add_argument("--rollout-precision", default="bf16", choices=("bf16", "fp8", "mxfp8"),
                    help="the sampler's copy of the base projections and routed experts: bf16 (the model's own "
                    "weights), fp8 (e4m3, 128x128 block scales) or mxfp8 (OCP MX, 32-element E8M0 blocks); "
                    "training keeps the model's weights (ember.core.rollout_precision)")
    ap.add_argument("--max-prefill-tokens", type=int, default=16384, metavar="N",
                    help="tokens per sampling step: one per running sequence, the rest for prompts (longer ones "
                    "prefilled in chunks over several steps; SamplerConfig.max_prefill_tokens)")
    ap.add_argument("--full-finetune", action="store_true",
                    help="let clients fully fine-tune this model (create a training client with rank 0); one process only")
    ap.add_argument("--optimizer-offload", default="none", metavar="none|host|disk:DIR",
                    help="where full fine-tuning keeps its fp32 master weights and Adam moments: on the device, in "
                    "pinned host memory, or in host memory with what it cannot hold in files under DIR")
    ap.add_argument("--optimizer-device-gib", type=float, default=0.0, metavar="GIB",
                    help="with --optimizer-offload host or disk:DIR: keep up to this many GiB of the optimizer state on the GPU anyway (whole parameters, the first ones), so fewer bytes cross the host link each step (ZeRO-Offload's partial offload; default 0: all of it off the GPU)")
    ap.add_argument("--warmup", default="auto", choices=WARMUP_MODES,
                    help="run a short training pass and a sample before serving, so that the first request "
                    "does not pay for autotuning and compiling GPU kernels (ember.engine.warmup); auto: on CUDA")
    ap.add_argument("--ray", default=None, metavar="ADDRESS",
                    help="run the --nproc ranks as actors of the Ray cluster at ADDRESS (or auto) "
                    "(ember.engine.ray_engine); this process stays the driver")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)  # set for the ranks rank 0 starts
    ap.add_argument("--dist-init", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    errors = engine_flag_errors(**flag_values(args))
    if errors:
        ap.error(errors[0])
    if args.device == "cpu" and not args.ray:  # on Ray: each actor sets its own
        torch.set_num_threads(max(1, cpu_threads(args.cpu_threads) // args.nproc))
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    kwargs = dict(max_adapters=args.max_adapters, max_rank=args.max_rank, full_finetune=args.full_finetune,
                  optimizer_offload=args.optimizer_offload, optimizer_device_bytes=int(args.optimizer_device_gib * 2**30),
                  activation_checkpointing=args.activation_checkpointing, rollout_precision=args.rollout_precision,
                  max_prefill_tokens=args.max_prefill_tokens)
    if args.nproc > 1 and not args.ray:
        from ember.engine import ranks

        if args.rank > 0:  # a follower: no store, no doorbell; rank 0's calls until it stops
            worker = ranks.start_rank(args, dtype, kwargs)
            ranks.follow(worker, lambda ids: tokenizer_decode(args.model_path)(ids))
            return 0
    store = Store.open(args.database_url, pool_size=2, run_migrations=False)
    caps = ["train", "sample"] if hasattr(Worker, "sample") else ["train"]
    doorbell = Doorbell()
    store.register_engine(args.base_model, os.getpid(), caps, doorbell.port)
    if args.ray:
        from ember.engine.ray_engine import RayFanOut

        if "://" not in args.storage:  # this process's temp folders (parked samplers, staging) are read by the
            # actors, on any node: keep them in the storage every node reads
            scratch = Path(args.storage).expanduser() / ".ember-scratch"
            scratch.mkdir(parents=True, exist_ok=True)
            args.stability_dir = args.stability_dir or tempfile.gettempdir()  # this process's only: local disk
            tempfile.tempdir = str(scratch)

        worker = RayFanOut.start(args.ray, dict(
            model_path=args.model_path, device=args.device, dtype=dtype_name, nproc=args.nproc, ep=args.ep,
            tp=args.tp, expert_fsdp=args.expert_fsdp, cpu_threads=args.cpu_threads, log_level=args.log_level,
            log_format=args.log_format, kwargs=kwargs, name=args.base_model,
            # a local root must be the same folder on every node (checked); with an fsspec URL the
            # actors see no folder of this machine: their checkpoint folders are relayed
            shared=[args.storage] if "://" not in args.storage else []))
        store.engine_ranks(args.base_model, worker.ranks)
    elif args.nproc > 1:
        worker = ranks.FanOut(ranks.start_rank(args, dtype, kwargs, argv if argv is not None else sys.argv[1:]))
        store.engine_ranks(args.base_model, worker.ranks)
    else:
        worker = Worker.from_pretrained(args.model_path, args.device, dtype, **kwargs)
    if wants_warm_up(args.warmup, args.device):
        store.engine_ready(args.base_model, "warming up")
        log.info("warming up: autotuning and compiling the GPU kernels (minutes on a fresh machine)")
        try:
            log.info("warm-up done", extra={"seconds": round(warm_up(worker, worker.config.vocab_size), 1)})
        except Exception as e:  # noqa: BLE001 - an optimisation: serve anyway, the error is logged
            log.warning("warm-up failed; serving without it", extra={"error": f"{type(e).__name__}: {e}"})
    service = EngineService(
        store, Storage(args.storage), args.base_model, worker, token_budget=args.token_budget,
        gap_timeout_s=args.gap_timeout, model_path=args.model_path, doorbell=doorbell,
        stability=StabilityStore(args.stability_memory_mb << 20, args.stability_disk_mb << 20, args.stability_ttl,
                                 args.stability_dir),
    )
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    orphaned = (lambda: os.getppid() != args.parent_pid) if args.parent_pid else (lambda: False)
    service.run(should_stop=lambda: bool(stopping) or orphaned())
    if args.nproc > 1 or args.ray:
        worker.stop()
    store.engine_ready(args.base_model, "stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
