"""``POST /api/v1/sessions/search`` and ``PUT /api/v1/sessions/{id}/project``, with the SDK's own
request and response types: filters (session id or display-name words, user_metadata, status,
project), newest-first keyset pages, checkpoint counts, and per-key isolation. And
``GET /api/v1/sessions/{id}/trace_export``: a signed URL of the session's timeline."""

import json
from datetime import timedelta

import pytest
from tinker import types

from ember.store.models import Checkpoint
from ember.store.payload import encode
from ember.store.repo import utcnow
from tests.server.test_api import _model, env, h  # noqa: F401 - env is a fixture

BASE = "tiny"


def _create(client, key, display_name=None, project_id=None, **meta):
    body = {"tags": [], "user_metadata": meta, "type": "create_session"}
    if display_name:
        body["display_name"] = display_name
    if project_id:
        body["project_id"] = project_id
    r = client.post("/api/v1/create_session", json=body, headers=h(key))
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def _search(client, key, **fields) -> types.SessionSearchResponse:
    req = types.SessionSearchRequest(**fields)
    r = client.post("/api/v1/sessions/search", json=req.model_dump(mode="json", exclude_none=True), headers=h(key))
    assert r.status_code == 200, r.text
    return types.SessionSearchResponse.model_validate(r.json())


def _ids(page: types.SessionSearchResponse) -> list[str]:
    return [s.session_id for s in page.sessions]


@pytest.fixture
def sessions(env):  # noqa: F811 - the fixture imported above
    client, store, (alice, bob) = env
    ids = [
        _create(client, alice, "Nightly RL run", run="a"),
        _create(client, alice, "nightly sft", project_id="team-x", run="b"),
        _create(client, alice, "debug", run="a", lr=0.1),
        _create(client, alice),
        _create(client, alice, "Another nightly RUN"),
    ]
    bob_session = _create(client, bob, "Nightly RL run", run="a")
    # Distinct creation times, oldest first (the API stamps them within the same millisecond).
    from ember.store.models import Session

    with store.write() as s:
        for i, sid in enumerate([*ids, bob_session]):
            s.get(Session, sid).created_at = utcnow() - timedelta(minutes=60 - i)
    return client, store, alice, bob, ids, bob_session


def test_search_filters_newest_first_and_isolated_by_key(sessions):
    client, _, alice, bob, ids, bob_session = sessions
    page = _search(client, alice)
    assert _ids(page) == ids[::-1] and page.next_cursor is None  # newest first, Bob's not among them
    first = page.sessions[-1]
    assert first.display_name == "Nightly RL run" and first.user_metadata == {"run": "a"}
    assert first.project_id == "default" and first.checkpoints_count == 0 and first.owner
    assert isinstance(first.status, types.SessionActive)
    assert _ids(_search(client, bob)) == [bob_session]
    # Display-name words, case-insensitively, each anywhere in the name; or the session id.
    assert _ids(_search(client, alice, display_name="NIGHTLY run")) == [ids[4], ids[0]]
    assert _ids(_search(client, alice, display_name="sft nightly")) == [ids[1]]
    assert _ids(_search(client, alice, display_name="sft", session_id=ids[3])) == [ids[3], ids[1]]
    assert _ids(_search(client, alice, session_id=bob_session)) == []  # another key's session
    # user_metadata: every pair must hold (values compared as the strings the SDK reports).
    assert _ids(_search(client, alice, user_metadata={"run": "a"})) == [ids[2], ids[0]]
    assert _ids(_search(client, alice, user_metadata={"run": "a", "lr": "0.1"})) == [ids[2]]
    assert _ids(_search(client, alice, project_ids=["team-x"])) == [ids[1]]
    # Owners: a key sees its own sessions only, whatever the search names.
    assert _ids(_search(client, alice, owner=types.AccessibleSearchOwner())) == ids[::-1]
    assert _ids(_search(client, alice, owner=types.UserSearchOwner(owner_urns=["someone-else"]))) == []
    me = first.owner
    assert _ids(_search(client, alice, owner=types.UserSearchOwner(owner_urns=[me]), display_name="debug")) == [ids[2]]


def test_search_pages_with_the_cursor(sessions):
    client, _, alice, _, ids, _ = sessions
    seen, cursor, pages = [], None, 0
    while True:
        page = _search(client, alice, limit=2, cursor=cursor)
        pages += 1
        seen += _ids(page)
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == ids[::-1] and pages == 3


