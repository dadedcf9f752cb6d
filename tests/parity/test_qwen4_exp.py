"""Qwen3.8-Flash-Next (``qwen4_exp``) equals transformers 5.23: fp32 per-token logprobs of a packed
batch with sequences past the QSA dense threshold (tiny budget), EOS inside sequences (n-gram memory
segments), hyper-connections and the MoE; LoRA gradients against PEFT; decoding through the GDN,
PLE-convolution, n-gram-context and QSA index-key states; the released checkpoint layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.common import TINY_QWEN4_EXP
from ember.core.layers import gated_attention
from ember.core.layers.qsa import QSAIndexer
from ember.core.loading import load_model
from ember.engine.worker import Worker
from tests.decoding import incremental_logprobs
from tests.parity.test_deepseek_v3 import peft_lora_check
from tests.parity.test_families import ember_logprobs, hf_logprobs
from tests.tiny_models import random_sequences

EOS = TINY_QWEN4_EXP["eos_token_id"]  # 1
# the config's QSA budget (8) and block size (2): a query attends to 4 of its 2-token blocks, densely up
# to position 8, sparsely after
SEQ_LENS = [17, 70, 5, 33]  # 70 also spans two GDN chunks


def build_hf(seed: int = 0):
    """A random tiny Qwen3.8-Flash-Next: GDN, GDN with PLE, QSA attention, GDN; 4 residual streams;
    every 1-D weight and the convolutions (the PLE one is zero at init) perturbed."""
    import transformers as tf

    torch.manual_seed(seed)
    # max_position_embeddings: transformers' default (the bench shape has 512); no effect on the model
    cfg = tf.Qwen4ExpTextConfig(**{**TINY_QWEN4_EXP, "max_position_embeddings": 32768, "initializer_range": 0.2})
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "conv1d" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def sequences(lengths, seed):
    """Random sequences with EOS tokens inside (two in a row in one of them)."""
    seqs = random_sequences(320, lengths, seed=seed)
    for s in seqs:
        for i in (5, 11, 12, 30):
            if i < len(s) - 1:
                s[i] = EOS
    return seqs


@pytest.fixture(scope="module")
def qwen4(tmp_path_factory):
    hf = build_hf()
    path = tmp_path_factory.mktemp("qwen4_exp") / "m"
    hf.save_pretrained(str(path))
    return hf, path


def test_logprobs_match_transformers(qwen4, monkeypatch):
    hf, path = qwen4
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    # seed 4's sequence has blocks tied at score 0 on the top-k boundary: ties break as transformers'
    seqs = sequences(SEQ_LENS, seed=1) + sequences([21], seed=4)
    calls = []
    sparse = gated_attention.selected_attention
    monkeypatch.setattr(gated_attention, "selected_attention", lambda *a: calls.append(1) or sparse(*a))
    got = ember_logprobs(worker, seqs)  # one packed batch
    assert calls  # the sparse QSA path ran
    refs = [hf_logprobs(hf, s) for s in seqs]
    for g, ref in zip(got, refs):
        assert ref.std() > 0.1
        torch.testing.assert_close(g.double(), ref, atol=1e-4, rtol=0)
    # the selection matters: attending densely instead would not match
    monkeypatch.setattr(QSAIndexer, "forward", lambda *a: None)
    dense = ember_logprobs(worker, seqs)
    assert (dense[1].double() - refs[1]).abs().max() > 1e-3


def test_lora_logprobs_and_gradients_match_peft(qwen4, monkeypatch):
    hf, path = qwen4
    errors = peft_lora_check(hf, path, monkeypatch)
    names = set(errors)
    for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "linear_attn.out_proj", "self_attn.q_proj",
                 "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "shared_expert.up_proj",
                 "experts.gate_up_proj", "experts.down_proj", "lm_head"):
        assert any(part in n for n in names), part
    for frozen in ("ple", "indexer", "hyper_connection", "conv1d", "norm", ".mlp.gate.", "shared_expert_gate"):
        assert not any(frozen in n for n in names), frozen
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])


def test_decoding_matches_training_and_transformers(qwen4):
    """Prefill, chunks and single tokens past the QSA threshold, with a sequence joining mid-way, give
    the packed training pass's logprobs (float64: exact up to rounding) and transformers'."""
    hf, path = qwen4
    worker = Worker.from_pretrained(path, "cpu", torch.float64)
    seqs = sequences([24, 14, 10], seed=2)
    schedule = [[7, 3, 0], [1, 4, 0], [3, 1, 0], [1, 1, 0], [1, 1, 0], [1, 1, 2], [1, 1, 1], [1, 1, 1], [1, 1, 6]]
    schedule += [[1, 0, 0]] * (24 - 17)
    got = incremental_logprobs(worker.model, seqs, schedule)
    for s, g, train in zip(seqs, got, ember_logprobs(worker, seqs)):
        torch.testing.assert_close(g, train.double(), atol=1e-10, rtol=0)
        torch.testing.assert_close(g, hf_logprobs(hf, s), atol=1e-4, rtol=0)


def test_released_checkpoint_layout(qwen4, tmp_path):
    """The multimodal release: text weights under ``model.language_model``, the n-gram table in row
    shards, vision and MTP weights (not loaded), the text config nested in ``text_config``."""
    hf, path = qwen4
    tensors = load_file(str(path / "model.safetensors"))
    assert any(".ngram_embedding.shard_1.weight" in k for k in tensors)
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): t
               for k, t in tensors.items()}
    renamed["mtp.fc_hidden.weight"] = torch.randn(64, 256)
    renamed["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.randn(32, 64)
    renamed["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3)
    folder = tmp_path / "release"
    folder.mkdir()
    save_file(renamed, str(folder / "model.safetensors"))
    text = json.loads((path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "text_config": text}))
    worker = Worker(load_model(folder, "cpu", torch.float32))
    assert type(worker.model).__name__ == "Qwen4ExpForCausalLM"
    seqs = sequences([21], seed=4)
    torch.testing.assert_close(ember_logprobs(worker, seqs)[0].double(), hf_logprobs(hf, seqs[0]), atol=1e-4, rtol=0)
