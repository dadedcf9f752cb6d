"""A live ``ember serve`` for the ember.rl tests: a tiny random Qwen3 (byte-level BPE) and a small
character-level Qwen3 for the arithmetic demo, both built locally. ``--max-adapters`` is small on
purpose, so RL loops (one sampler snapshot per step) run past it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from ember.engine.builtin import build_model
from tests.live_server import free_port, serve, stop, wait_ready

MAX_ADAPTERS = 6
# The demo's model (examples/arithmetic/demo.py): one token per character, so digits are tokens.
CHAR_MODEL = dict(tokenizer_vocab=259, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)


@dataclass
class RLServer:
    base_url: str
    models: dict[str, str]  # served name -> folder (also the tokenizer)
    log: Path

    def use(self, monkeypatch) -> None:
        """Point the tinker SDK at this server (environment of the current test)."""
        for k, v in {"TINKER_BASE_URL": self.base_url, "TINKER_API_KEY": "tml-rl-tests", "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1"}.items():
            monkeypatch.setenv(k, v)


@pytest.fixture(scope="session")
def rl_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    models = {"tiny": str(build_model(root / "tiny", "qwen3", seed=1)),
              "chars": str(build_model(root / "chars", "qwen3", seed=0, **CHAR_MODEL))}
    port = free_port()
    log = root / "server.log"
    args = ["--database-url", f"sqlite:///{root / 'ember.db'}", "--storage", str(root / "checkpoints"), "--no-auth",
            "--port", str(port), "--max-rank", "32", "--max-adapters", str(MAX_ADAPTERS), "--long-poll", "10"]
    for name, path in models.items():
        args += ["--model", f"{name}={path}"]
    proc = serve(args, log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, engines=True)
        yield RLServer(f"http://127.0.0.1:{port}", models, log)
    finally:
        stop(proc)


@pytest.fixture
def rl_env(rl_server, monkeypatch):
    rl_server.use(monkeypatch)
    return rl_server
