"""``ember serve`` of the tiny MoE model as a sharded engine, for the SDK scenario tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ember.engine.builtin import build_model
from ember.store import Store
from tests.conformance.conftest import Server
from tests.live_server import free_port, serve, stop, wait_ready

MOE = "tiny-qwen3-moe"


@contextmanager
def moe_server(root: Path, flags: list[str]) -> Iterator[Server]:
    """A server for one API key (``alice``) whose engine runs the tiny MoE with ``flags`` (e.g.
    ``--nproc 2 --ep 2``), stopped on exit."""
    models = {MOE: str(build_model(root / "models" / MOE, "qwen3_moe", seed=2))}
    db_url = f"sqlite:///{root / 'ember.db'}"
    store = Store.open(db_url)
    key = store.create_api_key("alice")[1]
    store.close()
    port = free_port()
    log = root / "server.log"
    proc = serve(["--database-url", db_url, "--storage", str(root / "checkpoints"), "--max-rank", "16",
                  "--model", f"{MOE}={models[MOE]}", "--cpu-threads", "2", *flags,
                  "--port", str(port), "--long-poll", "10"], log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, engines=True)
        yield Server(f"http://127.0.0.1:{port}", db_url, str(root / "checkpoints"), models, {"alice": key}, log, proc)
    finally:
        stop(proc)
