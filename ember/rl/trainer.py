"""``ember rl``: group-sampled policy-gradient training (GRPO, Dr. GRPO, RLOO, DAPO, PPO/CISPO/GSPO)
through the Tinker API.

Each step samples P prompts × G episodes with the current policy, shapes rewards (DAPO overlong),
optionally keeps only informative groups (dynamic sampling), computes group advantages and takes
one optimizer step per mini-batch of prompts. With ``async_staleness = k > 0`` a background thread
samples ahead — the batch of step t+1 is sampled while step t trains — using a policy at most k
versions old; the losses' importance ratios and the rollout corrections account for the lag.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from dataclasses import replace
from typing import Any

import numpy as np

from ember.rl import losses as L
from ember.rl.advantages import group_advantages, has_signal
from ember.rl.checkpoint import save_checkpoint
from ember.rl.config import RLConfig
from ember.rl.data import DataOrder
from ember.rl.envs import make_task
from ember.rl.objective import TrainBatch, apply_kl_to_advantages, forward_backward, pad
from ember.rl.plots import RL_PANELS, plot_metrics
from ember.rl.rollouts import Group, evaluate, rollout_groups
from ember.rl.session import Run, adam
from ember.rl.shaping import overlong_penalty

log = logging.getLogger("ember.rl")


def task_from(cfg_task: dict[str, Any], tokenizer: Any, seed: int):
    """The task of a config's ``task`` section (``kind`` plus the task's options)."""
    options = {k: v for k, v in cfg_task.items() if k != "kind"}
    options.setdefault("seed", seed)
    return make_task(cfg_task["kind"], tokenizer, **options)


class RLTrainer:
    """One ``ember rl`` run (see the module docstring)."""

    def __init__(self, cfg: RLConfig):
        cfg.validate()
        self.cfg = cfg
        self.run = Run(cfg, "rl")
        self.task = task_from(cfg.task, self.run.tokenizer, cfg.seed)
        self.eval_set = self.task.eval_problems()[: cfg.eval_problems]
        self.order = DataOrder(self.task.num_train_problems(), cfg.seed)
        self.norm_len = cfg.loss.norm_len or cfg.sampling.max_tokens
        self.reference = None
        if cfg.loss.kl_coef:
            ref = cfg.loss.kl_reference
            self.reference = (self.run.service.create_sampling_client(base_model=cfg.base_model) if ref == "base"
                              else self.run.service.create_sampling_client(model_path=ref)).result()
        self.last_eval: dict[str, float] = {}

    # ---- data -------------------------------------------------------------------------------
    def problem(self, position: int):
        """The training problem at ``position`` of the run's data order."""
        return self.task.train_problem(self.order.index(position))

    def collect(self, sampler: Any, step: int, position: int) -> tuple[list[Group], int, dict[str, float]]:
        """The groups of one step, from data ``position``; returns them, the new position and
        sampling metrics. With dynamic sampling, rounds of P prompts are sampled until P groups
        with differing rewards are kept (or ``max_gen_batches`` rounds); the excess is dropped."""
        cfg = self.cfg
        kept: list[Group] = []
        rounds = seen = 0
        limit = cfg.max_gen_batches if cfg.dynamic_sampling else 1
        while len(kept) < cfg.prompts_per_step and rounds < limit:
            problems = [self.problem(position + i) for i in range(cfg.prompts_per_step)]
            position += len(problems)
            groups = rollout_groups(sampler, self.task, problems, cfg.group_size, cfg.sampling, seed=cfg.seed,
                                    key=(step, rounds))
            seen += len(groups)
            if cfg.dynamic_sampling:  # on the unshaped task reward (§5.4)
                groups = [g for g in groups if has_signal(g.rewards)]
            kept += groups
            rounds += 1
        metrics = {"sampling/rounds": float(rounds), "sampling/groups_sampled": float(seen),
                   "sampling/groups_kept": float(min(len(kept), cfg.prompts_per_step))}
        return kept[: cfg.prompts_per_step], position, metrics

    # ---- one optimizer round -----------------------------------------------------------------
    def rollout_metrics(self, groups: list[Group]) -> dict[str, float]:
        trajs = [t for g in groups for t in g.trajectories]
        if not trajs:
            return {}
        sampled = np.concatenate([np.asarray(t.sampler_logprobs)[np.asarray(t.policy_mask, bool)] for t in trajs])
        return {"train/reward": float(np.mean([t.reward for t in trajs])),
                "train/accuracy": float(np.mean([t.metrics.get("correct", 0.0) for t in trajs])),
                "train/response_len": float(np.mean([t.num_sampled for t in trajs])),
                "train/truncated_frac": float(np.mean([t.truncated for t in trajs])),
                "train/turns": float(np.mean([t.turns for t in trajs])),
                # −E_μ[log μ(y_t)]: the sampler's per-token entropy, estimated on its own samples
                "train/entropy": float(-sampled.mean()) if sampled.size else 0.0}

    def shaped_rewards(self, group: Group) -> list[float]:
        cfg = self.cfg
        if cfg.overlong_max_len is None:
            return group.rewards
        return [t.reward + cfg.overlong_factor * overlong_penalty(t.num_sampled, cfg.overlong_max_len,
                                                                   cfg.overlong_cache_len) for t in group.trajectories]

    def train_step(self, groups: list[Group], step: int, staleness: int) -> dict[str, float]:
        """Advantages, optional KL / π_old, then one optimizer step per mini-batch of prompts."""
        cfg, tc = self.cfg, self.run.training
        metrics = self.rollout_metrics(groups)
        shaped = [self.shaped_rewards(g) for g in groups]
        advantages = group_advantages(shaped, normalize_by_std=cfg.normalize_by_std, leave_one_out=cfg.leave_one_out,
                                      std_scope=cfg.std_scope)
        rows, seq_adv, group_of = [], [], []
        for gi, (g, adv) in enumerate(zip(groups, advantages)):
            for t, a in zip(g.trajectories, adv):
                if cfg.overlong_filter and t.truncated:  # overlong filtering: out of the loss
                    continue
                rows.append(t)
                seq_adv.append(float(a))
                group_of.append(gi)
        metrics["train/shaped_reward"] = float(np.mean([r for rs in shaped for r in rs])) if shaped else 0.0
        metrics["train/staleness"] = float(staleness)
        if not rows:
            log.warning("step %d: no trajectories to train on", step)
            return metrics
        batch = TrainBatch.build(rows, seq_adv)
        if self.reference is not None:
            futs = [self.reference.compute_logprobs(_model_input(t.tokens)) for t in rows]
            batch.ref_logp = pad([[0.0 if x is None else x for x in f.result()[1:]] for f in futs],
                                 width=batch.mask.shape[1])
        if cfg.loss.recompute_old_logprobs:
            fwd = tc.forward(batch.datums({"weights": batch.mask}), "cross_entropy").result()
            batch.old_logp = pad([o["logprobs"].to_numpy() for o in fwd.loss_fn_outputs], width=batch.mask.shape[1])
            metrics.update(L.logprob_gap(batch.old_logp, batch.sampler_logp, batch.mask))
        if self.reference is not None:
            metrics.update(apply_kl_to_advantages(batch, cfg.loss))
        per_mb = cfg.minibatch_prompts or len(groups)
        order = np.arange(len(groups)) if per_mb >= len(groups) else self.run.rng.permutation(len(groups))
        lr = adam(cfg.optim, step, cfg.steps)
        sums: dict[str, float] = {}
        n_mb = 0
        group_of_arr = np.asarray(group_of)
        for ci in range(0, len(groups), per_mb):
            idx = np.flatnonzero(np.isin(group_of_arr, order[ci: ci + per_mb])).tolist()
            if not idx:
                continue
            sub = batch.select(idx)
            fut, finish = forward_backward(tc, sub, cfg.loss, self.norm_len)
            opt = tc.optim_step(lr)
            m, trainer_lp = finish(fut.result())
            opt.result()
            if n_mb == 0 and staleness == 0 and batch.old_logp is None and cfg.loss.kind != "stable_reinforce":
                # the first mini-batch runs at the sampled weights: the trainer/sampler gap (with
                # stable_reinforce the trainer returns log p_S, and the service reports stability/gap)
                m.update(L.logprob_gap(trainer_lp, sub.sampler_logp, sub.mask))
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v
            n_mb += 1
        for k, v in sums.items():
            metrics[k if "/" in k else f"train/{k}"] = v / n_mb if "gap/" not in k else v
        metrics["train/learning_rate"] = lr.learning_rate
        metrics["train/optimizer_steps"] = float(n_mb)
        return metrics

    # ---- the run ------------------------------------------------------------------------------
    def evaluate(self, sampler: Any, step: int) -> dict[str, float]:
        cfg = self.cfg
        scfg = replace(cfg.sampling, temperature=cfg.eval_temperature)
        m = evaluate(sampler, self.task, self.eval_set, scfg, k=cfg.eval_samples, seed=cfg.seed)
        self.run.metrics.log(step, m)
        self.last_eval = m
        return m

    def train(self) -> dict[str, Any]:
        """Run to ``cfg.steps``; returns the last held-out metrics and the files written."""
        cfg, run = self.cfg, self.run
        sampler = run.sampler()
        if run.start_step == 0 or (cfg.eval_every and run.start_step % cfg.eval_every == 0):
            self.evaluate(sampler, run.start_step)
        bar = run.progress(cfg.steps, "ember rl")
        final = run.resumed
        plots: list = []
        self._cond, self._stop = threading.Condition(), threading.Event()
        self._latest, self._position = (run.start_step, sampler), run.data_position
        batches = self._batches()
        try:
            for step in range(run.start_step, cfg.steps):
                version, groups, position, sampling_metrics = next(batches)
                metrics = {**sampling_metrics, **self.train_step(groups, step, staleness=step - version)}
                sampler = run.sampler()
                self._publish(step + 1, sampler)
                run.metrics.log(step, metrics)
                done = step + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
                    self.evaluate(sampler, done)
                if cfg.save_every and done % cfg.save_every == 0 and done != cfg.steps:
                    save_checkpoint(run.log_dir, run.training, run.state(done, position), f"step{done:06d}")
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('train/reward', 0):.3f}",
                                acc=f"{self.last_eval.get('eval/accuracy', float('nan')):.3f}")
            if run.start_step < cfg.steps:
                self.evaluate(sampler, cfg.steps)
                final = save_checkpoint(run.log_dir, run.training, run.state(cfg.steps, self._position), "final")
            else:
                log.info("%s already holds a finished run of %d steps; nothing to do", run.log_dir, cfg.steps)
        finally:
            self._stop.set()
            bar.close()
            plots = plot_metrics(run.metrics.records(), run.log_dir / "plots", RL_PANELS) if cfg.plots else []
            run.close("errored" if sys.exc_info()[0] else "success")
        return {"eval": self.last_eval, "log_dir": str(run.log_dir), "plots": [str(p) for p in plots],
                "state_path": final.state_path if final else None}

    # ---- sampling ahead -----------------------------------------------------------------------
    def _publish(self, version: int, sampler: Any) -> None:
        with self._cond:
            self._latest = (version, sampler)
            self._cond.notify_all()

    def _batches(self):
        """Yields ``(policy_version, groups, data_position_after, metrics)`` per step; with
        ``async_staleness = k`` a thread samples step s as soon as a policy of version ≥ s − k exists."""
        cfg, run = self.cfg, self.run
        k = cfg.async_staleness

        def produce(out: queue.Queue) -> None:
            position = run.data_position
            try:
                for step in range(run.start_step, cfg.steps):
                    with self._cond:
                        while self._latest[0] < step - k and not self._stop.is_set():
                            self._cond.wait(0.5)
                        version, s = self._latest
                    if self._stop.is_set():
                        return
                    groups, position, m = self.collect(s, step, position)
                    out.put((version, groups, position, m))
            except Exception as e:  # noqa: BLE001 -- handed to the training thread, which raises it
                out.put(e)

        if k == 0:
            position = run.data_position
            for step in range(run.start_step, cfg.steps):
                version, s = self._latest
                groups, position, m = self.collect(s, step, position)
                self._position = position
                yield version, groups, position, m
            return
        q: queue.Queue = queue.Queue(maxsize=k)
        threading.Thread(target=produce, args=(q,), daemon=True, name="ember-rl-sampler").start()
        for _ in range(run.start_step, cfg.steps):
            item = q.get()
            if isinstance(item, Exception):
                raise item
            self._position = item[2]
            yield item


def _model_input(tokens: list[int]):
    from tinker import types

    return types.ModelInput.from_ints(tokens)


def run_rl(cfg: RLConfig) -> dict[str, Any]:
    """Train with ``cfg`` (resuming from ``cfg.log_dir`` when it holds a checkpoint)."""
    return RLTrainer(cfg).train()
