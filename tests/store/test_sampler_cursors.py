"""The store side of ``retrieve_futures`` and ``join_sampling_session`` (SQLite and, with
EMBER_TEST_POSTGRES_URL, PostgreSQL): completions reported once per cursor step and again when a
cursor is re-sent, clones kept apart by their seq_id blocks, and join counters unique under
concurrency."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import update

from ember.store.models import SamplingSession
from ember.store.repo import Conflict

BLOCK = 1_000_000_000


def _sampler(store, owner="o", seq=0):
    session = store.create_session(owner, None, [], {}, None)
    return store.create_sampling_session(
        owner=owner, session_id=session, seq=seq, base_model="b", model_path=None, weights_uri=None
    )


def _sample(store, sampler, seq_id, owner="o"):
    return store.submit(owner=owner, base_model="b", op="sample", payload=b"p", sampler_id=sampler, seq_id=seq_id)


def test_completions_are_reported_once_per_cursor_and_again_for_a_resent_cursor(store):
    sampler = _sampler(store)
    r0, r1, r2 = (_sample(store, sampler, k) for k in range(3))
    assert store.sampler_completions(sampler, "o", 0, 0) == ([], 0)  # nothing finished: the cursor stays
    store.finish([(r0, b"x", None, None), (r1, None, "boom", "user")])
    assert store.sampler_completions(sampler, "o", 0, 0) == ([(r0, "done"), (r1, "failed")], 1)
    assert store.sampler_completions(sampler, "o", 0, 1) == ([], 1)  # seen
    # the answer to cursor 0 was lost: the client sends 0 again and gets the same answer
    assert store.sampler_completions(sampler, "o", 0, 0) == ([(r0, "done"), (r1, "failed")], 1)
    store.finish([(r2, b"y", None, None)])
    assert store.sampler_completions(sampler, "o", 0, 1) == ([(r2, "done")], 2)
    assert store.sampler_completions(sampler, "o", 0, 1) == ([(r2, "done")], 2)  # resent again
    assert store.sampler_completions(sampler, "o", 0, 2) == ([], 2)
    # a client restarting from 0 (a new poller) sees everything it has not acknowledged past 0
    assert store.sampler_completions(sampler, "o", 0, 0) == ([(r0, "done"), (r1, "failed"), (r2, "done")], 1)


def test_clones_and_samplers_are_kept_apart(store):
    sampler, other = _sampler(store), _sampler(store, seq=1)
    mine = _sample(store, sampler, 5)
    clone = [_sample(store, sampler, BLOCK + k) for k in range(2)]
    far = _sample(store, sampler, 7 * BLOCK)
    theirs = _sample(store, other, 5)
    store.finish([(rid, b"r", None, None) for rid in (mine, *clone, far, theirs)])
    assert store.sampler_completions(sampler, "o", 1, 0) == ([(clone[0], "done"), (clone[1], "done")], 1)
    assert store.sampler_completions(sampler, "o", 0, 0) == ([(mine, "done")], 1)
    assert store.sampler_completions(sampler, "o", 7, 3) == ([(far, "done")], 4)
    assert store.sampler_completions(sampler, "o", 2, 0) == ([], 0)
    assert store.sampler_completions(other, "o", 0, 0) == ([(theirs, "done")], 1)


def test_completions_of_an_unknown_or_foreign_sampler_are_none(store):
    sampler = _sampler(store)
    store.finish([(_sample(store, sampler, 0), b"r", None, None)])
    assert store.sampler_completions(sampler, "mallory", 0, 0) is None
    assert store.sampler_completions("nope:sample:0", "o", 0, 0) is None


def test_join_counts_clients_of_the_owners_sampler(store):
    sampler = _sampler(store)
    assert [store.join_sampler(sampler, "o") for _ in range(3)] == [1, 2, 3]
    assert store.join_sampler(sampler, "mallory") is None
    assert store.join_sampler("nope:sample:0", "o") is None
    assert store.get_sampling_session(sampler, "o").clients == 3


def test_join_refuses_a_client_number_whose_seq_ids_would_overflow(store):
    sampler = _sampler(store)
    with store.write() as s:
        s.execute(update(SamplingSession).where(SamplingSession.id == sampler).values(clients=BLOCK - 2))
    assert store.join_sampler(sampler, "o") == BLOCK - 1
    with pytest.raises(Conflict, match="clients"):
        store.join_sampler(sampler, "o")
    assert store.get_sampling_session(sampler, "o").clients == BLOCK - 1  # the refused join counted nothing


def test_concurrent_joins_get_distinct_numbers(store):
    sampler = _sampler(store)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: store.join_sampler(sampler, "o"), range(40)))
    assert sorted(got) == list(range(1, 41))
