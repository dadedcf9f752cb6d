"""Synthetic arithmetic: ``a+b=`` with multi-digit operands, single-turn and multi-turn.

Problems are drawn from ``numpy.random.default_rng([seed, stream, index])``, so problem ``i`` is the
same in every run with that seed; the held-out problems come from their own stream and are removed
from the training stream.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

from ember.rl.envs.base import Env, Problem, ProblemEnv, PromptFormat, StepResult, Task, Tokenizer

_INT = re.compile(r"-?\d+")
_TRAIN, _EVAL = 0, 1


def exact_integer(response: str, answer: str) -> float:
    """1.0 if the response is exactly the integer ``answer`` (surrounding whitespace allowed)."""
    return float(response.strip() == answer.strip())


def digit_credit(response: str, answer: str) -> float:
    """Partial credit: the fraction of digit positions (aligned from the units) that are right,
    over the longer of the two numbers; 1.0 only for the exact answer, 0 for a non-number."""
    r, a = response.strip(), answer.strip()
    if not r.lstrip("-").isdigit():
        return 0.0
    right = sum(x == y for x, y in zip(reversed(r), reversed(a)))
    return right / max(len(r), len(a))


def final_integer(response: str, answer: str) -> float:
    """1.0 if the last integer in the response equals ``answer`` (the cookbook's lenient check)."""
    found = _INT.findall(response.replace(",", ""))
    return float(bool(found) and int(found[-1]) == int(answer))


class ArithmeticTask(Task):
    """``a <op> b`` with operands of ``min_digits``..``max_digits`` digits (``b``: ``b_digits`` =
    [min, max] when given); ops from ``"+"``, ``"-"``, ``"*"``.

    The prompt is ``template`` formatted with ``question = "a+b="``; the reference answer is the
    result's decimal digits. ``grading``: ``"exact"`` (the response is the number and nothing
    else) or ``"final"`` (its last integer). ``reward``: ``"correct"`` (1 or 0, as graded) or
    ``"digits"`` (:func:`digit_credit`, a denser signal); the ``correct`` metric is always the grade.
    """

    def __init__(self, tokenizer: Tokenizer, *, min_digits: int = 1, max_digits: int = 3, ops: str = "+",
                 seed: int = 0, num_eval: int = 200, template: str = "{question}", grading: str = "exact",
                 reward: str = "correct", b_digits: list[int] | None = None):
        b_lo, b_hi = b_digits if b_digits is not None else (min_digits, max_digits)
        for name, lo, hi in (("min_digits, max_digits", min_digits, max_digits), ("b_digits", b_lo, b_hi)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} = {lo}, {hi}: need 1 <= min <= max")
        if not ops or any(o not in "+-*" for o in ops):
            raise ValueError(f"ops must be characters from '+-*', got {ops!r}")
        if grading not in ("exact", "final"):
            raise ValueError(f"grading must be 'exact' or 'final', got {grading!r}")
        if reward not in ("correct", "digits"):
            raise ValueError(f"reward must be 'correct' or 'digits', got {reward!r}")
        self.partial = digit_credit if reward == "digits" else None
        self.fmt = PromptFormat(tokenizer, template)
        self.min_digits, self.max_digits, self.ops, self.seed = min_digits, max_digits, ops, seed
        self.b_digits = (b_lo, b_hi)
        self.grader = exact_integer if grading == "exact" else final_integer
        self._eval = [self._draw(_EVAL, i) for i in range(num_eval)]
        self._eval_keys = {p.question for p in self._eval}

    def _operand(self, rng: np.random.Generator, digits: tuple[int, int] | None = None) -> int:
        lo_d, hi_d = digits or (self.min_digits, self.max_digits)
        d = int(rng.integers(lo_d, hi_d + 1))
        lo = 0 if d == 1 else 10 ** (d - 1)
        return int(rng.integers(lo, 10**d))

    def _draw(self, stream: int, index: int, attempt: int = 0) -> Problem:
        rng = np.random.default_rng([self.seed, stream, index, attempt])
        a, b = self._operand(rng), self._operand(rng, self.b_digits)
        op = self.ops[int(rng.integers(len(self.ops)))]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Problem(id=f"{'te'[stream]}{index}", question=f"{a}{op}{b}=", answer=str(value))

    def train_problem(self, index: int) -> Problem:
        for attempt in range(1000):
            p = self._draw(_TRAIN, index, attempt)
            if p.question not in self._eval_keys:
                return p
        raise RuntimeError("could not draw a training problem outside the held-out set; use fewer eval problems")

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def make_env(self, problem: Problem) -> Env:
        return ProblemEnv(problem, self.fmt, self.grader, reward=self.partial)

    def describe(self) -> dict:
        return {"task": "arithmetic", "digits": [self.min_digits, self.max_digits], "b_digits": list(self.b_digits),
                "ops": self.ops}


class ArithmeticChainEnv(Env):
    """Multi-turn: ``a+b=`` then, turn after turn, ``+c=`` asks for the running total. The episode
    ends at the first wrong answer or after all turns; reward = fraction of turns answered right.
    Observations are encoded on their own and appended to the token history (no re-tokenisation)."""

    def __init__(self, first: Problem, addends: list[int], fmt: PromptFormat, grader=exact_integer):
        self.first, self.addends, self.fmt, self.grader = first, addends, fmt, grader
        self.total = int(first.answer)
        self.turn = 0
        self.n_turns = 1 + len(addends)

    def initial_observation(self) -> list[int]:
        return self.fmt.prompt(self.first.question)

    def step(self, action: list[int], stop_reason: str) -> StepResult:
        ok = stop_reason == "stop" and self.grader(self.fmt.text(action), str(self.total)) == 1.0
        self.turn += 1
        done = not ok or self.turn == self.n_turns
        metrics = {"correct": float(ok and self.turn == self.n_turns), "turns": float(self.turn)}
        if done:  # the reward comes at the end: the fraction of turns answered right
            right = self.turn if ok else self.turn - 1
            return StepResult(reward=right / self.n_turns, done=True, metrics=metrics)
        c = self.addends[self.turn - 1]
        self.total += c
        obs = self.fmt.tokenizer.encode(f"+{c}=", add_special_tokens=False)
        return StepResult(reward=0.0, done=False, observation=list(obs), metrics=metrics)


class ArithmeticChainTask(ArithmeticTask):
    """:class:`ArithmeticTask` problems followed by ``turns − 1`` more additions (multi-turn)."""

    def __init__(self, tokenizer: Tokenizer, *, turns: int = 3, **kw):
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        kw.setdefault("ops", "+")
        super().__init__(tokenizer, **kw)
        self.turns = turns

    def make_env(self, problem: Problem) -> Env:
        rng = np.random.default_rng([self.seed, 2, zlib.crc32(problem.question.encode())])
        addends = [self._operand(rng) for _ in range(self.turns - 1)]
        return ArithmeticChainEnv(problem, addends, self.fmt, self.grader)

    def describe(self) -> dict:
        return {**super().describe(), "task": "arithmetic_chain", "turns": self.turns}
