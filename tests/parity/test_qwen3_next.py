"""Qwen3-Next equals transformers 5.23: fp32 per-token logprobs of a packed batch (Gated DeltaNet over
several 64-token chunks, gated attention with partial RoPE, MoE with a shared expert and a dense layer),
LoRA gradients against PEFT, and decoding through the recurrent and convolution states."""

from __future__ import annotations

import pytest
import torch

from bench.common import TINY_QWEN3_NEXT
from ember.engine.worker import Worker
from tests.decoding import incremental_logprobs
from tests.parity.test_deepseek_v3 import peft_lora_check
from tests.parity.test_families import ember_logprobs, hf_logprobs
from tests.tiny_models import random_sequences

SEQ_LENS = [17, 90, 5, 130]  # two span several GDN chunks (64 tokens)


def build_hf(seed: int = 0):
    """A random tiny Qwen3-Next: GDN, attention, GDN (with a dense MLP), attention. Norms, the GDN
    output norm, A_log, dt_bias and the convolutions are perturbed so every weight matters."""
    import transformers as tf

    torch.manual_seed(seed)
    # max_position_embeddings: transformers' default (the bench shape has 512); no effect on the model
    cfg = tf.Qwen3NextConfig(**{**TINY_QWEN3_NEXT, "max_position_embeddings": 32768, "initializer_range": 0.2})
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "conv1d" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    hf = build_hf()
    path = tmp_path_factory.mktemp("qwen3_next") / "m"
    hf.save_pretrained(str(path))
    return hf, path


def test_logprobs_match_transformers(qwen3_next):
    hf, path = qwen3_next
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    seqs = random_sequences(hf.config.vocab_size, SEQ_LENS, seed=1)
    for s, got in zip(seqs, ember_logprobs(worker, seqs)):  # one packed batch
        ref = hf_logprobs(hf, s)
        assert ref.std() > 0.1
        torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=0)


def test_lora_logprobs_and_gradients_match_peft(qwen3_next, monkeypatch):
    hf, path = qwen3_next
    errors = peft_lora_check(hf, path, monkeypatch)
    names = set(errors)
    for part in ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj", "self_attn.q_proj",
                 "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "shared_expert.gate_proj",
                 "shared_expert.down_proj", "experts.gate_up_proj", "experts.down_proj", "layers.2.mlp.up_proj",
                 "lm_head"):
        assert any(part in n for n in names), part
    for frozen in ("conv1d", "A_log", "dt_bias", "norm", ".mlp.gate.", "shared_expert_gate"):
        assert not any(frozen in n for n in names), frozen
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])


def test_decoding_matches_training_and_transformers(qwen3_next):
    """A prefill, multi-token chunks and one token at a time (the recurrent form), with a sequence that
    joins mid-way, give the packed training pass's logprobs: GDN recurrent and convolution states
    carry over exactly. In float64, so that the check is not limited by fp32 summation order (in fp32,
    transformers' own cached decoding drifts from its full pass by up to ~1e-4 on this model)."""
    hf, path = qwen3_next
    worker = Worker.from_pretrained(path, "cpu", torch.float64)
    seqs = random_sequences(hf.config.vocab_size, [28, 14, 8], seed=2)
    schedule = [[9, 4, 0], [1, 3, 0], [2, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 2], [1, 1, 1], [1, 1, 1], [1, 1, 4]]
    schedule += [[1, 0, 0]] * (28 - 18)
    got = incremental_logprobs(worker.model, seqs, schedule)
    for s, g, train in zip(seqs, got, ember_logprobs(worker, seqs)):
        torch.testing.assert_close(g, train.double(), atol=1e-10, rtol=0)
        torch.testing.assert_close(g, hf_logprobs(hf, s), atol=1e-4, rtol=0)
