"""Continuous batching: which requests join the running batch, and when, and how much of their
prompts each engine step prefills.

Each engine step has a budget of ``max_prefill_tokens`` tokens, split between decodes and prefills:
every running sequence decodes one token (they are counted first, so a running sequence never waits
for a prompt), and prompts get the rest (:meth:`Scheduler.prefill_budget`, at least one page).

Requests wait in arrival order. Before each step the scheduler admits waiting requests while
(a) their samples fit in the free decode rows (``max_seqs``), (b) their worst-case KV pages fit in
the unreserved pages, and (c) the step's prefill budget is not spent. An admitted request is
*prefilling* until its whole prompt is in the cache (``SequenceState.cached`` of its first sample:
tokens shared from the prefix index and chunks computed so far):

* with ``chunked`` (families whose layers can continue a cached prompt), :meth:`Scheduler.chunks`
  deals the budget to the prefilling requests in admission order, so a long prompt is prefilled in
  chunks over several steps while the running sequences keep decoding;
* otherwise a prompt is prefilled whole in the step it is admitted, and is admitted only if it fits
  what is left of the budget (the step's first prompt may exceed it).

Admission is first-come first-served: a request that does not fit yet blocks those behind it, so no
request starves. Finished samples give their rows and pages back at once, so new requests join
while others are still decoding.

Pages are *reserved* at admission for the longest possible generation, so a running sequence never
runs out of pages and nothing is ever preempted; pages are *allocated* lazily as sequences grow
(a chunk allocates the pages it writes), and samples of one prompt share its full pages (the shared
part is reserved once).
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
    # while prefilling in chunks, the prompt's hidden states and routing records so far (only for
    # requests that ask for prompt-side outputs; engine)
    hidden: list = field(default_factory=list)
    routing_parts: list = field(default_factory=list)

    @property
    def reserved_pages(self) -> int:
        return self.shared_pages + self.pages_per_sample * self.request.num_samples

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not in the cache yet (all of them before the engine starts the request)."""
        cached = self.sequences[0].cached if self.sequences else 0
        return len(self.request.prompt) - cached


class Scheduler:
    """Admission, the per-step token budget, and bookkeeping of rows and page reservations (see
    module doc). ``prefilling``: admitted requests whose prompt is not wholly cached yet, in
    admission order; ``running``: sequences that decode."""

    def __init__(
        self, max_seqs: int, usable_pages: int, page_size: int, max_prefill_tokens: int, chunked: bool = False
    ):
        self.max_seqs = max_seqs
        self.usable_pages = usable_pages
        self.page_size = page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked = chunked
        self.waiting: deque[RequestState] = deque()
        self.prefilling: list[RequestState] = []
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

    def prefill_budget(self) -> int:
        """Prompt tokens this step may prefill: ``max_prefill_tokens`` less one decode token per
        running sequence, but at least one page (prompts always make progress)."""
        return max(self.max_prefill_tokens - len(self.running), self.page_size)

    def admit(self) -> list[RequestState]:
        """Requests that join the batch in this step (their reservations taken; they are then
        ``prefilling``). The budget goes to the requests already prefilling first."""
        out = []
        left = self.prefill_budget() - sum(r.prompt_left for r in self.prefilling)
        while self.waiting:
            r = self.waiting[0]
            p = len(r.request.prompt)
            if self.chunked:
                budget_ok = left > 0
            else:  # whole prompts: the step's first one may exceed the budget
                budget_ok = p <= left or not (out or self.prefilling)
            fits = (
                self.reserved_rows + r.rows <= self.max_seqs
                and self.reserved_pages + r.reserved_pages <= self.usable_pages
                and budget_ok
            )
            if not fits:
                break
            self.waiting.popleft()
            self.reserved_rows += r.rows
            self.reserved_pages += r.reserved_pages
            r.unfinished = r.request.num_samples
            left -= p
            out.append(r)
        self.prefilling.extend(out)
        return out

    def chunks(self) -> list[tuple[RequestState, int]]:
        """``(request, tokens)``: how many more prompt tokens of each prefilling request this step
        prefills, in admission order (at most ``tokens``: the engine may find more of the prompt in
        the prefix index). Whole prompts unless ``chunked``; else the budget, dealt first come
        first served."""
        if not self.chunked:
            return [(r, r.prompt_left) for r in self.prefilling]
        out, left = [], self.prefill_budget()
        for r in self.prefilling:
            if left <= 0:
                break
            n = min(r.prompt_left, left)
            out.append((r, n))
            left -= n
        return out

    def prefilled(self, r: RequestState) -> None:
        """``r``'s whole prompt is cached: it stops prefilling (its samples decode or finish)."""
        self.prefilling.remove(r)

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
        return not self.waiting and not self.prefilling and not self.running
