"""Policy-gradient losses, loss aggregation, KL estimators and rollout corrections (spec §5.2–5.7,
§5.11–5.12), in plain torch.

Tensors are padded to ``[B, T]`` (B sequences of T loss positions) with a float ``mask`` that is 1 on
the tokens the policy sampled. Per-token losses are returned unaggregated; :func:`aggregation_weights`
gives the per-token coefficients of each aggregation mode, so the same weights can either multiply a
client-side loss or be folded into the advantages of a server-side Tinker loss (which sums over
tokens, spec §5.13).

Notation (§5.0): ``logp`` = log π_θ (trainer, current params), ``old_logp`` = log π_old (trainer at
rollout params), ``sampler_logp`` = log μ (the sampler), ``adv`` = advantages broadcast to tokens.
"""

from __future__ import annotations

import torch

from ember.rl.config import AGGREGATIONS, CORRECTIONS

__all__ = ["AGGREGATIONS", "CORRECTIONS"]  # the allowed names live with the (torch-free) config


def reinforce_loss(logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """On-policy REINFORCE ``ℓ_t = −A_t · log π_θ(y_t)`` (§5.6)."""
    return -adv * logp


def importance_sampling_loss(logp: torch.Tensor, sampler_logp: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Tinker ``importance_sampling``: ``ℓ_t = −(π_θ/μ)(y_t) · A_t``, no clipping (§5.6, §5.13)."""
    return -torch.exp(logp - sampler_logp) * adv


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher and optional dual clip (§5.3).

    ``ℓ_t = max(−r A, −clip(r, 1−ε_low, 1+ε_high) A)``; with ``dual_clip = c`` and ``A < 0``:
    ``ℓ_t ← min(ℓ_t, −c A)`` (arXiv:1912.09729). Returns the per-token loss and boolean masks of the
    tokens where the clipped branch (low or high) or the dual clip is active.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (c = 3 is usual), got {dual_clip}")
    r = torch.exp(logp - old_logp)
    unclipped = -r * adv
    clipped = -torch.clamp(r, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped  # the clipped branch sets the value (and zeroes the gradient)
    info = {"clip_low": active & (adv < 0), "clip_high": active & (adv > 0)}
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        info["dual_clip"] = dual
    return loss, info


def cispo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float = 1.0, eps_high: float = 3.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO ``ℓ_t = −sg(clip(r, 1−ε_low, 1+ε_high)) · A_t · log π_θ`` (§5.11, MiniMax-M1); the
    defaults clamp r to [0, 4], Tinker's ``cispo`` defaults. Never zeroes a token's gradient."""
    r = torch.exp(logp - old_logp).detach()
    w = torch.clamp(r, 1.0 - eps_low, 1.0 + eps_high)
    return -w * adv * logp, {"clip_low": r < 1.0 - eps_low, "clip_high": r > 1.0 + eps_high}


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    seq_adv: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (§5.12, arXiv:2507.18071): per-sequence loss ``−min(s_i A_i, clip(s_i, 1−ε_l, 1+ε_h) A_i)``
    with ``s_i = exp(mean_t log(π_θ/π_old))`` over the sampled tokens. Returns ``[B]`` losses (the
    caller averages over sequences, as GSPO does) and per-sequence clip masks."""
    n = mask.sum(-1).clamp_min(1.0)
    log_s = ((logp - old_logp) * mask).sum(-1) / n
    s = torch.exp(log_s)
    unclipped = -s * seq_adv
    clipped = -torch.clamp(s, 1.0 - eps_low, 1.0 + eps_high) * seq_adv
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    return loss, {"clip_low": active & (seq_adv < 0), "clip_high": active & (seq_adv > 0)}


def aggregation_weights(
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Per-token coefficients ``c`` such that ``Σ c·ℓ`` is the aggregated loss (§5.2, verl ``agg_loss``).

    ``num_tokens`` / ``num_seqs`` are the *global* counts over the whole optimizer batch (defaults:
    this tensor's), so splitting a batch into mini- or micro-batches does not change the weighting.
    ``seq-mean-token-sum-norm`` (Dr. GRPO) divides by the constant ``max_len``.
    """
    mask = mask.to(torch.float64) if mask.dtype == torch.bool else mask
    if mode == "token-mean":
        n = float(mask.sum()) if num_tokens is None else float(num_tokens)
        return mask / max(n, 1.0)
    if mode == "seq-mean-token-mean":
        g = float(mask.shape[0]) if num_seqs is None else float(num_seqs)
        per_seq = mask.sum(-1, keepdim=True).clamp_min(1.0)
        return mask / per_seq / max(g, 1.0)
    if mode == "seq-mean-token-sum":
        g = float(mask.shape[0]) if num_seqs is None else float(num_seqs)
        return mask / max(g, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if not max_len or max_len <= 0:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the constant divisor L_max)")
        return mask / float(max_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; one of {', '.join(AGGREGATIONS)}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimators of KL(π_θ ‖ π_ref) on tokens sampled from π_θ, with ``Δ = log π_ref − log π_θ``
    (Schulman, "Approximating KL divergence"): k1 = −Δ, k2 = ½Δ², k3 = e^Δ − Δ − 1 (§5.3)."""
    delta = ref_logp - logp
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta**2
    if estimator == "k3":
        return torch.expm1(delta) - delta
    raise ValueError(f"unknown KL estimator {estimator!r}; one of k1, k2, k3")


def rollout_correction(
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "none",
    *,
    tis_cap: float = 2.0,
    tis_min: float | None = None,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
    seq_low: float = 0.999,
    seq_high: float = 1.002,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached per-token weights ``w`` on ``ρ = π_old/μ`` that multiply the policy loss (§5.7).

    ``is``: w = ρ; ``tis``: w = min(ρ, C) (and ≥ C_min if given); ``icepop``: w = ρ·1[α ≤ ρ ≤ β];
    ``seq_mask``: keep a sequence iff exp(mean_t log ρ) ∈ [lo, hi], with the raw token ρ inside;
    ``seq_is``: w_i = exp(Σ_t log ρ_{i,t}) on every token of the sequence; ``none``: w = 1.
    Returns the weights (zero off the mask) and the fraction of sampled tokens masked out.
    """
    mask_f = mask.to(old_logp.dtype)
    log_rho = ((old_logp - sampler_logp) * mask_f).detach()
    rho = torch.exp(log_rho)
    rejected = torch.zeros_like(mask_f, dtype=torch.bool)
    if kind == "none":
        w = torch.ones_like(rho)
    elif kind == "is":
        w = rho
    elif kind == "tis":
        w = torch.clamp(rho, max=tis_cap)
        if tis_min is not None:
            w = torch.clamp(w, min=tis_min)
    elif kind == "icepop":
        keep = (rho >= icepop_low) & (rho <= icepop_high)
        w = rho * keep
        rejected = ~keep
    elif kind == "seq_mask":
        n = mask_f.sum(-1, keepdim=True).clamp_min(1.0)
        geo = torch.exp(log_rho.sum(-1, keepdim=True) / n)
        keep = (geo >= seq_low) & (geo <= seq_high)
        w = rho * keep
        rejected = (~keep).expand_as(rho)
    elif kind == "seq_is":
        w = torch.exp(log_rho.sum(-1, keepdim=True)).expand_as(rho).clone()
    else:
        raise ValueError(f"unknown rollout correction {kind!r}; one of {', '.join(CORRECTIONS)}")
    n_tok = float(mask_f.sum().clamp_min(1.0))
    masked = float((rejected.to(mask_f.dtype) * mask_f).sum()) / n_tok
    return (w * mask_f).detach(), {"correction/masked_frac": masked, "correction/mean_weight": float((w * mask_f).sum()) / n_tok}


def logprob_gap(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Rollout/trainer mismatch on the sampled tokens: mean |log π − log μ| and the k3 estimate of
    KL(μ ‖ π) (tokens drawn from μ, Δ = log π − log μ)."""
    m = mask.to(torch.float64)
    d = (trainer_logp.to(torch.float64) - sampler_logp.to(torch.float64)) * m
    n = float(m.sum().clamp_min(1.0))
    return {"gap/mean_abs_logprob_diff": float(d.abs().sum()) / n,
            "gap/k3_kl": float(((torch.expm1(d) - d) * m).sum()) / n}
