"""The console's pages and JSON (``ember.server.routes.console``) without an engine: metric points
as the engine records them with ``Store.finish(metrics=…)`` (steps counted from ``optim_step``
points, paged by ``after_seq``), the overview, and one key never seeing another's runs."""

import pytest

from ember.server.routes import console
from ember.store.payload import encode
from tests.server.test_api import _model, _session, api_env, h


@pytest.fixture
def env(tmp_path):
    with api_env(tmp_path) as e:
        yield e


def test_pages_are_served(env):
    client, _, _ = env
    r = client.get("/console")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"] and "Ember console" in r.text
    assert "javascript" in client.get("/console/console.js").headers["content-type"]
    assert "text/css" in client.get("/console/console.css").headers["content-type"]
    r = client.get("/console/../app.py")
    assert r.status_code == 404
    r = client.get("/console/secrets.txt")
    assert r.status_code == 404 and "console page" in r.json()["detail"]


def _points(store, model_id, ops):
    """Finish one request per op (seq 1, 2, …) with a metric each, as the engine does."""
    for seq, op in enumerate(ops, start=1):
        store.finish([], advance={model_id: seq + 1}, metrics=[(model_id, seq, op, {"loss:sum": 10.0 - seq})])


def test_metric_points_count_steps_and_page(env, monkeypatch):
    client, store, (alice, bob) = env
    model = _model(client, store, alice, _session(client, alice))
    _points(store, model, ["forward_backward", "optim_step", "forward_backward", "forward", "optim_step",
                           "forward_backward"])
    r = client.get(f"/console/api/training_runs/{model}/metrics", headers=h(alice))
    assert r.status_code == 200, r.text
    points = r.json()["points"]
    assert [(p["seq_id"], p["op"], p["step"]) for p in points] == [
        (1, "forward_backward", 0), (2, "optim_step", 0), (3, "forward_backward", 1), (4, "forward", 1),
        (5, "optim_step", 1), (6, "forward_backward", 2)]
    assert points[0]["metrics"] == {"loss:sum": 9.0} and points[0]["time"].endswith("+00:00")
    # a later page starts at the right step
    later = client.get(f"/console/api/training_runs/{model}/metrics?after_seq=4", headers=h(alice)).json()
    assert [(p["seq_id"], p["step"]) for p in later["points"]] == [(5, 1), (6, 2)] and not later["more"]
    monkeypatch.setattr(console, "MAX_POINTS", 2)
    first = client.get(f"/console/api/training_runs/{model}/metrics", headers=h(alice)).json()
    assert len(first["points"]) == 2 and first["more"]
    # another key: 404, as for a run that does not exist; a bad cursor: 400
    assert client.get(f"/console/api/training_runs/{model}/metrics", headers=h(bob)).status_code == 404
    assert client.get("/console/api/training_runs/nope:train:0/metrics", headers=h(alice)).status_code == 404
    r = client.get(f"/console/api/training_runs/{model}/metrics?after_seq=-1", headers=h(alice))
    assert r.status_code == 400 and "after_seq" in r.text
    assert client.get(f"/console/api/training_runs/{model}/metrics").status_code == 401


def test_overview_shows_only_the_keys_own_work(env):
    client, store, (alice, bob) = env
    session = _session(client, alice)
    model = _model(client, store, alice, session)
    r = client.post("/api/v1/create_sampling_session", headers=h(alice), json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny", "type": "create_sampling_session"})
    assert r.status_code == 200, r.text
    store.register_engine("tiny", 4242)
    store.engine_progress("tiny", 3, 300, 1.5, memory_bytes=123 << 20)
    a = client.get("/console/api/overview", headers=h(alice)).json()
    assert [r["training_run_id"] for r in a["training_runs"]] == [model] and a["training_runs_total"] == 1
    assert [s["session_id"] for s in a["sessions"]] == [session] and a["sessions"][0]["status"] == "active"
    assert [s["session_id"] for s in a["samplers"]] == [session]
    engine = {e["base_model"]: e for e in a["engines"]}["tiny"]
    assert (engine["passes"], engine["tokens"], engine["memory_bytes"]) == (3, 300, 123 << 20)
    b = client.get("/console/api/overview", headers=h(bob)).json()
    assert b["training_runs"] == [] and b["sessions"] == [] and b["samplers"] == [] and b["queue"]["mine"] == {}
    assert b["owner"] != a["owner"]
    # a request of alice's waiting in the queue: hers, and the base model's count; not bob's
    r = client.post("/api/v1/optim_step", headers=h(alice), json={
        "model_id": model, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}, "type": "optim_step"})
    assert r.status_code == 200, r.text
    a = client.get("/console/api/overview", headers=h(alice)).json()
    assert a["queue"]["mine"] == {"pending": 1} and a["queue"]["by_base_model"]["tiny"]["pending"] >= 1
    assert client.get("/console/api/overview", headers=h(bob)).json()["queue"]["mine"] == {}
    store.finish([(r.json()["request_id"], encode({}), None, None)], advance={model: 2})


def test_checkpoint_files_need_the_owners_checkpoint(env):
    client, _, (alice, _) = env
    for path in ("tinker://nope:train:0/weights/x", "not-a-path"):
        r = client.get("/console/api/checkpoint_files", params={"path": path}, headers=h(alice))
        assert r.status_code in (400, 404) and r.json()["detail"], r.text
