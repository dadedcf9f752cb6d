"""Environments, multi-turn rollouts (with a scripted sampler), data order and config files."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from ember.engine.builtin import build_tokenizer
from ember.rl.config import RLConfig, SFTConfig, load_config
from ember.rl.data import DataOrder
from ember.rl.envs import (
    ArithmeticChainTask,
    ArithmeticTask,
    MathAnswerTask,
    exact_integer,
    final_integer,
    math_equivalent,
)
from ember.rl.rollouts import SamplingConfig, derive_seed, rollout_groups


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chartok")
    build_tokenizer(path, vocab_size=259)  # byte alphabet + 3 specials: one token per character
    return AutoTokenizer.from_pretrained(str(path))


class ScriptedSampler:
    """A SamplingClient stand-in: answers each request with the next scripted texts and records prompts."""

    def __init__(self, tokenizer, answers):
        self.tok, self.answers, self.requests = tokenizer, list(answers), []

    def sample(self, prompt, num_samples, params):
        self.requests.append((prompt.to_ints(), num_samples, params))
        seqs = []
        for _ in range(num_samples):
            text, stop = self.answers.pop(0)
            toks = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if stop else [])
            seqs.append(SimpleNamespace(tokens=toks, logprobs=[-0.5] * len(toks), stop_reason="stop" if stop else "length"))
        return SimpleNamespace(result=lambda: SimpleNamespace(sequences=seqs))


def test_arithmetic_problems_are_deterministic_correct_and_held_out(tokenizer):
    a = ArithmeticTask(tokenizer, min_digits=2, max_digits=3, seed=7, num_eval=50)
    b = ArithmeticTask(tokenizer, min_digits=2, max_digits=3, seed=7, num_eval=50)
    assert [a.train_problem(i) for i in range(20)] == [b.train_problem(i) for i in range(20)]
    assert a.train_problem(0) != ArithmeticTask(tokenizer, min_digits=2, max_digits=3, seed=8).train_problem(0)
    held = {p.question for p in a.eval_problems()}
    for i in range(3000):
        p = a.train_problem(i)
        assert p.question not in held
        x, y = p.question[:-1].split("+")
        assert 10 <= int(x) < 1000 and 10 <= int(y) < 1000 and int(p.answer) == int(x) + int(y)
    with pytest.raises(ValueError, match="min_digits"):
        ArithmeticTask(tokenizer, min_digits=3, max_digits=2)


def test_graders():
    assert exact_integer(" 42 ", "42") == 1.0 and exact_integer("42.", "42") == 0.0 and exact_integer("", "4") == 0.0
    assert final_integer("so the sum is 1,234", "1234") == 1.0 and final_integer("no number", "3") == 0.0
    assert math_equivalent("The answer is \\boxed{0.5}", "1/2") == 1.0
    assert math_equivalent("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}") == 1.0
    assert math_equivalent("so x = \\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 1.0
    assert math_equivalent("The answer is 42.", "42") == 1.0
    assert math_equivalent("\\boxed{3}", "1/2") == 0.0 and math_equivalent("I don't know", "7") == 0.0


def test_math_task_reads_jsonl_and_parquet(tokenizer, tmp_path):
    rows = [{"problem": f"What is {i} / {2 * i}?", "solution": "\\frac{1}{2}"} for i in range(1, 41)]
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    for path in (jsonl, tmp_path / "m.parquet"):
        task = MathAnswerTask(tokenizer, str(path), question_key="problem", answer_key="solution", eval_fraction=0.25)
        train = {task.train_problem(i).question for i in range(task.num_train_problems())}
        held = {p.question for p in task.eval_problems()}
        assert train.isdisjoint(held) and len(train) + len(held) == 40 and held
        env = task.make_env(task.train_problem(0))
        prompt = tokenizer.decode(env.initial_observation())
        assert prompt.startswith("What is") and "\\boxed{}" in prompt
        eos = [tokenizer.eos_token_id]
        assert env.step(tokenizer.encode("\\boxed{0.5}", add_special_tokens=False) + eos, "stop").reward == 1.0
        assert env.step(tokenizer.encode("\\boxed{0.5}", add_special_tokens=False), "length").reward == 0.0
    with pytest.raises(ValueError, match="missing field"):
        MathAnswerTask(tokenizer, str(jsonl))


def test_single_turn_group_is_one_request_with_num_samples(tokenizer):
    task = ArithmeticTask(tokenizer, min_digits=1, max_digits=1, seed=0, num_eval=5)
    p = task.train_problem(0)
    sampler = ScriptedSampler(tokenizer, [(p.answer, True), ("0", True), (p.answer, False)])
    (group,) = rollout_groups(sampler, task, [p], 3, SamplingConfig(max_tokens=4), seed=1, key=(5,))
    assert len(sampler.requests) == 1 and sampler.requests[0][1] == 3
    assert sampler.requests[0][2].seed == derive_seed(1, 5, 0, 0, 0)
    assert group.rewards == [1.0, float(p.answer == "0"), 0.0]  # the third was cut off by max_tokens
    t = group.trajectories[0]
    prompt = tokenizer.encode(p.question, add_special_tokens=False)
    assert t.tokens[: len(prompt)] == prompt and t.policy_mask == [0] * len(prompt) + [1] * (len(p.answer) + 1)
    assert t.sampler_logprobs[len(prompt):] == [-0.5] * (len(p.answer) + 1)


def test_multi_turn_episode_passes_token_ids_between_turns(tokenizer):
    task = ArithmeticChainTask(tokenizer, turns=3, min_digits=2, max_digits=2, seed=3, num_eval=5)
    p = task.train_problem(0)
    env = task.make_env(p)
    addends = env.addends
    total1 = int(p.answer)
    total2 = total1 + addends[0]
    total3 = total2 + addends[1]
    # episode 1: all three turns right; episode 2: the second turn wrong
    sampler = ScriptedSampler(tokenizer, [(str(total1), True), (str(total1), True), (str(total2), True),
                                          (str(total2 + 1), True), (str(total3), True)])
    (group,) = rollout_groups(sampler, task, [p], 2, SamplingConfig(max_tokens=5), seed=0)
    right, wrong = group.trajectories
    assert right.reward == pytest.approx(1.0) and right.turns == 3 and right.metrics["correct"] == 1.0
    assert wrong.reward == pytest.approx(1 / 3) and wrong.turns == 2 and wrong.metrics["correct"] == 0.0
    enc = (lambda s: tokenizer.encode(s, add_special_tokens=False))
    eos = tokenizer.eos_token_id
    prompt = enc(p.question)
    # turn 2's prompt is exactly: prompt + sampled tokens + the observation's own tokens
    turn2 = [r[0] for r in sampler.requests[1:]]
    assert turn2[0] == prompt + enc(str(total1)) + [eos] + enc(f"+{addends[0]}=")
    want = (prompt + enc(str(total1)) + [eos] + enc(f"+{addends[0]}=") + enc(str(total2)) + [eos]
            + enc(f"+{addends[1]}=") + enc(str(total3)) + [eos])
    assert right.tokens == want
    sampled = [i for i, m in enumerate(right.policy_mask) if m]
    assert [right.tokens[i] for i in sampled] == enc(str(total1)) + [eos] + enc(str(total2)) + [eos] + enc(str(total3)) + [eos]


def test_data_order_visits_every_example_once_per_epoch():
    order = DataOrder(7, seed=3)
    e0 = [order.index(i) for i in range(7)]
    e1 = [order.index(i) for i in range(7, 14)]
    assert sorted(e0) == list(range(7)) == sorted(e1) and e0 != e1
    assert [DataOrder(7, seed=3).index(i) for i in range(9, 12)] == e1[2:5]
    assert DataOrder(None, 0).index(123) == 123


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "rl.toml"
    f.write_text('base_model = "m"\nsteps = 5\n[loss]\nkind = "cispo"\n[task]\nkind = "arithmetic"\nmax_digits = 2\n')
    cfg = load_config(RLConfig, f, ["loss.eps_high=5", "sampling.max_tokens=7", "optim.learning_rate=1e-3",
                                    "task.min_digits=2", "overlong_max_len=12", "overlong_cache_len=4"])
    assert cfg.loss.kind == "cispo" and cfg.loss.eps_high == 5.0 and isinstance(cfg.loss.eps_high, float)
    assert cfg.sampling.max_tokens == 7 and cfg.optim.learning_rate == 1e-3
    assert cfg.task == {"kind": "arithmetic", "max_digits": 2, "min_digits": 2} and cfg.steps == 5
    y = tmp_path / "sft.yaml"
    y.write_text("base_model: m\ndata: {kind: jsonl, path: x.jsonl}\n")
    assert load_config(SFTConfig, y).data == {"kind": "jsonl", "path": "x.jsonl"}
    with pytest.raises(ValueError, match="unknown config key.*loss.clip"):
        load_config(RLConfig, f, ["loss.clip=3"])
    with pytest.raises(ValueError, match="steps = 'many'"):
        load_config(RLConfig, f, ["steps=many"])
    with pytest.raises(ValueError, match="base_model is required"):
        load_config(RLConfig, None, [])
    with pytest.raises(ValueError, match="minibatch_prompts"):
        load_config(RLConfig, f, ["minibatch_prompts=100"])


def test_eval_metrics_pass_at_k(tokenizer):
    from ember.rl.rollouts import evaluate

    task = ArithmeticTask(tokenizer, min_digits=1, max_digits=1, seed=0, num_eval=2)
    probs = task.eval_problems()
    wrong = [str(int(p.answer) + 1) for p in probs]
    sampler = ScriptedSampler(tokenizer, [(probs[0].answer, True), (wrong[0], True), (wrong[1], True), (wrong[1], True)])
    m = evaluate(sampler, task, probs, SamplingConfig(max_tokens=3), k=2)
    assert m["eval/accuracy"] == 0.25 and m["eval/pass@2"] == 0.5
    assert np.isclose(m["eval/response_len"], np.mean([len(a) + 1 for a in [probs[0].answer, wrong[0], wrong[1], wrong[1]]]))


def test_digit_credit_and_second_operand_digits(tokenizer):
    from ember.rl.envs.arithmetic import digit_credit

    assert digit_credit("95", "95") == 1.0 and digit_credit("96", "95") == 0.5 and digit_credit("195", "95") == 2 / 3
    assert digit_credit("abc", "95") == 0.0 and digit_credit("", "5") == 0.0
    task = ArithmeticTask(tokenizer, min_digits=2, max_digits=2, b_digits=[1, 1], reward="digits", num_eval=5)
    for i in range(200):
        a, b = task.train_problem(i).question[:-1].split("+")
        assert len(a) == 2 and len(b) == 1
    p = task.train_problem(0)
    env = task.make_env(p)
    wrong_units = str(int(p.answer) // 10) + str((int(p.answer) + 1) % 10)
    step = env.step(tokenizer.encode(wrong_units, add_special_tokens=False) + [tokenizer.eos_token_id], "stop")
    assert step.metrics["correct"] == 0.0 and step.reward == pytest.approx((len(p.answer) - 1) / len(p.answer))


def test_chat_prompts_use_the_tokenizers_template(tokenizer):
    """``prompt = "chat"``: the tokenizer's chat template with a generation prompt (ChatML for the
    built-in tokenizer), as token ids."""
    from ember.rl.envs.base import PromptFormat

    ids = PromptFormat(tokenizer, "chat").prompt("1+1?")
    assert ids and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
