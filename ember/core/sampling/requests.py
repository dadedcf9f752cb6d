"""Token-level generation requests and results of the sampling engine, and stop rules.

These are the engine's own shapes (numpy and Python, no tensors): the worker translates Tinker's
sampling semantics (``num_samples``, seeds, ``stop`` forms) into a :class:`GenerationRequest` and its
result back into :class:`ember.types.SampleOutput`.

**Stop rules are token-level.** EOS ids, stop token ids and stop *token sequences* are matched on
the generated ids. Stop *strings* need text, which only the caller's tokenizer can produce: they are
matched through a ``detokenize(ids) -> str`` hook the caller supplies (the service layer owns the
tokenizer), applied to a window of the most recent tokens. A stop string may end inside a token;
generation stops after that token. Stop tokens and sequences are included in the returned tokens
(they are what the model produced, and RL datums need them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

Detokenize = Callable[[Sequence[int]], str]

# Tinker's encoding of an empty top-k entry (shared/spec/tinker_api.md §3.9)
EMPTY_TOPK_ID = 0
EMPTY_TOPK_LOGPROB = -99999.0


class InvalidGeneration(ValueError):
    """A generation request the engine refuses; the message names the field and the allowed range."""


@dataclass(frozen=True)
class StopRule:
    """When a sequence stops before ``max_tokens``.

    ``token_ids``: single stop tokens (EOS goes here when the request stops on EOS);
    ``sequences``: multi-token stop sequences; ``strings`` with ``detokenize``: stop strings.
    """

    token_ids: frozenset[int] = frozenset()
    sequences: tuple[tuple[int, ...], ...] = ()
    strings: tuple[str, ...] = ()
    detokenize: Detokenize | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.strings and self.detokenize is None:
            raise InvalidGeneration("stop strings need a detokenize hook (the caller's tokenizer)")
        if any(len(s) == 0 for s in self.sequences) or any(s == "" for s in self.strings):
            raise InvalidGeneration("stop sequences and stop strings must not be empty")

    @property
    def empty(self) -> bool:
        return not (self.token_ids or self.sequences or self.strings)

    def _window(self) -> int:
        # every token decodes to at least one byte, so a stop string of b bytes ending in the newest
        # token lies within the last b tokens; a few more absorb partial UTF-8 characters
        return max(len(s.encode()) for s in self.strings) + 4

    def matches(self, tokens: Sequence[int]) -> bool:
        """Whether the sequence of generated ``tokens`` ends a stop condition at its last token."""
        if not tokens:
            return False
        if tokens[-1] in self.token_ids:
            return True
        for s in self.sequences:
            if len(tokens) >= len(s) and tuple(tokens[-len(s) :]) == s:
                return True
        if self.strings:
            text = self.detokenize(list(tokens[-self._window() :]))
            return any(s in text for s in self.strings)
        return False


@dataclass
class GenerationRequest:
    """One prompt, sampled ``len(seeds)`` times with one adapter.

    * ``prompt_logprobs_from``: compute prompt logprobs (and top-k prompt logprobs) for positions
      ``>= max(1, prompt_logprobs_from)``; ``None``: none.
    * ``topk_prompt``: top-k prompt logprobs per computed position (0: off).
    * ``prompt_targets``: ``[P-1, K]`` int token ids (``-1`` = none) whose logprobs to return at
      each prompt position ``1..P-1``.
    * ``topk_sample``: top-k logprobs of every sampled position (0: off).
    * ``record_routing``: return the experts each MoE layer chose for every token fed to the model.
    * ``prompt_alt_k``: draw that many tokens (independently, with replacement, at the request's
      temperature; no top-k/top-p) at every prompt position ``1..P-1`` from the model's distribution
      there, with their logprobs (0: off).
    * ``record_support``: record what every sampled token was drawn from (:class:`TokenSupport`):
      the kept set when top-k/top-p truncate, else the ``record_support`` most likely tokens
      (0: off).
    """

    prompt: Sequence[int]
    max_tokens: int
    seeds: Sequence[int]
    slot: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: StopRule = field(default_factory=StopRule)
    prompt_logprobs_from: int | None = None
    topk_prompt: int = 0
    prompt_targets: np.ndarray | None = None
    topk_sample: int = 0
    record_routing: bool = False
    prompt_alt_k: int = 0
    record_support: int = 0

    @property
    def num_samples(self) -> int:
        return len(self.seeds)


@dataclass
class TokenSupport:
    """The sampler's support of each generated token of a sequence (``shared/spec/stability.md``).

    ``truncated``: top-k/top-p truncated the distribution, and ``ids`` is the kept set of each
    token (temperature, then top-k, then top-p) with ``q`` renormalised over it; otherwise ``ids``
    are the most likely tokens of the full ``softmax(z / τ)`` and ``q`` their probabilities in it.
    ``ids`` int32 ``[G, K]`` (most likely first, ``-1`` padded), ``q`` float32 ``[G, K]`` (0
    padded), ``mass`` float32 ``[G]`` (the probability of ``ids`` under ``softmax(z / τ)``),
    ``logprob`` float32 ``[G]`` (log q of the sampled token)."""

    truncated: bool
    ids: np.ndarray
    q: np.ndarray
    mass: np.ndarray
    logprob: np.ndarray

    @classmethod
    def stack(cls, truncated: bool, rows: list, head: int | None = None) -> TokenSupport:
        """From one ``(SupportRows, row)`` pair per generated token
        (:class:`~ember.core.sampling.logits.SupportRows`: a sampling step's records); ``head``:
        keep that many most likely tokens of untruncated rows (a step records as many as the
        largest request in it asked for)."""
        id_rows = [batch.ids[r] for batch, r in rows]
        q_rows = [batch.q[r] for batch, r in rows]
        mass = np.array([batch.mass[r] for batch, r in rows], np.float32)
        logprob = np.array([batch.logprob[r] for batch, r in rows], np.float32)
        width = max(len(x) for x in id_rows)
        if all(len(x) == width for x in id_rows):
            ids, q = np.stack(id_rows), np.stack(q_rows)
        else:  # kept sets of different sizes: pad
            ids = np.full((len(rows), width), -1, np.int32)
            q = np.zeros((len(rows), width), np.float32)
            for i, (a, b) in enumerate(zip(id_rows, q_rows)):
                ids[i, : len(a)], q[i, : len(b)] = a, b
        if not truncated and head is not None and head < width:
            ids, q = ids[:, :head].copy(), q[:, :head].copy()
            mass = q.sum(axis=1, dtype=np.float32)
        return cls(truncated, ids, q, mass, logprob)


@dataclass
class SequenceResult:
    """One sample: generated ``tokens`` (stop tokens included) and the model's logprob of each;
    ``stop_reason`` is ``"stop"`` or ``"length"``.

    ``topk_ids``/``topk_logprobs`` ``[G, k]`` when asked. ``routing`` ``[P + G - 1, L, k]``: the
    experts of each MoE layer (``GenerationResult.routing_layers``) for every token the model read,
    i.e. the prompt and all generated tokens but the last (the input of the training datum built
    from this sample). ``support``: with ``record_support``.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    routing: np.ndarray | None = None
    support: TokenSupport | None = None


@dataclass
class GenerationResult:
    """The samples of one request, in seed order, and the prompt-side outputs.

    ``prompt_logprobs`` ``[P]`` (NaN where not computed, always at 0); ``topk_prompt_ids``/
    ``topk_prompt_logprobs`` ``[P, k]`` (empty entries: id 0, logprob -99999); ``target_prompt_logprobs``
    ``[P-1, K]`` (0.0 where the target was -1); ``prompt_alt_tokens`` / ``prompt_alt_logprobs``
    ``[P-1, k]``: ``k`` draws at each position ``1..P-1`` and their logprobs.
    """

    sequences: list[SequenceResult]
    prompt_logprobs: np.ndarray | None = None
    topk_prompt_ids: np.ndarray | None = None
    topk_prompt_logprobs: np.ndarray | None = None
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens: np.ndarray | None = None
    prompt_alt_logprobs: np.ndarray | None = None
    routing_layers: tuple[int, ...] = ()
