"""Long-poll support: wait for futures to finish without one database poll per waiting client.

A single background task reads the store for every request id that some client is waiting on (one
query per round, however many waiters) and wakes those whose request has finished. A round runs
when an engine on this host says it finished something (a UDP datagram on the waiter's result
doorbell, registered in the store as a ``result_listeners`` row; see :mod:`ember.doorbell`), and
at the latest every ``interval_s`` (engines on other hosts, a lost datagram). The store stays the
only source of truth: a notification only says "look now".
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections import defaultdict

from ember.store import Store

log = logging.getLogger("ember.server")


class _Bell(asyncio.DatagramProtocol):
    def __init__(self, waiter: FutureWaiter):
        self.waiter = waiter

    def datagram_received(self, data, addr) -> None:
        self.waiter.notified(data)


class FutureWaiter:
    """``await wait(request_id, timeout)`` returns True once the request is done or failed."""

    def __init__(self, store: Store, interval_s: float = 0.025, notify: bool = True):
        self.store = store
        self.interval_s = interval_s
        self.notify = notify
        self.listener_id = f"api-{os.getpid()}-{secrets.token_hex(4)}"
        self.port: int | None = None
        self._waiters: dict[str, list[asyncio.Future]] = defaultdict(list)
        self._task: asyncio.Task | None = None
        self._rung: asyncio.Event | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self.rings = 0  # notifications received so far (see ``mark``)
        self._started = False

    async def start(self) -> None:
        """Open the result doorbell and register it (idempotent; a failure leaves plain polling)."""
        if not self.notify or self._started:
            return
        self._started = True  # before the first await: concurrent callers must not open a second one
        loop = asyncio.get_running_loop()
        self._rung = asyncio.Event()
        try:
            self._transport, _ = await loop.create_datagram_endpoint(
                lambda: _Bell(self), local_addr=("127.0.0.1", 0)
            )
            self.port = self._transport.get_extra_info("sockname")[1]
            await self.refresh()
        except Exception:  # notifications are an optimisation; polling still works
            log.exception("result doorbell unavailable; falling back to polling")
            self.notify = False

    async def refresh(self) -> None:
        """Keep the registration fresh (the reaper calls this; stale listeners are pruned)."""
        if self.port is not None:
            await asyncio.to_thread(self.store.listen_results, self.listener_id, socket.gethostname(), self.port)

    async def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
            self._rung = None
            self.port = None
            try:
                await asyncio.to_thread(self.store.unlisten_results, self.listener_id)
            except Exception:  # best effort at shutdown; the row goes stale and is pruned
                log.warning("could not unregister the result doorbell", exc_info=True)

    def notified(self, data: bytes) -> None:
        """A datagram from an engine: newline-separated ids of requests that finished. Their waiters
        wake at once (callers re-read the store, which stays the record: a stray datagram only costs
        them a read); anything else starts a store read for every waiter."""
        self.rings += 1
        try:
            ids = data.decode().split("\n")
        except UnicodeDecodeError:
            ids = []
        woken = False
        for rid in ids:
            for fut in self._waiters.pop(rid, []):
                woken = True
                if not fut.done():
                    fut.set_result(True)
        if not woken and self._rung is not None:
            self._rung.set()

    def mark(self) -> int:
        """Take before reading a future's state; pass to ``wait`` so that a notification that
        arrived in between (and found no waiter for it) is not missed."""
        return self.rings

    async def wait(self, request_id: str, timeout_s: float, since: int | None = None) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiters[request_id].append(fut)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        elif self._rung is not None and (since is None or since != self.rings):
            self._rung.set()  # something finished since the caller looked (or we cannot tell): read now
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
        await self.start()
        rung = self._rung
        while self._waiters:
            if rung is not None:
                rung.clear()  # before the read: a notification arriving during it starts another round
            ids = list(self._waiters)
            try:
                done = await asyncio.to_thread(self.store.finished_among, ids)
            except Exception:  # noqa: BLE001 - a database hiccup must not kill the poller
                done = set()
            for rid in done:
                for fut in self._waiters.pop(rid, []):
                    if not fut.done():
                        fut.set_result(True)
            if not self._waiters:
                break
            if rung is None:
                await asyncio.sleep(self.interval_s)
            else:
                try:
                    await asyncio.wait_for(rung.wait(), self.interval_s)
                except TimeoutError:
                    pass
