"""Logits of the positions that need them, and choosing the next token.

**Logits.** :func:`head_logits` applies the LM head (with each adapter group's LM-head LoRA) through
the same code as the trainer's chunked logprobs (:mod:`ember.core.logprobs`), and log-probabilities
use the same log-sum-exp, so a sampled token's logprob equals the trainer's logprob of that token.
Logprobs are those of the model itself (temperature 1, before top-k/top-p), as the trainer sees
them, whatever the sampling parameters.

**Sampling** (temperature ``T``, ``top_k``, ``top_p``; vLLM's order): ``T == 0`` is greedy (argmax).
Otherwise ``softmax(logits / T)``, keep the ``top_k`` most likely tokens (``-1``/``0``: all), then
the smallest set of most likely tokens whose probability reaches ``top_p`` (renormalised after
top-k), and draw one token by inverting the cumulative distribution at a uniform number ``u``.

**Seeds.** ``u`` is a hash of ``(seed, step)`` (SplitMix64, computed on the host), where ``step`` is
the index of the token in its sequence. A sequence's tokens therefore depend only on its seed and
its own logits, never on which other sequences share the batch: the same request with the same
seed gives the same tokens, and each sample of ``num_samples`` gets its own seed
(:func:`derive_seed`). Rows are processed independently, and a row's code path depends only on its
own parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ember.core.kernels import sampling as sampling_kernel
from ember.core.layers.lora import LoraRoute
from ember.core.logprobs import VocabSplit, apply_softcap, chunk_logits, default_chunk, head_lora_parts, row_logsumexp

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """SplitMix64 finaliser (Steele et al., 2014): a bijective 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request with ``seed`` (distinct per sample)."""
    return splitmix64((seed & _MASK64) ^ splitmix64(index + 1))


def seeded_uniform(seed: int, step: int) -> float:
    """A uniform number in (0, 1) (53 bits) determined by ``(seed, step)``."""
    h = splitmix64((seed & _MASK64) ^ splitmix64(0x5EED0000 + step))
    return ((h >> 11) + 0.5) / float(1 << 53)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`splitmix64` of each element of a ``uint64`` array (NumPy's uint64 products wrap)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """:func:`seeded_uniform` of each ``(seeds[i], steps[i])``, the same numbers, as one fp64 array
    (a decode step's rows at once instead of a Python hash per row)."""
    s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    h = _splitmix64_array(s ^ _splitmix64_array(np.asarray(steps, dtype=np.uint64) + np.uint64(0x5EED0000)))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def head_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    lora: LoraRoute | None,
    lora_name: str = "lm_head",
    vocab: VocabSplit | None = None,
) -> torch.Tensor:
    """Raw (uncapped) fp32 logits ``[N, V]`` of ``hidden`` ``[N, H]``: the LM head plus, for each
    adapter group of ``lora``, its LM-head LoRA (exactly the trainer's chunk computation). With the
    head split by vocabulary (``vocab``), each process's part is gathered: every process gets all
    ``V`` logits of its ``N`` rows (a sampler's few positions, not a training batch)."""
    if vocab is not None:
        weight = vocab.local(weight)
    logits = chunk_logits(hidden, weight, head_lora_parts(hidden, lora, lora_name), 0, hidden.shape[0])
    return gather_vocab(logits, vocab)


def gather_vocab(logits: torch.Tensor, vocab: VocabSplit | None) -> torch.Tensor:
    """The whole vocabulary's logits ``[N, V]`` from each process's part ``[N, V / tp]`` (as they
    are without a split)."""
    if vocab is None:
        return logits
    return vocab.gather(logits).permute(1, 0, 2).reshape(logits.shape[0], vocab.size)


