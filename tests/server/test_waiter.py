"""The long-poll waiter: woken by an engine's result datagram (no poll needed), by a plain ring
(one store read), and still correct by polling alone when no datagram comes."""

import asyncio
import socket
import time

from ember.doorbell import id_datagrams, ring, ring_ids
from ember.server.waiter import FutureWaiter
from ember.store import Store
from tests.store.backend import fresh_database


def _queued(store):
    sid = store.create_session("o", None, [], {}, None)
    return store.submit_model(owner="o", session_id=sid, model_seq_id=0, base_model="b", lora={"rank": 4},
                              optimizer_config={}, user_metadata={}, op="create_model", payload=b"p")


def test_id_datagrams_split_and_keep_every_id():
    ids = [f"{i:036d}" for i in range(100)]
    grams = id_datagrams(ids)
    assert len(grams) > 1 and all(len(g) <= 1200 for g in grams)
    assert [x.decode() for g in grams for x in g.split(b"\n")] == ids


def _run_on_store(tmp_path, scenario):
    with fresh_database(tmp_path) as url:
        store = Store.open(url)
        try:
            asyncio.run(scenario(store))
        finally:
            store.close()


def test_waiter_is_woken_by_datagrams_and_falls_back_to_polling(tmp_path):
    _run_on_store(tmp_path, _scenario)


async def _scenario(store):
    waiter = FutureWaiter(store, interval_s=30.0)  # only a datagram can wake it in time
    await waiter.start()
    assert store.result_listeners(socket.gethostname()) == [waiter.port]

    # 1. A result datagram with the id wakes its waiter at once.
    rid = _queued(store)
    task = asyncio.create_task(waiter.wait(rid, 10.0))
    await asyncio.sleep(0.1)
    assert not task.done()
    store.finish([(rid, b"", None, None)])
    t0 = time.monotonic()
    ring_ids(waiter.port, [rid])
    assert await task is True and time.monotonic() - t0 < 2.0

    # 2. A plain ring makes the waiter read the store.
    rid = _queued(store)
    task = asyncio.create_task(waiter.wait(rid, 10.0))
    await asyncio.sleep(0.1)
    store.finish([(rid, b"", None, None)])
    ring(waiter.port)
    assert await asyncio.wait_for(task, 2.0) is True

    # 3. A stray datagram naming an unfinished id wakes nothing for good: the caller re-reads and
    #    sees it pending (the route then waits again); an unknown request times out.
    rid = _queued(store)
    task = asyncio.create_task(waiter.wait(rid, 0.5))
    await asyncio.sleep(0.1)
    ring_ids(waiter.port, [rid])
    assert await task is True and store.get_future(rid, "o").state == "pending"
    assert await waiter.wait(rid, 0.2) is False

    await waiter.stop()
    assert store.result_listeners(socket.gethostname()) == []

    # 4. Without notifications, polling alone finds the result.
    poller = FutureWaiter(store, interval_s=0.01, notify=False)
    task = asyncio.create_task(poller.wait(rid, 5.0))
    await asyncio.sleep(0.05)
    store.finish([(rid, b"", None, None)])
    assert await asyncio.wait_for(task, 2.0) is True


def test_result_datagrams_roundtrip_split_and_refuse_forgeries():
    from ember.doorbell import MAX_RESULT_DATAGRAM, Outcome, parse_results, result_datagrams

    key = b"k" * 32
    outcomes = [(f"{i:036d}", bytes(range(256)) * 3, None, None) for i in range(30)]
    outcomes += [("failed-1", None, "boom ✗", "user"), ("failed-2", None, "oops", None), ("big", b"x" * 10_000, None, None)]
    grams, too_big = result_datagrams(key, outcomes)
    assert too_big == ["big"] and len(grams) > 1 and all(len(g) <= MAX_RESULT_DATAGRAM for g in grams)
    got = {}
    for g in grams:
        got.update(parse_results(key, g))
    assert got[outcomes[0][0]] == Outcome("done", bytes(range(256)) * 3, None, None) and len(got) == 32
    assert got["failed-1"] == ("failed", None, "boom ✗", "user") and got["failed-2"].category == "server"
    forged = grams[0][:-1] + bytes([grams[0][-1] ^ 1])
    assert parse_results(key, forged) is None and parse_results(b"other" * 8, grams[0]) is None
    assert parse_results(None, grams[0]) is None and parse_results(key, b"some-id") is None


def test_waiter_hands_datagram_outcomes_to_its_waiters(tmp_path):
    _run_on_store(tmp_path, _outcome_scenario)


async def _outcome_scenario(store):
    from ember.doorbell import RESULT_KEY_SETTING, ring_results

    waiter = FutureWaiter(store, interval_s=30.0)
    await waiter.start()
    key = bytes.fromhex(store.setting(RESULT_KEY_SETTING, lambda: "00"))
    rid = _queued(store)
    task = asyncio.create_task(waiter.wait(rid, 10.0))
    await asyncio.sleep(0.1)
    ring_results(waiter.port, key, [(rid, b"result", None, None)])
    assert await asyncio.wait_for(task, 2.0) == ("done", b"result", None, None)
    # a datagram under another key only says "look now": the waiter reads the store
    task = asyncio.create_task(waiter.wait(rid, 10.0))
    await asyncio.sleep(0.1)
    store.finish([(rid, b"", None, None)])
    ring_results(waiter.port, b"wrong" * 8, [(rid, b"forged", None, None)])
    assert await asyncio.wait_for(task, 2.0) is True
    await waiter.stop()
