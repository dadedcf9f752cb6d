"""Adapter checkpoints (with/without optimizer, atomic) and PEFT export/import."""

import copy
import json

import numpy as np
import pytest
import torch

import ember.core.checkpoint as ckpt
from ember.core.adapters import LoraConfig
from ember.core.optim import AdamParams
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences

HP = AdamParams(learning_rate=5e-3)


def _ce(slot, seed):
    seqs = random_sequences(320, [13, 7], seed=seed)
    return ForwardBackwardInput(
        slot, [Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:])}) for s in seqs], "cross_entropy"
    )


def _train(worker, slot, steps, seed):
    for i in range(steps):
        worker.forward_backward([_ce(slot, seed + i)])
        worker.optim_step(slot, HP)


def _weights(worker, slot):
    return {k: t.detach().clone() for k, t in worker.adapter(slot).tensors().items()}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_resume_with_optimizer_continues_exactly(family, hf_models, tmp_path):
    _, path = hf_models[family]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    a = worker.create_adapter(LoraConfig(rank=4, alpha=16, seed=3))
    _train(worker, a, 2, seed=0)
    worker.save_adapter(a, tmp_path / "s1", with_optimizer=True, metadata={"user_metadata": {"k": "v"}})
    meta = json.loads((tmp_path / "s1" / "metadata.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 16.0, "targets": ["attn", "mlp", "unembed"], "seed": 3}
    b = worker.load_adapter(tmp_path / "s1", with_optimizer=True)
    c = worker.load_adapter(tmp_path / "s1", with_optimizer=False)
    assert _weights(worker, a).keys() == _weights(worker, b).keys()
    for k, v in _weights(worker, a).items():
        assert torch.equal(v, _weights(worker, b)[k]) and torch.equal(v, _weights(worker, c)[k])
    for slot in (a, b, c):
        _train(worker, slot, 2, seed=100)
    wa, wb, wc = _weights(worker, a), _weights(worker, b), _weights(worker, c)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=0, rtol=0)
    assert any(not torch.allclose(wc[k], wa[k]) for k in wa)  # fresh moments give a different path


def test_loading_without_saved_optimizer_is_an_error(hf_models, tmp_path):
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    a = worker.create_adapter(LoraConfig(rank=4))
    worker.save_adapter(a, tmp_path / "w", with_optimizer=False)
    before = len(worker.bank)
    with pytest.raises(ValueError, match="without optimizer"):
        worker.load_adapter(tmp_path / "w", with_optimizer=True)
    assert len(worker.bank) == before  # the half-made adapter was released


def test_crash_during_save_leaves_old_checkpoint(hf_models, tmp_path, monkeypatch):
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    a = worker.create_adapter(LoraConfig(rank=4))
    worker.save_adapter(a, tmp_path / "c", with_optimizer=False)
    original = (tmp_path / "c" / "adapter.safetensors").read_bytes()
    _train(worker, a, 1, seed=0)
    calls = []

    def failing_save(tensors, filename):
        calls.append(filename)
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", failing_save)
    with pytest.raises(OSError):
        worker.save_adapter(a, tmp_path / "c", with_optimizer=True, overwrite=True)
    with pytest.raises(OSError):
        worker.save_adapter(a, tmp_path / "new", with_optimizer=True)
    assert calls
    assert (tmp_path / "c" / "adapter.safetensors").read_bytes() == original
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary debris
    with pytest.raises(FileExistsError):
        worker.save_adapter(a, tmp_path / "c", with_optimizer=False)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_peft_export_loads_in_peft_with_same_logits(family, hf_models, tmp_path):
    from peft import PeftModel

    hf, path = hf_models[family]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8, seed=2))
    randomise(worker.adapter(slot), seed=5, scale=0.1)
    out_dir = worker.export_peft(slot, tmp_path / "peft", base_model=str(path))
    cfg = json.loads((out_dir / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and "q_proj" in cfg["target_modules"]
    peft = PeftModel.from_pretrained(copy.deepcopy(hf), str(out_dir)).eval()
    s = random_sequences(320, [20], seed=8)[0]
    (out,) = worker.forward_backward(
        [ForwardBackwardInput(slot, [Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:])})], forward_only=True)]
    )
    with torch.no_grad():
        ref = torch.log_softmax(peft(torch.tensor([s[:-1]])).logits[0].double(), -1)
        base = torch.log_softmax(hf(torch.tensor([s[:-1]])).logits[0].double(), -1)
    idx = torch.tensor(s[1:])[:, None]
    np.testing.assert_allclose(out.logprobs[0], ref.gather(1, idx)[:, 0].numpy(), atol=1e-4)
    assert (ref - base).abs().max() > 1e-2  # the adapter really changes the model


@pytest.mark.parametrize("layout", ["peft", "tinker"])
def test_export_import_round_trip(layout, hf_models, tmp_path):
    from safetensors.torch import load_file

    _, path = hf_models["qwen3_moe"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8, seed=2))
    randomise(worker.adapter(slot), seed=6)
    out_dir = worker.export_peft(slot, tmp_path / layout, base_model="tiny", layout=layout)
    names = load_file(str(out_dir / "adapter_model.safetensors"))
    if layout == "tinker":
        assert "base_model.model.model.unembed_tokens.lora_A.weight" in names
        w1 = names["base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight"]
        assert w1.shape == (8, 4, 64)  # 3-D: (experts, rank, hidden)
        assert names["base_model.model.model.layers.0.mlp.experts.w2.lora_B.weight"].shape == (8, 64, 4)
    back = worker.import_peft(out_dir)
    for k, v in _weights(worker, slot).items():
        assert torch.equal(_weights(worker, back)[k], v), k


@pytest.mark.parametrize("layout", ["peft", "tinker"])
def test_normalize_moe_lora_export_round_trip(layout, hf_models, tmp_path):
    """A normalize_moe_lora adapter (experts at rank/top_k, scale alpha/(rank/top_k)) survives export
    and import with the same outputs in both layouts."""
    _, path = hf_models["qwen3_moe"]  # top-2 router
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8, seed=2, normalize_moe_lora=True))
    assert worker.adapter(slot).weights["model.layers.0.mlp.experts.down_proj"].A.shape == (8, 2, 32)
    randomise(worker.adapter(slot), seed=7, scale=0.1)
    s = random_sequences(320, [25], seed=9)[0]
    req = lambda sl: ForwardBackwardInput(
        sl, [Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:])})], forward_only=True
    )
    (ref,) = worker.forward_backward([req(slot)])
    back = worker.import_peft(worker.export_peft(slot, tmp_path / layout, base_model="tiny", layout=layout))
    assert worker.adapter(back).config.normalize_moe_lora == (layout == "peft")
    (out,) = worker.forward_backward([req(back)])
    np.testing.assert_allclose(out.logprobs[0], ref.logprobs[0], atol=1e-5)
