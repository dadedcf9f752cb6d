"""tinker-cookbook 0.6.1, unmodified and offline, against a live ``ember serve`` (a few steps each
on a tiny random model): chat SL with an interrupted run resumed exactly, math RL on synthetic
arithmetic with ``loss_fn=importance_sampling`` and with its default ``stable_reinforce`` (also
async, one step off policy), the multi-turn guess-the-number game, and DPO
through ``forward_backward_custom`` on a local comparisons file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import tinker_cookbook

EXAMPLE_DATA = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


def _records(path: Path) -> dict[int, dict]:
    """metrics.jsonl by step (the last record of a step wins: a resumed run re-logs its steps)."""
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.setdefault(r["step"], {}).update(r)
    return out


def _chat_sl_args(server, log_dir: Path, max_steps: int, save_every: int, behavior: str) -> list[str]:
    return [f"model_name={server.model}", "renderer_name=role_colon", f"dataset={EXAMPLE_DATA}", "batch_size=8",
            f"max_steps={max_steps}", f"save_every={save_every}", "eval_every=0", "lora_rank=8",
            "learning_rate=1e-3", "lr_schedule=constant", f"behavior_if_log_dir_exists={behavior}", f"log_path={log_dir}"]


def test_chat_sl_checkpoint_resumes_exactly(cookbook_server, tmp_path):
    module = "tinker_cookbook.recipes.chat_sl.train"
    run = tmp_path / "chat_sl"
    cookbook_server.recipe(module, _chat_sl_args(cookbook_server, run, 6, 2, "delete"), tmp_path)
    first = _records(run / "metrics.jsonl")
    assert sorted(first) == list(range(6)) and first[5]["train_mean_nll"] < first[0]["train_mean_nll"]
    ckpts = run / "checkpoints.jsonl"
    lines = [json.loads(x) for x in ckpts.read_text().splitlines() if x.strip()]
    assert [c["batch"] for c in lines if c["name"] != "final"] == [2, 4]
    step2 = lines[0]

    # The step-2 checkpoint holds the weights and Adam state after the updates the recipe had
    # submitted when it saved: with submit_ahead = 1 those of batches 0-3. Loading it with its
    # optimizer must reproduce the recipe's NLL of batch 4 (weights) and, after the recipe's
    # step on batch 4, of batch 5 (weights + Adam moments).
    out = cookbook_server.recipe("tests.cookbook.check_sl_checkpoint",
                                 [cookbook_server.model, str(EXAMPLE_DATA), step2["state_path"], "4"], tmp_path)
    replay = json.loads(out.stdout.strip().splitlines()[-1])
    assert replay["nll_j"] == pytest.approx(first[4]["train_mean_nll"], rel=1e-5)
    assert replay["nll_j1"] == pytest.approx(first[5]["train_mean_nll"], rel=1e-5)

    # The recipe's own resume: as if the run had crashed after that checkpoint, keep only it and
    # rerun with behavior_if_log_dir_exists=resume and a higher max_steps (4): the recipe loads it
    # (create_training_client_from_state_with_optimizer) and trains batches 2 and 3.
    ckpts.write_text(json.dumps(step2) + "\n")
    out = cookbook_server.recipe(module, _chat_sl_args(cookbook_server, run, 4, 2, "resume"), tmp_path)
    assert f"Resumed training from {step2['state_path']}" in out.stdout + out.stderr
    resumed = _records(run / "metrics.jsonl")
    assert sorted(resumed) == [0, 1, 2, 3] and all(math.isfinite(resumed[s]["train_mean_nll"]) for s in (2, 3))
    final = [json.loads(x) for x in ckpts.read_text().splitlines() if x.strip()][-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")


def test_math_rl_arithmetic_with_importance_sampling(cookbook_server, tmp_path):
    log_dir = tmp_path / "math_rl"
    cookbook_server.recipe("tinker_cookbook.recipes.math_rl.train", [
        f"model_name={cookbook_server.model}", "renderer_name=role_colon", "env=arithmetic",
        "loss_fn=importance_sampling", "group_size=4", "groups_per_batch=4", "max_tokens=5", "max_steps=2",
        "save_every=0", "eval_every=0", "lora_rank=8", "learning_rate=1e-4", "behavior_if_log_dir_exists=delete",
        f"log_path={log_dir}"], tmp_path)
    records = {s: r for s, r in _records(log_dir / "metrics.jsonl").items() if "env/all/total_episodes" in r}
    assert sorted(records) == [0, 1]  # the two training steps (a last record holds token totals)
    for r in records.values():
        assert r["env/all/total_episodes"] == 16 and r["env/all/ac_tokens_per_turn"] <= 5
        # sampler and trainer log-probabilities of the sampled tokens agree (same weights, fp32)
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-3 and r["optim/kl_sample_train_v2"] < 1e-5
    final = [json.loads(x) for x in (log_dir / "checkpoints.jsonl").read_text().splitlines()][-1]
    assert final["name"] == "final"


def _math_rl_default_loss(server, log_dir: Path, *extra: str) -> list[str]:
    """math_rl on synthetic arithmetic with the recipe's own loss (no loss_fn: stable_reinforce)."""
    return [f"model_name={server.model}", "renderer_name=role_colon", "env=arithmetic", "group_size=4",
            "groups_per_batch=4", "max_tokens=5", "save_every=0", "eval_every=0", "lora_rank=8",
            "learning_rate=1e-4", "behavior_if_log_dir_exists=delete", f"log_path={log_dir}", *extra]


