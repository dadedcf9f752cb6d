"""Trainer checkpoints for exact resume: the service holds the weights and optimizer state
(``save_state``); ``log_dir/checkpoints.jsonl`` holds, per checkpoint, its ``tinker://`` path, the
step, the data position and the trainer's RNG state."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainerState:
    """Everything besides the weights that a resumed run needs to continue exactly."""

    step: int  # iterations done
    data_position: int  # training examples / problems consumed
    rng_state: dict[str, Any]  # numpy bit_generator.state
    state_path: str  # tinker://…/weights/NAME (weights + optimizer)
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(log_dir: str | Path, training_client: Any, state: TrainerState, name: str) -> TrainerState:
    """``save_state(name)`` on the service, then append the record to ``checkpoints.jsonl``."""
    state.state_path = training_client.save_state(name).result().path
    path = Path(log_dir) / "checkpoints.jsonl"
    with open(path, "a") as fh:
        fh.write(json.dumps({"name": name, **asdict(state)}) + "\n")
    return state


def latest_checkpoint(log_dir: str | Path) -> TrainerState | None:
    """The last checkpoint recorded in ``log_dir`` (None if there is none)."""
    path = Path(log_dir) / "checkpoints.jsonl"
    if not path.exists():
        return None
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not lines:
        return None
    rec = lines[-1]
    rec.pop("name", None)
    return TrainerState(**rec)
