"""The engine's scheduler: per-model seq_id order (out-of-order arrival, gaps, duplicates, ended
models) and packing of different models' forward_backward requests into one pass."""

from datetime import datetime, timedelta

from ember.engine.scheduler import plan
from ember.store.repo import ModelCursor, PendingFuture

T0 = datetime(2026, 1, 1)


def fut(id, model="a", seq=1, op="forward_backward", tokens=10, age_s=0.0, sampler=None):
    return PendingFuture(id, op, model, sampler, seq, tokens, T0 - timedelta(seconds=age_s))


def run(pending, cursors, budget=1000, gap=60.0):
    return plan(pending, cursors, T0, budget, 500, gap)


def test_waits_for_the_first_chunk_then_runs_chunks_in_order():
    # Chunks arrive 2, 3 then 1 (the SDK sends the first chunk last), then optim 4.
    cur = {"a": ModelCursor(1, "active")}
    assert not run([fut("c2", seq=2), fut("c3", seq=3)], cur)
    p = run([fut("c2", seq=2), fut("c3", seq=3), fut("o4", seq=4, op="optim_step"), fut("c1", seq=1)], cur)
    assert [f.id for f in p.passes] == ["c1", "c2", "c3"] and not p.ops  # optim waits for the chunks
    p = run([fut("o4", seq=4, op="optim_step"), fut("f5", seq=5)], {"a": ModelCursor(4, "active")})
    assert [f.id for f in p.ops] == ["o4"] and not p.passes  # f5 must not overtake the step


def test_different_models_share_one_pass_within_the_token_budget():
    cur = {m: ModelCursor(1, "active") for m in "abc"}
    pending = [fut("a1", "a", tokens=400, age_s=3), fut("b1", "b", tokens=400, age_s=2), fut("c1", "c", tokens=400, age_s=1)]
    p = run(pending, cur, budget=1000)
    assert [f.id for f in p.passes] == ["a1", "b1"]  # oldest first; c1 waits for the next pass
    assert [f.id for f in run([fut("big", tokens=5000)], {"a": ModelCursor(1, "active")}).passes] == ["big"]


def test_ops_of_other_models_run_beside_the_pass():
    cur = {"a": ModelCursor(1, "active"), "b": ModelCursor(7, "active")}
    p = run([fut("a1", "a"), fut("b7", "b", seq=7, op="save_weights")], cur)
    assert [f.id for f in p.passes] == ["a1"] and [f.id for f in p.ops] == ["b7"]


def test_gaps_are_skipped_only_after_the_timeout():
    cur = {"a": ModelCursor(1, "active")}
    assert not run([fut("f3", seq=3, age_s=10)], cur, gap=60)
    p = run([fut("f3", seq=3, age_s=120)], cur, gap=60)
    assert p.skip == {"a": 3} and [f.id for f in p.passes] == ["f3"]


def test_stale_and_orphaned_requests_are_failed_with_a_reason():
    p = run([fut("old", seq=1), fut("ok", seq=2)], {"a": ModelCursor(2, "active")})
    assert [(f.id, "behind" in why) for f, why in p.dead] == [("old", True)] and [f.id for f in p.passes] == ["ok"]
    p = run([fut("x", model="gone", seq=1)], {})
    assert "does not exist" in p.dead[0][1]
    p = run([fut("y", seq=1), fut("u", seq=None, op="unload_model")], {"a": ModelCursor(1, "unloaded")})
    assert [f.id for f, _ in p.dead] == ["y"] and [f.id for f in p.ops] == ["u"]


def test_creation_is_seq_zero_and_samples_have_their_own_budget():
    p = run([fut("create", seq=0, op="create_model"), fut("f1", seq=1)], {"a": ModelCursor(0, "creating")})
    assert [f.id for f in p.ops] == ["create"] and not p.passes
    samples = [fut(f"s{i}", model=None, seq=i, op="sample", tokens=200, sampler="s") for i in range(4)]
    assert [f.id for f in run(samples, {}).samples] == ["s0", "s1"]
