"""Internal request and result types shared by the API layer and the engine (numpy, no torch).

These are Ember's own shapes, not Tinker's wire formats: the API layer decodes JSON/protobuf into
them, the engine executes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says which field and why (a 4xx for clients)."""


@dataclass
class SupportReplay:
    """What the sampler recorded at each target position of a datum, for ``stable_reinforce``
    (``shared/spec/stability.md``); built by the engine from the datum's provenance spans.

    ``kind`` int8 ``[N]``: 0 no record (no policy-gradient term), 1 the kept set of truncated
    sampling, 2 the most likely tokens of untruncated sampling. ``ids`` int32 ``[N, K]`` (``-1``
    padded) with the sampler's probabilities ``q`` float32 ``[N, K]``; ``inv_temperature``
    float32 ``[N]`` (1/τ of the sampler; 1 where ``kind`` is 0); ``mass`` float32 ``[N]`` (the
    sampler's probability of ``ids``); ``logprob`` float32 ``[N]`` (the sampler's processed
    logprob of the target)."""

    kind: np.ndarray
    ids: np.ndarray
    q: np.ndarray
    inv_temperature: np.ndarray
    mass: np.ndarray
    logprob: np.ndarray


@dataclass
class Datum:
    """One training example: ``tokens`` (model input, length N) and per-position loss inputs
    (``target_tokens`` ``[N]`` or ``[N, K]``, ``weights``, ``logprobs``, ``advantages`` …).

    ``routes`` int ``[N, L, k]``: experts a sampler chose at each input position in each MoE layer
    (``route_layers``), replayed by the forward pass (R3); rows of ``-1`` route live.
    ``support``: the sampler's records at the target positions (``stable_reinforce``)."""

    tokens: np.ndarray
    loss_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    routes: np.ndarray | None = None
    route_layers: tuple[int, ...] = ()
    support: SupportReplay | None = None


@dataclass
class ForwardBackwardInput:
    """One model's forward(_backward) over its datums, as one piece of a packed pass."""

    slot: int
    datums: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False
    custom_loss: dict | None = None  # loss_fn "custom": the program (see ember.lossgraph)


@dataclass
class ForwardBackwardOutput:
    """Per-datum target log-probabilities (shape of ``target_tokens``) and ``name:reduction`` metrics."""

    logprobs: list[np.ndarray]
    metrics: dict[str, float]


@dataclass
class RequestError:
    """A request that failed on its own without failing the rest of its batch."""

    message: str
    category: str = "user"


@dataclass
class SamplingParams:
    """Tinker's ``SamplingParams`` (shared/spec/tinker_api.md §3.8).

    ``max_tokens`` ``None``: until a stop or the end of the context. ``temperature`` 0: greedy.
    ``top_k`` -1 (or 0): off. ``seed`` ``None``: a random seed. ``stop``: ``None`` = EOS only,
    ``[]`` = nothing stops (not even EOS), a string, a list of strings, a list of token ids, or (Ember)
    a list of token-id lists (multi-token stop sequences). Stop strings need the caller's tokenizer
    (``Worker.sample(..., detokenize=...)``).
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list | None = None


@dataclass
class SampleInput:
    """One sampling request: ``num_samples`` completions of ``prompt`` with adapter ``slot`` (0: base).

    ``prompt_logprobs``: logprob of every prompt token (NaN at 0). ``prompt_logprobs_last_n``: only
    the last ``n`` prompt positions (implies prompt logprobs; NaN before). ``topk_prompt_logprobs``
    / ``topk_sample_logprobs``: the k most likely tokens per prompt / sampled position.
    ``target_prompt_logprobs``: ``[P-1, K]`` token ids (-1 = none) to score at positions ``1..P-1``.
    ``record_routing``: the experts each MoE layer chose for every token the model read.
    ``prompt_alt_tokens_k``: that many draws (request temperature, with replacement) from the
    model's distribution at every prompt position ``1..P-1``, with their logprobs.
    ``record_stability``: the stability record of every sample (``SampledSequence.support`` and,
    for MoE models, ``routing``), for ``stable_reinforce``.
    """

    slot: int
    prompt: np.ndarray
    params: SamplingParams = field(default_factory=SamplingParams)
    num_samples: int = 1
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: np.ndarray | None = None
    record_routing: bool = False
    prompt_alt_tokens_k: int = 0
    record_stability: bool = False


@dataclass
class SampledSequence:
    """One completion: ``tokens`` (stop tokens included), the model's logprob of each (temperature 1,
    the trainer's logprob), ``stop_reason`` ``"stop"`` (EOS or a stop condition) or ``"length"``.

    ``topk_ids`` / ``topk_logprobs`` ``[G, k]``; ``routing`` ``[P + G - 1, L, k]``: experts of each
    MoE layer for the prompt and every generated token but the last (the model input of the datum
    ``prompt + tokens``); ``support``: with ``record_stability``, what each token was drawn from
    (``ember.core.sampling.requests.TokenSupport``: numpy arrays ``ids``/``q`` ``[G, K]``,
    ``mass``/``logprob`` ``[G]``, and ``truncated``)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    routing: np.ndarray | None = None
    support: object | None = None


@dataclass
class SampleOutput:
    """The completions of one request (sample ``i`` used seed ``derive_seed(seed, i)``) and the
    prompt-side outputs: ``prompt_logprobs`` ``[P]`` (NaN where not computed), ``topk_prompt_ids`` /
    ``topk_prompt_logprobs`` ``[P, k]`` (empty entries: id 0, logprob -99999, as on Tinker's wire),
    ``target_prompt_logprobs`` ``[P-1, K]`` (0.0 where the target was -1), ``prompt_alt_tokens`` /
    ``prompt_alt_logprobs`` ``[P-1, k]``, ``routing_layers`` (the layer index of each routing
    column)."""

    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None
    topk_prompt_ids: np.ndarray | None = None
    topk_prompt_logprobs: np.ndarray | None = None
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens: np.ndarray | None = None
    prompt_alt_logprobs: np.ndarray | None = None
    routing_layers: tuple[int, ...] = ()
