"""``retrieve_futures`` and ``join_sampling_session`` through the API process without an engine
(sampling results are written into the store by hand, as an engine would): cursor semantics, clones,
failures, ack-only and long polls (woken by an engine's datagram or by the waiter's interval),
ownership, join counters and 400 bodies for bad input."""

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from ember.doorbell import ring, ring_ids
from ember.server.app import create_app
from ember.server.config import ServedModel, ServerConfig
from ember.server.waiter import FutureWaiter
from ember.store import Store
from ember.store.models import SamplingSession
from ember.store.payload import encode
from tests.server.test_waiter import _run_on_store
from tests.store.backend import fresh_database

BASE = "tiny"
BLOCK = 1_000_000_000
LONG_POLL_S = 2.0


@pytest.fixture
def env(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "vocab_size": 100, "max_position_embeddings": 16})
    )
    with fresh_database(tmp_path) as url:
        store = Store.open(url)
        keys = [store.create_api_key(n)[1] for n in ("alice", "bob")]
        config = ServerConfig(
            models={BASE: ServedModel.from_folder(BASE, model_dir)},
            database_url=url,
            storage=str(tmp_path / "ckpt"),
            long_poll_s=LONG_POLL_S,
        )
        with TestClient(create_app(config, store)) as client:
            yield client, store, keys
        store.close()


def h(key):
    return {"X-API-Key": key}


