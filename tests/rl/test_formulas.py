"""ember.rl formulas against hand-computed values (spec models_and_rl.md §5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ember.rl import losses as L
from ember.rl.advantages import group_advantages, has_signal
from ember.rl.objective import LossConfig, TrainBatch, objective_loss, server_inputs
from ember.rl.rollouts import Trajectory
from ember.rl.shaping import overlong_penalty, shaped_reward

# ---- §5.1 advantages ---------------------------------------------------------------------------

SPEC_R = [1, 0, 0, 1, 1, 0, 0, 0]


def test_grpo_worked_example_from_the_spec():
    (a,) = group_advantages([SPEC_R])
    assert a[0] == pytest.approx(1.208, abs=5e-4) and a[1] == pytest.approx(-0.725, abs=5e-4)
    # by hand: mean 3/8, unbiased variance (3·(5/8)² + 5·(3/8)²)/7 = 1.875/7
    std = math.sqrt(1.875 / 7)
    want = [(0.625 if r else -0.375) / (std + 1e-6) for r in SPEC_R]
    np.testing.assert_allclose(a, want, rtol=1e-12)


def test_dr_grpo_only_centres():
    (a,) = group_advantages([SPEC_R], normalize_by_std=False)
    np.testing.assert_allclose(a, [0.625 if r else -0.375 for r in SPEC_R], rtol=0, atol=1e-15)


def test_leave_one_out_baseline():
    (a,) = group_advantages([SPEC_R], normalize_by_std=False, leave_one_out=True)
    # b_i = (3 − R_i)/7: a right answer gets 1 − 2/7, a wrong one 0 − 3/7
    np.testing.assert_allclose(a, [5 / 7 if r else -3 / 7 for r in SPEC_R], atol=1e-15)


def test_batch_std_scope_and_zero_variance_groups():
    groups = [[1.0, 0.0], [2.0, 2.0, 2.0], [0.0, 3.0]]
    a = group_advantages(groups, std_scope="batch")
    centred = np.array([0.5, -0.5, 0, 0, 0, -1.5, 1.5])
    std = centred.std(ddof=1)
    np.testing.assert_allclose(np.concatenate(a), centred / (std + 1e-6), rtol=1e-12)
    g = group_advantages(groups)  # per-group std; the constant group gets exactly 0
    np.testing.assert_array_equal(g[1], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(g[0], np.array([0.5, -0.5]) / (math.sqrt(0.5) + 1e-6))
    assert not has_signal([2.0, 2.0, 2.0]) and has_signal([0.0, 1.0]) and not has_signal([1.0])


def test_advantages_reject_bad_groups():
    with pytest.raises(ValueError, match="non-empty"):
        group_advantages([[]])
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([[1.0]], leave_one_out=True)


# ---- §5.4 overlong table -----------------------------------------------------------------------

@pytest.mark.parametrize("length,want", [(10000, 0.0), (16384, 0.0), (17408, -0.25), (18432, -0.5),
                                         (20480, -1.0), (20481, -1.0), (40000, -1.0)])
def test_overlong_penalty_table(length, want):
    assert overlong_penalty(length, max_len=20480, cache_len=4096) == pytest.approx(want, abs=1e-12)


def test_overlong_half_strength():
    # spec check values: R_len(18432) = −0.5 at f = 1 and −0.25 at f = 0.5 ("half strength")
    assert shaped_reward(1.0, 18432, max_len=20480, cache_len=4096, factor=1.0) == pytest.approx(0.5)
    assert shaped_reward(1.0, 18432, max_len=20480, cache_len=4096, factor=0.5) == pytest.approx(0.75)
    assert shaped_reward(0.0, 30000, max_len=20480, cache_len=4096, factor=0.5) == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(10, max_len=8, cache_len=0)


# ---- §5.3 PPO, §5.11 CISPO, §5.12 GSPO, §5.6 IS / REINFORCE ----------------------------------

def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_ppo_clip_higher_and_dual_clip_values_and_gradients():
    ratios = _t(1.5, 0.5, 0.5, 4.0, 1.1)
    adv = _t(1.0, 1.0, -1.0, -1.0, 2.0)
    old = _t(-1.0, -2.0, -0.5, -3.0, -1.2)
    logp = (old + torch.log(ratios)).requires_grad_(True)
    loss, info = L.ppo_loss(logp, old, adv, 0.2, 0.28)
    # by hand: max(−rA, −clip(r, 0.8, 1.28)A)
    want = [-1.28, -0.5, 0.8, 4.0, -2.2]
    np.testing.assert_allclose(loss.detach().numpy(), want, rtol=1e-12)
    assert info["clip_high"].tolist() == [True, False, False, False, False]
    assert info["clip_low"].tolist() == [False, False, True, False, False]
    loss.sum().backward()
    # clipped tokens get no gradient; the others −A·r (d r / d logp = r)
    np.testing.assert_allclose(logp.grad.numpy(), [0.0, -0.5, 0.0, 4.0, -2.2], rtol=1e-12)
    dual, info = L.ppo_loss(logp.detach(), old, adv, 0.2, 0.28, dual_clip=3.0)
    np.testing.assert_allclose(dual.numpy(), [-1.28, -0.5, 0.8, 3.0, -2.2], rtol=1e-12)
    assert info["dual_clip"].tolist() == [False, False, False, True, False]


def test_cispo_keeps_every_gradient_with_a_clipped_weight():
    ratios = _t(5.0, 0.5, 1.0)
    adv = _t(1.0, -2.0, 0.5)
    old = _t(-1.0, -1.0, -1.0)
    logp = (old + torch.log(ratios)).requires_grad_(True)
    loss, info = L.cispo_loss(logp, old, adv)  # Tinker defaults: clamp r to [0, 4]
    w = torch.tensor([4.0, 0.5, 1.0], dtype=torch.float64)
    np.testing.assert_allclose(loss.detach().numpy(), (-w * adv * logp.detach()).numpy(), rtol=1e-12)
    loss.sum().backward()
    np.testing.assert_allclose(logp.grad.numpy(), (-w * adv).numpy(), rtol=1e-12)
    assert info["clip_high"].tolist() == [True, False, False]


def test_gspo_sequence_ratio_value_and_gradient():
    old = _t(-1.0, -2.0, -0.5).reshape(1, 3)
    mask = _t(1.0, 1.0, 0.0).reshape(1, 3)
    logp = (old + torch.log(_t(1.1, 0.9, 7.0)).reshape(1, 3)).requires_grad_(True)
    adv = _t(1.0)
    loss, _ = L.gspo_loss(logp, old, adv, mask, 0.2, 0.2)
    s = math.sqrt(1.1 * 0.9)  # geometric mean of the two sampled tokens' ratios; the masked one is ignored
    assert loss.item() == pytest.approx(-s, rel=1e-12)
    loss.sum().backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[-s / 2, -s / 2, 0.0]], rtol=1e-12)
    tight, info = L.gspo_loss(logp.detach(), old, adv, mask, 3e-4, 4e-4)  # paper ranges: s clipped to 1 − 3e-4
    assert tight.item() == pytest.approx(-s, rel=1e-12) and not info["clip_low"].item()
    tight_neg, info = L.gspo_loss(logp.detach(), old, -adv, mask, 3e-4, 4e-4)
    assert tight_neg.item() == pytest.approx(1 - 3e-4, rel=1e-12) and info["clip_low"].item()


def test_reinforce_and_importance_sampling():
    logp, q, adv = _t(-1.0, -2.0), _t(-1.5, -2.0), _t(2.0, -1.0)
    np.testing.assert_allclose(L.reinforce_loss(logp, adv).numpy(), [2.0, -2.0])
    np.testing.assert_allclose(L.importance_sampling_loss(logp, q, adv).numpy(), [-2.0 * math.exp(0.5), 1.0])


# ---- §5.2 aggregation ----------------------------------------------------------------------------

LOSS = _t(1.0, 2.0, 3.0, 4.0, 5.0, 6.0).reshape(2, 3)
MASK = _t(1.0, 1.0, 0.0, 1.0, 1.0, 1.0).reshape(2, 3)


@pytest.mark.parametrize("mode,want", [
    ("token-mean", (1 + 2 + 4 + 5 + 6) / 5),
    ("seq-mean-token-mean", ((1 + 2) / 2 + (4 + 5 + 6) / 3) / 2),
    ("seq-mean-token-sum", ((1 + 2) + (4 + 5 + 6)) / 2),
    ("seq-mean-token-sum-norm", (1 + 2 + 4 + 5 + 6) / 10),
])
def test_aggregation_modes(mode, want):
    w = L.aggregation_weights(MASK, mode, max_len=10)
    assert float((w * LOSS).sum()) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", L.AGGREGATIONS)
def test_aggregation_with_global_denominators_is_split_invariant(mode):
    rng = np.random.default_rng(0)
    loss = torch.as_tensor(rng.normal(size=(6, 5)))
    mask = torch.as_tensor((rng.random((6, 5)) < 0.7).astype(np.float64))
    mask[:, 0] = 1
    whole = float((L.aggregation_weights(mask, mode, max_len=7) * loss).sum())
    n_tok, n_seq = float(mask.sum()), 6
    parts = sum(float((L.aggregation_weights(mask[s], mode, num_tokens=n_tok, num_seqs=n_seq, max_len=7)
                       * loss[s]).sum()) for s in (slice(0, 2), slice(2, 6)))
    assert parts == pytest.approx(whole, rel=1e-12)


def test_aggregation_rejects_unknown_mode_and_missing_norm():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        L.aggregation_weights(MASK, "mean")
    with pytest.raises(ValueError, match="max_len"):
        L.aggregation_weights(MASK, "seq-mean-token-sum-norm")


# ---- KL estimators, §5.7 corrections ------------------------------------------------------------

def test_kl_estimators():
    logp, ref = _t(-1.0, -2.0), _t(-1.5, -1.0)  # Δ = ref − logp = [−0.5, 1.0]
    np.testing.assert_allclose(L.kl_estimate(logp, ref, "k1").numpy(), [0.5, -1.0])
    np.testing.assert_allclose(L.kl_estimate(logp, ref, "k2").numpy(), [0.125, 0.5])
    np.testing.assert_allclose(L.kl_estimate(logp, ref, "k3").numpy(),
                               [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1], rtol=1e-12)


def test_rollout_corrections():
    rho = _t(0.4, 1.0, 3.0, 6.0).reshape(1, 4)
    sampler = _t(-1.0, -1.0, -1.0, -1.0).reshape(1, 4)
    old = sampler + torch.log(rho)
    mask = torch.ones(1, 4, dtype=torch.float64)
    w, _ = L.rollout_correction(old, sampler, mask, "tis", tis_cap=2.0)
    np.testing.assert_allclose(w.numpy(), [[0.4, 1.0, 2.0, 2.0]], rtol=1e-12)
    w, m = L.rollout_correction(old, sampler, mask, "icepop", icepop_low=0.5, icepop_high=5.0)
    np.testing.assert_allclose(w.numpy(), [[0.0, 1.0, 3.0, 0.0]], rtol=1e-12)
    assert m["correction/masked_frac"] == pytest.approx(0.5)
    w, _ = L.rollout_correction(old, sampler, mask, "seq_is")
    np.testing.assert_allclose(w.numpy(), [[0.4 * 3 * 6] * 4], rtol=1e-12)
    # sequence masking on the geometric mean of ρ: (0.4·1·3·6)^(1/4) = 1.5245 is outside [0.999, 1.002]
    w, m = L.rollout_correction(old, sampler, mask, "seq_mask")
    assert float(w.abs().sum()) == 0.0 and m["correction/masked_frac"] == 1.0
    near = sampler + torch.log(_t(1.001, 0.9995, 1.0, 1.0005)).reshape(1, 4)
    w, _ = L.rollout_correction(near, sampler, mask, "seq_mask")
    np.testing.assert_allclose(w.numpy(), [[1.001, 0.9995, 1.0, 1.0005]], rtol=1e-12)
    with pytest.raises(ValueError, match="unknown rollout correction"):
        L.rollout_correction(old, sampler, mask, "clip")


def test_logprob_gap():
    gap = L.logprob_gap(_t(-1.0, -2.0, -9.0).reshape(1, 3), _t(-1.1, -1.8, 0.0).reshape(1, 3),
                        _t(1.0, 1.0, 0.0).reshape(1, 3))
    assert gap["gap/mean_abs_logprob_diff"] == pytest.approx(0.15)
    want = ((math.exp(0.1) - 0.1 - 1) + (math.exp(-0.2) + 0.2 - 1)) / 2
    assert gap["gap/k3_kl"] == pytest.approx(want, rel=1e-12)


# ---- folding corrections and aggregation into a server-side loss -----------------------------------

def _batch(seed: int = 0) -> tuple[TrainBatch, torch.Tensor]:
    rng = np.random.default_rng(seed)
    trajs = []
    for n_prompt, n_resp in [(3, 4), (2, 6), (4, 2)]:
        n = n_prompt + n_resp
        lp = [0.0] * n_prompt + list(-rng.random(n_resp) * 2)
        trajs.append(Trajectory(list(rng.integers(0, 50, n)), [0] * n_prompt + [1] * n_resp, lp))
    batch = TrainBatch.build(trajs, [1.3, -0.7, 0.4])
    batch.old_logp = batch.sampler_logp + torch.as_tensor(rng.normal(scale=0.3, size=batch.mask.shape)) * batch.mask
    logp = batch.old_logp + torch.as_tensor(rng.normal(scale=0.3, size=batch.mask.shape)) * batch.mask
    return batch, logp


def _tinker_server_loss(loss_fn: str, inputs: dict[str, torch.Tensor], config: dict, logp: torch.Tensor) -> float:
    """Tinker's built-in losses as documented (spec §5.13): sums over tokens, float64."""
    if loss_fn == "cross_entropy":
        return float(-(inputs["weights"] * logp).sum())
    r = torch.exp(logp - inputs["logprobs"])
    a = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return float(-(r * a).sum())
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    if loss_fn == "ppo":
        return float(-torch.minimum(r * a, torch.clamp(r, lo, hi) * a).sum())
    return float(-(torch.clamp(r, lo, hi) * logp * a).sum())  # cispo


