"""Metrics of a run: one JSON line per step in ``metrics.jsonl``, and TensorBoard / Weights & Biases
when they are installed and asked for."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("ember.rl")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (empty if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Writes ``{"step": s, ...}`` records to ``log_dir/metrics.jsonl`` (and to the optional sinks).

    ``resume_step``: a resumed run first drops records at or after that step (written after the
    checkpoint it resumes from), so the file reads as one uninterrupted run.
    """

    def __init__(self, log_dir: str | Path, config: dict[str, Any], *, resume_step: int | None = None,
                 tensorboard: bool = False, wandb_project: str | None = None, run_name: str | None = None):
        self.path = Path(log_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) < resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(log_dir) / "tensorboard"))
            except ImportError:
                log.warning("tensorboard = true but the tensorboard package is not installed; skipping it")
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(log_dir),
                                         resume="allow")
            except ImportError:
                log.warning("wandb_project is set but the wandb package is not installed; skipping it")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one record (non-finite floats are written as null)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": step, **clean}) + "\n")
        numbers = {k: v for k, v in clean.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
