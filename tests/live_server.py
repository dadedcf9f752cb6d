"""A live ``ember serve`` for tests that drive it over HTTP (conformance, cookbook, ember.rl,
reliability): start it, wait until its engines are ready, stop it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", *args], stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)


def wait_ready(base_url: str, proc: subprocess.Popen, log: Path, engines: bool, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base_url}/api/v1/healthz", timeout=2) as r:
                health = json.load(r)
            if not engines or all(v == "ready" for v in health["engines"].values()):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"ember serve not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
