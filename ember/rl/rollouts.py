"""Sampling episodes through a Tinker ``SamplingClient``.

:func:`rollout_groups` runs G episodes per problem, turn by turn. Each episode keeps one token list
(prompt, sampled turn, observation, sampled turn, ...) with a mask of the tokens the policy sampled
and the sampler's log-probabilities for them; the next turn's prompt is that list itself, so token
ids pass between turns unchanged (no re-tokenisation). All requests of one turn, across every group,
are in flight together. Sampling seeds derive from ``(seed, *key)``, so a run is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker import types

from ember.rl.config import SamplingConfig
from ember.rl.envs.base import Env, Problem, Task


@dataclass
class Trajectory:
    """One episode: the whole token history and what the policy sampled in it."""

    tokens: list[int]
    policy_mask: list[int]  # 1 where the policy sampled the token
    sampler_logprobs: list[float]  # log μ of sampled tokens, 0 elsewhere
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    truncated: bool = False  # a turn ended at max_tokens (or the context was full)
    turns: int = 0
    # Where each token came from (tinker provenance spans tiling ``tokens``), while every turn's
    # sample had a sequence_id; None otherwise. ``stable_reinforce`` datums carry them.
    spans: list | None = field(default_factory=list)
    unspanned: int = 0  # tokens at the end of ``tokens`` that the next request's prompt brings

    @property
    def num_sampled(self) -> int:
        return int(sum(self.policy_mask))


@dataclass
class Group:
    """The G episodes of one problem."""

    problem: Problem
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


def derive_seed(seed: int, *key: int) -> int:
    """A 31-bit sampling seed for ``key`` (step, group, turn, ...) under the run's ``seed``."""
    return int(np.random.SeedSequence([seed, *key]).generate_state(1)[0] >> 1)


def _params(cfg: SamplingConfig, seed: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                top_k=cfg.top_k, stop=cfg.stop, seed=seed)


def rollout_groups(
    sampling_client: Any,
    task: Task,
    problems: Sequence[Problem],
    group_size: int,
    cfg: SamplingConfig,
    *,
    seed: int,
    key: Sequence[int] = (),
) -> list[Group]:
    """Run ``group_size`` episodes of each problem to the end; returns one :class:`Group` per problem."""
    envs: list[list[Env]] = [[task.make_env(p) for _ in range(group_size)] for p in problems]
    trajs = [[Trajectory([], [], []) for _ in range(group_size)] for _ in problems]
    prompts = [[e.initial_observation() for e in group] for group in envs]
    for g, group in enumerate(trajs):
        for e, t in enumerate(group):
            t.tokens = list(prompts[g][e])
            t.policy_mask = [0] * len(t.tokens)
            t.sampler_logprobs = [0.0] * len(t.tokens)
            t.unspanned = len(t.tokens)
    active = {(g, e) for g in range(len(problems)) for e in range(group_size)}
    turn = 0
    while active:
        requests = []  # (future, [(g, e), ...])
        if turn == 0:
            for g in range(len(problems)):
                same = all(p == prompts[g][0] for p in prompts[g])
                members = [(g, e) for e in range(group_size)]
                batches = [members] if same else [[m] for m in members]
                for b, mem in enumerate(batches):
                    fut = sampling_client.sample(types.ModelInput.from_ints(prompts[g][mem[0][1]]), len(mem),
                                                 _params(cfg, derive_seed(seed, *key, g, turn, b)))
                    requests.append((fut, mem))
        else:
            for g, e in sorted(active):
                t = trajs[g][e]
                if cfg.max_context is not None and len(t.tokens) + cfg.max_tokens > cfg.max_context:
                    t.truncated = True
                    active.discard((g, e))
                    continue
                fut = sampling_client.sample(types.ModelInput.from_ints(t.tokens), 1,
                                             _params(cfg, derive_seed(seed, *key, g, turn, e)))
                requests.append((fut, [(g, e)]))
        for fut, members in requests:
            result = fut.result()
            for (g, e), seq in zip(members, result.sequences, strict=True):
                t = trajs[g][e]
                tokens = list(seq.tokens)
                if seq.logprobs is None or len(seq.logprobs) != len(tokens):
                    raise RuntimeError("the sampler returned no per-token logprobs; RL needs them")
                t.tokens += tokens
                t.policy_mask += [1] * len(tokens)
                _add_spans(t, getattr(seq, "sequence_id", None), len(tokens))  # None: a service without it
                t.sampler_logprobs += [float(x) for x in seq.logprobs]
                t.turns += 1
                t.truncated |= seq.stop_reason == "length"
                step = envs[g][e].step(tokens, seq.stop_reason)
                t.reward += step.reward
                t.metrics.update(step.metrics)
                if step.done:
                    active.discard((g, e))
                else:
                    t.tokens += step.observation
                    t.policy_mask += [0] * len(step.observation)
                    t.sampler_logprobs += [0.0] * len(step.observation)
                    t.unspanned = len(step.observation)
        turn += 1
    return [Group(p, ts) for p, ts in zip(problems, trajs)]


def _add_spans(t: Trajectory, sequence_id: str | None, n_sampled: int) -> None:
    """Record the provenance of a turn just appended to ``t.tokens``: the prompt tokens new in this
    request (at the end of its prompt) and the ``n_sampled`` tokens it sampled."""
    if t.spans is None or sequence_id is None:
        t.spans = None
        return
    prompt_len = len(t.tokens) - n_sampled
    if t.unspanned:
        t.spans.append(types.PromptProvenanceSpan(sequence_id=sequence_id, offset=prompt_len - t.unspanned,
                                                  length=t.unspanned))
    if n_sampled:
        t.spans.append(types.SampledProvenanceSpan(sequence_id=sequence_id, length=n_sampled))
    t.unspanned = 0


def evaluate(sampling_client: Any, task: Task, problems: Sequence[Problem], cfg: SamplingConfig, *, k: int = 1,
             seed: int = 0, prefix: str = "eval") -> dict[str, float]:
    """Held-out metrics with ``k`` samples per problem: mean reward, accuracy (mean ``correct``),
    pass@k (any sample correct) and response length."""
    groups = rollout_groups(sampling_client, task, problems, k, cfg, seed=seed, key=(2**30,))
    correct = np.array([[t.metrics.get("correct", 0.0) for t in g.trajectories] for g in groups])
    return {f"{prefix}/reward": float(np.mean([g.rewards for g in groups])),
            f"{prefix}/accuracy": float(correct.mean()),
            f"{prefix}/pass@{k}": float((correct.max(axis=1) > 0).mean()),
            f"{prefix}/response_len": float(np.mean([t.num_sampled for g in groups for t in g.trajectories]))}
