"""Full fine-tuning gradients equal transformers' autograd gradients (fp32, tiny random configs).

The transformers gradients are saved as a checkpoint in the model's own key layout and read back
with Ember's loader, so they arrive in Ember's layout (fused experts) by the same key mapping the
weights take."""

import pytest
import torch

from ember.core.batch import pack
from ember.core.full_ft import clone_for_training, frozen_parameter_names, trainable_parameters
from ember.core.loading import load_model
from ember.engine.worker import Worker
from tests.conftest import FAMILIES
from tests.tiny_models import random_sequences


def hf_loss(hf, seqs, weights):
    total = 0.0
    for s, w in zip(seqs, weights):
        logits = hf(torch.tensor([s[:-1]])).logits[0]
        lp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        total = total + (lp * w.double()).sum()
    return -total


def _builders():
    from tests.parity import test_deepseek_v3, test_olmo3, test_qwen3_next, test_qwen4_exp

    return {
        "deepseek_v3": lambda: test_deepseek_v3.build_hf("deepseek_v3"),
        "glm4_moe_lite": lambda: test_deepseek_v3.build_hf("glm4_moe_lite"),
        "olmo3": test_olmo3.build_hf,
        "qwen3_next": test_qwen3_next.build_hf,
        "qwen4_exp": test_qwen4_exp.build_hf,
        "inkling2": _inkling2_with_pad,  # its own embedding module
    }


def _inkling2_with_pad():
    """Inkling2 with a pad token; its row is made non-zero (transformers initialises it to zeros,
    and a zero embedding gives NaN gradients through Inkling2's normalisations)."""
    from tests.parity import test_inkling2

    hf = test_inkling2.build_hf_inkling2(pad_token_id=5)
    with torch.no_grad():
        hf.model.embed_tokens.weight[5].normal_(generator=torch.Generator().manual_seed(3))
    return hf


@pytest.mark.parametrize("family", FAMILIES)
def test_full_gradients_match_transformers(family, hf_models, tmp_path):
    hf, path = hf_models[family]
    check_gradients(hf, path, tmp_path)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe_lite", "olmo3", "qwen3_next", "qwen4_exp", "inkling2"])
def test_full_gradients_of_the_newer_families(family, tmp_path):
    hf = _builders()[family]()
    hf.save_pretrained(str(tmp_path / "m"))
    check_gradients(hf, tmp_path / "m", tmp_path)


def check_gradients(hf, path, tmp_path):
    model = clone_for_training(load_model(path, "cpu", torch.float32))
    seqs = random_sequences(model.config.vocab_size, [11, 17, 6], seed=7)
    pad = model.config.raw.get("pad_token_id")
    if pad is not None:  # transformers gives the pad token's embedding row no gradient (padding_idx)
        seqs[1][3] = seqs[2][0] = pad
    g = torch.Generator().manual_seed(1)
    weights = [torch.rand(len(s) - 1, generator=g) for s in seqs]
    batch = pack([s[:-1] for s in seqs], [(0, True)] * len(seqs), "cpu")
    targets = batch.gather([torch.tensor(s[1:]) for s in seqs])[:, None]
    lp = Worker(model, activation_checkpointing="off").logprobs(batch, targets)[:, 0]
    (-(lp * batch.gather(weights)).sum()).backward()

    hf.zero_grad(set_to_none=True)
    hf_loss(hf, seqs, weights).backward()
    assert_full_gradients_equal(model, grads_in_ember_layout(hf, tmp_path))
    params = dict(model.named_parameters())
    if pad is not None:
        assert params["model.embed_tokens.weight"].grad[pad].abs().max() == 0 or model.config.tie_word_embeddings


def grads_in_ember_layout(hf, tmp_path) -> dict[str, torch.Tensor]:
    """transformers' ``.grad`` of every weight, in Ember's parameter layout: saved in the weights'
    place and read back by Ember's loader (the model's weights are restored, its grads cleared).
    Buffers transformers saves (DeepSeek's router correction bias) get zeros."""
    with torch.no_grad():
        tensors = dict(hf.named_parameters()) | dict(hf.named_buffers())
        saved = {n: t.detach().clone() for n, t in tensors.items()}
        for t in tensors.values():
            t.copy_(t.grad if getattr(t, "grad", None) is not None else torch.zeros_like(t))
        hf.save_pretrained(str(tmp_path / "grads"))
        for n, t in tensors.items():
            t.copy_(saved[n])
    hf.zero_grad(set_to_none=True)
    return dict(load_model(tmp_path / "grads", "cpu", torch.float32).named_parameters())


def assert_full_gradients_equal(model, reference, tol=1e-4):
    """Every trainable weight's gradient equals ``reference`` (<= ``tol`` relative); weights the
    reference gives no gradient get none; frozen ones get none and stay frozen."""
    checked = 0
    for name, p in trainable_parameters(model):
        ref = reference[name]
        if ref.abs().max() == 0:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        assert p.grad is not None, name
        err = float((p.grad.double() - ref.double()).norm() / ref.double().norm())
        assert err <= tol, (name, err)
        checked += 1
    assert checked >= 0.8 * len(trainable_parameters(model))  # most weights really get gradients
    params = dict(model.named_parameters())
    assert all(params[n].grad is None and not params[n].requires_grad for n in frozen_parameter_names(model))
