"""Per-token log-probabilities of target tokens, computed over token chunks.

The LM head and log-softmax run ``chunk`` tokens at a time, in forward and again (recomputed) in
backward, so the full ``[T, V]`` fp32 logits never exist: peak memory is set by the chunk, not the
batch. LoRA on the LM head (``train_unembed``) is folded in per adapter group, and an optional final
logit softcap (``c * tanh(z / c)``) is applied before the softmax.
"""

from __future__ import annotations

import torch

from ember.core.layers.lora import LoraRoute

# fp32 logits of one chunk are chunk * V * 4 bytes; 2^28 elements = 1 GiB.
CHUNK_ELEMENTS = 1 << 28


def default_chunk(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab`` (a multiple of 128, at least 128)."""
    return max(128, (CHUNK_ELEMENTS // vocab) // 128 * 128)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Softmax precision: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunk_logits(h, weight, lora_parts, c0, c1, softcap):
    acc = _acc_dtype(h)
    logits = (h[c0:c1] @ weight.T).to(acc)
    for start, end, hA, B in lora_parts:
        s, e = max(start, c0), min(end, c1)
        if s < e:
            logits[s - c0 : e - c0] += (hA[s - start : e - start] @ B.T).to(acc)
    capped = None
    if softcap is not None:
        capped = torch.tanh(logits / softcap)
        logits = capped * softcap
    return logits, capped


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, softcap, bounds, *lora_tensors):
        lora_parts = [(s, e, lora_tensors[2 * i], lora_tensors[2 * i + 1]) for i, (s, e) in enumerate(bounds)]
        T = hidden.shape[0]
        out = torch.empty(targets.shape, dtype=_acc_dtype(hidden), device=hidden.device)
        lse = torch.empty(T, dtype=_acc_dtype(hidden), device=hidden.device)
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            logits, _ = _chunk_logits(hidden, weight, lora_parts, c0, c1, softcap)
            lse[c0:c1] = torch.logsumexp(logits, dim=-1)
            out[c0:c1] = logits.gather(1, targets[c0:c1]) - lse[c0:c1, None]
            del logits  # free this chunk before the next is computed
        ctx.save_for_backward(hidden, weight, targets, lse, *lora_tensors)
        ctx.chunk, ctx.softcap, ctx.bounds = chunk, softcap, bounds
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse, *lora_tensors = ctx.saved_tensors
        chunk, softcap, bounds = ctx.chunk, ctx.softcap, ctx.bounds
        lora_parts = [(s, e, lora_tensors[2 * i], lora_tensors[2 * i + 1]) for i, (s, e) in enumerate(bounds)]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = _acc_dtype(hidden)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_lora = [torch.zeros_like(t, dtype=acc) for t in lora_tensors]
        T = hidden.shape[0]
        grad_out = grad_out.to(acc)
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            logits, capped = _chunk_logits(hidden, weight, lora_parts, c0, c1, softcap)
            g = grad_out[c0:c1]
            # d logprob(t) / d logits = onehot(t) - softmax
            d = torch.exp(logits - lse[c0:c1, None]).mul_(-g.sum(-1, keepdim=True))
            d.scatter_add_(1, targets[c0:c1], g)
            if capped is not None:
                d.mul_(1.0 - capped.square())
            d_low = d.to(hidden.dtype)
            if need_h:
                grad_h[c0:c1] = d_low @ weight
            if need_w:
                grad_w += d.T @ hidden[c0:c1].to(acc)
            for i, (start, end, hA, B) in enumerate(lora_parts):
                s, e = max(start, c0), min(end, c1)
                if s >= e:
                    continue
                ds = d[s - c0 : e - c0]
                grad_lora[2 * i][s - start : e - start] = (ds.to(B.dtype) @ B).to(acc)
                grad_lora[2 * i + 1] += ds.T @ hA[s - start : e - start].to(acc)
            del logits, capped, d, d_low
        grads_lora = [gr.to(t.dtype) for gr, t in zip(grad_lora, lora_tensors)]
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            None,
            None,
            None,
            None,
            *grads_lora,
        )


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lora: LoraRoute | None = None,
    lora_name: str = "lm_head",
    softcap: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``log softmax(hidden @ weight.T)[t, targets[t, k]]`` as fp32 (fp64 for fp64 input) ``[T, K]`` (``targets`` ``[T, K]``
    or ``[T]``, giving ``[T]``), with the route's LM-head LoRA applied to each adapter's tokens."""
    squeeze = targets.dim() == 1
    if squeeze:
        targets = targets[:, None]
    chunk = chunk or default_chunk(weight.shape[0])
    bounds, tensors = [], []
    if lora is not None:
        for g in lora.groups:
            w = g.adapter.weights.get(lora_name) if g.adapter is not None else None
            if w is None or g.size == 0:
                continue
            hA = (hidden[g.start : g.end] @ w.A.to(hidden.dtype).T) * g.adapter.scale
            bounds.append((g.start, g.end))
            tensors += [hA, w.B.to(hidden.dtype)]
    out = _ChunkedLogprobs.apply(hidden, weight, targets, chunk, softcap, tuple(bounds), *tensors)
    return out[:, 0] if squeeze else out
