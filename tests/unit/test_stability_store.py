"""The engine's stability records: host memory up to a budget, then spilled to disk, least
recently used first; forgotten after inactivity, with their session, or past both budgets, with
an error that says why; never readable from another session."""

import numpy as np
import pytest

from ember.engine.stability import RecordMissing, StabilityRecord, StabilityStore, compact_routes


def record(session="s1", sampler="s1:sample:0", G=10, K=8, seed=0, routes=True):
    rng = np.random.default_rng(seed)
    P = 5
    return StabilityRecord(
        session_id=session, sampler_id=sampler, prompt=rng.integers(0, 100, P).astype(np.int32),
        tokens=rng.integers(0, 100, G).astype(np.int32), temperature=0.7, top_k=K, top_p=0.9, truncated=True,
        ids=rng.integers(-1, 100, (G, K)).astype(np.int32), q=rng.random((G, K)).astype(np.float32),
        mass=rng.random(G).astype(np.float32), logprob=-rng.random(G).astype(np.float32),
        routes=compact_routes(rng.integers(0, 300, (P + G - 1, 2, 4))) if routes else None, route_layers=(0, 2))


def same(a: StabilityRecord, b: StabilityRecord) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f)) if isinstance(getattr(a, f), np.ndarray) else getattr(a, f) == getattr(b, f)
        for f in vars(a))


def test_spills_to_disk_and_reads_back_exactly(tmp_path):
    one = record().nbytes
    store = StabilityStore(memory_bytes=3 * one, disk_bytes=100 * one, spill_dir=tmp_path)
    recs = {f"r{i}:0": record(seed=i) for i in range(8)}
    for k, r in recs.items():
        store.put(k, r)
    assert store.memory_used <= 3 * one and store.disk_used == 5 * one and len(store) == 8
    assert len(list(tmp_path.rglob("*.npz"))) == 5
    for k, r in recs.items():  # each comes back exactly (spilled ones from their file)
        assert same(store.get(k, "s1"), r), k
    assert store.memory_used <= 3 * one
    assert compact_routes(np.array([[3]])).dtype == np.uint8 and compact_routes(np.array([[300]])).dtype == np.int16


def test_past_both_budgets_the_least_recently_used_are_forgotten_with_a_reason(tmp_path):
    one = record().nbytes
    store = StabilityStore(memory_bytes=2 * one, disk_bytes=2 * one, spill_dir=tmp_path)
    for i in range(6):
        store.put(f"r{i}:0", record(seed=i))
        if i == 3:
            store.get("r0:0", "s1")  # r0 used again: not among the least recently used
    assert len(store) == 4
    with pytest.raises(RecordMissing, match="budget"):
        store.get("r1:0", "s1")
    assert same(store.get("r0:0", "s1"), record(seed=0))


def test_records_expire_after_inactivity_and_with_their_session():
    now = [0.0]
    store = StabilityStore(ttl_s=60, clock=lambda: now[0])
    store.put("a:0", record())
    store.put("b:0", record(sampler="s1:sample:1"))
    store.put("c:0", record(session="s2", sampler="s2:sample:0"))
    now[0] = 50
    store.get("a:0", "s1")
    now[0] = 100
    assert store.expire() == 2  # b and c were last used at 0
    with pytest.raises(RecordMissing, match="expired after 60 s"):
        store.get("b:0", "s1")
    assert store.drop_sampler("s1:sample:0", "its session ended") == 1
    with pytest.raises(RecordMissing, match="its session ended"):
        store.get("a:0", "s1")


def test_another_session_never_reads_a_record_nor_learns_why_it_is_gone():
    store = StabilityStore(ttl_s=60, clock=lambda: 0.0)
    store.put("a:0", record(session="s1"))
    with pytest.raises(RecordMissing) as e:
        store.get("a:0", "s2")
    assert "in this session" in str(e.value)
    store.drop_sampler("s1:sample:0", "its session ended")
    with pytest.raises(RecordMissing) as e:
        store.get("a:0", "s2")
    assert "session ended" not in str(e.value)
