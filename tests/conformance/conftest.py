"""A live ``ember serve`` on 127.0.0.1 for the conformance scenarios (spec §7).

One server per test session serves a tiny random Qwen3 and a tiny Qwen3-MoE, each with a locally
built tokenizer, on the database backend of ``tests.store.backend`` (SQLite, or PostgreSQL with
``EMBER_TEST_POSTGRES_URL``). Checkpoints go through fsspec (a ``file://`` URL) on SQLite and a plain
folder on PostgreSQL, so each CI backend run covers one storage kind. Extra API-only processes on
the same database serve other client flags (chunk size, zstd, serial chunks, retrieve_futures +
join_sampling_session, server-side custom losses). Each scenario runs
the official SDK in its own subprocess (the SDK keeps process-wide singletons).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ember.engine.builtin import build_model
from ember.store import Store
from tests.live_server import REPO, free_port, serve, stop, wait_ready
from tests.store.backend import backend, fresh_database

MODELS = {"tiny-qwen3": ("qwen3", 1), "tiny-qwen3-moe": ("qwen3_moe", 2)}


@dataclass
class Server:
    base_url: str
    database_url: str
    storage: str
    models: dict[str, str]
    keys: dict[str, str]
    log: Path
    proc: subprocess.Popen
    extra: dict[str, str] = field(default_factory=dict)  # flag name -> base URL of an API-only server

    def env(self, key: str = "alice", **extra) -> dict[str, str]:
        conf = {"base_url": self.base_url, "database_url": self.database_url, "models": self.models,
                "keys": self.keys, "extra": self.extra, "storage": self.storage}
        env = dict(os.environ, TINKER_BASE_URL=self.base_url, TINKER_API_KEY=self.keys[key], HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", EMBER_CONFORMANCE=json.dumps(conf), PYTHONPATH=str(REPO))
        env.update(extra)
        return env


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    models = {name: str(build_model(root / "models" / name, family, seed=seed)) for name, (family, seed) in MODELS.items()}
    with fresh_database(root) as db_url:
        storage = f"file://{root / 'checkpoints'}" if backend() == "sqlite" else str(root / "checkpoints")
        # Keys: one made with the CLI (as an admin would), one through the store.
        out = subprocess.run([sys.executable, "-m", "ember.cli", "keys", "create", "--name", "alice",
                              "--database-url", db_url], check=True, capture_output=True, text=True, cwd=REPO)
        alice = out.stdout.strip()
        store = Store.open(db_url)
        bob = store.create_api_key("bob")[1]
        store.close()
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = root / "server.log"
        common = ["--database-url", db_url, "--storage", storage, "--max-rank", "16", "--long-poll", "10"]
        for name, path in models.items():
            common += ["--model", f"{name}={path}"]
        proc = serve([*common, "--port", str(port), "--max-adapters", "24", "--full-finetune"], log)
        extra_procs = []
        try:
            wait_ready(base, proc, log, engines=True)
            flags = {"chunk2": {"fwdbwd_max_chunk_len": 2},
                     "serial": {"fwdbwd_max_chunk_len": 2, "parallel_fwdbwd_chunks": False},
                     "zstd": {"fwdbwd_max_chunk_len": 3, "proto_compress_fwdbwd": True},
                     "futures": {"sample_use_retrieve_futures": True, "sample_join_sampling_session": True},
                     "custom_loss": {"custom_loss_server_side": True},
                     "jwt": {"pjwt_auth_enabled": True}}
            extra = {}
            for name, cfg in flags.items():
                p = free_port()
                extra_procs.append(serve([*common, "--port", str(p), "--api-only", "--client-config", json.dumps(cfg)],
                                          root / f"api-{name}.log"))
                extra[name] = f"http://127.0.0.1:{p}"
            for (name, url), p in zip(extra.items(), extra_procs):
                wait_ready(url, p, root / f"api-{name}.log", engines=False)
            yield Server(base, db_url, storage, models, {"alice": alice, "bob": bob}, log, proc, extra)
        finally:
            for p in extra_procs:
                stop(p)
            stop(proc)


def run_scenario(server: Server, name: str, key: str = "alice", timeout_s: float = 300, **env) -> str:
    """Run ``tests/conformance/scenarios/{name}.py`` with the SDK against ``server``; returns stdout."""
    proc = subprocess.run([sys.executable, "-m", f"tests.conformance.scenarios.{name}"], env=server.env(key, **env),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise AssertionError(
            f"scenario {name} failed (exit {proc.returncode})\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
            f"{proc.stderr[-6000:]}\n--- server log (tail)\n{server.log.read_text()[-4000:]}"
        )
    return proc.stdout
