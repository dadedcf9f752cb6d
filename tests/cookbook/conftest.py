"""A live ``ember serve`` for tinker-cookbook 0.6.1 recipes, run unmodified and offline.

The tiny random Qwen3 (local byte-level BPE tokenizer, 4096-token context for the multi-turn
recipe) is served under its absolute folder path: the cookbook passes ``model_name`` both as the
service's ``base_model`` and to ``get_tokenizer``, which loads a local folder offline (spec
tinker_api.md §6.5-6.6). Recipes run with ``renderer_name=role_colon`` in their own subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ember.engine.builtin import build_model
from tests.live_server import free_port, serve, stop, wait_ready

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CookbookServer:
    base_url: str
    model: str  # the served name = the tokenizer folder
    log: Path

    def env(self) -> dict[str, str]:
        return dict(os.environ, TINKER_BASE_URL=self.base_url, TINKER_API_KEY="tml-cookbook-tests", HF_HUB_OFFLINE="1",
                    HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO), WANDB_MODE="disabled")

    def recipe(self, module: str, args: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
        """Run ``python -m module key=value...``; fails the test with the output tails if it fails."""
        proc = subprocess.run([sys.executable, "-m", module, *args], env=self.env(), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
        if proc.returncode != 0:
            raise AssertionError(f"{module} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                                 f"{proc.stderr[-5000:]}\n--- server log\n{self.log.read_text()[-3000:]}")
        return proc


@pytest.fixture(scope="session")
def cookbook_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    model = str(build_model(root / "models" / "tiny-qwen3", "qwen3", seed=1, max_position_embeddings=4096))
    port = free_port()
    log = root / "server.log"
    proc = serve(["--database-url", f"sqlite:///{root / 'ember.db'}", "--storage", str(root / "checkpoints"),
                   "--no-auth", "--model", f"{model}={model}", "--port", str(port), "--max-rank", "32",
                   "--long-poll", "10"], log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, log, engines=True)
        yield CookbookServer(f"http://127.0.0.1:{port}", model, log)
    finally:
        stop(proc)
