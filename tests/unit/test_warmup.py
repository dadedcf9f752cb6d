"""The engine's warm-up before serving: it runs the training and sampling paths once and leaves
nothing behind."""

import logging
import os

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.engine.warmup import keep_autotuning, wants_warm_up, warm_up
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput


def test_when_the_engine_warms_up():
    assert wants_warm_up("auto", "cuda") and wants_warm_up("auto", "cuda:1")
    assert not wants_warm_up("auto", "cpu") and not wants_warm_up("off", "cuda")
    assert wants_warm_up("on", "cpu")
    with pytest.raises(ValueError, match="warm-up must be one of"):
        wants_warm_up("sometimes", "cuda")


def test_triton_keeps_autotuning_results_unless_the_user_said_otherwise(monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    keep_autotuning()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    keep_autotuning()
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


def _step(worker: Worker) -> tuple[float, torch.Tensor]:
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=3))
    rng = np.random.default_rng(1)
    seq = rng.integers(0, worker.config.vocab_size, 25)
    datum = Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(24, np.float32)})
    out = worker.forward_backward([ForwardBackwardInput(slot, [datum], "cross_entropy")])[0]
    grads = worker.adapter(slot).flat.grad.clone()
    worker.free_adapter(slot)
    return out.metrics["loss:sum"], grads


def test_warm_up_runs_each_path_and_leaves_the_worker_as_it_was(hf_models, caplog):
    path = hf_models["qwen3"][1]
    fresh = Worker.from_pretrained(path, "cpu", torch.float32)
    warmed = Worker.from_pretrained(path, "cpu", torch.float32)
    caplog.set_level(logging.INFO, logger="ember.engine.warmup")
    seconds = warm_up(warmed, warmed.config.vocab_size, lengths=(12, 20))
    assert seconds > 0
    assert caplog.text.count("warm-up: training pass") == 2 and "warm-up: sampling" in caplog.text
    assert len(warmed.bank) == 0 and warmed._kept_scale == fresh._kept_scale
    assert warmed._sampler is None  # no KV cache held for an engine that may only train
    loss, grads = _step(warmed)
    want_loss, want_grads = _step(fresh)
    assert loss == want_loss and torch.equal(grads, want_grads)


def test_the_flag_reaches_the_engine(capsys):
    from types import SimpleNamespace

    from ember.engine import service
    from ember.server.supervisor import EngineOptions, EngineSupervisor

    model = SimpleNamespace(path="/models/m")
    for value in ("auto", "on", "off"):
        cmd = EngineSupervisor(None, {"m": model}, EngineOptions("sqlite://", "/tmp/ckpt", warmup=value)).command("m")
        assert cmd[cmd.index("--warmup") + 1] == value
    with pytest.raises(SystemExit):
        service.main(["--base-model", "m", "--model-path", "/x", "--database-url", "sqlite://", "--storage", "/tmp",
                      "--warmup", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
