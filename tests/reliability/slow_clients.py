"""Slow clients (slowloris) against a live ``ember serve``: many connections that send their headers
a byte at a time, or declare a large body and trickle it, must not starve other clients. The API
runs on one asyncio event loop, so a stalled connection holds a coroutine and a socket, not a
worker thread. Figures: connections held, and the latency of another key's requests meanwhile.

    python -m tests.reliability.slow_clients --connections 1000 --seconds 60    # the long version
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from tests.reliability.live import Live, live_server


def _trickle(host: str, port: int, stop: threading.Event, body: bool, held: list[int]) -> None:
    try:
        s = socket.create_connection((host, port), timeout=5)
    except OSError:
        return
    held.append(1)
    try:
        if body:  # complete headers, then a body of 10 MB at a byte a second
            s.sendall(b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
            chunk = b"["
        else:  # headers that never end
            s.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\n")
            chunk = b"X-a: b\r\n"
        while not stop.wait(1.0):
            s.sendall(chunk)
    except OSError:
        pass
    finally:
        s.close()


def slow_clients(live: Live, connections: int, seconds: float) -> dict:
    url = urlparse(live.base_url)
    stop = threading.Event()
    held: list[int] = []
    threads = [threading.Thread(target=_trickle, args=(url.hostname, url.port, stop, i % 2 == 1, held), daemon=True)
               for i in range(connections)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    latencies, failures = [], 0
    deadline = time.monotonic() + seconds
    with live.http("bob", timeout=10) as c:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                ok = c.post("/api/v1/create_session", json={"tags": []}).status_code == 200
            except Exception:  # noqa: BLE001 - a timeout is a failure to count
                ok = False
            latencies.append(time.perf_counter() - t0)
            failures += not ok
            time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(timeout=5)
    latencies.sort()
    return {"slow_connections": len(held), "requests": len(latencies), "failures": failures,
            "p50_ms": round(1e3 * statistics.median(latencies), 1),
            "p99_ms": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
            "max_ms": round(1e3 * latencies[-1], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ember-slow-") as tmp, live_server(Path(tmp)) as live:
        r = slow_clients(live, args.connections, args.seconds)
    print(r)
    return 1 if r["failures"] or r["p99_ms"] > 1000 else 0


if __name__ == "__main__":
    sys.exit(main())
