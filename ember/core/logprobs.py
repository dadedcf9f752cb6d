"""Per-token log-probabilities of target tokens, computed over token chunks.

The LM head and log-softmax run ``chunk`` tokens at a time, so the full ``[T, V]`` fp32 logits never
exist: peak memory is set by the chunk, not the batch. LoRA on the LM head (``train_unembed``) is
folded in per adapter group, and an optional final logit softcap (``c * tanh(z / c)``) is applied
before the softmax.

Gradients. With ``p`` the softmax, ``f = 1 - tanh²`` the softcap's derivative (1 without a cap) and
``g[t, k]`` the upstream gradient of ``logprob(targets[t, k])``::

    d logits[t] = (Σ_k g[t,k] onehot(targets[t,k]) - G[t] p[t]) ⊙ f[t],   G[t] = Σ_k g[t,k]
    d hidden[t] = Σ_k g[t,k] f[t,targets[t,k]] W[targets[t,k]] - G[t] (p ⊙ f)[t] @ W

When only ``hidden`` needs a gradient (frozen head, no head LoRA: the common LoRA case), the forward
pass stores ``(p ⊙ f) @ W`` (``[T, H]``) and the backward needs no vocabulary-sized work at all: one
head product fewer than recomputing the logits. Otherwise the backward recomputes each chunk.

Vocabulary parallelism. With a :class:`VocabSplit` each process holds rows ``start..stop`` of the
head (and of its LoRA ``B``) and computes only those logits. Per chunk, one all-gather of each
row's local log-sum-exp and local target logit gives the global ones; the softmax of the local
logits under the global log-sum-exp is the local part of ``p``, so ``d logits`` stays local and
``d hidden`` (and the head LoRA's ``d(hA)``) are partial sums, added once in the backward. No
process ever holds a row of logits over the whole vocabulary.

Alignment. On CUDA a head whose rows are not a multiple of :data:`HEAD_ALIGN` (Olmo 3's 100,278)
is padded with zero rows for the products: a row of logits (and of ``p``) then starts on a
16-byte boundary, which cuBLAS's Hopper kernels need (unaligned, it falls back to a CUTLASS sm80
kernel, 111 ms of an Olmo 3 step). The padded columns are never read: logits are views of the
first ``V`` columns, and ``p``'s padded columns are zero.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ember.core.kernels import fused
from ember.core.layers.lora import LoraRoute

# fp32 logits of one chunk are chunk * V * 4 bytes; 2^28 elements = 1 GiB.
CHUNK_ELEMENTS = 1 << 28
# LM-head rows gathered at once for the targets' gradient (fp32: 256 MiB)
GATHER_ELEMENTS = 1 << 26
# the head's rows are padded to a multiple of this for its products on CUDA (see the module doc)
HEAD_ALIGN = 64


class VocabSplit(Protocol):
    """The LM head split by vocabulary across processes (set on a model from outside, by
    :mod:`ember.dist.tensor_parallel`): this process holds rows ``start..stop`` of ``size``. Every
    method is a collective of the processes that split the vocabulary."""

    start: int
    stop: int
    size: int

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This process's rows of a head matrix (``weight`` itself if it holds only those)."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's ``x`` stacked: ``[processes, *x.shape]`` (no autograd)."""
        ...

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the processes, in place (no autograd)."""
        ...


def default_chunk(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab`` (a multiple of 128, at least 128)."""
    return max(128, (CHUNK_ELEMENTS // vocab) // 128 * 128)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Softmax precision: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


_MM_OUT_DTYPE: dict[str, bool] = {}


def _mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` with the result in ``acc`` precision (fp32 output straight from the bf16 product on
    CUDA, so logits are not rounded to bf16 first)."""
    if a.dtype == acc:
        return a @ b
    if a.is_cuda and _MM_OUT_DTYPE.get("ok", True):
        try:
            out = torch.mm(a, b, out_dtype=acc)
            _MM_OUT_DTYPE["ok"] = True
            return out
        except (RuntimeError, TypeError):
            _MM_OUT_DTYPE["ok"] = False
    return (a @ b).to(acc)


def _pads_head(weight: torch.Tensor) -> bool:
    return weight.is_cuda and weight.shape[0] % HEAD_ALIGN != 0


def aligned_head(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with zero rows added up to a multiple of :data:`HEAD_ALIGN` where its products
    need it (CUDA), else ``weight`` itself."""
    if not _pads_head(weight):
        return weight
    padded = weight.new_zeros(-(-weight.shape[0] // HEAD_ALIGN) * HEAD_ALIGN, weight.shape[1])
    padded[: weight.shape[0]] = weight
    return padded


def _head(weight: torch.Tensor) -> tuple[int, torch.Tensor, int | None]:
    """``(V, the head for the products, its padded width or None)`` (:func:`aligned_head`)."""
    head = aligned_head(weight)
    return weight.shape[0], head, (head.shape[0] if head is not weight else None)


def chunk_logits(h, weight, lora_parts, c0, c1, rows: int | None = None):
    """Raw (uncapped) logits of tokens ``[c0, c1)`` in accumulation precision; ``lora_parts`` are
    ``(start, end, scale·hA, B)`` LM-head corrections (:func:`head_lora_parts`). ``rows``: the
    vocabulary of a padded ``weight`` (:func:`aligned_head`); the logits are a view of its first
    ``rows`` columns."""
    acc = _acc_dtype(h)
    logits = _mm_acc(h[c0:c1], weight.T, acc)
    if rows is not None:
        logits = logits[:, :rows]
    for start, end, hA, B in lora_parts:
        s, e = max(start, c0), min(end, c1)
        if s < e:
            logits[s - c0 : e - c0] += _mm_acc(hA[s - start : e - start], B.T, acc)
    return logits


def apply_softcap(z: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(c·tanh(z/c), 1 - tanh²)``, or ``(z, None)`` without a cap."""
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, 1.0 - t * t


def row_logsumexp(logits: torch.Tensor, softcap: float | None, inv_t: torch.Tensor | None = None) -> torch.Tensor:
    """``logsumexp`` of each row of the (capped) logits, each row scaled by ``inv_t`` (``[C]``
    inverse temperatures; None: 1)."""
    if fused.use_triton(logits) and logits.dtype == torch.float32:
        return fused.row_logsumexp(logits, softcap, inv_t)
    z = apply_softcap(logits, softcap)[0]
    return torch.logsumexp(z if inv_t is None else z * inv_t[:, None].to(z.dtype), dim=-1)


def scaled_softmax(
    logits: torch.Tensor,
    lse: torch.Tensor,
    row_scale: torch.Tensor,
    softcap: float | None,
    dtype: torch.dtype,
    inv_t: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """``row_scale[:, None] * softmax(z · inv_t) ⊙ f`` (see module doc) in ``dtype``; ``width``: that
    many columns, the ones past the vocabulary zero (for a padded head's products)."""
    if fused.use_triton(logits) and logits.dtype == torch.float32:
        return fused.scaled_softmax(logits, lse, row_scale, softcap, dtype, inv_t, width)
    z, f = apply_softcap(logits, softcap)
    if inv_t is not None:
        z = z * inv_t[:, None].to(z.dtype)
    p = torch.exp(z - lse[:, None]) * row_scale[:, None]
    if f is not None:
        p = p * f
    if width is not None:
        p = torch.nn.functional.pad(p, (0, width - p.shape[1]))
    return p.to(dtype)


def _gathered(logits, targets, softcap, inv_t, mine=None):
    """The (capped, tempered) logits at ``targets`` and their derivative factor w.r.t. the raw
    logits (``f · inv_t``; None when both are 1). ``mine``: which targets are rows of this
    process's vocabulary (the others read as 0, with factor 0)."""
    zt, ft = apply_softcap(logits.gather(1, targets), softcap)
    if inv_t is not None:
        it = inv_t[:, None].to(zt.dtype)
        zt, ft = zt * it, it.expand_as(zt) if ft is None else ft * it
    if mine is not None:
        zero = zt.new_zeros(())
        zt = torch.where(mine, zt, zero)
        ft = torch.where(mine, zero + 1 if ft is None else ft, zero)
    return zt, ft


def _local_targets(targets: torch.Tensor, vocab: VocabSplit | None):
    """Targets as rows of this process's head, and which of them it holds (None: all)."""
    if vocab is None:
        return targets, None
    local = targets - vocab.start
    mine = (local >= 0) & (local < vocab.stop - vocab.start)
    return torch.where(mine, local, torch.zeros_like(local)), mine


def _global_lse(lse: torch.Tensor, zt: torch.Tensor, vocab: VocabSplit | None):
    """The log-sum-exp and target logits over the whole vocabulary from each process's part."""
    if vocab is None:
        return lse, zt
    parts = vocab.gather(torch.cat([lse[:, None], zt], dim=1))  # [processes, C, 1 + K]
    return torch.logsumexp(parts[:, :, 0], dim=0), parts[:, :, 1:].sum(0)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, softcap, inv_t, vocab, bounds, *lora_tensors):
        lora_parts = [(s, e, lora_tensors[2 * i], lora_tensors[2 * i + 1]) for i, (s, e) in enumerate(bounds)]
        targets, mine = _local_targets(targets, vocab)
        T = hidden.shape[0]
        acc = _acc_dtype(hidden)
        out = torch.empty(targets.shape, dtype=acc, device=hidden.device)
        lse = torch.empty(T, dtype=acc, device=hidden.device)
        # store (p ⊙ f) @ W now when hidden is the only input that needs a gradient
        precompute = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:])
        pw = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if precompute else None
        f_t = torch.ones(targets.shape, dtype=acc, device=hidden.device) if precompute else None
        ones = torch.ones(T, dtype=acc, device=hidden.device) if precompute else None
        V, head, width = _head(weight)
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            it = None if inv_t is None else inv_t[c0:c1]
            logits = chunk_logits(hidden, head, lora_parts, c0, c1, V)
            zt, ft = _gathered(logits, targets[c0:c1], softcap, it, None if mine is None else mine[c0:c1])
            lse[c0:c1], zt = _global_lse(row_logsumexp(logits, softcap, it), zt, vocab)
            out[c0:c1] = zt - lse[c0:c1, None]
            if precompute:
                scale = ones[c0:c1] if it is None else it.to(acc)
                p = scaled_softmax(logits, lse[c0:c1], scale, softcap, hidden.dtype, it, width)
                pw[c0:c1] = _mm_acc(p, head, acc)
                if ft is not None:
                    f_t[c0:c1] = ft
                del p
            del logits  # free this chunk before the next is computed
        del head
        ctx.precompute = precompute
        if precompute:
            ctx.save_for_backward(weight, targets, pw, f_t)
        else:
            ctx.save_for_backward(hidden, weight, targets, lse, *lora_tensors)
        ctx.chunk, ctx.softcap, ctx.bounds, ctx.hidden_dtype, ctx.inv_t = chunk, softcap, bounds, hidden.dtype, inv_t
        ctx.vocab, ctx.mine = vocab, mine
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.precompute:
            weight, targets, pw, f_t = ctx.saved_tensors
            g = grad_out.to(pw.dtype)
            coef = g * f_t
            grad_h = -g.sum(1, keepdim=True) * pw
            # Σ_k coef[t, k] · W[targets[t, k]], a bounded number of gathered rows at a time
            K, H = targets.shape[1], weight.shape[1]
            step = max(1, GATHER_ELEMENTS // (K * H))
            for c0 in range(0, targets.shape[0], step):
                rows = weight.index_select(0, targets[c0 : c0 + step].reshape(-1)).view(-1, K, H).to(pw.dtype)
                if K == 1:  # one target a token: a scaled add (a batch of 1 × 1 products took 1 ms at 16k tokens)
                    grad_h[c0 : c0 + step].addcmul_(coef[c0 : c0 + step], rows[:, 0])
                else:
                    grad_h[c0 : c0 + step] += torch.bmm(coef[c0 : c0 + step, None, :], rows)[:, 0]
            if ctx.vocab is not None:  # each process's part of the vocabulary
                ctx.vocab.sum_(grad_h)
            return (grad_h.to(ctx.hidden_dtype), None, None, None, None, None, None, None)
        hidden, weight, targets, lse, *lora_tensors = ctx.saved_tensors
        chunk, softcap, bounds = ctx.chunk, ctx.softcap, ctx.bounds
        lora_parts = [(s, e, lora_tensors[2 * i], lora_tensors[2 * i + 1]) for i, (s, e) in enumerate(bounds)]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = _acc_dtype(hidden)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_lora = [torch.zeros_like(t, dtype=acc) for t in lora_tensors]
        T = hidden.shape[0]
        grad_out = grad_out.to(acc)
        V, head, width = _head(weight)
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            it = None if ctx.inv_t is None else ctx.inv_t[c0:c1]
            logits = chunk_logits(hidden, head, lora_parts, c0, c1, V)
            g = grad_out[c0:c1]
            tgt = targets[c0:c1]
            ft = _gathered(logits, tgt, softcap, it, None if ctx.mine is None else ctx.mine[c0:c1])[1]
            row = -g.sum(-1) if it is None else -g.sum(-1) * it.to(acc)
            d_head = scaled_softmax(logits, lse[c0:c1], row, softcap, hidden.dtype, it, width)
            del logits
            d = d_head[:, :V]  # d_head's padded columns stay zero
            d.scatter_add_(1, tgt, (g if ft is None else g * ft).to(d.dtype))
            if need_h:
                grad_h[c0:c1] = d_head @ head
            if need_w:
                grad_w += _mm_acc(d_head.T, hidden[c0:c1], acc)[:V]
            for i, (start, end, hA, B) in enumerate(lora_parts):
                s, e = max(start, c0), min(end, c1)
                if s >= e:
                    continue
                ds = d[s - c0 : e - c0]
                grad_lora[2 * i][s - start : e - start] = _mm_acc(ds.to(B.dtype), B, acc)
                grad_lora[2 * i + 1] += _mm_acc(ds.T.to(hA.dtype), hA[s - start : e - start], acc)
            del d, d_head
        if ctx.vocab is not None:
            # d hidden and each head LoRA's d(hA) are partial sums over the vocabulary's parts;
            # d W and the LoRA B's are this process's rows
            partial = ([grad_h] if need_h else []) + grad_lora[0::2]
            if partial:
                flat = ctx.vocab.sum_(torch.cat([t.reshape(-1).to(acc) for t in partial]))
                for t, part in zip(partial, flat.split([t.numel() for t in partial])):
                    t.copy_(part.view_as(t))
        grads_lora = [gr.to(t.dtype) for gr, t in zip(grad_lora, lora_tensors)]
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            None,
            None,
            None,
            None,
            None,
            None,
            *grads_lora,
        )


def head_lora_parts(
    hidden: torch.Tensor, lora: LoraRoute | None, lora_name: str = "lm_head"
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(start, end, scale · hidden[start:end] @ A.T, B)`` for each adapter group of ``lora`` whose
    adapter adapts the LM head."""
    parts = []
    if lora is not None:
        for g in lora.groups:
            w = g.adapter.weights.get(lora_name) if g.adapter is not None else None
            if w is None or g.size == 0:
                continue
            hA = (hidden[g.start : g.end] @ w.A.to(hidden.dtype).T) * g.adapter.scale
            parts.append((g.start, g.end, hA, w.B.to(hidden.dtype)))
    return parts


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lora: LoraRoute | None = None,
    lora_name: str = "lm_head",
    softcap: float | None = None,
    chunk: int | None = None,
    inv_temperature: torch.Tensor | None = None,
    vocab: VocabSplit | None = None,
) -> torch.Tensor:
    """``log softmax(hidden @ weight.T)[t, targets[t, k]]`` as fp32 (fp64 for fp64 input) ``[T, K]``
    (``targets`` ``[T, K]`` or ``[T]``, giving ``[T]``), with the route's LM-head LoRA applied to each
    adapter's tokens. ``inv_temperature`` ``[T]``: row ``t``'s (capped) logits are multiplied by it
    before the softmax (a sampler's ``1 / τ``; None: 1 everywhere). ``vocab``: the head is split by
    vocabulary across processes (every one of them calls this with the same ``hidden``)."""
    squeeze = targets.dim() == 1
    if squeeze:
        targets = targets[:, None]
    if vocab is not None:
        weight = vocab.local(weight)
    chunk = chunk or default_chunk(weight.shape[0])
    parts = head_lora_parts(hidden, lora, lora_name)
    bounds = tuple((s, e) for s, e, _, _ in parts)
    tensors = [t for _, _, hA, B in parts for t in (hA, B)]
    if inv_temperature is not None:
        inv_temperature = inv_temperature.to(device=hidden.device, dtype=_acc_dtype(hidden))
    out = _ChunkedLogprobs.apply(hidden, weight, targets, chunk, softcap, inv_temperature, vocab, bounds, *tensors)
    return out[:, 0] if squeeze else out
