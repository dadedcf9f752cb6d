"""Full fine-tuning checkpoints (sharded safetensors + index, atomic) and the whole-model Hugging
Face export, checked against transformers on tiny random models."""

import json
import re

import pytest
import torch
from safetensors import safe_open

import ember.core.full_checkpoint as fc
from ember.core.checkpoint import checkpoint_format, read_metadata
from ember.core.full_ft import clone_for_training, trainable_parameters
from ember.core.loading import checkpoint_files, load_model
from tests.parity.test_families import ember_logprobs, hf_logprobs
from tests.tiny_models import build_hf_model, random_sequences, save_hf_model


def perturbed(path):
    model = clone_for_training(load_model(path, "cpu", torch.float32))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in trainable_parameters(model):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def test_save_load_round_trip_sharded_and_atomic(tmp_path, monkeypatch):
    path = save_hf_model(build_hf_model("qwen3", seed=1), tmp_path / "m")
    model = perturbed(path)
    names = [n for n, _ in trainable_parameters(model)]
    state = {f"{n}.exp_avg": torch.randn(3) for n in names[:4]}
    fc.save_full(model, tmp_path / "ck", names, state, {"user": 1}, shard_bytes=20_000)
    assert checkpoint_format(tmp_path / "ck") == fc.FORMAT
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and set(index["weight_map"]) == set(names)
    fresh = clone_for_training(load_model(path, "cpu", torch.float32))
    got = fc.load_full(fresh, tmp_path / "ck", names, with_optimizer=True)
    a, b = dict(model.named_parameters()), dict(fresh.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in names)
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="full fine-tuning checkpoint"):
        read_metadata(tmp_path / "ck")  # the LoRA loader refuses it clearly
    with pytest.raises(ValueError, match="missing"):
        fc.load_full(fresh, tmp_path / "ck", names + ["extra.weight"], with_optimizer=False)
    calls = []
    real = fc.save_file

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(fc, "save_file", failing)
    with pytest.raises(OSError):
        fc.save_full(model, tmp_path / "crash", names, None, shard_bytes=20_000)
    assert not (tmp_path / "crash").exists() and not list(tmp_path.glob(".crash*"))


