"""The Tinker loss functions Ember serves: their inputs and config keys (no torch here, so the API
layer can validate requests before they reach the engine). Formulas: ``ember.core.losses``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LossSpec:
    """Required and optional ``loss_fn_inputs`` and ``loss_fn_config`` defaults of one loss."""

    inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config: dict[str, float | None] = field(default_factory=dict)  # None = required
    allows_2d_targets: bool = False


LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(inputs=("target_tokens",), optional_inputs=("weights",), allows_2d_targets=True),
    "importance_sampling": LossSpec(inputs=("target_tokens", "logprobs", "advantages")),
    "ppo": LossSpec(
        inputs=("target_tokens", "logprobs", "advantages"),
        config={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    ),
    "cispo": LossSpec(
        inputs=("target_tokens", "logprobs", "advantages"),
        config={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    ),
    "dro": LossSpec(inputs=("target_tokens", "logprobs", "advantages"), config={"beta": None}),
}


def resolve_loss_config(loss_fn: str, config: dict[str, float] | None) -> dict[str, float]:
    """The loss's config with defaults filled in; ``ValueError`` for an unknown loss or missing key.

    Unknown config keys are ignored (clients may send keys other servers understand)."""
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; supported: {sorted(LOSS_SPECS)}")
    config = dict(config or {})
    out = {}
    for key, default in spec.config.items():
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"loss_fn {loss_fn!r} needs loss_fn_config[{key!r}]")
        out[key] = float(value)
    return out
