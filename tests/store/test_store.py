"""The store against SQLite and (with EMBER_TEST_POSTGRES_URL) PostgreSQL: idempotent submits,
ordering cursors, engine loss, sessions, checkpoints, ownership, and 64 concurrent writers."""

import multiprocessing as mp
import time
from datetime import timedelta

import numpy as np
import pytest
from sqlalchemy import inspect, select

from ember.store import Store
from ember.store.models import Checkpoint, Future, TrainingModel
from ember.store.payload import decode, encode
from ember.store.repo import Conflict, Gone, utcnow
from tests.store.writers import run_writers


def _model(store, owner="o", session=None, seq=0, base="b"):
    session = session or store.create_session(owner, None, [], {}, None)
    rid = store.submit_model(owner=owner, session_id=session, model_seq_id=seq, base_model=base,
                             lora={"rank": 4}, optimizer_config={"type": "adamw"}, user_metadata={},
                             op="create_model", payload=b"p")
    return session, f"{session}:train:{seq}", rid


def test_migrations_create_every_table_and_rerun_cleanly(db_url, store):
    tables = set(inspect(store.engine).get_table_names())
    assert {"api_keys", "sessions", "models", "futures", "checkpoints", "sampling_sessions", "engines",
            "settings", "result_listeners", "custom_losses", "alembic_version"} <= tables
    Store.open(db_url).close()  # second migration run is a no-op


