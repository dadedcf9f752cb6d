"""``stable_reinforce`` straight from ``shared/spec/stability.md``, in float64 over full-vocabulary
logits: the reference the engine's chunked, gathered implementation is checked against.

Also the sampler's kept set (temperature, then top-k, then top-p, vLLM's order) recomputed from
logits, for checks that only have a model's logits (the SDK scenario)."""

from __future__ import annotations

import numpy as np
import torch


def kept_set(z: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, q)`` of one row of logits ``z`` ``[V]``: most likely first, ``q`` renormalised."""
    p = np.exp(z / temperature - np.logaddexp.reduce(z / temperature))
    order = np.argsort(-p, kind="stable")
    p = p[order]
    if 0 < top_k < p.size:
        p = p[:top_k]
    p = p / p.sum()
    before = np.cumsum(p) - p
    keep = before < top_p if top_p < 1 else np.ones(p.size, bool)
    return order[: keep.sum()], p[keep] / p[keep].sum()


def loss(
    logits: torch.Tensor,
    targets: np.ndarray,
    rows: dict[int, dict],
    advantages: np.ndarray,
    tis_cap: float = 0.0,
    kl_coeff: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, logprobs [N])`` from float64 ``logits`` ``[N, V]``. ``rows`` maps each position
    with a record to ``{"ids", "q", "temperature", "truncated", "logq_y"}``; other positions return
    the plain log-softmax of their target and add nothing to the loss."""
    total = logits.new_zeros(())
    out = torch.log_softmax(logits, dim=-1).gather(1, torch.as_tensor(targets)[:, None])[:, 0].clone()
    for t, r in rows.items():
        tau = r["temperature"] if r["temperature"] > 0 else 1.0
        z = logits[t] / tau
        ids = torch.as_tensor(np.asarray(r["ids"], np.int64))
        q = torch.as_tensor(np.asarray(r["q"], np.float64))
        y = int(targets[t])
        A = float(advantages[t])
        q_y = float(np.exp(r["logq_y"]))
        if r["truncated"]:
            lp = z[ids] - torch.logsumexp(z[ids], 0)  # log p_S over the kept set
            p = lp.exp()
            lp_y = lp[(ids == y).nonzero()[0, 0]]
            w = torch.ones_like(q) if not tis_cap else (p / q).clamp(0, tis_cap).detach()
            w_y = 1.0 if not tis_cap else float((lp_y.detach().exp() / q_y).clamp(0, tis_cap))
            center = ((q * w).detach() * lp).sum()
            kl = (p * (lp - q.log())).sum()
        else:
            full = torch.log_softmax(z, 0)
            lp, p = full[ids], full[ids].exp()
            lp_y = full[y]
            rho = float((1 - q.sum()) / max(float(1 - p.sum().detach()), 1e-6))
            if tis_cap:
                m, alpha = torch.minimum(p, tis_cap * q), min(1.0, tis_cap * rho)
                w_y = float((lp_y.detach().exp() / q_y).clamp(0, tis_cap))
            else:
                m, alpha, w_y = q, rho, 1.0
            center = ((m - alpha * p).detach() * lp).sum()
            p_tail, q_tail = 1 - p.sum(), 1 - q.sum()
            kl = (p * (lp - q.log())).sum() + p_tail * (p_tail.log() - torch.log(q_tail))
        total = total - A * (w_y * lp_y - center) + kl_coeff * kl
        out[t] = lp_y
    return total, out
