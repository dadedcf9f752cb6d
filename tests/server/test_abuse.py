"""Isolation and abuse (issue 19, part 4): per-key quotas answer 429 with a body naming the limit
and never count a retry; checkpoint names and tinker:// paths cannot leave their folder; signed
download URLs expire and cannot be altered to reach another checkpoint or another key's trace;
keys are stored hashed."""

from __future__ import annotations

import hashlib
import time

import pytest

from ember.server.quotas import Quotas
from ember.storage.signing import _b64, _unb64, sign_token
from ember.store.payload import encode
from tests.server.test_api import _model, _session, api_env, h


@pytest.fixture
def small(tmp_path):
    quotas = Quotas(training_runs=2, samplers=2, checkpoint_bytes=1000, queued_requests=100)
    with api_env(tmp_path, quotas=quotas) as e:
        yield e


def _quota(r, what: str) -> str:
    assert r.status_code == 429, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert detail.startswith("quota exceeded") and what in detail, detail
    return detail


def test_training_run_quota_counts_active_runs_and_never_a_retry(small):
    client, store, (alice, bob) = small
    session = _session(client, alice)
    body = {"session_id": session, "base_model": "tiny", "lora_config": {"rank": 4}}
    for seq in (0, 1):
        assert client.post("/api/v1/create_model", json={**body, "model_seq_id": seq}, headers=h(alice)).status_code == 200
    r = client.post("/api/v1/create_model", json={**body, "model_seq_id": 2}, headers=h(alice))
    assert "training runs are active" in _quota(r, "--quota-training-runs") and r.headers["x-should-retry"] == "false"
    # a retry of an existing creation is answered as before
    assert client.post("/api/v1/create_model", json={**body, "model_seq_id": 1}, headers=h(alice)).status_code == 200
    # another key is not limited by alice's usage
    assert _model(client, store, bob, _session(client, bob))
    # finishing the session frees the runs
    client.post(f"/api/v1/sessions/{session}/finish", json={}, headers=h(alice))
    s2 = _session(client, alice)
    assert client.post("/api/v1/create_model", json={**body, "session_id": s2, "model_seq_id": 0},
                       headers=h(alice)).status_code == 200


def test_queued_request_quota_is_429_with_retry_after_and_keeps_the_seq_id_free(tmp_path):
    with api_env(tmp_path, quotas=Quotas(queued_requests=3)) as (client, store, (alice, bob)):
        _queued_quota(client, store, alice, bob)


def _queued_quota(client, store, alice, bob):
    model = _model(client, store, alice, _session(client, alice))
    time.sleep(1.1)  # the API's count of a key's queue may be up to 1 s old (it only ever overcounts)
    ok = [client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": s, "adam_params": {}},
                      headers=h(alice)) for s in (1, 2, 3)]
    assert all(r.status_code == 200 for r in ok), [r.text for r in ok]
    time.sleep(1.1)  # the queue length cache refreshes
    r = client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 4, "adam_params": {}}, headers=h(alice))
    _quota(r, "--quota-queued-requests")
    assert r.headers["retry-after"] == "1"
    # bob's queue is his own
    bob_model = _model(client, store, bob, _session(client, bob))
    assert client.post("/api/v1/optim_step", json={"model_id": bob_model, "seq_id": 1, "adam_params": {}},
                       headers=h(bob)).status_code == 200
    # once alice's requests finish, seq_id 4 (not recorded as rejected) is accepted
    store.finish([(x.json()["request_id"], encode({"metrics": {}}), None, None) for x in ok], advance={model: 4})
    time.sleep(1.1)
    r = client.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 4, "adam_params": {}}, headers=h(alice))
    assert r.status_code == 200, r.text


