"""The policy objective of one optimizer step, sent through the Tinker API.

Two ways to run the same objective (``LossConfig.backend``):

* **server**: a built-in Tinker loss (``cross_entropy`` for REINFORCE, ``importance_sampling``,
  ``ppo``, ``cispo``) with the aggregation weights and the detached rollout-correction weights folded
  into the per-token advantages. Every one of these losses is positively homogeneous in A, so
  ``w·ℓ(A) = ℓ(w·A)`` for ``w ≥ 0`` and the folded sum equals the aggregated, corrected loss.
* **custom**: ``forward_backward_custom`` with the loss computed here in torch on the returned
  log-probabilities — needed for GSPO (sequence-level ratio), the dual clip and a KL term inside the
  loss; costs one extra forward pass.

``auto`` picks ``server`` whenever it can express the configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tinker import types

from ember.rl import losses as L
from ember.rl.config import LossConfig
from ember.rl.rollouts import Trajectory


def pad(rows: list[list[float]] | list[np.ndarray], dtype=torch.float64, width: int | None = None) -> torch.Tensor:
    """Right-pad 1-D rows with zeros to ``[B, T]`` (T = the longest row, or ``width``)."""
    t = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), t, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.float64), dtype=dtype)
    return out


@dataclass
class TrainBatch:
    """Trajectories of one optimizer step in padded ``[B, T]`` form (T = loss positions)."""

    trajectories: list[Trajectory]
    seq_adv: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T]
    sampler_logp: torch.Tensor
    adv: torch.Tensor  # token advantages, after any KL-in-reward penalty
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None

    @classmethod
    def build(cls, trajectories: list[Trajectory], seq_adv: list[float]) -> TrainBatch:
        mask = pad([t.policy_mask[1:] for t in trajectories])
        sa = torch.as_tensor(np.asarray(seq_adv, dtype=np.float64))
        return cls(trajectories, sa, mask, pad([t.sampler_logprobs[1:] for t in trajectories]), sa[:, None] * mask)

    @property
    def lengths(self) -> list[int]:
        return [len(t.tokens) - 1 for t in self.trajectories]

    def select(self, idx: list[int]) -> TrainBatch:
        """The sub-batch of rows ``idx`` (a mini-batch)."""
        pick = (lambda x: None if x is None else x[idx])
        return TrainBatch([self.trajectories[i] for i in idx], self.seq_adv[idx], self.mask[idx],
                          self.sampler_logp[idx], self.adv[idx], pick(self.old_logp), pick(self.ref_logp))

    def pi_old(self) -> torch.Tensor:
        return self.sampler_logp if self.old_logp is None else self.old_logp

    def datums(self, inputs: dict[str, torch.Tensor] | None = None, provenance: bool = False) -> list[types.Datum]:
        """One Datum per trajectory (``input = tokens[:-1]``, ``target_tokens = tokens[1:]``) with
        the given ``[B, T]`` loss inputs cut back to each row's length; with ``provenance``, the
        spans naming the sampled sequences behind every position (``Datum.with_provenance``)."""
        out = []
        for i, (t, n) in enumerate(zip(self.trajectories, self.lengths)):
            fields: dict[str, Any] = {"target_tokens": list(t.tokens[1:])}
            for name, value in (inputs or {}).items():
                fields[name] = value[i, :n].to(torch.float32).tolist()
            datum = types.Datum(model_input=types.ModelInput.from_ints(t.tokens[:-1]), loss_fn_inputs=fields)
            if provenance:
                if t.spans is None:
                    raise RuntimeError("stable_reinforce needs every sample's sequence_id; the sampler returned none")
                datum = datum.with_provenance(model_input=_shift(t.spans, last=True), loss_fn_inputs=_shift(t.spans))
            out.append(datum)
        return out


def _shift(spans: list, last: bool = False) -> list:
    """Spans tiling ``tokens`` cut to tile ``tokens[:-1]`` (``last``: the model input) or
    ``tokens[1:]`` (the targets)."""
    spans = list(spans)
    i = -1 if last else 0
    edge = spans[i]
    if edge.length == 1:
        spans.pop(i)
    elif last:
        spans[i] = dataclasses.replace(edge, length=edge.length - 1)
    else:
        spans[i] = dataclasses.replace(edge, offset=edge.offset + 1, length=edge.length - 1)
    return spans


def apply_kl_to_advantages(batch: TrainBatch, cfg: LossConfig) -> dict[str, float]:
    """``kl_mode = "reward"``: subtract ``kl_coef · KL_t`` (estimator on μ vs π_ref) from each sampled
    token's advantage; returns the mean KL."""
    if batch.ref_logp is None:
        raise ValueError("a KL penalty needs the reference log-probabilities (batch.ref_logp)")
    kl = L.kl_estimate(batch.pi_old(), batch.ref_logp, cfg.kl_estimator) * batch.mask
    if cfg.kl_mode == "reward":
        batch.adv = batch.adv - cfg.kl_coef * kl
    return {"kl/policy_ref": float(kl.sum() / batch.mask.sum().clamp_min(1.0))}