def test_migrations_build_the_schema_the_models_declare(store):
    """Alembic's autogenerate finds nothing to add: migrations and ``ember.store.models`` agree."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from ember.store.models import Base

    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": False}), Base.metadata)
    assert diff == [], diff


def test_api_keys_are_stored_hashed_and_revocable(store):
    key_id, key = store.create_api_key("alice")
    assert key.startswith("tml-") and store.owner_of_key(key) == key_id
    with store.read() as s:
        assert all(key not in (k.key_hash, k.name) for k in s.scalars(select(type(store.list_api_keys()[0]))))
    assert store.owner_of_key("tml-wrong") is None
    assert store.revoke_api_key(key_id) and store.owner_of_key(key) is None


def test_model_ids_and_idempotent_creation(store):
    session, model_id, rid = _model(store)
    assert model_id == f"{session}:train:0"
    _, again, rid2 = _model(store, session=session)
    assert (again, rid2) == (model_id, rid)
    m = store.get_model(model_id, "o")
    assert m.next_seq == 0 and m.status == "creating"
    assert store.get_model(model_id, "someone-else") is None


def test_submits_are_idempotent_and_stale_seq_ids_refused(store):
    _, mid, _ = _model(store)
    a = store.submit(owner="o", base_model="b", op="optim_step", payload=b"1", model_id=mid, seq_id=1)
    assert store.submit(owner="o", base_model="b", op="optim_step", payload=b"2", model_id=mid, seq_id=1) == a
    created = store.get_model(mid, "o").last_request_time
    store.finish([(a, b"r", None, None)], advance={mid: 4})  # e.g. seq 2, 3 were skipped as a gap
    model = store.get_model(mid, "o")
    assert model.next_seq == 4 and model.last_request_time > created  # set when its requests run
    # A resubmission of an executed request still answers the original; a new one is refused.
    assert store.submit(owner="o", base_model="b", op="optim_step", payload=b"2", model_id=mid, seq_id=1) == a
    with pytest.raises(Conflict, match="already executed"):
        store.submit(owner="o", base_model="b", op="optim_step", payload=b"3", model_id=mid, seq_id=3)
    # The cursor never moves backwards.
    store.finish([], advance={mid: 1})
    assert store.get_model(mid, "o").next_seq == 4


def test_pending_lists_payload_free_rows_oldest_first_and_claim_returns_payloads(store):
    _, mid, create = _model(store)
    ids = [store.submit(owner="o", base_model="b", op="forward_backward", payload=bytes([i]), model_id=mid,
                        seq_id=i, n_tokens=10 * i) for i in (3, 1, 2)]
    pending = store.pending("b")
    assert [p.id for p in pending] == [create, *ids]
    assert {p.seq_id for p in pending} == {0, 1, 2, 3} and pending[1].n_tokens == 30
    assert store.claim(ids[:2]) == {ids[0]: bytes([3]), ids[1]: bytes([1])}
    assert [p.id for p in store.pending("b")] == [create, ids[2]]


def test_pending_with_cursors_is_pending_plus_cursors_in_one_read(store):
    _, mid, _ = _model(store)
    store.submit(owner="o", base_model="b", op="optim_step", payload=b"", model_id=mid, seq_id=1)
    store.submit(owner="o", base_model="b", op="unload_sampler", payload=None, sampler_id="s:sample:0")
    pending, cursors = store.pending_with_cursors("b")
    assert pending == store.pending("b")
    assert cursors == store.cursors([mid]) and cursors[mid].next_seq == 0
    assert store.claim([]) == {}


def test_result_listeners_register_refresh_and_prune(store):
    store.listen_results("api-1", "h", 5000)
    store.listen_results("api-1", "h", 5001)  # a refresh, not a second row
    store.listen_results("api-2", "other-host", 5002)
    assert store.result_listeners("h") == [5001]
    time.sleep(0.01)
    store.listen_results("api-3", "h", 5003, stale_after_s=0)  # prunes every listener not just refreshed
    assert store.result_listeners("h") == [5003] and store.result_listeners("other-host") == []
    store.unlisten_results("api-3")
    assert store.result_listeners("h") == []


def test_engine_loss_fails_queued_requests_and_loses_models(store):
    _, mid, create = _model(store)
    store.finish([(create, b"", None, None)], advance={mid: 1}, model_status={mid: ("active", None)})
    f = store.submit(owner="o", base_model="b", op="optim_step", payload=b"", model_id=mid, seq_id=1)
    other = _model(store, base="other")[2]
    assert store.engine_lost("b", "engine died") == (1, 1)
    row = store.get_future(f, "o")
    assert (row.state, row.error, row.category) == ("failed", "engine died", "server")
    assert store.get_model(mid, "o").status == "lost"
    assert store.get_future(other, "o").state == "pending"  # other base models are untouched


def test_sessions_end_by_finish_or_timeout_and_unload_their_models(store):
    session, mid, _ = _model(store)
    assert store.heartbeat(session, "o") == "active"
    with pytest.raises(KeyError):
        store.heartbeat(session, "intruder")
    assert store.end_session(session, "finished", "success") == [mid]
    assert store.get_model(mid, "o").status == "unloaded"
    assert [p.op for p in store.pending("b")][-1] == "unload_model"
    with pytest.raises(Gone):
        store.active_session(session, "o")
    idle = store.create_session("o", None, [], {}, None)
    with store.write() as s:
        s.get(type(store.get_session(idle, "o")), idle).last_heartbeat = utcnow() - timedelta(seconds=100)
    assert store.expire_idle_sessions(50) == [idle]
    assert store.get_session(idle, "o").status == "expired"


def _ckpt(path, owner="o"):
    return Checkpoint(tinker_path=path, owner=owner, model_id="m", kind="training", name="n", uri="/x",
                      base_model="b", lora={"rank": 4}, optimizer_config={}, created_at=utcnow())


def test_checkpoint_names_clash_unless_overwrite(store):
    _, mid, _ = _model(store)
    p = "tinker://m/weights/n"
    f1 = store.submit(owner="o", base_model="b", op="save_weights", payload=b"", model_id=mid, seq_id=1,
                      checkpoint=_ckpt(p))
    with pytest.raises(Conflict, match="being written"):
        store.submit(owner="o", base_model="b", op="save_weights", payload=b"", model_id=mid, seq_id=2,
                     checkpoint=_ckpt(p))
    store.finish([(f1, b"", None, None)], checkpoints={p: ("ready", 123)})
    assert store.get_checkpoint(p, "o").size_bytes == 123
    assert store.get_checkpoint(p, "x") is None
    with pytest.raises(Conflict, match="already exists"):
        store.submit(owner="o", base_model="b", op="save_weights", payload=b"", model_id=mid, seq_id=2,
                     checkpoint=_ckpt(p))
    store.submit(owner="o", base_model="b", op="save_weights", payload=b"", model_id=mid, seq_id=2,
                 checkpoint=_ckpt(p), overwrite=True)
    assert store.get_checkpoint(p, "o").state == "pending"
    store.update_checkpoint(p, "o", public=True)  # not ready: refused
    assert not store.get_checkpoint(p, "o").public


def test_payload_codec_roundtrip_and_refuses_objects():
    obj = {"datums": [{"tokens": np.arange(5, dtype=np.int64), "w": np.ones((2, 3), np.float32)}], "x": 1.5,
           "s": "text", "n": None, "flags": [True, False]}
    back = decode(encode(obj))
    np.testing.assert_array_equal(back["datums"][0]["tokens"], obj["datums"][0]["tokens"])
    assert back["datums"][0]["w"].dtype == np.float32 and back["datums"][0]["w"].flags.writeable
    assert {k: back[k] for k in ("x", "s", "n", "flags")} == {"x": 1.5, "s": "text", "n": None, "flags": [True, False]}
    with pytest.raises(TypeError):
        encode({"bad": np.array(["a"], dtype=object)})


def test_64_concurrent_writers_never_see_database_is_locked(db_url, store):
    """8 processes x 8 threads write at once (submit, idempotent resubmit, heartbeat, complete)."""
    procs_n, threads_n, rounds = 8, 8, 4
    session = store.create_session("o", None, [], {}, None)
    models = []
    for i in range(procs_n * threads_n):
        _, mid, create = _model(store, session=session, seq=i)
        store.finish([(create, b"", None, None)], advance={mid: 1}, model_status={mid: ("active", None)})
        models.append(mid)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=run_writers, args=(db_url, session, models[i::procs_n], rounds, out))
             for i in range(procs_n)]
    for p in procs:
        p.start()
    errors = [e for _ in procs for e in out.get(timeout=300)]
    for p in procs:
        p.join(60)
    assert not errors, errors[0]
    with store.read() as s:
        done = s.scalars(select(Future).where(Future.op == "forward_backward", Future.state == "done")).all()
        cursors = set(s.scalars(select(TrainingModel.next_seq)))
    assert len(done) == procs_n * threads_n * rounds
    assert cursors == {rounds + 1}


def test_live_submits_check_the_model_in_their_transaction(store):
    from ember.store.repo import NotLive

    session, mid, create = _model(store)
    kw = dict(owner="o", base_model="b", op="optim_step", payload=b"", model_id=mid, live=True)
    with pytest.raises(NotLive) as e:
        store.submit(**{**kw, "owner": "mallory"}, seq_id=1)
    assert e.value.kind == "missing"
    with pytest.raises(NotLive) as e:
        store.submit(**{**kw, "model_id": "nope:train:0"}, seq_id=1)
    assert e.value.kind == "missing"
    first = store.submit(**kw, seq_id=1)  # a model being created takes requests
    assert store.submit(**kw, seq_id=1) == first
    store.finish([(create, b"", "no room", "user")], model_status={mid: ("failed", "no room")})
    with pytest.raises(NotLive) as e:
        store.submit(**kw, seq_id=2)
    assert e.value.kind == "failed" and "could not be created" in str(e.value)
    _, other, _ = _model(store, session=session, seq=1)
    store.end_session(session, "finished", "done")
    with pytest.raises(NotLive) as e:
        store.submit(**{**kw, "model_id": other}, seq_id=1)
    assert e.value.kind == "gone" and "finished" in str(e.value)


def test_take_plans_and_claims_in_one_transaction_and_finish_claims_the_next_op(store):
    _, mid, create = _model(store)
    store.finish([(create, b"", None, None)], advance={mid: 1}, model_status={mid: ("active", None)})
    fb = store.submit(owner="o", base_model="b", op="forward_backward", payload=b"f", model_id=mid, seq_id=1)
    opt = store.submit(owner="o", base_model="b", op="optim_step", payload=b"o", model_id=mid, seq_id=2)
    seen = []

    def choose(pending, cursors):
        seen.append(([p.id for p in pending], cursors[mid].next_seq))
        return "plan", [fb]

    assert store.take("b", choose) == ("plan", {fb: b"f"})
    assert seen == [([fb, opt], 1)] and [p.id for p in store.pending("b")] == [opt]
    assert store.take("other", choose) == (None, {})
    (claimed, payload), = store.finish([(fb, b"r", None, None)], advance={mid: 2}, claim_next=True)
    assert (claimed.id, claimed.op, claimed.seq_id, payload) == (opt, "optim_step", 2, b"o")
    assert store.pending("b") == [] and store.get_future(fb, "o").state == "done"
    # not next in order, or a forward_backward: nothing is claimed
    store.submit(owner="o", base_model="b", op="optim_step", payload=b"", model_id=mid, seq_id=4)
    assert store.finish([(opt, b"", None, None)], advance={mid: 3}, claim_next=True) == []


def test_copied_checkpoints_share_files_and_copies_are_idempotent(store):
    _, mid, _ = _model(store)
    p = "tinker://m/weights/n"
    f1 = store.submit(owner="o", base_model="b", op="save_weights", payload=b"", model_id=mid, seq_id=1,
                      checkpoint=_ckpt(p))
    with pytest.raises(KeyError):  # not ready yet
        store.copy_checkpoint(p, "o", "c1:train:0", "c1", None)
    store.finish([(f1, b"", None, None)], checkpoints={p: ("ready", 123)})
    copy = store.copy_checkpoint(p, "o", "c1:train:0", "c1", None)
    assert copy.tinker_path == "tinker://c1:train:0/weights/n" and copy.uri == "/x" and copy.size_bytes == 123
    run = store.get_model("c1:train:0", "o")
    assert run.status == "unloaded" and run.user_metadata == {"copied_from": p}
    assert store.copy_checkpoint(p, "o", "c1:train:0", "c1", None).tinker_path == copy.tinker_path  # a retry
    with pytest.raises(KeyError):  # another owner, unpublished
        store.copy_checkpoint(p, "x", "c2:train:0", "c2", None)
    with pytest.raises(Conflict, match="training run"):  # that run id holds something else
        store.copy_checkpoint(p, "o", mid, "s", None)
    # deleting the source leaves the files referenced by the copy; deleting the copy releases them
    assert store.delete_checkpoint(p, "o") is not None and store.uri_referenced("/x")
    assert store.delete_checkpoint(copy.tinker_path, "o") is not None and not store.uri_referenced("/x")
