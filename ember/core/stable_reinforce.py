"""Ember's ``stable_reinforce`` loss: REINFORCE with sample-support replay and score centering
(``shared/spec/stability.md``; background in ``shared/research/rl_at_scale.md`` §2–3).

Per target position ``t`` with a sampler record, the trainer's logits ``z_t`` (fp32) and the
record's support ``S_t`` with the sampler's probabilities ``q_t`` at its temperature ``τ``:

Truncated sampling (``S_t`` is the kept set after temperature, top-k and top-p; ``kind`` 1)::

    log p_S(v) = z_t[v]/τ − logsumexp_{u∈S_t} z_t[u]/τ          # sample-support replay
    w_v        = 1, or clamp(p_S(v)/q_t(v), 0, tis_cap)           # token TIS (optional)
    C_t        = Σ_{v∈S_t} sg(q_t(v)·w_v) · log p_S(v)            # score centering, exact over S_t
    ℓ_t        = −A_t · (sg(w_y)·log p_S(y_t) − C_t)
               + kl_coeff · Σ_{v∈S_t} p_S(v)(log p_S(v) − log q_t(v))

Untruncated sampling (``S_t`` = the head ``H``, the sampler's most likely tokens; ``kind`` 2),
with ``p`` the full-vocabulary ``softmax(z_t/τ)``, the head/tail estimator (arXiv:2609.20807
Eq. 14; miles' ``_score_topk``)::

    ρ   = (1 − Σ_H q) / max(1 − Σ_H p, 1e-6)
    C_t = Σ_{v∈H} sg(m_v − α·p_v) · log p(v),   m_v = q_v, α = ρ          (no TIS)
                                                m_v = min(p_v, c·q_v), α = min(1, c·ρ)   (TIS, cap c)
    ℓ_t = −A_t · (sg(w_y)·log p(y_t) − C_t)
        + kl_coeff · (Σ_{v∈H} p_v(log p_v − log q_v) + p_tail(log p_tail − log q_tail))

(the KL of the head plus the tail lumped into one outcome: a lower bound of the full KL). In both
cases the gradient is ``−A_t(w_y ∇log p(y_t) − E_q[w ∇log p])``: the policy gradient minus its
drift under the sampler's distribution. Positions without a record (``kind`` 0: prompt positions,
or no provenance) carry no term.

The log-probabilities come from the chunked LM-head pass at the support's ids only
(:func:`ember.core.logprobs.token_logprobs` with per-row inverse temperatures): ``lp[:, 0]`` is the
target's, ``lp[:, 1:]`` the support's, all ``log softmax(z/τ)`` over the full vocabulary; the
renormalisation over ``S_t`` is done here, so no ``[T, V]`` tensor is ever kept.
"""

from __future__ import annotations

import torch

_FAR = -1e30  # stands in for -inf at padded support entries (finite: no NaN gradients)


def stable_reinforce(
    lp: torch.Tensor,
    kind: torch.Tensor,
    valid: torch.Tensor,
    q: torch.Tensor,
    advantages: torch.Tensor,
    sampler_logprob: torch.Tensor,
    sampler_mass: torch.Tensor,
    tis_cap: float = 0.0,
    kl_coeff: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss_sum, logprobs [N], metric sums)`` of one datum (see module doc).

    ``lp`` ``[N, 1 + K]`` tempered log-probabilities (target, then support ids); ``kind`` ``[N]``
    (0/1/2); ``valid`` ``[N, K]`` (real support entries); ``q`` ``[N, K]`` the sampler's
    probabilities; ``advantages``, ``sampler_logprob`` (log q of the target), ``sampler_mass``
    ``[N]``. ``tis_cap`` 0: no TIS. The metric sums (``gap``, ``sampler_mass``, ``trainer_mass``,
    ``tokens``) run over the positions with a record."""
    dtype = lp.dtype
    q, adv = q.to(dtype), advantages.to(dtype)
    lp_y, lp_s = lp[:, 0], lp[:, 1:]
    truncated, head = kind == 1, kind == 2
    scored = truncated | head

    # sample-support replay: renormalise over the recorded kept set
    s_masked = torch.where(valid, lp_s, torch.full_like(lp_s, _FAR))
    lse = torch.logsumexp(s_masked, dim=-1)
    lps = torch.where(valid, lp_s - lse[:, None], torch.zeros_like(lp_s))
    lps_y = lp_y - lse
    ps = torch.exp(lps) * valid
    p_head = torch.exp(lp_s) * valid  # full-vocabulary probabilities of the head ids

    # truncated: exact score centering over S
    logq = torch.log(q.clamp_min(1e-30))
    if tis_cap > 0:
        w = (ps / q.clamp_min(1e-30)).clamp(0, tis_cap).detach() * valid
        w_y_trunc = torch.exp(lps_y - sampler_logprob.to(dtype)).clamp(0, tis_cap).detach()
    else:
        w, w_y_trunc = valid.to(dtype), torch.ones_like(lps_y)
    c_trunc = ((q * w).detach() * lps).sum(-1)
    term_trunc = -adv * (w_y_trunc * lps_y - c_trunc)
    kl_trunc = (ps * (lps - logq) * valid).sum(-1)

    # untruncated: head/tail estimator
    q_mass, p_mass = (q * valid).sum(-1), p_head.sum(-1)
    rho = ((1 - q_mass) / (1 - p_mass).clamp_min(1e-6)).detach()
    if tis_cap > 0:
        m = torch.minimum(p_head, tis_cap * q)
        alpha = torch.clamp(tis_cap * rho, max=1.0)
        w_y_head = torch.exp(lp_y - sampler_logprob.to(dtype)).clamp(0, tis_cap).detach()
    else:
        m, alpha, w_y_head = q, rho, torch.ones_like(lp_y)
    c_head = ((m - alpha[:, None] * p_head).detach() * valid * lp_s).sum(-1)
    term_head = -adv * (w_y_head * lp_y - c_head)
    p_tail, q_tail = (1 - p_mass).clamp_min(1e-12), (1 - q_mass).clamp_min(1e-12)
    kl_head = (p_head * (lp_s - logq) * valid).sum(-1) + p_tail * (torch.log(p_tail) - torch.log(q_tail))

    zero = torch.zeros_like(lp_y)
    term = torch.where(truncated, term_trunc, torch.where(head, term_head, zero))
    if kl_coeff:
        term = term + kl_coeff * torch.where(truncated, kl_trunc, torch.where(head, kl_head, zero))
    logprobs = torch.where(truncated, lps_y, lp_y)
    with torch.no_grad():
        metrics = {
            "gap": ((logprobs - sampler_logprob.to(dtype)).abs() * scored).sum(),
            "sampler_mass": (sampler_mass.to(dtype) * scored).sum(),
            "trainer_mass": (p_mass * scored).sum(),
            "tokens": scored.sum().to(dtype),
        }
    return term.sum(), logprobs, metrics
