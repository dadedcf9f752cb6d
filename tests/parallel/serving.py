"""``ember serve`` of tiny built-in models (the MoE as a sharded engine), for the SDK scenario tests."""

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
    with models_server(root, {MOE: ("qwen3_moe", 2)}, ["--cpu-threads", "2", *flags]) as server:
        yield server


@contextmanager
def models_server(root: Path, models: dict[str, tuple[str, int]], flags: list[str],
                  storage: str | None = None) -> Iterator[Server]:
    """A server for one API key (``alice``) of the built-in models ``{name: (family, seed)}``
    with ``flags``, its checkpoints in ``storage`` (default: the folder ``root/checkpoints``; a
    path or an fsspec URL), stopped on exit."""
    paths = {name: str(build_model(root / "models" / name, family, seed=seed)) for name, (family, seed) in models.items()}
    db_url = f"sqlite:///{root / 'ember.db'}"
    store = Store.open(db_url)
    key = store.create_api_key("alice")[1]
    store.close()
    port = free_port()
    log = root / "server.log"
    storage = storage or str(root / "checkpoints")
    proc = serve(["--database-url", db_url, "--storage", storage, "--max-rank", "16",
                  *(a for name, path in paths.items() for a in ("--model", f"{name}={path}")), *flags,
                  "--port", str(port), "--long-poll", "10"], log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, engines=True)
        yield Server(f"http://127.0.0.1:{port}", db_url, storage, paths, {"alice": key}, log, proc)
    finally:
        stop(proc)
