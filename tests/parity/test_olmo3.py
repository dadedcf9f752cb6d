"""Olmo 3 equals transformers 5.23: per-token logprobs (fp32) on sequences longer than the sliding
window, with YaRN on the full-attention layer, in both config formats; LoRA gradients against PEFT."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bench.common import TINY_OLMO3
from ember.core.config import AttentionSpec
from ember.engine.worker import Worker
from tests.parity.test_deepseek_v3 import check_decoding, peft_lora_check
from tests.parity.test_families import ember_logprobs, hf_logprobs
from tests.tiny_models import random_sequences

WINDOW = TINY_OLMO3["sliding_window"]  # 8
SEQ_LENS = [17, 70, 5, 40]  # all but one longer than the window


def build_hf(seed: int = 0):
    """A random tiny Olmo 3: three sliding-window layers and one full layer with YaRN (the
    long-context checkpoints' layout), norms randomised."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Olmo3Config(**{**TINY_OLMO3, "initializer_range": 0.2})
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def olmo(tmp_path_factory):
    hf = build_hf()
    path = tmp_path_factory.mktemp("olmo3") / "m"
    hf.save_pretrained(str(path))
    assert hf.config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert hf.config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    return hf, path


def _legacy_copy(path, dest):
    """The same checkpoint with a transformers-4 style config: top-level ``rope_theta`` and
    ``rope_scaling`` instead of per-layer-type ``rope_parameters``."""
    shutil.copytree(path, dest)
    cfg = json.loads((path / "config.json").read_text())
    full = cfg.pop("rope_parameters")["full_attention"]
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("fmt", ["rope_parameters", "legacy"])
def test_logprobs_match_transformers(fmt, olmo, tmp_path):
    hf, path = olmo
    if fmt == "legacy":
        path = _legacy_copy(path, tmp_path / "legacy")
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    assert [layer.self_attn.spec for layer in worker.model.model.layers] == [AttentionSpec("sliding", WINDOW)] * 3 + [
        AttentionSpec()
    ]
    seqs = random_sequences(hf.config.vocab_size, SEQ_LENS, seed=1)
    for s, got in zip(seqs, ember_logprobs(worker, seqs)):
        ref = hf_logprobs(hf, s)
        assert ref.std() > 0.1
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)


def test_the_window_and_yarn_matter(olmo):
    """Without the window, or without YaRN, the long sequence's logprobs move: the parity test above
    really exercises both."""
    hf, path = olmo
    seq = random_sequences(hf.config.vocab_size, [70], seed=1)
    ref = hf_logprobs(hf, seq[0])
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    layers = worker.model.model.layers
    for layer in layers[:3]:
        layer.self_attn.spec = AttentionSpec()
    assert (ember_logprobs(worker, seq)[0].double() - ref).abs().max() > 1e-2
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    full = worker.model.model.layers[3].self_attn
    full.rotary = worker.model.model.layers[0].self_attn.rotary  # sliding layers' plain rope
    assert (ember_logprobs(worker, seq)[0].double() - ref).abs().max() > 1e-2


def test_bf16_load_is_close(olmo):
    hf, path = olmo
    worker = Worker.from_pretrained(path, "cpu", torch.bfloat16)
    seq = random_sequences(hf.config.vocab_size, [30], seed=4)[0]
    got = ember_logprobs(worker, [seq])[0]
    assert (got.double() - hf_logprobs(hf, seq)).abs().mean() < 0.05


def test_lora_logprobs_and_gradients_match_peft(olmo, monkeypatch):
    hf, path = olmo
    errors = peft_lora_check(hf, path, monkeypatch)
    for part in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert any(f"{part}.lora_A" in n for n in errors), part
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])


def test_decoding_matches_transformers_and_trainer(olmo):
    """Prompts and continuations longer than the window: the paged cache's sliding-window decode."""
    hf, path = olmo
    check_decoding(hf, path, [11, 3], 10)
