"""What ``ember rl`` and ``ember sft`` share: the Tinker clients, the tokenizer, the learning-rate
schedule, the progress bar and the end-of-run files. Only the public ``tinker`` client API is used."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from tinker import types

from ember.rl.checkpoint import TrainerState, latest_checkpoint
from ember.rl.config import OptimConfig, RunConfig, service_env, to_dict
from ember.rl.metrics import MetricsLogger

log = logging.getLogger("ember.rl")


def learning_rate(cfg: OptimConfig, step: int, total: int) -> float:
    """The learning rate at ``step`` of ``total``: linear warmup, then constant / linear / cosine decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total <= cfg.warmup_steps:
        return cfg.learning_rate
    frac = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    if cfg.schedule == "linear":
        return cfg.learning_rate * (1.0 - frac)
    return cfg.learning_rate * 0.5 * (1.0 + math.cos(math.pi * frac))


def adam(cfg: OptimConfig, step: int, total: int) -> types.AdamParams:
    """Tinker ``AdamParams`` for ``step``."""
    return types.AdamParams(learning_rate=learning_rate(cfg, step, total), beta1=cfg.beta1, beta2=cfg.beta2,
                            eps=cfg.eps, weight_decay=cfg.weight_decay, grad_clip_norm=cfg.grad_clip_norm)


class Run:
    """The clients and bookkeeping of one training run (resumed from ``log_dir`` when possible)."""

    def __init__(self, cfg: RunConfig, kind: str):
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.resumed: TrainerState | None = latest_checkpoint(self.log_dir) if cfg.resume else None
        if not cfg.resume:
            (self.log_dir / "checkpoints.jsonl").unlink(missing_ok=True)
        (self.log_dir / "config.json").write_text(json.dumps({"kind": kind, **to_dict(cfg)}, indent=2))
        self.service = tinker.ServiceClient(**service_env(cfg))
        if self.resumed is not None:
            log.info("resuming from %s (step %d)", self.resumed.state_path, self.resumed.step)
            self.training = self.service.create_training_client_from_state_with_optimizer(
                self.resumed.state_path).result()
        elif cfg.init_from:
            self.training = self.service.create_training_client_from_state(cfg.init_from).result()
        else:
            self.training = self.service.create_lora_training_client(
                base_model=cfg.base_model, rank=cfg.lora_rank, seed=cfg.lora_seed).result()
        self.tokenizer = self._tokenizer()
        self.rng = np.random.default_rng(cfg.seed)
        self.start_step, self.data_position = 0, 0
        if self.resumed is not None:
            self.rng.bit_generator.state = self.resumed.rng_state
            self.start_step, self.data_position = self.resumed.step, self.resumed.data_position
        self.metrics = MetricsLogger(self.log_dir, to_dict(cfg), resume_step=self.start_step if self.resumed else None,
                                     tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project,
                                     run_name=self.log_dir.name)

    def _tokenizer(self) -> Any:
        if self.cfg.tokenizer:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.cfg.tokenizer)
        return self.training.get_tokenizer()

    def sampler(self) -> Any:
        """A sampling client on the current weights (an in-memory snapshot on the service); it
        records stability information when the loss replays it (``stable_reinforce``)."""
        loss = getattr(self.cfg, "loss", None)
        record = loss is not None and loss.kind == "stable_reinforce"
        return self.training.save_weights_and_get_sampling_client(record_stability_info=record).result()

    def state(self, step: int, data_position: int, **extra: Any) -> TrainerState:
        return TrainerState(step=step, data_position=data_position, rng_state=self.rng.bit_generator.state,
                            state_path="", extra=extra)

    def progress(self, total: int, desc: str) -> Any:
        """A tqdm progress bar (disabled when ``progress = false``)."""
        from tqdm import tqdm

        return tqdm(total=total, initial=self.start_step, desc=desc, disable=not self.cfg.progress,
                    dynamic_ncols=True, file=sys.stderr)

    def close(self, status: str = "success") -> None:
        """Close the metric sinks and finish the service session (``status``: success | errored | interrupted)."""
        self.metrics.close()
        self.service.close(status).result()
