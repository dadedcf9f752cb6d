"""Reward shaping on response length: DAPO's soft overlong punishment (spec §5.4, arXiv:2503.14476)."""

from __future__ import annotations


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """``R_len(|y|)``: 0 up to ``max_len − cache_len``, then a linear ramp to −1 at ``max_len``,
    and −1 beyond it. The caller adds ``factor · R_len`` to the task reward (factor 0.5 = "half
    strength": the ramp ends at −0.5)."""
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"overlong cache_len must be in (0, max_len={max_len}], got {cache_len}")
    free = max_len - cache_len
    if length <= free:
        return 0.0
    if length <= max_len:
        return (free - length) / cache_len
    return -1.0


def shaped_reward(task_reward: float, length: int, *, max_len: int, cache_len: int, factor: float) -> float:
    """``R_task + factor · R_len(length)`` (DAPO: factor 1; "half strength": 0.5)."""
    return task_reward + factor * overlong_penalty(length, max_len, cache_len)