def log_softmax(raw: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Log-probabilities of raw logits (the trainer's softcap and log-sum-exp)."""
    return apply_softcap(raw, softcap)[0] - row_logsumexp(raw, softcap)[:, None]


def capped(raw: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits the model's distribution is defined by (softcap applied)."""
    return apply_softcap(raw, softcap)[0]


def topk_logprobs(logprobs: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and logprobs (float32) of the ``k`` most likely tokens of each row, most
    likely first (ties: lower token id first)."""
    k = min(k, logprobs.shape[-1])
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return ids[:, :k].to(torch.int32).cpu().numpy(), values[:, :k].float().cpu().numpy()


def plain(temperature: float, top_k: int, top_p: float, vocab: int) -> bool:
    """Whether a row with these parameters is sampled by :func:`sample_rows` (greedy, or
    temperature without top-k/top-p truncation)."""
    return temperature == 0 or (_k(top_k, vocab) == vocab and top_p >= 1)


def sample_rows(z: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain rows: one token per row of ``z`` (``[B, V]`` fp32, softcap applied) drawn at
    temperature ``1 / inv_temperature[b]`` (0: greedy) by inverting the cumulative distribution at
    ``u[b]``, and its logprob at temperature 1. One Triton kernel on the GPU
    (:mod:`ember.core.kernels.sampling`), fp64 PyTorch elsewhere; both pick the same token unless
    ``u`` lies within rounding distance of a boundary. Returns ``(tokens [B] long, logprobs [B] fp32)``."""
    if sampling_kernel.available(z):
        return sampling_kernel.sample_rows(z.contiguous(), inv_temperature, u)
    inv_t = inv_temperature.to(torch.float64)
    probs = torch.softmax(z.double() * inv_t[:, None], dim=-1)
    tok = torch.where(inv_t == 0, z.argmax(dim=-1), _invert_cdf(probs, u.to(torch.float64)[:, None]))
    lp = z.gather(1, tok[:, None])[:, 0] - torch.logsumexp(z, dim=-1)
    return tok, lp


def sample_tokens(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    uniforms: Sequence[float],
) -> torch.Tensor:
    """One token per row of ``logits`` (``[B, V]``, softcap already applied), each row with its own
    parameters and uniform number (see module doc). Returns ``[B]`` (long)."""
    return draw_tokens(logits, temperature, top_k, top_p, uniforms)[0]


def draw_tokens(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    uniforms: Sequence[float],
    keep_support: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, dict[int, tuple[SupportRows, int]]]:
    """:func:`sample_tokens`, and for each truncated (top-k/top-p) row ``i`` with
    ``keep_support[i]`` the kept set the token was drawn from, computed from the very
    probabilities of the draw: ``{i: (rows, r)}``, row ``r`` of a :class:`SupportRows`."""
    B, V = logits.shape
    device = logits.device
    out = torch.empty(B, dtype=torch.long, device=device)
    supports: dict[int, tuple[SupportRows, int]] = {}
    simple = [i for i in range(B) if plain(temperature[i], top_k[i], top_p[i], V)]
    filtered = [i for i in range(B) if not plain(temperature[i], top_k[i], top_p[i], V)]
    if simple:
        idx = torch.tensor(simple, device=device)
        params = torch.tensor(
            [[1.0 / temperature[i] if temperature[i] > 0 else 0.0 for i in simple], [uniforms[i] for i in simple]],
            dtype=torch.float64,
        ).to(device)
        out[idx] = sample_rows(logits.index_select(0, idx), params[0], params[1])[0]
    if filtered:
        idx = torch.tensor(filtered, device=device)
        z = logits.index_select(0, idx).double() / _col([temperature[i] for i in filtered], device)
        z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        probs = torch.softmax(z, dim=-1)
        ranks = torch.arange(V, device=device)[None, :]
        ks = torch.tensor([_k(top_k[i], V) for i in filtered], device=device)[:, None]
        probs = probs * (ranks < ks)
        top_k_mass = probs.sum(dim=-1, keepdim=True)
        probs = probs / top_k_mass
        ps = _col([top_p[i] for i in filtered], device)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the more likely tokens
        probs = probs * ((before < ps) | (ps >= 1))
        pick = _invert_cdf(probs, _col([uniforms[i] for i in filtered], device))
        out[idx] = order.gather(1, pick[:, None])[:, 0]
        rows = [j for j, i in enumerate(filtered) if keep_support is not None and keep_support[i]]
        if rows:
            kept = _kept_sets(probs, order, top_k_mass[:, 0], pick, rows)
            supports.update({filtered[j]: (kept, r) for r, j in enumerate(rows)})
    return out, supports


@dataclass
class SupportRows:
    """What the tokens of one sampling step were drawn from, one row per token (the stability
    record, ``shared/spec/stability.md``).

    ``ids`` int32 ``[R, K]`` (most likely first, ``-1`` padded) with probabilities ``q`` float32
    ``[R, K]`` (0 padded): the kept set after temperature, top-k and top-p with ``q`` renormalised
    over it, or, for untruncated sampling, the most likely tokens of the full distribution with
    their probabilities in it. ``mass`` float32 ``[R]``: the probability of ``ids`` under
    ``softmax(z / τ)``; ``logprob`` float32 ``[R]``: log q of the sampled token (the sampler's
    processed logprob)."""

    ids: np.ndarray
    q: np.ndarray
    mass: np.ndarray
    logprob: np.ndarray


def _kept_sets(probs, order, top_k_mass, pick, rows) -> SupportRows:
    """Kept sets of the truncated rows ``rows`` (of the sorted ``probs``). Top-k and top-p keep a
    prefix of the sorted order, so a row's set is its first ``count`` sorted entries. One
    device-to-host copy."""
    idx = torch.tensor(rows, device=probs.device)
    p = probs.index_select(0, idx)
    counts = (p > 0).sum(dim=-1, keepdim=True)
    width = int(counts.max())
    mass = p.sum(dim=-1, keepdim=True)
    q = p[:, :width] / mass
    inside = torch.arange(width, device=p.device)[None, :] < counts
    ids = torch.where(inside, order.index_select(0, idx)[:, :width], -1)
    lq = torch.log(q.gather(1, pick.index_select(0, idx)[:, None]))
    kept = mass * top_k_mass.index_select(0, idx)[:, None]
    host = torch.cat([ids.double(), q, kept, lq], 1).cpu().numpy()
    return SupportRows(host[:, :width].astype(np.int32), host[:, width : 2 * width].astype(np.float32),
                       host[:, 2 * width].astype(np.float32), host[:, 2 * width + 1].astype(np.float32))


def head_support(
    raw: torch.Tensor, softcap: float | None, inv_temperature: np.ndarray, tokens: torch.Tensor, k: int
) -> SupportRows:
    """Untruncated rows of raw logits ``raw`` ``[B, V]`` (fp32): the ``k`` most likely tokens of
    ``softmax(z / τ)`` (``z`` the capped logits) with their probabilities, and the sampled
    ``tokens``' logprob at ``τ``; a greedy row (``inv_temperature`` 0) was drawn from the single
    token it chose. The device part is :func:`head_record` (the static decoder runs it inside its
    CUDA graph); the rest is ``[B, k]`` arithmetic on the host (:func:`head_rows`)."""
    inv_t = torch.from_numpy(np.asarray(inv_temperature, np.float64)).to(raw.device, non_blocking=True)
    rec = head_record(raw, softcap, inv_t, tokens, k).cpu().numpy()
    return head_rows(rec, softcap, inv_temperature, tokens.cpu().numpy())


def head_record(
    raw: torch.Tensor, softcap: float | None, inv_temperature: torch.Tensor, tokens: torch.Tensor, k: int
) -> torch.Tensor:
    """What needs the whole row, as fp64 ``[B, 2k + 2]``: the ids and raw logits of the row's top
    ``k`` (the cap and ``1/τ`` are monotone, so they are the distribution's top ``k``), the
    log-sum-exp of the capped, tempered logits (``inv_temperature`` 0 counts as 1) and the sampled
    token's raw logit. No host synchronisation: it can run inside a CUDA graph."""
    t = torch.where(inv_temperature > 0, inv_temperature, 1.0).to(torch.float32)
    lse = row_logsumexp(raw, softcap, t)
    top, ids = torch.topk(raw, min(k, raw.shape[-1]), dim=-1)
    picked = raw.gather(1, tokens.to(torch.long)[:, None])
    return torch.cat([ids.to(torch.float64), top.to(torch.float64), lse[:, None].to(torch.float64),
                      picked.to(torch.float64)], 1)


def head_rows(rec: np.ndarray, softcap: float | None, inv_temperature: np.ndarray, tokens: np.ndarray) -> SupportRows:
    """:class:`SupportRows` of untruncated rows from their :func:`head_record` (host arrays)."""
    n = (rec.shape[1] - 2) // 2
    inv_t = np.asarray(inv_temperature, np.float64)
    greedy = inv_t <= 0
    t = np.where(greedy, 1.0, inv_t)
    ids = rec[:, :n].astype(np.int32)
    z = rec[:, n : 2 * n]
    picked = rec[:, 2 * n + 1]
    if softcap is not None:
        z, picked = softcap * np.tanh(z / softcap), softcap * np.tanh(picked / softcap)
    lse = rec[:, 2 * n]
    q = np.exp(z * t[:, None] - lse[:, None])
    lp = picked * t - lse
    if greedy.any():
        ids[greedy] = -1
        ids[greedy, 0] = np.asarray(tokens)[greedy]
        q[greedy], lp[greedy] = 0.0, 0.0
        q[greedy, 0] = 1.0
    return SupportRows(ids, q.astype(np.float32), q.sum(axis=1).astype(np.float32), lp.astype(np.float32))


def _k(top_k: int, vocab: int) -> int:
    return vocab if top_k <= 0 else min(top_k, vocab)


def _col(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device=device)[:, None]


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative probability reaches ``u`` times the row's total mass (never
    a zero-probability index, since ``0 < u < 1``)."""
    cdf = torch.cumsum(probs, dim=-1)
    pick = torch.searchsorted(cdf, (u[:, 0] * cdf[:, -1])[:, None].contiguous())[:, 0]
    return pick.clamp_max(probs.shape[-1] - 1)


def chunked_rows(n: int, vocab: int) -> int:
    """Rows per chunk when full-vocabulary logits of ``n`` rows are needed (about 1 GiB of fp32)."""
    return min(n, default_chunk(vocab)) if n else 1
