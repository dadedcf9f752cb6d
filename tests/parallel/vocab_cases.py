"""The chunked logprob pass with the LM head split by vocabulary equals the whole head (fp64), run
on every rank by :mod:`tests.parallel.launch`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ember.core.logprobs import _ChunkedLogprobs, token_logprobs
from ember.core.sampling.logits import head_logits
from ember.dist.mesh import Layout
from ember.dist.tensor_parallel import VocabParallel

TOL = dict(atol=1e-10, rtol=1e-10)


def _inputs(V: int, H: int, T: int, K: int):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (T, K), generator=g)
    inv_t = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
    # two adapter groups' LM-head LoRA: rows [2, 9) and [9, 20)
    bounds = ((2, 9), (9, 20))
    lora = []
    for s, e in bounds:
        lora += [torch.randn(e - s, 3, generator=g, dtype=torch.float64),  # scale · h A^T
                 torch.randn(V, 3, generator=g, dtype=torch.float64)]  # B
    return hidden, weight, targets, inv_t, bounds, lora


def _run(hidden, weight, targets, inv_t, bounds, lora, vocab, train_head: bool):
    """Logprobs and the gradients of a weighted sum of them: of ``hidden`` only (the pass that
    stores ``(p ⊙ f) @ W``) or also of the head and its LoRA (the recomputing backward)."""
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_(train_head)
    lora = [t.clone().requires_grad_(train_head) for t in lora]
    w, parts = weight, lora
    if vocab is not None:
        w, rows = vocab.local(weight), slice(vocab.start, vocab.stop)
        parts = [t if i % 2 == 0 else t[rows] for i, t in enumerate(lora)]  # B: this rank's rows
    parts = parts if train_head else []
    out = _ChunkedLogprobs.apply(hidden, w, targets, 5, 30.0, inv_t, vocab, bounds if train_head else (), *parts)
    weights = torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin()
    (out * weights).sum().backward()
    grads = [hidden.grad] + ([weight.grad] + [t.grad for t in lora] if train_head else [])
    return out.detach(), grads


def vocab_parallel_logprobs(rank: int, world: int):
    V, H, T, K = 24 * world, 6, 20, 3
    layout = Layout(world, rank, tp=world)
    start, stop = layout.tp_range(V)
    vocab = VocabParallel(dist.group.WORLD, start, stop, V)
    args = _inputs(V, H, T, K)
    for train_head in (False, True):
        want, want_grads = _run(*args, None, train_head)
        got, got_grads = _run(*args, vocab, train_head)
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got_grads[0], want_grads[0], **TOL)  # d hidden: whole on every rank
        if train_head:
            # d W and d B: this rank's rows (the full tensors' other rows got no gradient here)
            torch.testing.assert_close(got_grads[1][start:stop], want_grads[1][start:stop], **TOL)
            assert float(got_grads[1][:start].abs().sum() + got_grads[1][stop:].abs().sum()) == 0.0
            for i, (g, w) in enumerate(zip(got_grads[2:], want_grads[2:])):
                if i % 2 == 0:  # d(hA): whole on every rank
                    torch.testing.assert_close(g, w, **TOL)
                else:
                    torch.testing.assert_close(g[start:stop], w[start:stop], **TOL)

    # the public entry: a tied head (the whole matrix passed, this rank reads its rows), 1-d targets
    hidden, weight, targets = args[0], args[1], args[2][:, 0]
    torch.testing.assert_close(
        token_logprobs(hidden, weight, targets, vocab=vocab, chunk=7), token_logprobs(hidden, weight, targets), **TOL
    )
    # a sampler's logits: every rank gets all V of its rows
    torch.testing.assert_close(head_logits(hidden, weight, None, vocab=vocab), head_logits(hidden, weight, None), **TOL)
