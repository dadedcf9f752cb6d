"""Sustained load on a live ``ember serve`` (issue 19, part 3): concurrent official-SDK clients,
each with its own session, mixing training steps (forward_backward + optim_step), sampling,
sampler snapshots and checkpoints, for a fixed time, on SQLite or PostgreSQL (``backend()``).

Figures: futures per second, p50/p99 latency of each route (the server's access log) and of each
client operation, "database is locked" errors (goal 0), the API and engine processes' resident
memory at the start and the end, and the store's accounting: every request ended, and each
model ran exactly the optim_steps its client had acknowledged (none lost, none twice).

    python -m tests.reliability.load --clients 64 --seconds 600 --out load.json      # the long version
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import tinker
from sqlalchemy import text
from tinker import types

from ember.store import Store
from tests.reliability.live import MODEL, Live, live_server
from tests.store.backend import backend, fresh_database

ADAM = types.AdamParams(learning_rate=1e-4)


def _rss_mb(pid: int | None) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, TypeError):
        return None
    return None


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _client(live: Live, index: int, deadline: float, stats: dict, lock: threading.Lock) -> None:
    rng = random.Random(index)
    sc = tinker.ServiceClient(base_url=live.base_url, api_key=live.keys["alice" if index % 2 else "bob"])
    tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=index).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    acked, times, errors = 0, defaultdict(list), Counter()
    prompt = types.ModelInput.from_ints([5, 17, 42, 9])
    n = 0
    while time.monotonic() < deadline:
        op = rng.choices(["train", "sample", "snapshot", "save"], weights=[60, 25, 10, 5])[0]
        t0 = time.perf_counter()
        try:
            if op == "train":
                seq = np.random.default_rng(index * 100_000 + n).integers(3, 500, 33)
                datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                                    loss_fn_inputs={"target_tokens": seq[1:].tolist(), "weights": [1.0] * 32})
                fb, opt = tc.forward_backward([datum], "cross_entropy"), tc.optim_step(ADAM)
                fb.result()
                opt.result()
                acked += 1
            elif op == "sample":
                sampler.sample(prompt, 2, types.SamplingParams(max_tokens=8, seed=n)).result()
            elif op == "snapshot":
                sampler = tc.save_weights_and_get_sampling_client().result()
            else:
                tc.save_state(f"load-{n}").result()
            times[op].append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - counted and reported; the run goes on
            errors[f"{op}: {type(e).__name__}: {str(e)[:120]}"] += 1
        n += 1
    with lock:
        stats["acked"][tc.model_id] = acked
        for op, ts in times.items():
            stats["times"][op] += ts
        stats["errors"].update(errors)
    try:  # the SDK's close future once (1 of 64 clients) did not resolve though the server answered 200
        sc.close("success").result(timeout=30)
    except Exception as e:  # noqa: BLE001 - not the server's: counted, and the run goes on
        with lock:
            stats["errors"][f"close (SDK): {type(e).__name__}"] += 1


def run_load(root: Path, clients: int, seconds: float) -> dict:
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database(root)) if backend() == "postgresql" else None
        live = stack.enter_context(live_server(root / "server", database_url=url,
                                               args=("--max-adapters", str(max(32, 4 * clients)))))
        stats = {"acked": {}, "times": defaultdict(list), "errors": Counter()}
        lock = threading.Lock()
        api_pid, engine_pid = live.proc.pid, live.engine_pid()
        start_log = len(live.log.read_text().splitlines())
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=_client, args=(live, i, deadline, stats, lock), daemon=True)
                   for i in range(clients)]
        for t in threads:
            t.start()
        time.sleep(min(10.0, seconds / 3))  # the start-up (sessions, models, first samplers) is done
        rss0 = {"api_mb": _rss_mb(api_pid), "engine_mb": _rss_mb(engine_pid)}
        t_start = time.time()
        samples = []  # resident memory along the run: does it level off?
        while any(t.is_alive() for t in threads) and time.time() - t_start < seconds + 300:
            time.sleep(min(30.0, max(1.0, seconds / 10)))
            samples.append((round(time.time() - t_start), _rss_mb(api_pid), _rss_mb(engine_pid)))
        for t in threads:
            t.join(timeout=60)
        wall = time.time() - t_start
        rss1 = {"api_mb": _rss_mb(api_pid), "engine_mb": _rss_mb(engine_pid)}
        records = live.log_records()[start_log:]
        routes = defaultdict(list)
        for r in records:
            if r.get("msg") == "request" and r.get("path"):
                routes[f"{r['method']} {r['path']}"].append(r["ms"])
        locked = live.log.read_text().count("database is locked")
        store = Store.open(live.database_url, pool_size=1, run_migrations=False)
        drain = time.monotonic() + 60  # closing the sessions queued unloads of their models and samplers
        while True:
            with store.read() as s:
                open_requests = dict(s.execute(text("select op, count(*) from futures where state not in "
                                                    "('done', 'failed') group by op")).all())
            if not open_requests or time.monotonic() > drain:
                break
            time.sleep(0.5)
        with store.read() as s:
            ran = dict(s.execute(text("select model_id, count(*) from futures where op = 'optim_step' "
                                      "and state = 'done' group by model_id")).all())
            finished = s.execute(text("select count(*) from futures where state in ('done', 'failed') and "
                                      "finished_at >= :t"), {"t": time.strftime("%Y-%m-%d %H:%M:%S",
                                                                                time.gmtime(t_start))}).scalar()
        store.close()
        mismatched = {m: (a, ran.get(m, 0)) for m, a in stats["acked"].items() if ran.get(m, 0) != a}
        return {
            "backend": "postgres" if url else "sqlite", "clients": clients, "seconds": seconds,
            "futures_per_s": round(finished / wall, 1),
            "client_ops": {op: {"n": len(ts), "p50_ms": round(1e3 * statistics.median(ts), 1),
                                "p99_ms": round(1e3 * _percentile(ts, 0.99), 1)} for op, ts in stats["times"].items()},
            "routes": {p: {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
                           "p99_ms": round(_percentile(ms, 0.99), 2)} for p, ms in sorted(routes.items()) if len(ms) > 5},
            "database_is_locked": locked, "client_errors": dict(stats["errors"]),
            "requests_open_at_end": open_requests, "optim_steps_mismatched": mismatched,
            "memory_start": rss0, "memory_end": rss1, "memory_along": samples,
            "engine_restarts": live.engine_starts() - 1,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ember-load-") as tmp:
        report = run_load(Path(tmp), args.clients, args.seconds)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    bad = report["database_is_locked"] or report["requests_open_at_end"] or report["optim_steps_mismatched"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