def test_sampler_and_checkpoint_byte_quotas(small):
    client, store, (alice, _) = small
    session = _session(client, alice)
    for seq in (0, 1):
        assert client.post("/api/v1/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": seq,
                                                                    "base_model": "tiny"}, headers=h(alice)).status_code == 200
    r = client.post("/api/v1/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 2,
                                                             "base_model": "tiny"}, headers=h(alice))
    _quota(r, "--quota-samplers")
    model = _model(client, store, alice, session)
    r = client.post("/api/v1/save_weights", json={"model_id": model, "path": "a", "seq_id": 1}, headers=h(alice))
    assert r.status_code == 200
    path = f"tinker://{model}/weights/a"
    store.finish([(r.json()["request_id"], encode({"size_bytes": 5000}), None, None)], advance={model: 2},
                 checkpoints={path: ("ready", 5000)})
    r = client.post("/api/v1/save_weights", json={"model_id": model, "path": "b", "seq_id": 2}, headers=h(alice))
    assert "GiB" in _quota(r, "--quota-checkpoint-gb")
    # the refused save did not take its seq_id: after a delete, the same seq_id saves
    assert client.delete(f"/api/v1/training_runs/{model}/checkpoints/weights/a", headers=h(alice)).status_code == 200
    r = client.post("/api/v1/save_weights", json={"model_id": model, "path": "b", "seq_id": 2}, headers=h(alice))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", ["../x", "..", "a/../../b", "/etc/passwd", ".hidden", "a\\b", "a/b", "x" * 201, ""])
def test_checkpoint_names_and_paths_cannot_leave_their_folder(tmp_path, name):
    with api_env(tmp_path) as (client, store, (alice, _)):
        model = _model(client, store, alice, _session(client, alice))
        r = client.post("/api/v1/save_weights", json={"model_id": model, "path": name, "seq_id": 1}, headers=h(alice))
        assert r.status_code == 400 and "checkpoint name" in r.json()["detail"], r.text
        r = client.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{model}/weights/{name}"}, headers=h(alice))
        assert r.status_code in (400, 404), r.text
        r = client.post("/api/v1/load_weights", json={"path": f"tinker://{model}/weights/{name}", "model_id": model,
                                                      "seq_id": 2}, headers=h(alice))
        assert r.status_code in (400, 404), r.text
        assert not any(p.name == "passwd" for p in tmp_path.rglob("*"))


def test_signed_download_urls_expire_and_cannot_be_altered(tmp_path):
    with api_env(tmp_path) as (client, store, (alice, bob)):
        secret = store.setting("url_signing_secret", lambda: "unused")
        token = sign_token(secret, {"p": "tinker://x:train:0/external_weights/e", "f": "adapter.safetensors"},
                           time.time() - 1)
        r = client.get(f"/api/v1/download/{token}")
        assert r.status_code == 403 and "expired" in r.json()["detail"]
        # a valid token whose claims are edited to name another checkpoint or another key's trace
        live = sign_token(secret, {"s": "alice-session", "o": "alice-key"}, time.time() + 60)
        body, mac = live.split(".")
        forged = _b64(_unb64(body).replace(b"alice-key", b"bob-key!!")) + "." + mac
        r = client.get(f"/api/v1/download/{forged}")
        assert r.status_code == 403 and "signature" in r.json()["detail"]
        # without the server's secret a token cannot be made at all
        r = client.get(f"/api/v1/download/{sign_token('guess', {'s': 'x', 'o': 'y'}, time.time() + 60)}")
        assert r.status_code == 403
        # the URL endpoint itself only serves the owner's checkpoints
        model = _model(client, store, alice, _session(client, alice))
        r = client.get(f"/api/v1/training_runs/{model}/checkpoints/external_weights/e/external_weights_urls",
                       headers=h(bob))
        assert r.status_code == 404


def test_keys_are_stored_hashed(tmp_path):
    with api_env(tmp_path) as (client, store, (alice, _)):
        rows = store.list_api_keys()
        assert rows and all(len(k.key_hash) == 64 for k in rows)
        assert hashlib.sha256(alice.encode()).hexdigest() in {k.key_hash for k in rows}
        with store.read() as s:
            dump = " ".join(str(v) for row in s.execute(__import__("sqlalchemy").text("select * from api_keys"))
                            for v in row)
        assert alice not in dump
        assert client.app.state.ember.auth._cache == {} or all(
            isinstance(k, bytes) for k in client.app.state.ember.auth._cache)
