"""Internal request and result types shared by the API layer and the engine (numpy, no torch).

These are Ember's own shapes, not Tinker's wire formats: the API layer decodes JSON/protobuf into
them, the engine executes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says which field and why (a 4xx for clients)."""


@dataclass
class Datum:
    """One training example: ``tokens`` (model input, length N) and per-position loss inputs
    (``target_tokens`` ``[N]`` or ``[N, K]``, ``weights``, ``logprobs``, ``advantages`` …)."""

    tokens: np.ndarray
    loss_inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardInput:
    """One model's forward(_backward) over its datums, as one piece of a packed pass."""

    slot: int
    datums: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False


@dataclass
class ForwardBackwardOutput:
    """Per-datum target log-probabilities (shape of ``target_tokens``) and ``name:reduction`` metrics."""

    logprobs: list[np.ndarray]
    metrics: dict[str, float]


@dataclass
class RequestError:
    """A request that failed on its own without failing the rest of its batch."""

    message: str
    category: str = "user"
