"""What the engine runs next: per-model ``seq_id`` order, and packing across models.

Each training model executes its requests strictly in ``seq_id`` order (``models.next_seq`` is the
cursor). The scheduler looks at every queued request of one base model and builds a :class:`Plan`:

* ``passes``: the ``forward_backward`` requests that run together in ONE packed pass. From every
  model whose next request is a forward_backward it takes that request and the consecutive
  forward_backward requests behind it (running consecutive chunks of one model in one pass is the
  same as running them one after another: gradients add up, and forward-only requests see the same
  weights because no optimizer step lies between them). Models are served oldest request first
  until the token budget is used; the first request always fits.
* ``ops``: the next request of every other model when it is not a forward_backward (optim_step,
  save, load, create, unload); each runs on its own.
* ``samples``: sampling requests (independent of training order) up to their own token budget;
  they run after the training pass of the same tick, so neither starves the other.
* ``dead``: requests that can never run (their model failed, was unloaded or lost, or their
  seq_id is behind the cursor), with the reason.
* ``skip``: gaps to jump. A client that reserved a seq_id but never sent it (a crash between
  reserving and sending) would block its model forever; after ``gap_timeout_s`` the cursor moves to
  the next request that did arrive.

No torch here: the scheduler only orders rows.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from ember.store.repo import ModelCursor, PendingFuture

FORWARD_BACKWARD = "forward_backward"
UNSEQUENCED_MODEL_OPS = {"unload_model"}
ENDED = {"failed": "its creation failed", "lost": "it was lost", "unloaded": "it was unloaded"}


@dataclass
class Plan:
    passes: list[PendingFuture] = field(default_factory=list)
    ops: list[PendingFuture] = field(default_factory=list)
    samples: list[PendingFuture] = field(default_factory=list)
    dead: list[tuple[PendingFuture, str]] = field(default_factory=list)
    skip: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.passes or self.ops or self.samples or self.dead or self.skip)


def plan(
    pending: list[PendingFuture],
    cursors: dict[str, ModelCursor],
    now: datetime,
    token_budget: int,
    sample_budget: int,
    gap_timeout_s: float,
    status_details: dict[str, str] | None = None,
) -> Plan:
    """The next batch of work for one base model (see the module docstring)."""
    out = Plan()
    by_model: dict[str, list[PendingFuture]] = defaultdict(list)
    sample_tokens = 0
    for f in pending:
        if f.model_id is None:
            if f.op != "sample":
                out.ops.append(f)  # sampler bookkeeping (unload_sampler)
            elif not out.samples or sample_tokens + f.n_tokens <= sample_budget:
                out.samples.append(f)
                sample_tokens += f.n_tokens
            continue
        if f.op in UNSEQUENCED_MODEL_OPS or f.seq_id is None:
            out.ops.append(f)
            continue
        by_model[f.model_id].append(f)

    heads: list[list[PendingFuture]] = []
    for mid, futures in by_model.items():
        futures.sort(key=lambda f: f.seq_id)  # type: ignore[arg-type, return-value]
        cur = cursors.get(mid)
        if cur is None:
            out.dead.extend((f, f"model {mid} does not exist") for f in futures)
            continue
        if cur.status in ENDED:
            detail = (status_details or {}).get(mid)
            why = f"model {mid} cannot run requests: {ENDED[cur.status]}" + (f" ({detail})" if detail else "")
            out.dead.extend((f, why) for f in futures)
            continue
        nxt = cur.next_seq
        while futures and futures[0].seq_id < nxt:  # type: ignore[operator]
            f = futures.pop(0)
            out.dead.append((f, f"seq_id {f.seq_id} of model {mid} is behind the execution cursor ({nxt})"))
        if not futures:
            continue
        first = futures[0]
        if first.seq_id != nxt:
            if (now - first.created_at).total_seconds() < gap_timeout_s:
                continue  # an earlier request of this model has not arrived yet
            out.skip[mid] = first.seq_id  # type: ignore[assignment]
            nxt = first.seq_id  # type: ignore[assignment]
        run = [first]
        if first.op == FORWARD_BACKWARD:
            for f in futures[1:]:
                if f.op != FORWARD_BACKWARD or f.seq_id != run[-1].seq_id + 1:  # type: ignore[operator]
                    break
                run.append(f)
            heads.append(run)
        else:
            out.ops.append(first)

    tokens = 0
    for run in sorted(heads, key=lambda r: r[0].created_at):
        for f in run:
            if out.passes and tokens + f.n_tokens > token_budget:
                break
            out.passes.append(f)
            tokens += f.n_tokens
        else:
            continue
        break
    return out
