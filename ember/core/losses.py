"""Tinker's loss functions, as sums over tokens (``shared/spec/tinker_api.md`` §3.4).

``lp`` are the learner's log-probabilities of the target tokens, ``q`` the sampler's (input
``logprobs``), ``A`` the advantages and ``r = exp(lp - q)``:

* ``cross_entropy``:       ``-Σ w·lp``
* ``importance_sampling``: ``-Σ r·A``
* ``ppo``:                 ``-Σ min(r·A, clip(r, lo, hi)·A)``
* ``cispo``:               ``-Σ sg(clip(r, lo, hi))·lp·A``
* ``dro``:                 ``-Σ (lp·A - ½β(lp - q)²)``
"""

from __future__ import annotations

import torch

from ember.lossdefs import resolve_loss_config


def loss_sum(loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict | None = None) -> torch.Tensor:
    """The summed loss (fp32 scalar) over the tokens of ``lp`` (``[T]``, or ``[T, K]`` for
    ``cross_entropy`` with 2-D targets), with ``inputs`` aligned to ``lp``."""
    cfg = resolve_loss_config(loss_fn, config)
    if loss_fn == "cross_entropy":
        w = inputs.get("weights")
        return -(lp if w is None else w * lp).sum()
    q, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - q).square()).sum()
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv).sum()
    if loss_fn == "cispo":
        return -(ratio.clamp(lo, hi).detach() * lp * adv).sum()
    raise AssertionError(loss_fn)
