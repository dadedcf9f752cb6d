"""Engine processes of ``ember serve``: start one per base model, watch them, restart the dead.

When an engine dies its in-memory adapters die with it. The supervisor then fails the requests that
were queued or running on it (with a message saying so), marks the models it held as lost (clients
recreate them from a checkpoint), and starts a new engine. The API keeps answering throughout.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ember.server.config import ServedModel
from ember.store import Store

log = logging.getLogger("ember.supervisor")
HEALTHY_S = 10.0  # an engine that ran this long before it died is restarted without backoff (a crash loop at start is not)


@dataclass
class EngineOptions:
    database_url: str
    storage: str
    device: str = "cpu"
    dtype: str | None = None
    max_adapters: int = 32
    max_rank: int = 64
    token_budget: int = 16384
    gap_timeout_s: float = 300.0
    log_level: str = "INFO"
    log_format: str = "json"  # text | json (resolved by ember serve: its own format, for one readable stream)
    cpu_threads: int | None = None  # torch threads of a CPU engine (None: the engine's default)
    stability_memory_mb: int = 2048  # stability records (record_stability_info) in host memory ...
    stability_disk_mb: int = 16384  # ... then spilled to local disk ...
    stability_ttl_s: float = 3600.0  # ... kept this long without use
    nproc: int = 1  # processes per engine (ember.engine.sharded)
    ep: int = 1  # expert-parallel degree
    tp: int = 1  # tensor-parallel degree
    expert_fsdp: bool = False  # experts sharded over the ranks that hold the same ones (ember.dist.fsdp)
    activation_checkpointing: str = "auto"  # auto | on | off (ember.core.checkpointing)
    rollout_precision: str = "bf16"  # bf16 | fp8 | mxfp8: the sampler's base weights (ember.core.rollout_precision)
    max_prefill_tokens: int = 16384  # tokens per sampling step (decodes first; prompts chunked beyond it)
    full_finetune: bool = False  # clients may fully fine-tune (rank 0; ember.engine.full_runs)
    optimizer_offload: str = "none"  # none | host | disk:DIR: full fine-tuning's optimizer state
    optimizer_device_gib: float = 0.0  # ... of which this much stays on the GPU anyway (host, disk)
    ray: str | None = None  # a Ray cluster's address (or "auto"): the ranks run as its actors (ember.engine.ray_engine)
    warmup: str = "auto"  # auto | on | off: a short pass and sample before serving (ember.engine.warmup)


class EngineSupervisor:
    """Owns the engine subprocesses (see the module docstring)."""

    def __init__(self, store: Store, models: dict[str, ServedModel], options: EngineOptions, poll_s: float = 0.5):
        self.store = store
        self.models = models
        self.options = options
        self.poll_s = poll_s
        self.procs: dict[str, subprocess.Popen] = {}
        self._backoff: dict[str, float] = {}  # delay before the next restart of a crashing engine
        self._started: dict[str, float] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def command(self, name: str) -> list[str]:
        o, m = self.options, self.models[name]
        cmd = [
            sys.executable, "-m", "ember.engine.service", "--base-model", name, "--model-path", str(m.path),
            "--database-url", o.database_url, "--storage", o.storage, "--device", o.device,
            "--max-adapters", str(o.max_adapters), "--max-rank", str(o.max_rank),
            "--token-budget", str(o.token_budget), "--gap-timeout", str(o.gap_timeout_s), "--log-level", o.log_level,
            "--log-format", o.log_format,
            "--parent-pid", str(os.getpid()), "--stability-memory-mb", str(o.stability_memory_mb),
            "--stability-disk-mb", str(o.stability_disk_mb), "--stability-ttl", str(o.stability_ttl_s),
            "--activation-checkpointing", o.activation_checkpointing, "--rollout-precision", o.rollout_precision,
            "--max-prefill-tokens", str(o.max_prefill_tokens), "--warmup", o.warmup,
        ]
        if o.dtype:
            cmd += ["--dtype", o.dtype]
        if o.full_finetune:
            cmd += ["--full-finetune", "--optimizer-offload", o.optimizer_offload,
                    "--optimizer-device-gib", str(o.optimizer_device_gib)]
        if o.cpu_threads:
            cmd += ["--cpu-threads", str(o.cpu_threads)]
        if o.nproc > 1 or o.ray:
            cmd += ["--nproc", str(o.nproc), "--ep", str(o.ep), "--tp", str(o.tp)]
            if o.expert_fsdp:
                cmd.append("--expert-fsdp")
        if o.ray:
            cmd += ["--ray", o.ray]
        return cmd

    def start(self) -> None:
        """Clear what a previous server left behind, start every engine and the watcher thread."""
        for name in self.models:
            failed, lost = self.store.engine_lost(name, "the Ember server restarted; recreate the model from a checkpoint")
            if failed or lost:
                log.warning("cleared state of a previous run", extra={"base_model": name, "futures_failed": failed,
                                                                       "models_lost": lost})
            self._spawn(name)
        self._thread = threading.Thread(target=self._watch, name="engine-supervisor", daemon=True)
        self._thread.start()

    def _spawn(self, name: str) -> None:
        self.procs[name] = subprocess.Popen(self.command(name), stdin=subprocess.DEVNULL)
        self._started[name] = time.monotonic()
        log.info("engine started", extra={"base_model": name, "pid": self.procs[name].pid})

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            try:
                self._check()
            except Exception:  # a database hiccup must not stop the watcher: the next poll retries
                log.exception("engine watcher pass failed")

    def _check(self) -> None:
        """Fail the requests of dead engines and start new ones."""
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or self._stopping.is_set():
                continue
            detail = (
                f"the engine for base model {name!r} died (exit code {code}) while this request was queued or "
                "running; its models were lost and the engine is restarting. Recreate the training client from "
                "a checkpoint (create_training_client_from_state_with_optimizer)."
            )
            failed, lost = self.store.engine_lost(name, detail)
            log.error("engine died", extra={"base_model": name, "exit_code": code, "futures_failed": failed,
                                             "models_lost": lost})
            delay = self._backoff.get(name, 0.0)
            if time.monotonic() - self._started.get(name, 0.0) > HEALTHY_S:
                delay = 0.0  # it had run well: a new crash restarts at once
            if delay:
                time.sleep(delay)
            self._backoff[name] = min(30.0, max(1.0, delay * 2))
            if not self._stopping.is_set():
                self._spawn(name)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the engines (SIGTERM, then SIGKILL after ``timeout_s``)."""
        self._stopping.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