def test_math_rl_with_its_default_loss_stable_reinforce(cookbook_server, tmp_path):
    """The recipe as a new user runs it: loss_fn defaults to stable_reinforce, so the sampler
    records stability information and every datum carries provenance."""
    log_dir = tmp_path / "math_rl_sr"
    cookbook_server.recipe("tinker_cookbook.recipes.math_rl.train",
                           _math_rl_default_loss(cookbook_server, log_dir, "max_steps=3"), tmp_path)
    records = {s: r for s, r in _records(log_dir / "metrics.jsonl").items() if "env/all/total_episodes" in r}
    assert sorted(records) == [0, 1, 2]
    for r in records.values():
        assert r["env/all/total_episodes"] == 16
        # the trainer's replayed logprobs of the sampled tokens equal the sampler's (τ = 1, untruncated)
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-3 and r["optim/kl_sample_train_v2"] < 1e-5
    assert json.loads((log_dir / "config.json").read_text())["loss_fn"] == "stable_reinforce"
    assert '"losses": ["stable_reinforce"]' in cookbook_server.log.read_text()  # what the engine ran


def test_math_rl_async_one_step_off_policy(cookbook_server, tmp_path):
    """An async run (max_steps_off_policy=1): sampling runs a step ahead of training, and
    stable_reinforce trains on records made by the previous weights' sampler."""
    log_dir = tmp_path / "math_rl_async"
    cookbook_server.recipe("tinker_cookbook.recipes.math_rl.train", _math_rl_default_loss(
        cookbook_server, log_dir, "max_steps=3", "max_steps_off_policy=1"), tmp_path)
    records = {s: r for s, r in _records(log_dir / "metrics.jsonl").items() if "env/all/total_episodes" in r}
    assert len(records) == 3, sorted(records)


def test_multiplayer_guess_number(cookbook_server, tmp_path):
    log_dir = tmp_path / "guess"
    cookbook_server.recipe("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", [
        f"model_name={cookbook_server.model}", "renderer_name=role_colon", "group_size=2", "batch_size=2",
        "max_tokens=4", "max_steps=1", "save_every=0", "eval_every=0", "learning_rate=1e-4",
        "behavior_if_log_dir_exists=delete", f"log_path={log_dir}"], tmp_path, timeout_s=420)
    (record,) = [r for r in _records(log_dir / "metrics.jsonl").values() if "env/all/total_episodes" in r]
    # a random policy never guesses right, so every episode runs its 10 turns (multi-turn sampling)
    assert record["env/all/total_episodes"] == 4
    assert record["env/all/turns_per_episode"] > 1


def test_dpo_through_forward_backward_custom_on_local_comparisons(cookbook_server, tmp_path):
    rows = []
    for i in range(24):
        q = f"Is {i} a number?"
        rows.append({"comparison": {"prompt_conversation": [{"role": "user", "content": q}],
                                    "completion_A": [{"role": "assistant", "content": "Yes, it is."}],
                                    "completion_B": [{"role": "assistant", "content": "Banana."}]},
                     "label": "A"})
    comparisons = tmp_path / "comparisons.jsonl"
    comparisons.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log_dir = tmp_path / "dpo"
    cookbook_server.recipe("tests.cookbook.dpo_driver", [cookbook_server.model, str(comparisons), str(log_dir), "4"],
                           tmp_path)
    records = _records(log_dir / "metrics.jsonl")
    assert sorted(records) == [0, 1, 2, 3]
    # step 0: the policy is its own reference, so every log-ratio is 0 and the loss is log 2
    assert records[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3)
    assert records[3]["dpo_loss"] < records[0]["dpo_loss"] - 0.01 and records[3]["accuracy"] == 1.0
