"""Math problems from a user's JSONL or parquet file, graded by ``math-verify``.

The verifier (Hugging Face ``math-verify``) extracts the final answer (a ``\\boxed{}`` answer first,
then LaTeX or plain expressions) and checks numeric and symbolic equivalence with the reference
(``1/2`` = ``0.5`` = ``\\frac{2}{4}``), so a right answer in another form still scores 1.
"""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path

from ember.rl.envs.base import Env, Problem, ProblemEnv, PromptFormat, Task, Tokenizer

DEFAULT_TEMPLATE = "{question}\nPut the final answer in \\boxed{{}}.\n"


def math_equivalent(response: str, answer: str) -> float:
    """1.0 if ``response``'s final answer is mathematically equal to the reference ``answer``."""
    from math_verify import parse, verify

    # math-verify bounds its work with SIGALRM, which only the main thread may use.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    pred = parse(response, parsing_timeout=timeout)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=timeout))


def load_records(path: str | Path) -> list[dict]:
    """Rows of a ``.jsonl`` (one JSON object a line) or ``.parquet`` file."""
    path = Path(path)
    if path.suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"dataset {path}: expected a .jsonl or .parquet file")


class MathAnswerTask(Task):
    """Problems from ``path`` (fields ``question_key`` and ``answer_key``); the held-out set is
    ``eval_path`` if given, else every row whose id hashes into the ``eval_fraction``."""

    def __init__(self, tokenizer: Tokenizer, path: str, *, eval_path: str | None = None, question_key: str = "question",
                 answer_key: str = "answer", template: str = DEFAULT_TEMPLATE, eval_fraction: float = 0.1,
                 seed: int = 0):
        self.fmt = PromptFormat(tokenizer, template)
        rows = self._problems(path, question_key, answer_key)
        if eval_path:
            self._train, self._eval = rows, self._problems(eval_path, question_key, answer_key)
        else:
            cut = int(eval_fraction * 2**32)
            is_eval = [zlib.crc32(f"{seed}:{p.question}".encode()) < cut for p in rows]
            self._train = [p for p, e in zip(rows, is_eval) if not e]
            self._eval = [p for p, e in zip(rows, is_eval) if e]
        if not self._train:
            raise ValueError(f"{path}: no training problems left after the held-out split")

    @staticmethod
    def _problems(path: str, qk: str, ak: str) -> list[Problem]:
        out = []
        for i, row in enumerate(load_records(path)):
            missing = [k for k in (qk, ak) if k not in row]
            if missing:
                raise ValueError(f"{path} row {i}: missing field(s) {missing}; has {sorted(row)} "
                                 "(set question_key / answer_key)")
            out.append(Problem(id=str(row.get("id", i)), question=str(row[qk]), answer=str(row[ak])))
        return out

    def train_problem(self, index: int) -> Problem:
        return self._train[index % len(self._train)]

    def num_train_problems(self) -> int:
        return len(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def make_env(self, problem: Problem) -> Env:
        return ProblemEnv(problem, self.fmt, math_equivalent)

    def describe(self) -> dict:
        return {"task": "math", "train": len(self._train), "eval": len(self._eval)}