@pytest.mark.parametrize("family,tied", [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_export_loads_in_transformers_with_the_trained_logits(tmp_path, family, tied):
    import transformers

    from ember.engine.worker import Worker

    path = save_hf_model(build_hf_model(family, seed=2, tie_word_embeddings=tied), tmp_path / "m", "60KB")
    base = load_model(path, "cpu", torch.float32)
    model = perturbed(path)
    names = [n for n, _ in trainable_parameters(model)]
    out = fc.export_hf(model, names, path, tmp_path / "hf", shard_bytes=50_000)
    assert (out / "config.json").is_file()
    base_keys = {k for f in checkpoint_files(path) for k in safe_open(str(f), "pt").keys()}  # noqa: SIM118
    out_keys = {k for f in checkpoint_files(out) for k in safe_open(str(f), "pt").keys()}  # noqa: SIM118
    assert out_keys == base_keys
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    seqs = random_sequences(320, [13, 6], seed=3)
    ours = ember_logprobs(Worker(model), seqs)
    before = ember_logprobs(Worker(base), seqs)
    for s, lp, b in zip(seqs, ours, before):
        assert (lp - b).abs().max() > 1e-2  # the perturbation shows
        torch.testing.assert_close(lp.double(), hf_logprobs(hf.eval(), s), atol=1e-4, rtol=0)


def test_ember_export_cli(tmp_path, capsys):
    import transformers

    from ember.cli import main
    from ember.engine.worker import Worker

    path = save_hf_model(build_hf_model("qwen3", seed=5), tmp_path / "m")
    model = perturbed(path)
    names = [n for n, _ in trainable_parameters(model)]
    fc.save_full(model, tmp_path / "ck", names, None, {"base_model": {"model_type": "qwen3", "vocab_size": 320}})
    assert main(["export", str(tmp_path / "ck"), "--base", str(path), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    seq = random_sequences(320, [9], seed=1)[0]
    torch.testing.assert_close(ember_logprobs(Worker(model), [seq])[0].double(), hf_logprobs(hf, seq), atol=1e-4, rtol=0)
    assert main(["export", str(tmp_path / "ck"), "--base", str(path), "--out", str(tmp_path / "hf")]) == 2
    assert "exists" in capsys.readouterr().err
    lora_worker = Worker(load_model(path, "cpu", torch.float32), max_adapters=1)
    from ember.core.adapters import LoraConfig

    slot = lora_worker.create_adapter(LoraConfig(rank=4))
    lora_worker.save_adapter(slot, tmp_path / "lora", with_optimizer=False)
    assert main(["export", str(tmp_path / "lora"), "--base", str(path), "--out", str(tmp_path / "peft")]) == 0
    assert (tmp_path / "peft" / "adapter_config.json").is_file()
    assert main(["export", str(tmp_path / "nope"), "--base", str(path), "--out", str(tmp_path / "x")]) == 2


def test_ember_export_errors_are_clear(tmp_path, capsys):
    """Bad paths, swapped arguments, a base of another model: one line each, exit status 2."""
    from ember.cli import main

    path = save_hf_model(build_hf_model("qwen3", seed=5), tmp_path / "m")
    small = save_hf_model(build_hf_model("qwen3", seed=5, hidden_size=32, head_dim=8), tmp_path / "small")
    moe = save_hf_model(build_hf_model("qwen3_moe", seed=5), tmp_path / "moe")
    model = perturbed(path)
    names = [n for n, _ in trainable_parameters(model)]
    fc.save_full(model, tmp_path / "ck", names, None, {"base_model": {"model_type": "qwen3", "vocab_size": 320}})
    fc.save_full(model, tmp_path / "bare", names, None)  # no base_model metadata: the weights decide
    cases = {
        ("nope", path): "checkpoint .*nope does not exist",
        ("ck", tmp_path / "nobase"): "--base .*nobase does not exist",
        ("m", path): "Hugging Face model folder, not an Ember checkpoint",
        ("ck", tmp_path / "ck"): "is an Ember checkpoint; pass the base model",
        ("ck", moe): "model_type of 'qwen3'; .* has 'qwen3_moe'",
        ("bare", small): "has shape .*the model this checkpoint was trained from",
        ("bare", moe): "does not hold this model's trained weights.*the model this checkpoint was trained from",
    }
    for (ck, base), pattern in cases.items():
        args = ["export", str(tmp_path / ck), "--base", str(base), "--out", str(tmp_path / "out")]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert re.search(pattern, err), err
        assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path / "ck"), "--base", str(path), "--out", str(tmp_path / "o"), "--quantized", "x"])
    assert "--quantized" in capsys.readouterr().err


def test_ember_export_cli_quantized_base(tmp_path, capsys):
    """``--quantized`` picks the export's format for a quantized base."""
    from ember.cli import main
    from tests.unit.test_export_families import quantized_base, stored

    base = quantized_base(tmp_path, "mxfp8")
    model = perturbed(base)
    names = [n for n, _ in trainable_parameters(model)]
    fc.save_full(model, tmp_path / "ck", names, None)
    assert main(["export", str(tmp_path / "ck"), "--base", str(base), "--out", str(tmp_path / "q")]) == 0
    assert set(stored(tmp_path / "q")) == set(stored(base))
    assert main(["export", str(tmp_path / "ck"), "--base", str(base), "--out", str(tmp_path / "d"),
                 "--quantized", "dequantize"]) == 0
    plain = stored(tmp_path / "d")
    assert not any(k.endswith("_scale") for k in plain) and len(plain) < len(stored(base))
    again = dict(load_model(tmp_path / "d", "cpu", torch.float32).named_parameters())
    assert all(torch.equal(again[n], p) for n, p in model.named_parameters())
