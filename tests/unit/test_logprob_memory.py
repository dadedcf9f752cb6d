"""Chunked logprobs keep peak memory flat as the sequence grows past the chunk size."""

import subprocess
import sys
import textwrap

import torch

from ember.core.logprobs import token_logprobs

SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from ember.core.logprobs import token_logprobs
    T, chunk = int(sys.argv[1]), int(sys.argv[2])
    V, H = 32000, 64
    torch.manual_seed(0)
    w = torch.randn(V, H) * 0.05
    h = torch.randn(T, H, requires_grad=True)
    t = torch.randint(0, V, (T,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lp = token_logprobs(h, w, t, chunk=chunk)
    lp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) / 1024)
    """
)


def _peak_mb(tokens: int, chunk: int) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tokens), str(chunk)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def test_peak_memory_is_flat_in_sequence_length():
    chunk = 512
    short = _peak_mb(2 * chunk, chunk)
    long = _peak_mb(8 * chunk, chunk)
    unchunked = _peak_mb(8 * chunk, 8 * chunk)
    full_logits_mb = 8 * chunk * 32000 * 4 / 2**20  # 500 MiB of fp32 logits
    assert long - short < 0.1 * full_logits_mb, (short, long)
    assert unchunked - long > 0.5 * full_logits_mb, (long, unchunked)  # the measurement can see it


def test_chunking_does_not_change_values_or_gradients():
    torch.manual_seed(1)
    V, H, T = 500, 16, 300
    w = torch.randn(V, H, dtype=torch.float64)
    h = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (T, 2))
    g = torch.randn(T, 2, dtype=torch.float64)
    outs = []
    for chunk, softcap in [(T, None), (128, None), (T, 5.0), (128, 5.0)]:
        h.grad = None
        lp = token_logprobs(h, w, t, softcap=softcap, chunk=chunk)
        (lp * g).sum().backward()
        logits = h @ w.T if softcap is None else 5.0 * torch.tanh((h @ w.T) / 5.0)
        ref = torch.log_softmax(logits, -1).gather(1, t)
        torch.testing.assert_close(lp.double(), ref.detach(), atol=1e-6, rtol=1e-6)
        outs.append((lp.detach(), h.grad.clone()))
    h2 = h.detach().clone().requires_grad_()
    ref = torch.log_softmax(h2 @ w.T, -1).gather(1, t)
    (ref * g).sum().backward()
    torch.testing.assert_close(outs[1][1], h2.grad, atol=1e-6, rtol=1e-6)
    h3 = h.detach().clone().requires_grad_()
    ref = torch.log_softmax(5.0 * torch.tanh((h3 @ w.T) / 5.0), -1).gather(1, t)
    (ref * g).sum().backward()
    torch.testing.assert_close(outs[3][1], h3.grad, atol=1e-6, rtol=1e-6)


def test_stored_and_recomputed_gradients_agree():
    """Frozen head: gradients come from the forward-time ``(p ⊙ f) @ W``; trainable head: from
    recomputed chunks. Both equal autograd through the plain formula."""
    torch.manual_seed(2)
    V, H, T = 400, 12, 90
    for softcap, K in ((None, 3), (3.0, 3), (None, 1)):  # several targets a token, and one
        w = torch.randn(V, H, dtype=torch.float64)
        h = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
        t = torch.randint(0, V, (T, K))
        g = torch.randn(T, K, dtype=torch.float64)
        grads = []
        for train_head in (False, True):
            wi = w.clone().requires_grad_(train_head)
            h.grad = None
            (token_logprobs(h, wi, t, softcap=softcap, chunk=32) * g).sum().backward()
            grads.append(h.grad.clone())
            if train_head:
                head_grad = wi.grad.clone()
        w2 = w.clone().requires_grad_()
        h2 = h.detach().clone().requires_grad_()
        z = h2 @ w2.T
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        (torch.log_softmax(z, -1).gather(1, t) * g).sum().backward()
        for got in grads:
            torch.testing.assert_close(got, h2.grad, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(head_grad, w2.grad, atol=1e-9, rtol=1e-9)
