"""LoRA outputs and gradients equal a PEFT model holding the same factors."""

import copy

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput
from tests.conftest import FAMILIES
from tests.lora_helpers import peft_grads_as_ember, peft_model_like, randomise
from tests.tiny_models import random_sequences


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_logprobs_and_gradients_match_peft(family, hf_models):
    hf, path = hf_models[family]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=5))
    adapter = worker.adapter(slot)
    randomise(adapter, seed=11)
    peft = peft_model_like(copy.deepcopy(hf), adapter)

    seqs = random_sequences(hf.config.vocab_size, [12, 31, 7], seed=3)
    g = torch.Generator().manual_seed(7)
    weights = [torch.rand(len(s) - 1, generator=g) for s in seqs]
    datums = [
        Datum(np.array(s[:-1]), {"target_tokens": np.array(s[1:]), "weights": w.numpy()})
        for s, w in zip(seqs, weights)
    ]
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "cross_entropy")])

    loss_ref = 0.0
    for s, w, lp in zip(seqs, weights, out.logprobs):
        logits = peft(torch.tensor([s[:-1]])).logits[0]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.from_numpy(lp), ref.detach(), atol=1e-4, rtol=0)
        loss_ref = loss_ref - (w * ref).sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(loss_ref), rel=1e-5)
    loss_ref.backward()

    ref_grads = peft_grads_as_ember(peft, adapter)
    mine = adapter.grads()
    assert set(ref_grads) == set(mine)
    assert any(".experts." in k for k in mine) == (family == "qwen3_moe")
    for k, ref in ref_grads.items():
        assert mine[k] is not None, k
        err = (mine[k] - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err < 1e-4, (k, float(err))
