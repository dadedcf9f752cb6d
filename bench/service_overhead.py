"""API overhead of `ember serve`, measured against calling the engine in-process, in one run.

1. Round trip of one forward_backward + optim_step through the official SDK against a live
   `ember serve` (built-in tiny model, SQLite), versus the same two calls on an in-process Worker
   with the same model and batch. The difference is what the service adds per step.
2. Futures per second with 32 concurrent clients (32 adapters, each submitting optim_step and
   waiting for it, in a loop).

Both sides use the same device (``--device``, default cpu) and, on the CPU, the same number of torch
threads (``--threads``; default: what `ember serve` gives an engine on the CPU, all cores but one).

``--floor`` also times the same SDK loop against ``bench/sdk_floor.py``, a server that answers at
once from memory: what the SDK and its HTTP round trips cost with no server work at all, so the
added time splits into that floor and what Ember itself adds.

``--breakdown`` also prints where a step's time goes, from the server's JSON log: the API's time per
route, the engine's pass and optim_step, and the wait between a forward_backward's answer and the
start of its pass (doorbell, the engine's read and claim).

Usage: python bench/service_overhead.py [--steps 40] [--clients 32] [--rounds 10] [--threads N] [--device D]
       [--floor] [--breakdown]
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(rng, n_datums=4, length=32):
    seqs = rng.integers(0, 500, (n_datums, length + 1))
    return seqs


def in_process(model_dir: Path, steps: int, seqs, threads: int, device: str) -> list[float]:
    import torch

    from ember.core.adapters import LoraConfig
    from ember.core.optim import AdamParams
    from ember.engine.worker import Worker
    from ember.types import Datum, ForwardBackwardInput

    torch.set_num_threads(threads)  # the engine's count (ember.engine.service.cpu_threads)
    worker = Worker.from_pretrained(model_dir, device, torch.float32, max_adapters=4, max_rank=16)
    slot = worker.create_adapter(LoraConfig(rank=8, alpha=32, seed=0))
    datums = [Datum(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1, np.float32)}) for s in seqs]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        worker.forward_backward([ForwardBackwardInput(slot, datums)])
        worker.optim_step(slot, AdamParams(learning_rate=1e-4))
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # the service's answer waits for the step too
        times.append(time.perf_counter() - t0)
    return times


def through_sdk(base_model: str, steps: int, seqs) -> list[float]:
    import tinker
    from tinker import types

    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=base_model, rank=8, seed=0).result()
    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": s[1:].tolist(), "weights": [1.0] * (len(s) - 1)})
            for s in seqs]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        f = tc.forward_backward(data, "cross_entropy")
        o = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        f.result()
        o.result()
        times.append(time.perf_counter() - t0)
    sc.close("success").result()
    return times


def futures_per_second(base_model: str, clients: int, rounds: int) -> float:
    import tinker
    from tinker import types

    sc = tinker.ServiceClient()
    tcs = [sc.create_lora_training_client(base_model=base_model, rank=4, seed=i) for i in range(clients)]
    tcs = [f.result() for f in tcs]
    barrier = threading.Barrier(clients + 1)

    def run(tc):
        barrier.wait()
        for _ in range(rounds):
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()

    threads = [threading.Thread(target=run, args=(tc,)) for tc in tcs]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    sc.close("success").result()
    return clients * rounds / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the engine and of the in-process baseline (default: ember serve's, "
                         "all cores but one)")
    ap.add_argument("--device", default="cpu", help="torch device of both sides (default cpu; float32 on either)")
    ap.add_argument("--floor", action="store_true", help="also time the SDK against a server that does no work")
    ap.add_argument("--breakdown", action="store_true", help="also print where the service's time goes (from its log)")
    args = ap.parse_args()
    from ember.engine.service import cpu_threads

    threads = cpu_threads(args.threads)
    load0 = os.getloadavg()
    home = Path(tempfile.mkdtemp(prefix="ember-bench-"))
    subprocess.run([sys.executable, "-m", "ember.engine.builtin", str(home)], check=True, stdout=subprocess.DEVNULL)
    model_dir = home / "models" / "ember-tiny-qwen3"
    seqs = _batch(np.random.default_rng(0))

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(home / "server.log", "wb")  # noqa: SIM115 - kept open for the server's lifetime
    server = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--home", str(home), "--no-auth",
                               "--port", str(port), "--max-adapters", str(args.clients + 4),
                               "--log-level", "INFO" if args.breakdown else "WARNING",
                               "--cpu-threads", str(threads), "--device", args.device, "--dtype", "float32"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"ember serve exited ({server.returncode}):\n{(home / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/api/v1/healthz") as r:
                    if all(v == "ready" for v in json.load(r)["engines"].values()):
                        break
            except OSError:
                pass
            time.sleep(0.5)
        os.environ.update(TINKER_BASE_URL=base, TINKER_API_KEY="tml-bench", TINKER_TELEMETRY="0")
        local = in_process(model_dir, args.steps, seqs, threads, args.device)
        window = [time.time()]
        remote = through_sdk("ember-tiny-qwen3", args.steps, seqs)
        window.append(time.time())
        fps = futures_per_second("ember-tiny-qwen3", args.clients, args.rounds)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    med_local, med_remote = statistics.median(local[3:]), statistics.median(remote[3:])
    floor = sdk_floor(args.steps, seqs) if args.floor else None
    load1 = os.getloadavg()
    print(f"device {args.device}; torch threads {threads}; load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end "
          f"({os.cpu_count()} cores)")
    print("| measurement | value |")
    print("|---|---|")
    print(f"| forward_backward + optim_step, in-process Worker (median of {args.steps - 3}) | {med_local * 1e3:.1f} ms |")
    print(f"| forward_backward + optim_step, SDK -> ember serve (median) | {med_remote * 1e3:.1f} ms |")
    print(f"| added by the service per step (2 futures) | {(med_remote - med_local) * 1e3:.1f} ms |")
    if floor is not None:
        print(f"| forward_backward + optim_step, SDK -> bench/sdk_floor.py (no work; median) | {floor * 1e3:.1f} ms |")
        print(f"| added by Ember beyond that floor, per step | {(med_remote - med_local - floor) * 1e3:.1f} ms |")
    print(f"| futures/s, {args.clients} concurrent clients (optim_step round trips) | {fps:.0f} |")
    if args.breakdown:
        breakdown(home / "server.log", *window)


def sdk_floor(steps: int, seqs) -> float:
    """Median SDK step against ``bench/sdk_floor.py`` (started here, in its own process)."""
    port = _free_port()
    stub = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sdk_floor.py")), str(port)])
    try:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if stub.poll() is not None:
                    raise SystemExit(f"bench/sdk_floor.py exited ({stub.returncode})") from None
                time.sleep(0.2)
        os.environ["TINKER_BASE_URL"] = f"http://127.0.0.1:{port}"
        return statistics.median(through_sdk("floor", steps, seqs)[3:])
    finally:
        stub.terminate()
        stub.wait(10)


def breakdown(log_path: Path, t0: float, t1: float) -> None:
    """Median milliseconds of the SDK phase's requests (API side), packed passes, optim_step
    operations, and the wait from a forward_backward's answer to the start of its pass."""
    by: dict[str, list[float]] = {}
    fb_ends, pass_starts = [], []
    for line in log_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not t0 <= rec.get("ts", 0) <= t1:
            continue
        if rec["msg"] == "request":
            name = rec["path"].removeprefix("/api/v1/")
            by.setdefault(f"API {name}", []).append(rec["ms"])
            if name == "forward_backward":
                fb_ends.append(rec["ts"])
        elif rec["msg"] == "packed pass":
            by.setdefault("engine: packed pass", []).append(rec["seconds"] * 1e3)
            if "queued_ms" in rec:
                by.setdefault("engine: request stored -> its pass starts", []).append(rec["queued_ms"])
            pass_starts.append(rec["ts"] - rec["seconds"])
        elif rec["msg"] == "operation" and rec.get("op") == "optim_step":
            by.setdefault("engine: optim_step", []).append(rec["seconds"] * 1e3)
    waits = []
    for start in pass_starts:
        before = [t for t in fb_ends if t <= start]
        if before:
            waits.append((start - max(before)) * 1e3)
    if waits:
        by["forward_backward answered -> pass starts (log times; includes the pass's finish)"] = waits
    print("| where the time goes (SDK phase) | count | median ms |")
    print("|---|---|---|")
    for name, values in by.items():
        print(f"| {name} | {len(values)} | {statistics.median(values):.2f} |")


if __name__ == "__main__":
    main()
