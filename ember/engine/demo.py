"""A short engine demo: two adapters learn different tasks in the same packed batches.

Adapter A learns "next token = token + 1", adapter B "next token = token + 2", over a small random
Qwen3-shaped model. Every step runs ONE forward/backward over both adapters' sequences, then one
AdamW step per adapter; both losses fall. The adapters are then checkpointed and exported as PEFT.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ember.core.adapters import LoraConfig
from ember.core.config import config_from_hf
from ember.core.loading import random_model
from ember.core.optim import AdamParams
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput

TINY_QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
}


def _task(shift: int, rng: np.random.Generator, vocab: int, n: int, length: int) -> list[Datum]:
    datums = []
    for _ in range(n):
        start = int(rng.integers(0, vocab))
        seq = (start + shift * np.arange(length + 1)) % vocab
        datums.append(Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(length, np.float32)}))
    return datums


def run_demo(steps: int = 100, device: str = "cpu", out: Path | None = None, seed: int = 0) -> dict[str, list[float]]:
    """Train the two adapters for ``steps`` steps; returns each adapter's per-token loss history."""
    torch.manual_seed(seed)
    cfg = config_from_hf(TINY_QWEN3)
    worker = Worker(random_model(cfg, device, torch.float32, seed=seed), max_adapters=4, max_rank=16)
    slots = {
        "plus1": worker.create_adapter(LoraConfig(rank=8, alpha=16, seed=1)),
        "plus2": worker.create_adapter(LoraConfig(rank=16, alpha=16, seed=2)),
    }
    shifts = {"plus1": 1, "plus2": 2}
    rng = np.random.default_rng(seed)
    history: dict[str, list[float]] = {k: [] for k in slots}
    hp = AdamParams(learning_rate=1e-2)
    t0 = time.time()
    for step in range(steps):
        requests = [
            ForwardBackwardInput(slot, _task(shifts[name], rng, cfg.vocab_size, 8, 32)) for name, slot in slots.items()
        ]
        outs = worker.forward_backward(requests)
        for (name, slot), o in zip(slots.items(), outs):
            history[name].append(o.metrics["loss:sum"] / (8 * 32))
            worker.optim_step(slot, hp)
        if step % 5 == 0 or step == steps - 1:
            losses = "  ".join(f"{k}: {v[-1]:.3f}" for k, v in history.items())
            print(f"step {step:3d}  per-token loss  {losses}  ({time.time() - t0:.1f}s)", flush=True)
    if out is not None:
        out = Path(out)
        for name, slot in slots.items():
            worker.save_adapter(slot, out / f"{name}-checkpoint", with_optimizer=True, overwrite=True)
            worker.export_peft(slot, out / f"{name}-peft", base_model="ember-demo-tiny-qwen3")
        print(f"checkpoints and PEFT exports written to {out}")
    return history
