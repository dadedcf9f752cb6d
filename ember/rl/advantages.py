"""Outcome-reward advantages for group-sampled RL (spec ``models_and_rl.md`` §5.1).

A *group* is the G responses sampled for one prompt. Every function takes a list of groups (each
a 1-D array of rewards; groups may differ in size) and returns one advantage per response, in the
same layout. Advantages are per sequence; the trainer broadcasts them to the sequence's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

StdScope = Literal["group", "batch"]


def group_advantages(
    groups: Sequence[Sequence[float]],
    *,
    normalize_by_std: bool = True,
    leave_one_out: bool = False,
    std_scope: StdScope = "group",
    eps: float = 1e-6,
) -> list[np.ndarray]:
    """GRPO / Dr. GRPO / RLOO / REINFORCE++ advantages, one array per group.

    * baseline: the group mean (GRPO, DeepSeekMath arXiv:2402.03300) or, with ``leave_one_out``,
      the mean of the *other* responses ``b_i = (Σ_{j≠i} R_j)/(G−1)`` (RLOO, arXiv:2402.14740);
    * ``normalize_by_std``: divide by ``std + eps`` with the unbiased std (ddof=1, as ``torch.std``
      and verl's ``norm_adv_by_std_in_grpo``); off = Dr. GRPO (arXiv:2503.20783);
    * ``std_scope="batch"``: subtract the group baseline, then divide by the std of all centred
      rewards in the batch (REINFORCE++, arXiv:2501.03262);
    * a group whose rewards are all equal gets advantage 0 (never divided by a zero std).

    Worked example (spec): ``R = [1,0,0,1,1,0,0,0]`` gives ``A ≈ [1.208, −0.725, …]``.
    """
    if std_scope not in ("group", "batch"):
        raise ValueError(f"std_scope must be 'group' or 'batch', got {std_scope!r}")
    centred = []
    for g in groups:
        r = np.asarray(g, dtype=np.float64)
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"each group must be a non-empty 1-D list of rewards, got shape {r.shape}")
        if leave_one_out:
            if r.size < 2:
                raise ValueError("leave_one_out needs at least 2 responses per group")
            baseline = (r.sum() - r) / (r.size - 1)
        else:
            baseline = np.full_like(r, r.mean())
        centred.append(r - baseline)
    if not normalize_by_std:
        return centred
    if std_scope == "batch":
        flat = np.concatenate(centred)
        std = flat.std(ddof=1) if flat.size > 1 else 0.0
        return [c / (std + eps) if std > 0 else np.zeros_like(c) for c in centred]
    out = []
    for g, c in zip(groups, centred):
        r = np.asarray(g, dtype=np.float64)
        std = r.std(ddof=1) if r.size > 1 else 0.0
        out.append(c / (std + eps) if std > 0 else np.zeros_like(c))
    return out


def has_signal(rewards: Sequence[float]) -> bool:
    """DAPO dynamic-sampling filter (§5.5): keep a group only if its rewards are not all equal."""
    r = np.asarray(rewards, dtype=np.float64)
    return bool(r.size > 1 and np.ptp(r) > 0)
