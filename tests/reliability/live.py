"""A live ``ember serve`` (built-in tiny Qwen3, real HTTP on loopback, SQLite or PostgreSQL) for the
reliability scripts, with two API keys and what they need to count: engine starts and deaths
from the server's JSON log, the engine's pid, and a well-formed request from another key."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ember.engine.builtin import build_model
from ember.store import Store
from tests.live_server import free_port, serve, stop, wait_ready

MODEL = "tiny"


@dataclass
class Live:
    base_url: str
    database_url: str
    storage: str
    keys: dict[str, str]
    log: Path
    proc: object
    model_dir: Path
    args: list[str] = field(default_factory=list)

    def http(self, key: str = "alice", timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"X-API-Key": self.keys[key]}, timeout=timeout)

    def log_records(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def engine_starts(self) -> int:
        return sum(1 for r in self.log_records() if r.get("msg") == "engine started")

    def engine_deaths(self) -> int:
        return sum(1 for r in self.log_records() if r.get("msg") == "engine died")

    def engine_pid(self) -> int | None:
        store = Store.open(self.database_url, pool_size=1, run_migrations=False)
        try:
            return next((e.pid for e in store.engines() if e.base_model == MODEL), None)
        finally:
            store.close()

    def other_key_works(self, key: str = "bob") -> bool:
        """A well-formed request of another key: create a session, answered 200."""
        with self.http(key) as c:
            r = c.post("/api/v1/create_session", json={"tags": ["probe"], "user_metadata": {}})
            return r.status_code == 200


@contextmanager
def live_server(root: Path, *, auth: bool = True, database_url: str | None = None, storage: str | None = None,
                args: tuple[str, ...] = ()) -> Iterator[Live]:
    """``ember serve`` of the built-in tiny model under ``root`` (keys ``alice`` and ``bob``)."""
    root.mkdir(parents=True, exist_ok=True)
    model = build_model(root / "model", "qwen3", seed=1)
    url = database_url or f"sqlite:///{root / 'ember.db'}"
    store = Store.open(url)
    keys = {"alice": store.create_api_key("alice")[1], "bob": store.create_api_key("bob")[1]}
    store.close()
    if not auth:
        keys = {"alice": "tml-alice", "bob": "tml-bob"}
    port = free_port()
    log = root / "server.log"
    cmd = ["--model", f"{MODEL}={model}", "--database-url", url, "--storage", storage or str(root / "checkpoints"),
           "--port", str(port), "--long-poll", "5", *(() if auth else ("--no-auth",)), *args]
    proc = serve(cmd, log)
    live = Live(f"http://127.0.0.1:{port}", url, storage or str(root / "checkpoints"), keys, log, proc, model, cmd)
    try:
        wait_ready(live.base_url, proc, log, engines=True)
        yield live
    finally:
        stop(live.proc)  # the one running now: a fault test may have restarted it


def wait_engine(live: Live, timeout_s: float = 120.0) -> float:
    """Seconds until the engine reports ready again (after a kill)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            with urllib.request.urlopen(f"{live.base_url}/api/v1/healthz", timeout=2) as r:
                if all(v == "ready" for v in json.load(r)["engines"].values()):
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the engine did not come back within {timeout_s} s")