@pytest.mark.parametrize("kind", ["reinforce", "importance_sampling", "ppo", "cispo"])
@pytest.mark.parametrize("aggregation", L.AGGREGATIONS)
@pytest.mark.parametrize("correction", ["none", "tis", "icepop"])
def test_server_loss_with_folded_advantages_equals_the_objective(kind, aggregation, correction):
    batch, logp = _batch()
    cfg = LossConfig(kind=kind, aggregation=aggregation, correction=correction, tis_cap=1.2, icepop_low=0.8,
                     icepop_high=1.25)
    loss_fn, inputs, config, _ = server_inputs(batch, cfg, norm_len=8)
    direct, _ = objective_loss(logp, batch, cfg, norm_len=8)
    assert _tinker_server_loss(loss_fn, inputs, config, logp) == pytest.approx(float(direct), rel=1e-10, abs=1e-12)


def test_loss_config_validation_names_the_field():
    with pytest.raises(ValueError, match="loss.kind"):
        LossConfig(kind="grpo").validate()
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(kind="cispo", dual_clip=3.0).validate()
    with pytest.raises(ValueError, match="cannot run GSPO"):
        LossConfig(kind="gspo", backend="server").validate()
    assert LossConfig(kind="gspo").use_custom() and not LossConfig(kind="ppo").use_custom()
    assert LossConfig(kind="ppo", kl_coef=0.1, kl_mode="loss").use_custom()
