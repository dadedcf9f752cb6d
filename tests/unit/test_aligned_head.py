"""The LM head padded to aligned rows (what CUDA takes for vocabularies like Olmo 3's) gives the
same log-probabilities and gradients as the head as it is."""

import pytest
import torch

from ember.core import logprobs
from ember.core.logprobs import HEAD_ALIGN, aligned_head, token_logprobs


def test_aligned_head_pads_only_where_needed(monkeypatch):
    w = torch.randn(HEAD_ALIGN * 3 + 5, 4)
    assert aligned_head(w) is w  # the CPU takes the head as it is
    monkeypatch.setattr(logprobs, "_pads_head", lambda weight: weight.shape[0] % HEAD_ALIGN != 0)
    padded = aligned_head(w)
    assert padded.shape == (HEAD_ALIGN * 4, 4)
    assert torch.equal(padded[: w.shape[0]], w) and not padded[w.shape[0] :].any()
    even = torch.randn(HEAD_ALIGN * 2, 4)
    assert aligned_head(even) is even


class _Group:
    def __init__(self, start, end, adapter):
        self.start, self.end, self.size, self.adapter = start, end, end - start, adapter


class _Adapter:
    def __init__(self, A, B):
        self.weights = {"lm_head": type("W", (), {"A": A, "B": B})()}
        self.scale = 0.5


@pytest.mark.parametrize("trained_head", [False, True])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_a_padded_head_gives_the_same_values_and_gradients(monkeypatch, trained_head, softcap):
    torch.manual_seed(0)
    V, H, T, r = 2 * HEAD_ALIGN + 13, 16, 40, 4
    w = (torch.randn(V, H, dtype=torch.float64) * 0.3).requires_grad_(trained_head)
    h = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T, 3))
    inv_t = torch.rand(T, dtype=torch.float64) + 0.5
    grad = torch.randn(T, 3, dtype=torch.float64)
    A = torch.randn(r, H, dtype=torch.float64, requires_grad=True)
    B = torch.randn(V, r, dtype=torch.float64, requires_grad=True)
    # a head LoRA on the second half of the tokens (only with the head trained: the precompute
    # path is the frozen head without head LoRA)
    lora = (type("Route", (), {"groups": [_Group(T // 2, T, _Adapter(A, B))]})() if trained_head else None)

    def run():
        for t in (w, h, A, B):
            t.grad = None
        lp = token_logprobs(h, w, targets, lora=lora, softcap=softcap, chunk=16, inv_temperature=inv_t)
        (lp * grad).sum().backward()
        grads = [t.grad.clone() for t in (h, w, A, B) if t.grad is not None]
        return lp.detach(), grads

    plain, plain_grads = run()
    monkeypatch.setattr(logprobs, "_pads_head", lambda weight: weight.shape[0] % HEAD_ALIGN != 0)
    padded, padded_grads = run()
    assert len(plain_grads) == (4 if trained_head else 1) == len(padded_grads)
    torch.testing.assert_close(padded, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(padded_grads, plain_grads):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
