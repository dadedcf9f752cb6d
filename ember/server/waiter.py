"""Long-poll support: wait for futures to finish without one database poll per waiting client.

A single background task reads the store for every request id that some client is waiting on (one
query per round, however many waiters) and wakes those whose request has finished. A round runs
when an engine on this host says it finished something (a UDP datagram on the waiter's result
doorbell, registered in the store as a ``result_listeners`` row; see :mod:`ember.doorbell`), and
at the latest every ``interval_s`` (engines on other hosts, a lost datagram). The store stays the
only source of truth: a datagram with ids only says "look now"; one that carries the committed
outcomes (authenticated with the key in the store) hands them to their waiters, which answer
without reading the row back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections import OrderedDict, defaultdict

from ember.doorbell import RESULT_KEY_SETTING, Outcome, parse_results
from ember.store import Store

log = logging.getLogger("ember.server")
RECENT_OUTCOMES = 1024  # outcomes kept from result datagrams (each at most MAX_RESULT_DATAGRAM bytes)


def _new_key() -> str:
    return secrets.token_hex(32)


class _Bell(asyncio.DatagramProtocol):
    def __init__(self, waiter: FutureWaiter):
        self.waiter = waiter

    def datagram_received(self, data, addr) -> None:
        self.waiter.notified(data)


class FutureWaiter:
    """``await wait(request_id, timeout)`` returns once the request is done or failed: its
    :class:`~ember.doorbell.Outcome` when an engine's datagram carried it, else True (read the
    store); False on timeout. ``await next_ring(timeout)`` returns on the next datagram of any kind
    (callers that wait on a whole set of requests re-read the store themselves)."""

    def __init__(self, store: Store, interval_s: float = 0.025, notify: bool = True):
        self.store = store
        self.interval_s = interval_s
        self.notify = notify
        self.listener_id = f"api-{os.getpid()}-{secrets.token_hex(4)}"
        self.port: int | None = None
        self._waiters: dict[str, list[asyncio.Future]] = defaultdict(list)
        self._ring_waiters: set[asyncio.Future] = set()  # ``next_ring`` callers: any datagram wakes them
        self._task: asyncio.Task | None = None
        self._rung: asyncio.Event | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self.rings = 0  # notifications received so far (see ``mark``)
        self._started = False
        self._key: bytes | None = None  # HMAC key of result datagrams (None: ids only)
        # the last outcomes datagrams brought, waited for or not (``recent``)
        self._recent: OrderedDict[str, Outcome | bool] = OrderedDict()

    async def start(self) -> None:
        """Open the result doorbell and register it (idempotent; a failure leaves plain polling)."""
        if not self.notify or self._started:
            return
        self._started = True  # before the first await: concurrent callers must not open a second one
        loop = asyncio.get_running_loop()
        self._rung = asyncio.Event()
        try:
            self._transport, _ = await loop.create_datagram_endpoint(lambda: _Bell(self), local_addr=("127.0.0.1", 0))
            self.port = self._transport.get_extra_info("sockname")[1]
            self._key = bytes.fromhex(await asyncio.to_thread(self.store.setting, RESULT_KEY_SETTING, _new_key))
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
        """A datagram from an engine: the committed outcomes of requests (``result_datagrams``),
        which go to their waiters, or newline-separated ids of requests that finished, whose
        waiters wake at once (callers re-read the store, which stays the record: a stray datagram
        only costs them a read); anything else starts a store read for every waiter."""
        self.rings += 1
        for fut in self._ring_waiters:
            if not fut.done():
                fut.set_result(True)
        self._ring_waiters.clear()
        outcomes = parse_results(self._key, data)
        if outcomes is not None:
            found: dict[str, Outcome | bool] = dict(outcomes)
        else:
            try:
                found = dict.fromkeys(data.decode().split("\n"), True)
            except UnicodeDecodeError:
                found = {}
        self._recent.update(found)
        while len(self._recent) > RECENT_OUTCOMES:
            self._recent.popitem(last=False)
        woken = False
        for rid, outcome in found.items():
            for fut in self._waiters.pop(rid, []):
                woken = True
                if not fut.done():
                    fut.set_result(outcome)
        if not woken and self._rung is not None:
            self._rung.set()

    def recent(self, request_id: str) -> Outcome | bool:
        """What the last ``RECENT_OUTCOMES`` ids of result datagrams said about ``request_id``: its
        outcome (a copy of what its engine committed), True (it finished: read the store) or
        False (nothing)."""
        return self._recent.get(request_id, False)

    def mark(self) -> int:
        """Take before reading a future's state; pass to ``wait`` so that a notification that
        arrived in between (and found no waiter for it) is not missed."""
        return self.rings

    async def next_ring(self, timeout_s: float, since: int | None = None) -> bool:
        """Wait for the next datagram of any kind (some request finished somewhere): True when one
        came, False after ``timeout_s``. For waits on many requests at once (``retrieve_futures``)
        that re-read the store on each ring, at no cost to the waiter's poll. ``since`` (a
        ``mark`` taken before the caller's read): True at once if a datagram came after it."""
        if since is not None and since != self.rings:
            return True
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._ring_waiters.add(fut)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return False
        finally:
            self._ring_waiters.discard(fut)

    async def wait(self, request_id: str, timeout_s: float, since: int | None = None) -> Outcome | bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._waiters[request_id].append(fut)
        stale = since is None or since != self.rings  # something finished since the caller looked (or we cannot tell)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll(read_first=stale))
        elif self._rung is not None and stale:
            self._rung.set()  # read now
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            return False
        finally:
            waiting = self._waiters.get(request_id)
            if waiting is not None:
                if fut in waiting:
                    waiting.remove(fut)
                if not waiting:
                    del self._waiters[request_id]

    async def _poll(self, read_first: bool = True) -> None:
        """Read the store for the waited-on ids whenever rung, at the latest every ``interval_s``.
        ``read_first=False``: the waiter's caller has just read its row and nothing finished since,
        so the first read waits for a ring (or the interval) too."""
        await self.start()
        rung = self._rung
        if not read_first and rung is not None:
            try:
                await asyncio.wait_for(rung.wait(), self.interval_s)
            except TimeoutError:
                pass
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