def _correction(batch: TrainBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    return L.rollout_correction(batch.pi_old(), batch.sampler_logp, batch.mask, cfg.correction,
                                tis_cap=cfg.tis_cap, icepop_low=cfg.icepop_low, icepop_high=cfg.icepop_high,
                                seq_low=cfg.seq_mask_low, seq_high=cfg.seq_mask_high)


def token_coefficients(batch: TrainBatch, cfg: LossConfig, norm_len: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token aggregation × rollout-correction coefficients (detached, zero off the mask)."""
    corr, metrics = _correction(batch, cfg)
    return L.aggregation_weights(batch.mask, cfg.aggregation, max_len=norm_len) * corr, metrics


def objective_loss(logp: torch.Tensor, batch: TrainBatch, cfg: LossConfig, norm_len: int
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The aggregated, corrected loss (a scalar with a gradient to ``logp``) and its clip metrics."""
    lo, hi = cfg.eps()
    mask = batch.mask
    info: dict[str, torch.Tensor] = {}
    if cfg.kind == "gspo":
        # GSPO aggregates per sequence (its own seq-mean); a sequence's correction weight is the
        # mean of its tokens' weights.
        corr, metrics = _correction(batch, cfg)
        seq_loss, info = L.gspo_loss(logp, batch.pi_old(), batch.seq_adv, mask, lo, hi)
        seq_w = corr.sum(-1) / mask.sum(-1).clamp_min(1.0) / max(mask.shape[0], 1)
        loss = (seq_w * seq_loss).sum()
        frac_of = (lambda m: float(m.to(torch.float64).mean()))
    else:
        coef, metrics = token_coefficients(batch, cfg, norm_len)
        if cfg.kind == "reinforce":
            tok = L.reinforce_loss(logp, batch.adv)
        elif cfg.kind == "importance_sampling":
            tok = L.importance_sampling_loss(logp, batch.sampler_logp, batch.adv)
        elif cfg.kind == "ppo":
            tok, info = L.ppo_loss(logp, batch.pi_old(), batch.adv, lo, hi, cfg.dual_clip)
        else:
            tok, info = L.cispo_loss(logp, batch.pi_old(), batch.adv, lo, hi)
        if cfg.kl_coef and cfg.kl_mode == "loss":
            tok = tok + cfg.kl_coef * L.kl_estimate(logp, batch.ref_logp, cfg.kl_estimator)
        loss = (coef * tok * mask).sum()
        n = float(mask.sum().clamp_min(1.0))
        frac_of = (lambda m: float((m.to(torch.float64) * mask).sum()) / n)
    for name, m in info.items():
        metrics[f"clip/{name}_frac"] = frac_of(m)
    return loss, metrics


def server_inputs(batch: TrainBatch, cfg: LossConfig, norm_len: int) -> tuple[str, dict[str, torch.Tensor],
                                                                             dict[str, float], dict[str, float]]:
    """The built-in Tinker loss, its per-token inputs and config for ``batch`` (folded advantages)."""
    if cfg.kind == "stable_reinforce":  # the service applies its own TIS, over the sampler's support
        coef = L.aggregation_weights(batch.mask, cfg.aggregation, max_len=norm_len)
        config = {"tis_cap": cfg.tis_cap} if cfg.correction == "tis" else {}
        return "stable_reinforce", {"logprobs": batch.sampler_logp, "advantages": batch.adv * coef}, config, {}
    coef, metrics = token_coefficients(batch, cfg, norm_len)
    folded = batch.adv * coef
    if cfg.kind == "reinforce":
        return "cross_entropy", {"weights": folded}, {}, metrics
    lo, hi = cfg.eps()
    if cfg.kind == "importance_sampling":
        return "importance_sampling", {"logprobs": batch.sampler_logp, "advantages": folded}, {}, metrics
    config = {"clip_low_threshold": 1.0 - lo, "clip_high_threshold": 1.0 + hi}
    return cfg.kind, {"logprobs": batch.pi_old(), "advantages": folded}, config, metrics


def forward_backward(training_client: Any, batch: TrainBatch, cfg: LossConfig, norm_len: int
                     ) -> tuple[Any, Any]:
    """Submit the step's forward/backward; returns ``(future, finish)`` where ``finish(result)``
    gives ``(metrics, trainer_logprobs [B, T])``."""
    if cfg.use_custom():
        def custom(data, logprobs_list):
            width = batch.mask.shape[1]
            logp = torch.stack([torch.nn.functional.pad(lp.to(torch.float64), (0, width - lp.shape[0]))
                                for lp in logprobs_list])
            loss, m = objective_loss(logp, batch, cfg, norm_len)
            custom.metrics = m
            return loss, {}

        custom.metrics = {}
        fut = training_client.forward_backward_custom(batch.datums({"weights": batch.mask}), custom)

        def finish(result) -> tuple[dict[str, float], torch.Tensor]:
            lp = pad([o["logprobs"].to_numpy() for o in result.loss_fn_outputs], width=batch.mask.shape[1])
            return {**custom.metrics, "loss": float(result.metrics["loss:sum"])}, lp
        return fut, finish

    loss_fn, inputs, config, metrics = server_inputs(batch, cfg, norm_len)
    fut = training_client.forward_backward(batch.datums(inputs, provenance=loss_fn == "stable_reinforce"), loss_fn,
                                           config or None)

    def finish(result) -> tuple[dict[str, float], torch.Tensor]:
        lp = pad([o["logprobs"].to_numpy() for o in result.loss_fn_outputs], width=batch.mask.shape[1])
        out = dict(metrics, loss=float(result.metrics["loss:sum"]))
        # the service's replay diagnostics (stability/gap, support masses, route flips)
        out.update({k.split(":")[0]: v for k, v in result.metrics.items() if k.startswith("stability/")})
        if cfg.kind in ("ppo", "cispo"):  # which tokens the server clipped, from the logprobs it used
            lo, hi = cfg.eps()
            fn = L.ppo_loss if cfg.kind == "ppo" else L.cispo_loss
            _, info = fn(lp, batch.pi_old(), batch.adv, lo, hi)
            n = float(batch.mask.sum().clamp_min(1.0))
            out.update({f"clip/{k}_frac": float((v.to(torch.float64) * batch.mask).sum()) / n for k, v in info.items()})
        return out, lp
    return fut, finish