def _sampler(client, key):
    r = client.post("/api/v1/create_session", json={"tags": [], "type": "create_session"}, headers=h(key))
    session = r.json()["session_id"]
    r = client.post(
        "/api/v1/create_sampling_session",
        headers=h(key),
        json={"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE},
    )
    assert r.status_code == 200, r.text
    return session, r.json()["sampling_session_id"]


def _sample(client, key, sampler, seq_id):
    r = client.post(
        "/api/v1/asample",
        headers=h(key),
        json={
            "sampling_session_id": sampler,
            "seq_id": seq_id,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def _poll(client, key, sampler, cursor, timeout=0, clone=0, **extra):
    body = {
        "target": {"type": "sampling_session", "sampling_session_id": sampler, "cloned_sampler_id": clone},
        "prev_cursor": cursor,
        "timeout": timeout,
        "retrieved_request_ids": [],
        **extra,
    }
    return client.post("/api/v1/retrieve_futures", json=body, headers=h(key))


def _done(rid):
    return {"state": "finished", "request_id": rid, "response_payload_uncompressed_size": None}


def test_completions_move_the_cursor_once_and_a_resent_cursor_gets_them_again(env):
    client, store, (alice, _) = env
    _, sampler = _sampler(client, alice)
    r0, r1 = _sample(client, alice, sampler, 0), _sample(client, alice, sampler, 1)
    clone = _sample(client, alice, sampler, 3 * BLOCK)
    t0 = time.monotonic()
    assert _poll(client, alice, sampler, 0).json() == {"completions": [], "cursor": 0}
    assert time.monotonic() - t0 < LONG_POLL_S / 2  # timeout 0: an ack-only poll answers at once
    store.finish([(r0, encode({}), None, None), (r1, None, "boom", "user"), (clone, encode({}), None, None)])
    first = {"completions": [_done(r0), {"state": "failed", "request_id": r1}], "cursor": 1}
    assert _poll(client, alice, sampler, 0, retrieved_request_ids=[r0]).json() == first
    assert _poll(client, alice, sampler, 1).json() == {"completions": [], "cursor": 1}
    assert _poll(client, alice, sampler, 0).json() == first  # the answer was lost: the same again
    # the clone (seq_ids 3e9...) has its own completions and cursor
    assert _poll(client, alice, sampler, 0, clone=3).json() == {"completions": [_done(clone)], "cursor": 1}
    assert _poll(client, alice, sampler, 5, clone=1).json() == {"completions": [], "cursor": 5}
    # what the SDK then fetches: the result of each completion
    assert client.post("/api/v1/retrieve_future", json={"request_id": r1}, headers=h(alice)).json() == {
        "error": "boom",
        "category": "user",
    }


def test_a_long_poll_waits_until_the_deadline_or_its_timeout(env):
    client, _, (alice, _) = env
    _, sampler = _sampler(client, alice)
    _sample(client, alice, sampler, 0)
    t0 = time.monotonic()
    assert _poll(client, alice, sampler, 4, timeout=0.3).json() == {"completions": [], "cursor": 4}
    assert 0.25 < time.monotonic() - t0 < LONG_POLL_S
    t0 = time.monotonic()
    assert _poll(client, alice, sampler, 4, timeout=None).json() == {"completions": [], "cursor": 4}
    assert LONG_POLL_S - 0.05 < time.monotonic() - t0 < LONG_POLL_S + 1.5


@pytest.mark.parametrize("datagram", [True, False])
def test_a_long_poll_wakes_when_a_request_finishes(env, datagram):
    """With a datagram (the waiter's interval made too long to matter) and without one (the
    interval alone): either way well before the long-poll deadline."""
    client, store, (alice, _) = env
    _, sampler = _sampler(client, alice)
    rid = _sample(client, alice, sampler, 0)
    waiter = client.app.state.ember.waiter
    if datagram:
        waiter.interval_s = 60.0

    def finish():
        store.finish([(rid, encode({}), None, None)])
        if datagram:
            ring_ids(waiter.port, [rid])

    threading.Timer(0.3, finish).start()
    t0 = time.monotonic()
    assert _poll(client, alice, sampler, 0, timeout=None).json() == {"completions": [_done(rid)], "cursor": 1}
    assert 0.25 < time.monotonic() - t0 < LONG_POLL_S / 2


def test_next_ring_wakes_on_any_datagram_and_sees_one_since_a_mark(tmp_path):
    async def scenario(store):
        waiter = FutureWaiter(store, interval_s=60.0)
        await waiter.start()
        try:
            assert await waiter.next_ring(0.05) is False
            mark = waiter.mark()
            task = asyncio.gather(*(waiter.next_ring(5.0) for _ in range(3)))
            await asyncio.sleep(0.05)
            ring(waiter.port)
            assert await asyncio.wait_for(task, 2.0) == [True] * 3
            # a datagram came after the mark (while the caller read the store): no wait at all
            assert await asyncio.wait_for(waiter.next_ring(5.0, since=mark), 0.01) is True
        finally:
            await waiter.stop()

    _run_on_store(tmp_path, scenario)


def test_join_counts_clients_and_samplers_are_the_owners_only(env):
    client, store, (alice, bob) = env
    session, sampler = _sampler(client, alice)
    join = {"sampling_session_id": sampler, "type": "join_sampling_session"}
    got = [client.post("/api/v1/join_sampling_session", json=join, headers=h(alice)).json() for _ in range(3)]
    assert got == [{"client_counter": n, "type": "join_sampling_session"} for n in (1, 2, 3)]
    for r in (
        client.post("/api/v1/join_sampling_session", json=join, headers=h(bob)),
        client.post("/api/v1/join_sampling_session", json={**join, "sampling_session_id": "nope"}, headers=h(alice)),
        _poll(client, bob, sampler, 0),
        _poll(client, bob, sampler, 0, timeout=None),
        _poll(client, alice, "nope", 0),
    ):
        assert r.status_code == 404 and "not found" in r.json()["detail"], r.text
    # past the last client number whose seq_ids fit in 64 bits: a 400, and nothing counted
    with store.write() as s:
        s.execute(update(SamplingSession).where(SamplingSession.id == sampler).values(clients=BLOCK - 1))
    r = client.post("/api/v1/join_sampling_session", json=join, headers=h(alice))
    assert r.status_code == 400 and "clients" in r.json()["detail"]
    assert store.get_sampling_session(sampler, None).clients == BLOCK - 1
    # a finished session takes no new clients
    client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}, headers=h(alice))
    r = client.post("/api/v1/join_sampling_session", json=join, headers=h(alice))
    assert r.status_code == 410 and r.json()["detail"]


def test_bad_input_is_a_400_with_a_detail(env):
    client, _, (alice, _) = env
    _, sampler = _sampler(client, alice)
    target = {"type": "sampling_session", "sampling_session_id": sampler, "cloned_sampler_id": 0}
    bodies = [
        {"prev_cursor": 0},
        {"target": {**target, "type": "training_run"}, "prev_cursor": 0},
        {"target": {**target, "cloned_sampler_id": -1}, "prev_cursor": 0},
        {"target": {**target, "cloned_sampler_id": BLOCK}, "prev_cursor": 0},
        {"target": target, "prev_cursor": -1},
        {"target": target, "prev_cursor": "x"},
        {"target": target, "prev_cursor": 0, "timeout": -1},
        {"target": target, "prev_cursor": 0, "retrieved_request_ids": "r"},
    ]
    for body in bodies:
        r = client.post("/api/v1/retrieve_futures", json=body, headers=h(alice))
        assert r.status_code == 400 and r.json()["detail"].startswith("invalid request"), (body, r.text)
    r = client.post("/api/v1/join_sampling_session", json={"type": "join_sampling_session"}, headers=h(alice))
    assert r.status_code == 400 and "sampling_session_id" in r.json()["detail"]
