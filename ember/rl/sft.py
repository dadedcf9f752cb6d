"""``ember sft``: supervised fine-tuning through the Tinker API (``cross_entropy`` on the target
tokens only), on a task's problems with their reference answers or on a prompt/completion JSONL
file; held-out accuracy (tasks: greedy sampling + the task's grader) or NLL (files) every N steps."""

from __future__ import annotations

import logging
import sys
import zlib
from typing import Any

from tinker import types

from ember.rl.checkpoint import save_checkpoint
from ember.rl.config import SFTConfig
from ember.rl.data import DataOrder
from ember.rl.envs.math_answers import load_records
from ember.rl.plots import SFT_PANELS, plot_metrics
from ember.rl.rollouts import SamplingConfig, evaluate
from ember.rl.session import Run, adam
from ember.rl.trainer import task_from

log = logging.getLogger("ember.rl")
Example = tuple[list[int], list[int]]  # (prompt tokens, target tokens)


def supervised_datum(prompt: list[int], target: list[int]) -> types.Datum:
    """``input = (prompt + target)[:-1]``, ``target_tokens = (prompt + target)[1:]``, weight 1 on
    the positions that predict ``target``."""
    if not prompt or not target:
        raise ValueError("a supervised example needs a non-empty prompt and target")
    tokens = prompt + target
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(target)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})


class JsonlExamples:
    """Prompt/completion rows of a JSONL or parquet file; a hash of the prompt puts
    ``eval_fraction`` of them in the held-out split."""

    def __init__(self, tokenizer: Any, path: str, prompt_key: str = "prompt", completion_key: str = "completion",
                 eval_fraction: float = 0.05, seed: int = 0):
        rows = load_records(path)
        train, held = [], []
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        for i, row in enumerate(rows):
            if prompt_key not in row or completion_key not in row:
                raise ValueError(f"{path} row {i}: needs fields {prompt_key!r} and {completion_key!r}; has {sorted(row)}")
            ex = (list(tokenizer.encode(str(row[prompt_key]), add_special_tokens=False)),
                  list(tokenizer.encode(str(row[completion_key]), add_special_tokens=False)) + eos)
            to_eval = zlib.crc32(f"{seed}:{row[prompt_key]}".encode()) < int(eval_fraction * 2**32)
            (held if to_eval else train).append(ex)
        if not train:
            raise ValueError(f"{path}: no training rows")
        self.train, self.held_out = train, held


class SFTTrainer:
    """One ``ember sft`` run."""

    def __init__(self, cfg: SFTConfig):
        cfg.validate()
        self.cfg = cfg
        self.run = Run(cfg, "sft")
        tok = self.run.tokenizer
        self.task = self.file = None
        if cfg.data["kind"] == "task":
            self.task = task_from(cfg.task, tok, cfg.seed)
            self.eval_set = self.task.eval_problems()[: cfg.eval_problems]
            size = self.task.num_train_problems()
        else:
            opts = {k: v for k, v in cfg.data.items() if k != "kind"}
            if "path" not in opts:
                raise ValueError("data.path is required for data.kind = 'jsonl'")
            self.file = JsonlExamples(tok, seed=cfg.seed, **opts)
            self.eval_set = self.file.held_out[: cfg.eval_problems]
            size = len(self.file.train)
        self.order = DataOrder(size, cfg.seed)
        self.last_eval: dict[str, float] = {}

    def example(self, position: int) -> Example:
        i = self.order.index(position)
        if self.task is not None:
            return self.task.supervised_example(self.task.train_problem(i))
        return self.file.train[i]

    def evaluate(self, step: int) -> dict[str, float]:
        if self.task is not None:
            scfg = SamplingConfig(max_tokens=self.cfg.eval_max_tokens, temperature=0.0)
            m = evaluate(self.run.sampler(), self.task, self.eval_set, scfg, k=1, seed=self.cfg.seed)
        elif self.eval_set:
            data = [supervised_datum(p, t) for p, t in self.eval_set]
            out = self.run.training.forward(data, "cross_entropy").result()
            m = {"eval/nll": float(out.metrics["loss:sum"]) / sum(len(t) for _, t in self.eval_set)}
        else:
            m = {}
        if m:
            self.run.metrics.log(step, m)
            self.last_eval = m
        return m

    def train(self) -> dict[str, Any]:
        """Run to ``cfg.steps``; returns the last held-out metrics and the files written."""
        cfg, run = self.cfg, self.run
        tc = run.training
        position = run.data_position
        if run.start_step == 0 or (cfg.eval_every and run.start_step % cfg.eval_every == 0):
            self.evaluate(run.start_step)
        bar = run.progress(cfg.steps, "ember sft")
        plots: list = []
        final = run.resumed
        try:
            for step in range(run.start_step, cfg.steps):
                batch = [self.example(position + i) for i in range(cfg.batch_size)]
                position += len(batch)
                params = adam(cfg.optim, step, cfg.steps)
                fut = tc.forward_backward([supervised_datum(p, t) for p, t in batch], "cross_entropy")
                opt = tc.optim_step(params)
                result = fut.result()
                opt.result()
                n_target = sum(len(t) for _, t in batch)
                metrics = {"train/loss": float(result.metrics["loss:sum"]) / n_target,
                           "train/learning_rate": params.learning_rate, "train/target_tokens": float(n_target)}
                run.metrics.log(step, metrics)
                done = step + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
                    self.evaluate(done)
                if cfg.save_every and done % cfg.save_every == 0 and done != cfg.steps:
                    save_checkpoint(run.log_dir, tc, run.state(done, position), f"step{done:06d}")
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
            if run.start_step < cfg.steps:
                self.evaluate(cfg.steps)
                final = save_checkpoint(run.log_dir, tc, run.state(cfg.steps, position), "final")
            else:
                log.info("%s already holds a finished run of %d steps; nothing to do", run.log_dir, cfg.steps)
        finally:
            bar.close()
            if cfg.plots:
                plots = plot_metrics(run.metrics.records(), run.log_dir / "plots", SFT_PANELS)
            run.close("errored" if sys.exc_info()[0] else "success")
        return {"eval": self.last_eval, "log_dir": str(run.log_dir), "plots": [str(p) for p in plots],
                "state_path": final.state_path if final else None}


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    """Train with ``cfg`` (resuming from ``cfg.log_dir`` when it holds a checkpoint)."""
    return SFTTrainer(cfg).train()

