"""Tinker's sampling semantics on top of the token-level sampling engine.

:func:`generation_request` turns a :class:`~ember.types.SampleInput` into the engine's
:class:`~ember.core.sampling.GenerationRequest` (seeds per sample, stop forms, prompt-logprob
options) and :func:`sample_output` turns the result back (shared/spec/tinker_api.md §3.8–3.9).
``Worker.sample`` uses both.
"""

from __future__ import annotations

import math
import secrets

import numpy as np

from ember.core.sampling import GenerationRequest, GenerationResult, InvalidGeneration, StopRule, derive_seed
from ember.core.sampling.requests import Detokenize
from ember.lossdefs import STABILITY_HEAD
from ember.types import InvalidRequest, SampledSequence, SampleInput, SampleOutput


def stop_rule(stop, eos_ids: tuple[int, ...], vocab: int, detokenize: Detokenize | None) -> StopRule:
    """Tinker's ``stop``: ``None`` = EOS only; ``[]`` = nothing (not even EOS); a string or a list of
    strings (needs ``detokenize``); a list of token ids; (Ember) a list of token-id lists."""
    if stop is None:
        return StopRule(token_ids=frozenset(eos_ids))
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop)
    if not stop:
        return StopRule()
    if all(isinstance(s, str) for s in stop):
        if detokenize is None:
            raise InvalidRequest("stop strings need the tokenizer: this engine was given no detokenize hook")
        if any(s == "" for s in stop):
            raise InvalidRequest("stop strings must not be empty")
        return StopRule(strings=tuple(stop), detokenize=detokenize)
    if all(_is_int(s) for s in stop):
        ids = [int(s) for s in stop]
        _check_ids(ids, vocab)
        return StopRule(token_ids=frozenset(ids))
    if all(isinstance(s, (list, tuple, np.ndarray)) for s in stop):
        seqs = tuple(tuple(int(t) for t in s) for s in stop)
        if any(not s for s in seqs):
            raise InvalidRequest("stop token sequences must not be empty")
        _check_ids([t for s in seqs for t in s], vocab)
        return StopRule(sequences=seqs)
    raise InvalidRequest("stop must be a string, a list of strings, a list of token ids or a list of token-id lists")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_ids(ids: list[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"stop token ids must be in [0, {vocab}), got {bad[0]}")


def generation_request(
    inp: SampleInput, eos_ids: tuple[int, ...], vocab: int, max_seq_len: int, detokenize: Detokenize | None
) -> GenerationRequest:
    """The engine request of ``inp`` (``InvalidRequest`` naming the field when it is malformed)."""
    p = inp.params
    prompt = np.asarray(inp.prompt)
    if prompt.ndim != 1 or prompt.size == 0:
        raise InvalidRequest("prompt must be a non-empty 1-D list of token ids")
    if not _is_int(inp.num_samples) or inp.num_samples < 1:
        raise InvalidRequest(f"num_samples={inp.num_samples} must be an integer >= 1")
    max_tokens = p.max_tokens
    if max_tokens is None:
        max_tokens = max_seq_len - prompt.size
        if max_tokens < 1:
            raise InvalidRequest(f"prompt of {prompt.size} tokens leaves no room in the context length {max_seq_len}")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise InvalidRequest(f"max_tokens={max_tokens} must be an integer >= 1")
    for name in ("temperature", "top_p"):
        value = getattr(p, name)
        if not isinstance(value, (int, float, np.floating)) or not math.isfinite(value):
            raise InvalidRequest(f"{name}={value} must be a finite number")
    if p.seed is not None and not _is_int(p.seed):
        raise InvalidRequest(f"seed={p.seed!r} must be an integer")
    last_n = inp.prompt_logprobs_last_n
    if last_n is not None and (not _is_int(last_n) or last_n < 0):
        raise InvalidRequest(f"prompt_logprobs_last_n={last_n} must be an integer >= 0")
    if inp.prompt_logprobs or last_n is not None:
        start = 0 if last_n is None else max(0, prompt.size - last_n)
    else:
        start = None
    seed = secrets.randbits(63) if p.seed is None else int(p.seed)
    targets = inp.target_prompt_logprobs
    if targets is not None:
        targets = np.asarray(targets)
        if targets.ndim == 1:
            targets = targets[:, None]
    return GenerationRequest(
        prompt=prompt,
        max_tokens=int(max_tokens),
        seeds=[derive_seed(seed, i) for i in range(int(inp.num_samples))],
        slot=inp.slot,
        temperature=float(p.temperature),
        top_k=int(p.top_k) if _is_int(p.top_k) else p.top_k,
        top_p=float(p.top_p),
        stop=stop_rule(p.stop, eos_ids, vocab, detokenize),
        prompt_logprobs_from=start,
        topk_prompt=inp.topk_prompt_logprobs,
        prompt_targets=targets,
        topk_sample=inp.topk_sample_logprobs,
        record_routing=inp.record_routing,
        prompt_alt_k=inp.prompt_alt_tokens_k,
        record_support=STABILITY_HEAD if inp.record_stability else 0,
    )


def sample_output(result: GenerationResult) -> SampleOutput:
    """The worker's result type of an engine result."""
    return SampleOutput(
        sequences=[
            SampledSequence(s.tokens, s.logprobs, s.stop_reason, s.topk_ids, s.topk_logprobs, s.routing, s.support)
            for s in result.sequences
        ],
        prompt_logprobs=result.prompt_logprobs,
        topk_prompt_ids=result.topk_prompt_ids,
        topk_prompt_logprobs=result.topk_prompt_logprobs,
        target_prompt_logprobs=result.target_prompt_logprobs,
        prompt_alt_tokens=result.prompt_alt_tokens,
        prompt_alt_logprobs=result.prompt_alt_logprobs,
        routing_layers=result.routing_layers,
    )


__all__ = ["InvalidGeneration", "generation_request", "sample_output", "stop_rule"]
