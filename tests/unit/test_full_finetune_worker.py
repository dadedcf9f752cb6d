"""Full fine-tuning in the worker (rank 0 runs, ember.engine.full_runs): a run trains its own copy
and never the base model; a packed call that mixes LoRA and full requests gives each what it gets
alone; one step equals torch.optim.AdamW; optimizer offload modes agree bitwise; the run samples
its current weights, snapshots keep theirs; save/load is exact; memory and kind errors are clear."""

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.core.full_ft import frozen_parameter_names, trainable_parameters
from ember.core.loading import load_model
from ember.core.optim import AdamParams
from ember.engine import full_runs
from ember.engine.full_runs import NoRoom
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput, SampleInput, SampleOutput, SamplingParams
from tests.tiny_models import build_hf_model, random_sequences, save_hf_model

HP = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(build_hf_model("qwen3", seed=4), tmp_path_factory.mktemp("m") / "qwen3")


def worker_of(path, **kw) -> Worker:
    w = Worker(load_model(path, "cpu", torch.float32), max_adapters=4, full_finetune=True,
               activation_checkpointing="off", **kw)
    w.model_dir = path
    return w


def datums(seed: int, lengths=(9, 14)) -> list[Datum]:
    return [Datum(np.asarray(s[:-1]), {"target_tokens": np.asarray(s[1:]), "weights": np.ones(len(s) - 1, np.float32)})
            for s in random_sequences(320, lengths, seed=seed)]


def fb(w, slot, data, forward_only=False):
    (out,) = w.forward_backward([ForwardBackwardInput(slot, data, "cross_entropy", forward_only=forward_only)])
    return out


def base_state(w):
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


def test_a_run_trains_its_own_copy_and_equals_adamw(model_dir):
    w = worker_of(model_dir)
    before = base_state(w)
    run = w.create_adapter(LoraConfig(rank=0))
    assert run < 0
    data = datums(1)
    ref = {n: p.detach().clone().requires_grad_() for n, p in trainable_parameters(w.model)}
    fb(w, run, data)
    # the reference: the same loss by autograd on fp32 copies of the base weights
    model = w.full.get(run).model
    grads = {n: p.grad.clone() for n, p in trainable_parameters(model)}
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "norm" not in n)
    opt = torch.optim.AdamW(list(ref.values()), lr=HP.learning_rate, betas=(HP.beta1, HP.beta2), eps=HP.eps,
                            weight_decay=HP.weight_decay)
    for n, p in ref.items():
        p.grad = grads[n].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(ref.values()), HP.grad_clip_norm)
    opt.step()
    metrics = w.optim_step(run, HP)
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    after = dict(trainable_parameters(model))
    moved = 0.0
    for n, p in ref.items():
        torch.testing.assert_close(after[n].detach(), p.detach(), rtol=1e-6, atol=1e-7)
        moved += float((p.detach() - before[n]).abs().sum())
    assert moved > 0
    for n, p in w.model.named_parameters():  # the shared base model never changes
        assert torch.equal(p, before[n]), n


def test_mixed_lora_and_full_requests_each_get_what_they_get_alone(model_dir):
    w = worker_of(model_dir)
    run, lora = w.create_adapter(LoraConfig(rank=0)), w.create_adapter(LoraConfig(rank=4, seed=3))
    data = datums(2)
    fb(w, run, data)
    w.optim_step(run, HP)  # the run's weights now differ from the base model's
    fb(w, lora, data)
    w.optim_step(lora, HP)
    alone = [fb(w, s, data, forward_only=True).logprobs for s in (run, lora, 0)]
    outs = w.forward_backward([ForwardBackwardInput(s, data, "cross_entropy", forward_only=True) for s in (run, lora, 0)])
    for got, ref in zip(outs, alone):
        for a, b in zip(got.logprobs, ref):
            np.testing.assert_array_equal(a, b)
    assert not np.allclose(alone[0][0], alone[2][0])  # the run really moved


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_offloaded_optimizer_equals_resident(model_dir, offload, tmp_path):
    results = []
    for mode in ("none", "host" if offload == "host" else f"disk:{tmp_path}"):
        w = worker_of(model_dir, optimizer_offload=mode)
        run = w.create_adapter(LoraConfig(rank=0))
        for i in range(2):
            fb(w, run, datums(10 + i))
            w.optim_step(run, HP)
        results.append({n: p.detach().clone() for n, p in trainable_parameters(w.full.get(run).model)})
        w.free_adapter(run)
    for n in results[0]:
        assert torch.equal(results[0][n], results[1][n]), n


