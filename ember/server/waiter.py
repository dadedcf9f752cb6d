"""Long-poll support: wait for futures to finish without one database poll per waiting client.

A single background task polls the store for every request id that some client is waiting on
(one query per tick, however many waiters) and wakes those whose request has finished.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from ember.store import Store


class FutureWaiter:
    """``await wait(request_id, timeout)`` returns True once the request is done or failed."""

    def __init__(self, store: Store, interval_s: float = 0.002):
        self.store = store
        self.interval_s = interval_s
        self._waiters: dict[str, list[asyncio.Future]] = defaultdict(list)
        self._task: asyncio.Task | None = None

    async def wait(self, request_id: str, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiters[request_id].append(fut)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            waiting = self._waiters.get(request_id)
            if waiting is not None:
                if fut in waiting:
                    waiting.remove(fut)
                if not waiting:
                    del self._waiters[request_id]

    async def _poll(self) -> None:
        while self._waiters:
            ids = list(self._waiters)
            try:
                done = await asyncio.to_thread(self.store.finished_among, ids)
            except Exception:  # noqa: BLE001 - a database hiccup must not kill the poller
                done = set()
            for rid in done:
                for fut in self._waiters.pop(rid, []):
                    if not fut.done():
                        fut.set_result(True)
            await asyncio.sleep(self.interval_s)
