"""Continuous batching: which requests join the running batch, and when.

Requests wait in arrival order. Before each engine step the scheduler admits waiting requests while
(a) their samples fit in the free decode rows (``max_seqs``), (b) their worst-case KV pages fit in
the unreserved pages, and (c) the step's prefill stays within ``max_prefill_tokens`` (the first
admitted prompt may exceed it). Admission is first-come first-served: a request that does not fit
yet blocks those behind it, so no request starves. Finished samples give their rows and pages back
at once, so new requests join while others are still decoding.

Pages are *reserved* at admission for the longest possible generation, so a running sequence never
runs out of pages and nothing is ever preempted; pages are *allocated* lazily as sequences grow,
and samples of one prompt share its full pages (the shared part is reserved once).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ember.core.sampling.requests import GenerationRequest


def page_reservation(prompt_len: int, max_tokens: int, num_samples: int, page_size: int) -> tuple[int, int]:
    """``(shared, per_sample)`` pages a request can need: a sequence holds ``prompt_len + max_tokens
    - 1`` tokens at most (the last sampled token is never fed back); with several samples the full
    prompt pages are shared and each sample owns the rest (its copy of the partial page included)."""
    total = math.ceil((prompt_len + max_tokens - 1) / page_size)
    if max_tokens == 1:  # every sample ends at the prefill: only the prompt's pages
        return total, 0
    if num_samples == 1:
        return 0, total
    shared = prompt_len // page_size
    return shared, total - shared


@dataclass(eq=False)
class SequenceState:
    """One sample being generated."""

    id: int
    request: RequestState
    index: int
    seed: int
    pages: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys/values are in the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[np.ndarray] = field(default_factory=list)
    topk_logprobs: list[np.ndarray] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    support: list = field(default_factory=list)  # (SupportRows, row) per token, with record_support
    stop_reason: str | None = None

    @property
    def slot(self) -> int:
        return self.request.request.slot


@dataclass(eq=False)
class RequestState:
    """A request and its samples, from admission to its result."""

    handle: int
    request: GenerationRequest
    shared_pages: int
    pages_per_sample: int
    rows: int = 0  # decode rows reserved (0 when max_tokens == 1: no sample ever decodes)
    sequences: list[SequenceState] = field(default_factory=list)
    outputs: dict = field(default_factory=dict)  # prompt-side results, filled by the prefill
    prompt_routing: np.ndarray | None = None
    unfinished: int = 0
    prefix_key: object = None  # the prefix index's key of its adapter weights at admission (engine)

    @property
    def reserved_pages(self) -> int:
        return self.shared_pages + self.pages_per_sample * self.request.num_samples


class Scheduler:
    """Admission and bookkeeping of rows and page reservations (see module doc)."""

    def __init__(self, max_seqs: int, usable_pages: int, page_size: int, max_prefill_tokens: int):
        self.max_seqs = max_seqs
        self.usable_pages = usable_pages
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[RequestState] = deque()
        self.running: list[SequenceState] = []
        self.reserved_pages = 0
        self.reserved_rows = 0

    def plan(self, handle: int, request: GenerationRequest) -> RequestState:
        """The request's state with its page needs; ``ValueError`` if it can never fit."""
        shared, per = page_reservation(len(request.prompt), request.max_tokens, request.num_samples, self.page_size)
        rows = request.num_samples if request.max_tokens > 1 else 0
        state = RequestState(handle, request, shared, per, rows)
        if rows > self.max_seqs:
            raise ValueError(
                f"num_samples={request.num_samples} exceeds the sampler's {self.max_seqs} concurrent sequences"
            )
        if state.reserved_pages > self.usable_pages:
            raise ValueError(
                f"prompt of {len(request.prompt)} tokens + max_tokens={request.max_tokens} x {request.num_samples} "
                f"samples needs {state.reserved_pages} KV pages; the cache holds {self.usable_pages}"
            )
        return state

    def add(self, state: RequestState) -> None:
        self.waiting.append(state)

    def admit(self) -> list[RequestState]:
        """Requests that join the batch in this step (their reservations taken)."""
        out, tokens = [], 0
        while self.waiting:
            r = self.waiting[0]
            p = len(r.request.prompt)
            fits = (
                self.reserved_rows + r.rows <= self.max_seqs
                and self.reserved_pages + r.reserved_pages <= self.usable_pages
                and (not out or tokens + p <= self.max_prefill_tokens)
            )
            if not fits:
                break
            self.waiting.popleft()
            self.reserved_rows += r.rows
            self.reserved_pages += r.reserved_pages
            r.unfinished = r.request.num_samples
            tokens += p
            out.append(r)
        return out

    def finish_sequence(self, seq: SequenceState) -> bool:
        """Give back a finished sample's row and own pages; True when its request is complete."""
        r = seq.request
        if seq in self.running:
            self.running.remove(seq)
        self.reserved_rows -= 1 if r.rows else 0
        self.reserved_pages -= r.pages_per_sample
        r.unfinished -= 1
        if r.unfinished == 0:
            self.reserved_pages -= r.shared_pages
            return True
        return False

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
