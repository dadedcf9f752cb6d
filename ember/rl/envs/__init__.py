"""Environments for ``ember.rl``: synthetic arithmetic (single- and multi-turn) and math answers
graded by ``math-verify`` over a user's JSONL/parquet file."""

from __future__ import annotations

from typing import Any

from ember.rl.envs.arithmetic import ArithmeticChainTask, ArithmeticTask, exact_integer, final_integer
from ember.rl.envs.base import Env, Problem, ProblemEnv, PromptFormat, StepResult, Task
from ember.rl.envs.math_answers import MathAnswerTask, math_equivalent

TASKS = {"arithmetic": ArithmeticTask, "arithmetic_chain": ArithmeticChainTask, "math": MathAnswerTask}


def make_task(kind: str, tokenizer: Any, **options: Any) -> Task:
    """The task named ``kind`` (``arithmetic``, ``arithmetic_chain``, ``math``) with its options."""
    if kind not in TASKS:
        raise ValueError(f"unknown task {kind!r}; one of {', '.join(TASKS)}")
    try:
        return TASKS[kind](tokenizer, **options)
    except TypeError as e:  # an unknown option: name it
        raise ValueError(f"task {kind!r}: {e}") from None


__all__ = [
    "TASKS",
    "ArithmeticChainTask",
    "ArithmeticTask",
    "Env",
    "MathAnswerTask",
    "Problem",
    "ProblemEnv",
    "PromptFormat",
    "StepResult",
    "Task",
    "exact_integer",
    "final_integer",
    "make_task",
    "math_equivalent",
]