def test_search_by_status_project_assignment_and_checkpoint_counts(sessions):
    client, store, alice, bob, ids, _ = sessions
    r = client.post(f"/api/v1/sessions/{ids[2]}/finish", json={"reason": {"type": "errored"}}, headers=h(alice))
    assert r.status_code == 200, r.text
    client.post(f"/api/v1/sessions/{ids[3]}/finish", json={"reason": {"type": "success"}}, headers=h(alice))
    errored = _search(client, alice, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])])
    assert _ids(errored) == [ids[2]]
    status = errored.sessions[0].status
    assert isinstance(status, types.ClientSessionFinished) and status.reason.type == "errored"
    finished = [types.ClientFinishedSessionStatusQuery()]
    assert _ids(_search(client, alice, statuses=finished)) == [ids[3], ids[2]]
    active = _search(client, alice, statuses=[types.ActiveSessionStatusQuery()])
    assert _ids(active) == [ids[4], ids[1], ids[0]]
    assert _ids(_search(client, alice, statuses=[types.FailedSessionStatusQuery()])) == []  # Ember fails no session

    # Projects: the owner moves a session; another key cannot (404).
    r = client.put(f"/api/v1/sessions/{ids[0]}/project", json={"project_id": "team-x"}, headers=h(alice))
    assert r.status_code == 200, r.text
    assert _ids(_search(client, alice, project_ids=["team-x"])) == [ids[1], ids[0]]
    r = client.put(f"/api/v1/sessions/{ids[0]}/project", json={"project_id": "mine"}, headers=h(bob))
    assert r.status_code == 404 and r.json()["detail"]
    r = client.put(f"/api/v1/sessions/{ids[0]}/project", json={"project_id": ""}, headers=h(alice))
    assert r.status_code == 400 and r.json()["detail"]

    # Checkpoints of the session's training runs: ready ones are counted with their bytes.
    r = client.post("/api/v1/create_model", headers=h(alice), json={
        "session_id": ids[0], "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4},
        "type": "create_model"})
    assert r.status_code == 200, r.text
    model_id = r.json()["model_id"]
    with store.write() as s:
        for name, state, size in (("a", "ready", 100), ("b", "ready", 23), ("c", "pending", None)):
            s.add(Checkpoint(tinker_path=f"tinker://{model_id}/weights/{name}", owner=store.owner_of_key(alice) or "",
                             model_id=model_id, kind="training", name=name, uri=f"file:///x/{name}", state=state,
                             base_model=BASE, lora={"rank": 4}, optimizer_config={}, user_metadata=None,
                             created_at=utcnow(), expires_at=None, encrypted=False, public=False, size_bytes=size))
    (hit,) = _search(client, alice, session_id=ids[0]).sessions
    assert (hit.checkpoints_count, hit.checkpoint_storage_bytes) == (2, 123)


@pytest.mark.parametrize("body", [
    {"limit": 0}, {"limit": 201}, {"statuses": []}, {"display_name": ""}, {"owner": {"type": "everyone"}},
    {"cursor": {"last_created_at": "2026-01-01T00:00:00", "last_session_id": "x"}},  # naive time
    {"statuses": [{"type": "client_finished", "reasons": ["bored"]}]},
])
def test_bad_searches_get_400_with_a_detail(env, body):  # noqa: F811
    client, _, (alice, _) = env
    r = client.post("/api/v1/sessions/search", json=body, headers=h(alice))
    assert r.status_code == 400 and r.json()["detail"].startswith("invalid request"), r.text


def test_trace_export_is_a_signed_url_of_the_sessions_timeline(env):  # noqa: F811
    client, store, (alice, bob) = env
    session = _create(client, alice, "traced")
    model_id = _model(client, store, alice, session)
    r = client.post("/api/v1/optim_step", headers=h(alice), json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
    optim = r.json()["request_id"]
    store.claim([optim])
    store.finish([(optim, encode({"metrics": {}}), None, None)], advance={model_id: 2})
    bad = client.post("/api/v1/optim_step", headers=h(alice), json={"model_id": model_id, "seq_id": 2,
                                                                    "adam_params": {"type": "sgd"}})
    assert bad.status_code == 400  # recorded as a "rejected" request, which the engine fails in order
    queued = client.post("/api/v1/optim_step", headers=h(alice), json={"model_id": model_id, "seq_id": 3,
                                                                       "adam_params": {}}).json()["request_id"]

    r = client.get(f"/api/v1/sessions/{session}/trace_export", headers=h(alice))
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text
    url = r.json()["url"]
    assert client.get(f"/api/v1/sessions/{session}/trace_export", headers=h(bob)).status_code == 404
    trace = client.get(url)  # no API key: the URL authorises itself
    assert trace.status_code == 200 and trace.headers["content-type"] == "application/json", trace.text
    events = json.loads(trace.content)["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    tid = tracks[f"training run {model_id}"]
    slices = {e["args"]["request_id"]: e for e in events if e["ph"] == "X" and e.get("cat") == "request"}
    created = store.get_session(session, store.owner_of_key(alice) or "").created_at
    row = store.get_future(optim, store.owner_of_key(alice) or "")
    assert slices[optim]["tid"] == tid and slices[optim]["name"] == "optim_step"
    assert slices[optim]["ts"] == pytest.approx((row.started_at - created).total_seconds() * 1e6)
    assert slices[optim]["dur"] == pytest.approx((row.finished_at - row.started_at).total_seconds() * 1e6)
    # Finished without running (here: finished without an engine's claim) is an instant.
    (instant,) = [e for e in events if e["ph"] == "i"]
    assert instant["name"] == "create_model" and instant["args"]["state"] == "done"
    # Still queued (no engine here): their waits run to the export.
    waits = {e["id"]: e for e in events if e.get("cat") == "queue" and e["ph"] == "b"}
    assert waits[queued]["name"] == "optim_step queued" and queued not in slices
    assert sum(w["name"] == "rejected queued" for w in waits.values()) == 1
    assert any(e.get("tid") == 0 and e["ph"] == "X" and e["name"] == "session (active)" for e in events)
    # A tampered or foreign token is refused.
    assert client.get(url[:-3] + "xyz").status_code == 403
