"""Per-key quotas: what one API key may hold at once, so that one user cannot fill the engines,
the queue or the checkpoint storage everyone shares.

A request over a quota gets **429** with a JSON ``detail`` naming the limit, the key's usage and
the flag that sets it. Queued requests drain by themselves, so that 429 carries ``Retry-After``
and the SDK's retries succeed once the queue is shorter; the other limits only move when the user
frees something (finishes a session, deletes checkpoints), so their 429 says so and carries
``x-should-retry: false``. A resubmission of something that already exists is never refused.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ember.server.errors import ApiError

QUEUE_REFRESH_S = 1.0  # how stale the cached queue length of a key may be on the hot submit path


@dataclass(frozen=True)
class Quotas:
    """Limits per API key; 0 = unlimited."""

    training_runs: int = 256  # models creating or active
    samplers: int = 16384  # samplers of active sessions (an RL loop makes one per step)
    checkpoint_bytes: int = 1 << 40  # saved checkpoints, ready or being written
    queued_requests: int = 4096  # futures pending or running


_HOW = {
    "training_runs": ("training runs are active", "--quota-training-runs", "finish a session or unload a model"),
    "samplers": ("samplers are open", "--quota-samplers", "finish the sessions that hold them"),
    "checkpoint_bytes": ("bytes of checkpoints are stored", "--quota-checkpoint-gb", "delete checkpoints"),
    "queued_requests": ("requests are queued", "--quota-queued-requests", "wait for them to finish"),
}


class QuotaGuard:
    """Checks a key's usage against :class:`Quotas` before something new is created."""

    def __init__(self, store, quotas: Quotas):
        self.store = store
        self.quotas = quotas
        self._queued: dict[str, tuple[int, float]] = {}  # owner -> (queued count, read at)
        self._lock = threading.Lock()

    def check(self, owner: str, what: str, adding: int = 1) -> None:
        """Raise 429 if ``owner`` holding ``adding`` more of ``what`` would pass its quota."""
        limit = getattr(self.quotas, what)
        if not limit:
            return
        used = self._queued_count(owner) if what == "queued_requests" else self.store.usage(owner, what)
        if used + adding > limit:
            noun, flag, remedy = _HOW[what]
            shown = f"{used / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB" if what == "checkpoint_bytes" else f"{used} of {limit}"
            detail = f"quota exceeded: {shown} {noun} for this API key (server flag {flag}); {remedy}"
            headers = {"Retry-After": "1"} if what == "queued_requests" else {"x-should-retry": "false"}
            err = ApiError(429, detail, headers=headers)
            err.rejectable = False  # type: ignore[attr-defined] - a retry may succeed: keep the seq_id free
            raise err
        if what == "queued_requests":
            with self._lock:
                count, at = self._queued[owner]
                self._queued[owner] = (count + adding, at)  # this process's submits since the read

    def _queued_count(self, owner: str) -> int:
        now = time.monotonic()
        with self._lock:
            hit = self._queued.get(owner)
        if hit is not None and now - hit[1] < QUEUE_REFRESH_S:
            return hit[0]
        count = self.store.usage(owner, "queued_requests")
        with self._lock:
            if len(self._queued) > 65536:
                self._queued.clear()
            self._queued[owner] = (count, now)
        return count
