"""Crash and fault injection against a live ``ember serve`` (issue 19, part 2).

An official-SDK client trains (forward_backward + optim_step per step, ``save_state`` every few
steps) while faults are injected in a loop, one per round:

* ``kill -9`` of the engine **during** a ``forward_backward`` pass, an ``optim_step`` or a
  ``save_state`` (the kill lands while the store shows the request running, or right after it was
  queued);
* ``kill -9`` of the API process (``ember serve`` itself; its engines exit with it), then a restart
  on the same database and checkpoint folder;
* a restart of the PostgreSQL server mid-run (PostgreSQL runs only);
* a full checkpoint disk (the checkpoint root on a small tmpfs, filled up; needs root).

After a fault the client does what the service's errors tell it to: a lost model is recreated
from the last checkpoint (``create_training_client_from_state_with_optimizer``) and training goes
on. The invariants, checked after every fault and at the end:

* every request ends (done, or failed with a reason) — none stays queued or running;
* no optim_step is applied twice or lost silently: every checkpoint's Adam step count equals the
  optim_steps the client had acknowledged on that model's lineage, and its weights equal a replay
  of exactly those steps from the lineage's start (an in-process Worker, fp32);
* no checkpoint is half-written: every ready checkpoint loads; stale staging folders are gone;
* the engine comes back (recovery time: from the fault to the next acknowledged step).

    python -m tests.reliability.faults --rounds 60 --out faults.json                 # long, SQLite
    EMBER_TEST_POSTGRES_URL=postgresql://postgres@127.0.0.1:5432/test \\
        python -m tests.reliability.faults --rounds 60                               # long, PostgreSQL
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tinker
import torch
from safetensors.numpy import load_file
from sqlalchemy import text
from tinker import types

from ember.store import Store
from tests.live_server import serve, wait_ready
from tests.reliability.live import MODEL, Live, live_server, wait_engine
from tests.store.backend import backend, fresh_database

ADAM = types.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
RANK, SEED = 8, 0
TOKENS = 384  # per datum; 8 datums make a pass slow enough to be killed while it runs
TERMINAL = ("done", "failed")


def datums(step: int) -> list[types.Datum]:
    """The batch of data step ``step`` (a pure function of it, for the replay)."""
    rng = np.random.default_rng(step)
    out = []
    for _ in range(8):
        seq = rng.integers(3, 500, TOKENS + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": seq[1:].tolist(), "weights": [1.0] * TOKENS}))
    return out


@dataclass
class Ckpt:
    path: str
    start: str | None  # the checkpoint this model's lineage was created from (None: a fresh adapter)
    steps: list[int]  # the steps acknowledged on the lineage since ``start``


@dataclass
class Client:
    """The training client and what it knows was acknowledged."""

    sc: tinker.ServiceClient
    tc: object = None
    start: str | None = None
    acked: list[int] = field(default_factory=list)
    ckpts: list[Ckpt] = field(default_factory=list)
    next_step: int = 0
    recoveries: int = 0

    def fresh(self) -> None:
        self.tc = self.sc.create_lora_training_client(base_model=MODEL, rank=RANK, seed=SEED).result()
        self.start, self.acked = None, []

    def train(self) -> None:
        step = self.next_step
        self.next_step += 1
        fb = self.tc.forward_backward(datums(step), "cross_entropy")
        opt = self.tc.optim_step(ADAM)
        fb.result()
        opt.result()
        self.acked.append(step)

    def save(self) -> str:
        path = self.tc.save_state(f"c{len(self.ckpts)}-{self.next_step}").result().path
        self.ckpts.append(Ckpt(path, self.start, list(self.acked)))
        return path

    def recover(self) -> None:
        """The model is gone (its engine died): go on from the last checkpoint."""
        self.recoveries += 1
        if not self.ckpts:
            self.fresh()
            return
        last = self.ckpts[-1].path
        self.tc = self.sc.create_training_client_from_state_with_optimizer(last).result()
        self.start, self.acked = last, []


def _attempt(client: Client, fn, tries: int = 8) -> float | None:
    """Run ``fn`` (a step or a save), recovering the model after a failure; returns the seconds
    until it succeeded, or None."""
    t0 = time.monotonic()
    for _ in range(tries):
        try:
            fn()
            return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - any failure: the model may be lost; recover and retry
            time.sleep(0.5)
            try:
                client.recover()
            except Exception:  # noqa: BLE001 - the server may still be restarting
                time.sleep(2.0)
    return None


class Injector:
    """The faults, against one live server (restarted in place when the API is killed)."""

    def __init__(self, live: Live, disk: Path | None):
        self.live = live
        self.disk = disk  # a tmpfs checkpoint root, when the disk-full fault can run

    def _store(self) -> Store:
        return Store.open(self.live.database_url, pool_size=1, run_migrations=False)

    def kill_engine_during(self, op: str, run) -> dict:
        """SIGKILL the engine while a request of ``op`` runs (or right after it was queued)."""
        pid = self.live.engine_pid()
        seen = {}
        done = threading.Event()

        def watch():
            store = self._store()
            deadline = time.monotonic() + 10
            try:
                while time.monotonic() < deadline and not done.is_set():
                    with store.read() as s:
                        rows = s.execute(text(
                            "select state from futures where op = :op and state in ('pending', 'running') "
                            "order by created_at desc limit 1"), {"op": op}).all()
                    if rows and (rows[0][0] == "running" or time.monotonic() > deadline - 9.5):
                        seen["state"] = rows[0][0]
                        os.kill(pid, signal.SIGKILL)
                        return
                    time.sleep(0.002)
            finally:
                store.close()

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            run()
            seen["op"] = "acknowledged before the kill"
        except Exception as e:  # noqa: BLE001 - the op is expected to fail
            seen["op"] = f"failed: {str(e)[:120]}"
        done.set()
        t.join()
        return {"killed_while": seen.get("state", "not caught"), "client_saw": seen["op"]}

    def kill_api(self) -> dict:
        os.kill(self.live.proc.pid, signal.SIGKILL)
        self.live.proc.wait()
        time.sleep(1.5)  # its engines see their parent gone and exit
        self.live.proc = serve(self.live.args, self.live.log)
        wait_ready(self.live.base_url, self.live.proc, self.live.log, engines=True)
        return {}

    def restart_postgres(self) -> dict:
        version = max(os.listdir("/etc/postgresql"))
        subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"], check=True,
                       capture_output=True, timeout=120)
        return {}

    def fill_disk(self, client: Client) -> dict:
        """Fill the checkpoint root; a save must fail with a clear error; free it; a save works."""
        filler = self.disk / "filler"
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * (1 << 20))
                    fh.flush()
            except OSError:
                pass
        try:
            client.save()
            result = {"save_on_full_disk": "accepted?!"}
        except Exception as e:  # noqa: BLE001 - the expected failure (the client recorded nothing)
            result = {"save_on_full_disk": "failed", "error": str(e)[:200],
                      "clear": "No space left" in str(e) or "Errno 28" in str(e)}
        finally:
            filler.unlink()
        return result


def check_requests_end(live: Live, before: float, timeout_s: float = 90.0) -> int:
    """Requests created before ``before`` (Unix time) still queued or running after ``timeout_s``."""
    store = Store.open(live.database_url, pool_size=1, run_migrations=False)
    try:
        cutoff = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(before))
        deadline = time.monotonic() + timeout_s
        while True:
            with store.read() as s:
                n = s.execute(text(
                    "select count(*) from futures where state not in ('done', 'failed') and created_at < :c"),
                    {"c": cutoff}).scalar()
            if not n or time.monotonic() > deadline:
                return int(n or 0)
            time.sleep(0.5)
    finally:
        store.close()


def verify_checkpoints(live: Live, client: Client) -> dict:
    """Every checkpoint the client saved: its Adam step count and weights against a replay of the
    steps acknowledged on its lineage; every ready checkpoint row loads; no staging folder left."""
    from ember.core.adapters import LoraConfig
    from ember.core.checkpoint import load_adapter
    from ember.engine.worker import Worker
    from ember.types import Datum, ForwardBackwardInput

    torch.set_num_threads(1)
    store = Store.open(live.database_url, pool_size=1, run_migrations=False)
    worker = Worker.from_pretrained(live.model_dir, "cpu", torch.float32, max_adapters=4, max_rank=RANK)
    uri = {}
    with store.read() as s:
        for path, u, state in s.execute(text("select tinker_path, uri, state from checkpoints")):
            uri[path] = (u, state)
    out = Counter()
    worst = 0.0
    for c in client.ckpts:
        folder, state = uri[c.path]
        opt = load_file(str(Path(folder) / "optimizer.safetensors"))
        step_count = int(next(v for k, v in opt.items() if k.endswith(".step")).reshape(-1)[0])
        base_steps = 0
        if c.start is not None:
            start = next(x for x in client.ckpts if x.path == c.start)
            base_steps = len(_lineage(client, start))
            slot = load_adapter(worker.bank, uri[c.start][0], with_optimizer=True).slot
        else:
            slot = worker.create_adapter(LoraConfig(rank=RANK, alpha=32.0, seed=SEED))
        expected = base_steps + len(c.steps)
        out["duplicates"] += step_count > expected
        out["lost"] += step_count < expected
        from ember.core.optim import AdamParams

        for step in c.steps:
            ds = [Datum(np.asarray(d.model_input.to_ints()), {"target_tokens": np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy()),
                                                              "weights": np.ones(TOKENS, np.float32)}) for d in datums(step)]
            worker.forward_backward([ForwardBackwardInput(slot, ds, "cross_entropy")])
            worker.optim_step(slot, AdamParams(learning_rate=ADAM.learning_rate, beta1=ADAM.beta1, beta2=ADAM.beta2,
                                               eps=ADAM.eps))
        saved = load_file(str(Path(folder) / "adapter.safetensors"))
        mine = {k: v.numpy() for k, v in worker.adapter(slot).tensors().items()}
        err = max(float(np.abs(mine[k] - v).max() / max(np.abs(v).max(), 1e-12)) for k, v in saved.items())
        worst = max(worst, err)
        out["weights_differ"] += err > 1e-3
        worker.free_adapter(slot)
        out["verified"] += 1
    for path, (u, state) in uri.items():  # every ready checkpoint is whole
        if state == "ready":
            files = {p.name for p in Path(u).iterdir()} if Path(u).is_dir() else set()
            out["corrupt"] += not {"metadata.json", "adapter.safetensors"} <= files
    stale = [p for p in Path(live.storage).rglob(".stage-*")]
    store.close()
    return {**dict(out), "worst_weight_rel_diff": worst, "stale_staging_folders": len(stale)}


def _lineage(client: Client, c: Ckpt) -> list[int]:
    """All steps behind checkpoint ``c``, through the checkpoints its lineage started from."""
    steps = list(c.steps)
    while c.start is not None:
        c = next(x for x in client.ckpts if x.path == c.start)
        steps = c.steps + steps
    return steps


@contextmanager
def tmpfs(path: Path, megabytes: int):
    """A tmpfs of ``megabytes`` at ``path`` (None when this machine does not allow mounting)."""
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                        capture_output=True, check=False).returncode == 0
    try:
        yield path if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def run_faults(root: Path, rounds: int, steps_per_round: int = 2) -> dict:
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database(root)) if backend() == "postgresql" else None  # else: SQLite
        disk = stack.enter_context(tmpfs(root / "disk", 48))
        live = stack.enter_context(live_server(root / "server", database_url=url,
                                               storage=str(disk / "checkpoints") if disk else None))
        injector = Injector(live, disk)
        client = Client(tinker.ServiceClient(base_url=live.base_url, api_key=live.keys["alice"]))
        client.fresh()
        kinds = ["engine_forward_backward", "engine_optim_step", "engine_save", "api"]
        if url is not None:
            kinds.append("postgres")
        if disk is not None:
            kinds.append("disk_full")
        injected, recovery, lost_requests, notes = Counter(), [], 0, []
        _attempt(client, client.train)
        _attempt(client, client.save)
        for r in range(rounds):
            kind = kinds[r % len(kinds)]
            for _ in range(steps_per_round):
                _attempt(client, client.train)
            t_fault = time.time()
            if kind == "engine_forward_backward":
                note = injector.kill_engine_during("forward_backward", client.train)
            elif kind == "engine_optim_step":
                note = injector.kill_engine_during("optim_step", client.train)
            elif kind == "engine_save":
                note = injector.kill_engine_during("save_weights", client.save)
            elif kind == "api":
                note = injector.kill_api()
            elif kind == "postgres":
                note = injector.restart_postgres()
            else:
                note = injector.fill_disk(client)
            injected[kind] += 1
            if kind.startswith("engine") or kind == "api":
                wait_engine(live)
            seconds = _attempt(client, client.train)
            recovery.append(time.time() - t_fault if seconds is not None else float("inf"))
            _attempt(client, client.save)
            lost_requests += check_requests_end(live, t_fault)
            notes.append({"round": r, "fault": kind, **note})
        checks = verify_checkpoints(live, client)
        return {
            "faults_injected": dict(injected), "rounds": rounds, "client_recoveries": client.recoveries,
            "requests_never_ended": lost_requests, "checkpoints": checks,
            "recovery_s": {"mean": round(float(np.mean(recovery)), 2), "max": round(float(np.max(recovery)), 2)},
            "backend": "postgres" if url else "sqlite", "disk_full_tested": disk is not None, "notes": notes,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ember-faults-") as tmp:
        report = run_faults(Path(tmp), args.rounds)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "notes"}, indent=1))
    c = report["checkpoints"]
    bad = (report["requests_never_ended"] or c.get("duplicates") or c.get("lost") or c.get("corrupt")
           or c.get("weights_differ") or c["stale_staging_folders"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
