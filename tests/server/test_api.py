"""The API process without an engine (results are written into the store by hand, as an engine
would): auth and per-key isolation, status codes and JSON details for bad input, idempotent
submits, long-polling, sessions (heartbeat, finish, timeout -> 410), metrics, and no torch import."""

import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import zstandard
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from ember.server.app import create_app
from ember.server.config import ServedModel, ServerConfig
from ember.store import Store
from ember.store.payload import encode
from tests.store.backend import fresh_database

BASE = "tiny"


@contextmanager
def api_env(tmp_path, **config):
    """A TestClient of the API on a fresh database (keys for alice and bob) and a folder model;
    ``config``: ServerConfig fields over the tests' defaults."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 100,
                                                       "max_position_embeddings": 16}))
    with fresh_database(tmp_path) as url:
        store = Store.open(url)
        keys = [store.create_api_key(n)[1] for n in ("alice", "bob")]
        config = ServerConfig(**{"models": {BASE: ServedModel.from_folder(BASE, model_dir)}, "database_url": url,
                                 "storage": str(tmp_path / "ckpt"), "long_poll_s": 0.3, "max_body_bytes": 200_000,
                                 "session_timeout_s": 60.0, "reaper_interval_s": 0.2, **config})
        with TestClient(create_app(config, store)) as client:
            yield client, store, keys
        store.close()


@pytest.fixture
def env(tmp_path):
    with api_env(tmp_path) as e:
        yield e


def h(key):
    return {"X-API-Key": key}


def _session(client, key):
    r = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": {"k": "v"}, "type": "create_session"},
                    headers=h(key))
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def _model(client, store, key, session, seq=0):
    r = client.post("/api/v1/create_model", headers=h(key), json={
        "session_id": session, "model_seq_id": seq, "base_model": BASE,
        "lora_config": {"rank": 4, "seed": 0, "train_unembed": True, "train_mlp": True, "train_attn": True},
        "optimizer_config": {"type": "adamw"}, "type": "create_model"})
    assert r.status_code == 200, r.text
    model_id = r.json()["model_id"]
    store.finish([(r.json()["request_id"], encode({}), None, None)], advance={model_id: 1},
                 model_status={model_id: ("active", None)})
    return model_id


def _fwdbwd_body(model_id, seq, tokens=(1, 2, 3), targets=(2, 3, 4), loss_fn="cross_entropy"):
    d = types.Datum(model_input=types.ModelInput.from_ints(list(tokens)), loss_fn_inputs={"target_tokens": list(targets)})
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn=loss_fn),
                                       model_id=model_id, seq_id=seq)
    return forward_backward_request_to_proto(req).SerializeToString()


def _post_proto(client, key, body, **headers):
    return client.post("/api/v1/forward_backward", content=body,
                       headers={**h(key), "Content-Type": "application/x-protobuf", **headers})


def test_auth_is_required_and_keys_are_isolated(env):
    client, store, (alice, bob) = env
    r = client.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})
    assert r.status_code == 401 and "X-API-Key" in r.json()["detail"]
    assert client.post("/api/v1/client/config", json={}, headers=h("tml-nope")).status_code == 401
    assert client.post("/api/v1/client/config", json={}, headers=h(alice)).json() == {}
    session = _session(client, alice)
    model_id = _model(client, store, alice, session)
    rid = _post_proto(client, alice, _fwdbwd_body(model_id, 1)).json()["request_id"]
    # Bob sees none of Alice's objects: every lookup is a 404 with a detail.
    for method, path, body in [
        ("post", "/api/v1/get_info", {"model_id": model_id}),
        ("post", "/api/v1/retrieve_future", {"request_id": rid}),
        ("post", "/api/v1/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {}}),
        ("get", f"/api/v1/training_runs/{model_id}", None),
        ("get", f"/api/v1/training_runs/{model_id}/checkpoints", None),
        ("get", f"/api/v1/sessions/{session}", None),
        ("post", "/api/v1/session_heartbeat", {"session_id": session}),
        ("post", f"/api/v1/sessions/{session}/finish", {}),
        ("delete", f"/api/v1/training_runs/{model_id}/checkpoints/weights/x", None),
    ]:
        r = client.request(method.upper(), path, json=body, headers=h(bob))
        assert r.status_code == 404 and r.json()["detail"], (path, r.status_code, r.text)
    assert _post_proto(client, bob, _fwdbwd_body(model_id, 2)).status_code == 404
    assert client.get("/api/v1/training_runs", headers=h(bob)).json()["training_runs"] == []
    assert client.get("/api/v1/sessions", headers=h(bob)).json()["sessions"] == []
    assert [t["training_run_id"] for t in client.get("/api/v1/training_runs", headers=h(alice)).json()["training_runs"]] == [model_id]


def test_bad_input_gets_a_4xx_with_a_json_detail_never_409(env):
    client, store, (alice, _) = env
    session = _session(client, alice)
    model_id = _model(client, store, alice, session)
    cases = [
        (client.post("/api/v1/create_session", content=b"{not json", headers={**h(alice), "Content-Type": "application/json"}), 400),
        (client.post("/api/v1/create_model", json={"session_id": session}, headers=h(alice)), 400),
        (client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 5, "base_model": "Qwen/nope"}, headers=h(alice)), 400),
        (client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 5, "base_model": BASE,
                                                   "lora_config": {"rank": 1000}}, headers=h(alice)), 400),
        (client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 5, "base_model": BASE,
                                                   "optimizer_config": {"type": "dimuon"}}, headers=h(alice)), 400),
        (client.post("/api/v1/create_model", json={"session_id": "nope", "model_seq_id": 5, "base_model": BASE}, headers=h(alice)), 404),
        (_post_proto(client, alice, b"\x0a\xff\xff garbage"), 400),
        (client.post("/api/v1/forward_backward", json={"model_id": model_id}, headers=h(alice)), 400),
        (_post_proto(client, alice, _fwdbwd_body(model_id, 1, loss_fn="nope")), 400),
        (_post_proto(client, alice, _fwdbwd_body(model_id, 2, tokens=(1, 2, 300))), 400),
        (_post_proto(client, alice, _fwdbwd_body(model_id, 3, targets=(1, 2))), 400),
        (_post_proto(client, alice, _fwdbwd_body("s:train:9", 1)), 404),
        (_post_proto(client, alice, b"x" * 300_000), 413),
        (_post_proto(client, alice, zstandard.ZstdCompressor().compress(b"\0" * 1_000_000), **{"Content-Encoding": "zstd"}), 413),
        # too large to read, plain or once decompressed: the request the body starts with takes its seq_id
        (_post_proto(client, alice, _fwdbwd_body(model_id, 5, tokens=(1,) * 60_000, targets=(2,) * 60_000)), 413),
        (_post_proto(client, alice, zstandard.ZstdCompressor().compress(
            _fwdbwd_body(model_id, 6, tokens=(1,) * 60_000, targets=(2,) * 60_000)), **{"Content-Encoding": "zstd"}), 413),
        (client.post("/api/v1/save_weights", json={"model_id": model_id, "path": "../../etc", "seq_id": 4}, headers=h(alice)), 400),
        (client.post("/api/v1/save_weights", json={"model_id": model_id, "path": "ok", "seq_id": 4, "ttl_seconds": 5}, headers=h(alice)), 400),
        (client.post("/api/v1/load_weights", json={"session_id": session, "model_seq_id": 3, "path": "file:///etc/passwd"}, headers=h(alice)), 400),
        (client.post("/api/v1/load_weights", json={"session_id": session, "model_seq_id": 3, "path": f"tinker://{model_id}/weights/missing"}, headers=h(alice)), 404),
        (client.post("/api/v1/weights_info", json={"tinker_path": "tinker://a/b"}, headers=h(alice)), 400),
        (client.post("/api/v1/retrieve_future", json={"request_id": "nope"}, headers=h(alice)), 404),
        (client.post("/api/v1/save_weights_external", json={"model_id": model_id, "path": "e", "seq_id": 4,
                                                            "age_encryption_recipients": ["not-a-key"]}, headers=h(alice)), 400),
    ]
    for i, (r, status) in enumerate(cases):
        assert r.status_code == status, (i, r.status_code, r.text)
        assert r.json()["detail"], i
    # Rejected requests still took their seq_ids (forward_backward 1-3, 5-6, save_weights 4): the
    # engine fails them in order, so the model's later requests are not held up.
    rows = [p for p in store.pending(BASE) if p.model_id == model_id]
    assert sorted((p.op, p.seq_id) for p in rows) == [("rejected", i) for i in range(1, 7)]


def test_submits_are_idempotent_and_name_clashes_are_400(env):
    client, store, (alice, _) = env
    model_id = _model(client, store, alice, _session(client, alice))
    first = _post_proto(client, alice, _fwdbwd_body(model_id, 1)).json()
    assert _post_proto(client, alice, _fwdbwd_body(model_id, 1)).json() == first
    save = {"model_id": model_id, "path": "ck", "seq_id": 2, "type": "save_weights"}
    rid = client.post("/api/v1/save_weights", json=save, headers=h(alice)).json()["request_id"]
    store.finish([(rid, encode({"size_bytes": 10}), None, None)], checkpoints={f"tinker://{model_id}/weights/ck": ("ready", 10)})
    r = client.post("/api/v1/save_weights", json={**save, "seq_id": 3}, headers=h(alice))
    assert r.status_code == 400 and "already exists" in r.json()["detail"]


def test_retrieve_future_long_polls_then_answers(env):
    client, store, (alice, _) = env
    session = _session(client, alice)
    model_id = _model(client, store, alice, session)
    rid = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}},
                      headers=h(alice)).json()["request_id"]
    t0 = time.monotonic()
    r = client.post("/api/v1/retrieve_future", json={"request_id": rid, "allow_metadata_only": True}, headers=h(alice))
    assert r.json() == {"type": "try_again", "request_id": rid, "queue_state": "active"}
    assert 0.25 < time.monotonic() - t0 < 2.0
    threading.Timer(0.1, store.finish, args=([(rid, encode({"metrics": {"grad_norm": 1.5}}), None, None)],)).start()
    r = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=h(alice))
    assert r.json() == {"type": "optim_step", "metrics": {"grad_norm": 1.5}}
    # the fixture's sessions expire after 1 s without a heartbeat (for the 410 test): keep this one alive
    client.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=h(alice))
    fb = _post_proto(client, alice, _fwdbwd_body(model_id, 2)).json()["request_id"]
    store.finish([(fb, None, "boom: the pass failed", "server")])
    assert client.post("/api/v1/retrieve_future", json={"request_id": fb}, headers=h(alice)).json() == {
        "error": "boom: the pass failed", "category": "server"}


def test_finished_and_idle_sessions_answer_410(env):
    client, store, (alice, _) = env
    session = _session(client, alice)
    model_id = _model(client, store, alice, session)
    assert client.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=h(alice)).status_code == 200
    assert client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}, headers=h(alice)).status_code == 200
    r = client.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=h(alice))
    assert r.status_code == 410 and "finished" in r.json()["detail"]
    r = _post_proto(client, alice, _fwdbwd_body(model_id, 1))
    assert r.status_code == 410 and r.json()["detail"]
    assert store.get_model(model_id, store.owner_of_key(alice)).status == "unloaded"
    client.app.state.ember.config.session_timeout_s = 1.0  # the reaper (every 0.2 s) reads it each pass
    idle = _session(client, alice)
    time.sleep(1.8)
    r = client.post("/api/v1/session_heartbeat", json={"session_id": idle}, headers=h(alice))
    assert r.status_code == 410 and "expired" in r.json()["detail"]


def test_metrics_and_health(env):
    client, store, (alice, _) = env
    model_id = _model(client, store, alice, _session(client, alice))
    _post_proto(client, alice, _fwdbwd_body(model_id, 1))
    text = client.get("/metrics").text
    assert 'ember_futures{base_model="tiny",state="pending"} 1.0' in text
    assert 'ember_queue_depth{base_model="tiny"} 1.0' in text and "ember_http_requests_total" in text
    assert client.get("/api/v1/healthz").json() == {"status": "ok", "engines": {"tiny": "absent"}}


def test_the_api_process_never_imports_torch():
    code = ("import sys, ember.server.app, ember.server.serve, ember.cli\n"
            "from ember.server.routes import futures, rest, sampling, service, training\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_numpy_payloads_reach_the_store_intact(env):
    client, store, (alice, _) = env
    model_id = _model(client, store, alice, _session(client, alice))
    rid = _post_proto(client, alice, _fwdbwd_body(model_id, 1, tokens=(5, 6, 7), targets=(6, 7, 8))).json()["request_id"]
    from ember.store.payload import decode

    payload = decode(store.claim([rid])[rid])
    np.testing.assert_array_equal(payload["datums"][0]["tokens"], [5, 6, 7])
    assert payload["loss_fn"] == "cross_entropy" and payload["forward_only"] is False


def test_hot_routes_check_a_cached_model_in_the_submit_transaction(env):
    """forward_backward and optim_step read a model once, then check it inside their submit: an
    ended session still answers 410 (never a rejection record), a bad request on a live model 400."""
    client, store, (alice, bob) = env
    session = _session(client, alice)
    model_id = _model(client, store, alice, session)
    assert _post_proto(client, alice, _fwdbwd_body(model_id, 1)).status_code == 200  # now cached
    r = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {"type": "sgd"}},
                    headers=h(alice))
    assert r.status_code == 400
    assert _post_proto(client, bob, _fwdbwd_body(model_id, 3)).status_code == 404  # another owner's
    assert client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}},
                       headers=h(alice)).status_code == 200
    r = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3, "adam_params": {}}, headers=h(alice))
    assert r.status_code == 410 and "finished" in r.json()["detail"]
    r = _post_proto(client, alice, _fwdbwd_body(model_id, 3, loss_fn="nope"))  # invalid AND ended: 410 first
    assert r.status_code == 410
    rows = [(p.op, p.seq_id) for p in store.pending(BASE) if p.model_id == model_id]
    assert ("forward_backward", 1) in rows and ("rejected", 2) in rows and not any(s == 3 for _, s in rows)


def test_retrieve_of_a_hot_submit_answers_from_the_engines_datagram_without_a_read(env):
    from ember.doorbell import RESULT_KEY_SETTING, ring_ids, ring_results

    client, store, (alice, bob) = env
    model_id = _model(client, store, alice, _session(client, alice))
    st = client.app.state.ember
    key = bytes.fromhex(store.setting(RESULT_KEY_SETTING, lambda: "00"))
    rid = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}},
                      headers=h(alice)).json()["request_id"]
    result = encode({"metrics": {"grad_norm": 2.5}})
    store.finish([(rid, result, None, None)], advance={model_id: 2})
    ring_results(st.waiter.port, key, [(rid, result, None, None)])
    deadline = time.monotonic() + 2
    while not st.waiter.recent(rid) and time.monotonic() < deadline:
        time.sleep(0.01)
    reads = []
    original = store.get_future
    store.get_future = lambda *a: reads.append(a) or original(*a)
    try:
        r = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=h(alice))
        assert r.json() == {"type": "optim_step", "metrics": {"grad_norm": 2.5}} and reads == []
        assert client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=h(bob)).status_code == 404
        # finished with a result too large for a datagram (ids only): read from the store
        rid2 = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {}},
                           headers=h(alice)).json()["request_id"]
        store.finish([(rid2, None, "boom", "user")], advance={model_id: 3})
        ring_ids(st.waiter.port, [rid2])
        deadline = time.monotonic() + 2
        while not st.waiter.recent(rid2) and time.monotonic() < deadline:
            time.sleep(0.01)
        reads.clear()
        r = client.post("/api/v1/retrieve_future", json={"request_id": rid2}, headers=h(alice))
        assert r.json() == {"error": "boom", "category": "user"} and len(reads) == 1
    finally:
        store.get_future = original


def test_cancel_future_fails_a_pending_sample_only(env):
    client, store, (alice, bob) = env
    session = _session(client, alice)
    r = client.post("/api/v1/create_sampling_session", headers=h(alice),
                    json={"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE})
    assert r.status_code == 200, r.text
    sampler = r.json()["sampling_session_id"]
    r = client.post("/api/v1/asample", headers=h(alice), json={
        "sampling_session_id": sampler, "seq_id": 1, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4}})
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    assert client.post("/api/v1/client/dynamic_config", json={}, headers=h(alice)).json()["sample_cancel_enabled"]
    assert client.post("/api/v1/cancel_future", json={"request_id": rid}, headers=h(bob)).status_code == 404
    assert client.post("/api/v1/cancel_future", json={"request_id": rid}, headers=h(alice)).status_code == 200
    assert client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=h(alice)).json() == {
        "error": "cancelled by the client", "category": "user"}
    assert client.post("/api/v1/cancel_future", json={"request_id": rid}, headers=h(alice)).status_code == 200
    assert store.pending(BASE) == []  # the engine never sees it
    # not a sampling request: nothing happens
    model_id = _model(client, store, alice, session)
    opt = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}},
                      headers=h(alice)).json()["request_id"]
    assert client.post("/api/v1/cancel_future", json={"request_id": opt}, headers=h(alice)).status_code == 200
    assert [f.id for f in store.pending(BASE)] == [opt]
