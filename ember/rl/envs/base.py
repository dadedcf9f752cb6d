"""Environments: what a policy sees, and the reward for what it says.

An :class:`Env` is one episode. It speaks token ids: ``initial_observation()`` gives the prompt,
``step(action)`` takes the sampled tokens and returns a reward, whether the episode is over and, if
not, the tokens to append before the next turn. The rollout code keeps one growing token list per
episode (prompt, sampled turn, observation, sampled turn, ...), so earlier turns are never
re-tokenised.

A :class:`Task` is a source of environments: training problems by index (deterministic, so a
resumed run continues with exactly the problems it would have seen) and a fixed held-out set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the environments use."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class StepResult:
    """What the environment answers to one sampled turn."""

    reward: float
    done: bool
    observation: list[int] = field(default_factory=list)  # tokens appended before the next turn
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. {"correct": 1.0}


class Env(ABC):
    """One episode of one or more turns, in token ids."""

    @abstractmethod
    def initial_observation(self) -> list[int]:
        """The prompt's token ids."""

    @abstractmethod
    def step(self, action: list[int], stop_reason: str) -> StepResult:
        """Score the sampled tokens (``stop_reason`` is the sampler's: "stop" or "length")."""


@dataclass(frozen=True)
class Problem:
    """A question with a reference answer (and the text a supervised example would train on)."""

    id: str
    question: str
    answer: str


class PromptFormat:
    """Turns a question into prompt tokens and sampled tokens back into text.

    ``template`` is a format string with ``{question}`` (plain prompts for base models), or the
    word ``"chat"`` to use the tokenizer's chat template with a generation prompt.
    """

    def __init__(self, tokenizer: Tokenizer, template: str = "{question}"):
        if template != "chat" and "{question}" not in template:
            raise ValueError(f"prompt template must contain '{{question}}' or be 'chat', got {template!r}")
        self.tokenizer = tokenizer
        self.template = template

    def prompt(self, question: str) -> list[int]:
        """Prompt token ids for ``question``."""
        if self.template == "chat":
            ids = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
        return list(self.tokenizer.encode(self.template.format(question=question), add_special_tokens=False))

    def completion(self, answer: str) -> list[int]:
        """Supervised target tokens for ``answer``: its text followed by EOS."""
        ids = list(self.tokenizer.encode(answer, add_special_tokens=False))
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def text(self, tokens: list[int]) -> str:
        """Sampled tokens as text, without EOS or other special tokens."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)


class Grader(Protocol):
    def __call__(self, response: str, answer: str) -> float: ...


class ProblemEnv(Env):
    """A single-turn episode: the prompt is the question; ``correct`` is the grader's score (1 or
    0) and the reward is ``correct``, or ``reward(response, answer)`` when given (partial credit);
    ``require_stop`` gives 0 to a response cut off by ``max_tokens``."""

    def __init__(self, problem: Problem, fmt: PromptFormat, grader: Grader, require_stop: bool = True,
                 reward: Grader | None = None):
        self.problem, self.fmt, self.grader, self.require_stop, self.reward = problem, fmt, grader, require_stop, reward

    def initial_observation(self) -> list[int]:
        return self.fmt.prompt(self.problem.question)

    def step(self, action: list[int], stop_reason: str) -> StepResult:
        text = self.fmt.text(action)
        correct = float(self.grader(text, self.problem.answer))
        reward = correct if self.reward is None else float(self.reward(text, self.problem.answer))
        if self.require_stop and stop_reason != "stop":
            correct = reward = 0.0
        return StepResult(reward=reward, done=True, metrics={"correct": correct})


class Task(ABC):
    """A source of environments and supervised examples."""

    fmt: PromptFormat

    @abstractmethod
    def train_problem(self, index: int) -> Problem:
        """The ``index``-th training problem (deterministic)."""

    @abstractmethod
    def eval_problems(self) -> list[Problem]:
        """The held-out problems (never among the training problems)."""

    @abstractmethod
    def make_env(self, problem: Problem) -> Env:
        """A fresh episode for ``problem``."""

    def supervised_example(self, problem: Problem) -> tuple[list[int], list[int]]:
        """(prompt tokens, target tokens) to train ``problem``'s reference answer by SFT."""
        return self.fmt.prompt(problem.question), self.fmt.completion(problem.answer)

    def num_train_problems(self) -> int | None:
        """How many distinct training problems there are (None = an endless stream)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"task": type(self).__name__}