def sample(w, slot, prompt, seed=5):
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=seed)
    (out,) = w.sample([SampleInput(slot=slot, prompt=np.asarray(prompt), params=params, num_samples=1)])
    assert isinstance(out, SampleOutput), out
    return out.sequences[0]


def test_sampling_reads_the_run_and_snapshots_keep_their_weights(model_dir, monkeypatch):
    w = worker_of(model_dir)
    run = w.create_adapter(LoraConfig(rank=0))
    data = datums(3)
    for _ in range(2):
        fb(w, run, data)
        w.optim_step(run, HP)
    prompt = random_sequences(320, [7], seed=8)[0]
    snap = w.snapshot_adapter(run)
    first = sample(w, snap, prompt)
    full = prompt + list(first.tokens)
    d = Datum(np.asarray(full[:-1]), {"target_tokens": np.asarray(full[1:]), "weights": np.ones(len(full) - 1, np.float32)})
    trainer = fb(w, run, [d], forward_only=True).logprobs[0][len(prompt) - 1 :]
    np.testing.assert_allclose(np.asarray(first.logprobs), trainer, atol=1e-5)
    # the run steps on: the snapshot keeps the weights it saw (a host copy)
    later = []
    for _ in range(full_runs.HOST_SNAPSHOTS + 1):
        fb(w, run, data)
        later.append(w.snapshot_adapter(run))
        w.optim_step(run, HP)
    kept = sample(w, later[-1], prompt)
    fb(w, run, data)
    w.optim_step(run, HP)
    again = sample(w, later[-1], prompt)
    assert list(again.tokens) == list(kept.tokens)
    np.testing.assert_array_equal(np.asarray(again.logprobs), np.asarray(kept.logprobs))
    now = sample(w, w.snapshot_adapter(run), prompt)
    assert not np.allclose(np.asarray(now.logprobs)[:1], np.asarray(kept.logprobs)[:1])  # the run did move on
    (gone,) = w.sample([SampleInput(slot=snap, prompt=np.asarray(prompt), params=SamplingParams(max_tokens=2),
                                    num_samples=1)])
    assert "superseded" in gone.message  # only the last HOST_SNAPSHOTS host copies are kept


def test_save_load_is_exact_and_kinds_do_not_mix(model_dir, tmp_path):
    w = worker_of(model_dir)
    run = w.create_adapter(LoraConfig(rank=0))
    fb(w, run, datums(4))
    w.optim_step(run, HP)
    w.save_adapter(run, tmp_path / "full", with_optimizer=True)
    resumed = w.load_adapter(tmp_path / "full", with_optimizer=True)
    for slot in (run, resumed):
        fb(w, slot, datums(5))
        w.optim_step(slot, HP)
    a = dict(trainable_parameters(w.full.get(run).model))
    b = dict(trainable_parameters(w.full.get(resumed).model))
    for n, value in a.items():
        assert torch.equal(value, b[n]), n
    lora = w.create_adapter(LoraConfig(rank=4))
    w.save_adapter(lora, tmp_path / "lora", with_optimizer=False)
    assert not w.checkpoint_kind_matches(run, tmp_path / "lora")
    assert not w.checkpoint_kind_matches(lora, tmp_path / "full")
    plain = Worker(load_model(model_dir, "cpu", torch.float32), max_adapters=2)
    with pytest.raises(ValueError, match="--full-finetune"):
        plain.load_adapter(tmp_path / "full", with_optimizer=False)
    with pytest.raises(ValueError, match="--full-finetune"):
        plain.validate(LoraConfig(rank=0))


def test_no_room_is_a_clear_error_and_changes_nothing(model_dir, monkeypatch):
    w = worker_of(model_dir)
    monkeypatch.setattr(full_runs, "free_bytes", lambda device: 1024)
    with pytest.raises(NoRoom, match="no memory for another full fine-tuning run"):
        w.create_adapter(LoraConfig(rank=0))
    assert not w.full.runs


def test_frozen_parameters_of_qwen4_exp_are_not_trained():
    from ember.core.layers.qsa import QSAIndexer

    assert QSAIndexer.frozen_in_full_finetune
    indexer = QSAIndexer(16, 2, 8, 8, 4, 1e-6, 0)
    holder = torch.nn.Module()
    holder.idx = indexer
    holder.proj = torch.nn.Linear(4, 4)
    assert frozen_parameter_names(holder) == {n for n, _ in holder.named_parameters() if n.startswith("idx.")}
    assert [n for n, _ in trainable_parameters(holder)] == ["proj.weight", "proj.bias"]
