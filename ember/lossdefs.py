"""The Tinker loss functions Ember serves: their inputs and config keys (no torch here, so the API
layer can validate requests before they reach the engine). Formulas: ``ember.core.losses``."""

from __future__ import annotations

from dataclasses import dataclass, field

# The stability record of sampling with record_stability_info (shared/spec/stability.md):
STABILITY_SUPPORT_MAX = 256  # truncated sampling: the largest kept set recorded per token (the request's top_k)
STABILITY_HEAD = 64  # untruncated sampling: the most likely tokens recorded per token (K_head)


@dataclass(frozen=True)
class LossSpec:
    """Required and optional ``loss_fn_inputs`` and ``loss_fn_config`` defaults of one loss."""

    inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config: dict[str, float | None] = field(default_factory=dict)  # None = required
    allows_2d_targets: bool = False
    needs_provenance: bool = False  # every datum names the sampled sequences it reproduces
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)  # allowed config ranges


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
    # Ember's definition (shared/spec/stability.md, docs/rl.md): support replay, score centering and
    # R3 from the stability record; tis_cap 0 = no TIS; routing_replay 0 = route live (diagnostics)
    "stable_reinforce": LossSpec(
        inputs=("target_tokens", "advantages"),
        optional_inputs=("logprobs",),
        config={"tis_cap": 0.0, "kl_coeff": 0.0, "routing_replay": 1.0},
        needs_provenance=True,
        bounds={"tis_cap": (0.0, 1e6), "kl_coeff": (0.0, 1e6), "routing_replay": (0.0, 1.0)},
    ),
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
        lo, hi = spec.bounds.get(key, (float("-inf"), float("inf")))
        if not lo <= out[key] <= hi:
            raise ValueError(f"loss_fn_config[{key!r}]={value} must be between {lo:g} and {hi:g} for loss_fn {loss_fn!r}")
    return out
