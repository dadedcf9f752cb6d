"""Helpers for the SDK scenarios: the server's description, reference log-probabilities computed
with plain transformers on the same weights, and datum builders."""

from __future__ import annotations

import json
import os
from functools import cache

import numpy as np
import torch
from tinker import types

CONF = json.loads(os.environ["EMBER_CONFORMANCE"])
QWEN3, MOE = "tiny-qwen3", "tiny-qwen3-moe"


def model_dir(name: str) -> str:
    return CONF["models"][name]


@cache
def hf_model(name: str):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir(name), dtype=torch.float32,
                                                          attn_implementation="eager")
    return m.eval()


def reference_logprobs(name: str, tokens, targets) -> np.ndarray:
    """log p(target_i | tokens[:i+1]) of the base model with transformers (float32); ``targets``
    ``[N]`` or ``[N, K]``."""
    with torch.no_grad():
        logits = hf_model(name)(torch.tensor([list(tokens)])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    t = torch.as_tensor(np.asarray(targets), dtype=torch.long)
    if t.dim() == 1:
        return logp.gather(1, t[:, None])[:, 0].numpy()
    return logp.gather(1, t).numpy()


def random_datum(rng: np.random.Generator, n: int, vocab: int = 512, weights=None) -> types.Datum:
    seq = rng.integers(0, vocab, n + 1)
    w = np.ones(n, np.float32) if weights is None else np.asarray(weights, np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                       loss_fn_inputs={"target_tokens": seq[1:].tolist(), "weights": w.tolist()})


def tokens_of(d: types.Datum) -> list[int]:
    return d.model_input.to_ints()


def arr(td) -> np.ndarray:
    """A TensorData as a numpy array of its shape."""
    a = td.to_numpy()
    return a.reshape(td.shape) if td.shape else a


def check_metric_keys(metrics: dict) -> None:
    for k in metrics:
        assert k.count(":") == 1, f"metric key {k!r} must be name:reduction"
    assert "loss:sum" in metrics, metrics
