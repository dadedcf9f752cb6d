"""Stage 9: lifecycle. Heartbeats arrive while a session idles; telemetry is accepted; after
close() the session is finished: heartbeats get 410 and new requests a 410 with a body. The
RestClient moves the session to a project and finds it with search_sessions, finished, and
export_session_trace gives a URL of its timeline (the model's create and unload)."""

import json
import time
import urllib.request

import httpx
import tinker
from tinker import types

from ember.store import Store
from tests.conformance.scenarios.common import CONF, QWEN3

key = CONF["keys"]["alice"]
base = CONF["base_url"]
sc = tinker.ServiceClient()
tc = sc.create_lora_training_client(base_model=QWEN3, rank=4, seed=9).result()
session = sc.holder.get_session_id()
store = Store.open(CONF["database_url"], pool_size=1, run_migrations=False)
owner = store.owner_of_key(key)
created = store.get_session(session, owner).created_at
time.sleep(11.5)  # the SDK heartbeats every 10 s
row = store.get_session(session, owner)
assert row.status == "active" and (row.last_heartbeat - created).total_seconds() >= 9, (created, row.last_heartbeat)

r = httpx.post(f"{base}/api/v1/telemetry", headers={"X-API-Key": key},
               json={"events": [], "platform": "test", "sdk_version": "0.38.0", "session_id": session, "process_uuid": "x"})
assert r.json() == {"status": "accepted"}

rest = sc.create_rest_client()
rest.assign_session_project(session, "lifecycle").result()
sc.close("success").result()
r = httpx.post(f"{base}/api/v1/session_heartbeat", headers={"X-API-Key": key},
               json={"session_id": session, "type": "session_heartbeat"})
assert r.status_code == 410 and "finished" in r.json()["detail"], r.text
assert store.get_model(tc.model_id, owner).status == "unloaded"
# (The SDK itself refuses a closed client, after ~30 s of retries; not our concern here.)
# Another process (e.g. an unpickled client) still sending on the session gets a 410 with a body.
r = httpx.post(f"{base}/api/v1/optim_step", headers={"X-API-Key": key},
               json={"model_id": tc.model_id, "seq_id": 1, "adam_params": {}, "type": "optim_step"})
assert r.status_code == 410 and "finished" in r.json()["detail"], r.text
r = httpx.post(f"{base}/api/v1/create_model", headers={"X-API-Key": key},
               json={"session_id": session, "model_seq_id": 5, "base_model": QWEN3, "type": "create_model"})
assert r.status_code == 410 and r.json()["detail"], r.text
page = tinker.ServiceClient().create_rest_client().search_sessions(
    types.SessionSearchRequest(session_id=session, project_ids=["lifecycle"])).result()
(found,) = page.sessions
assert found.session_id == session and found.project_id == "lifecycle" and page.next_cursor is None, page
assert isinstance(found.status, types.ClientSessionFinished) and found.status.reason.type == "success", found.status
url = tinker.ServiceClient().create_rest_client().export_session_trace(session).result()
with urllib.request.urlopen(url) as r:  # no credentials: the URL authorises itself
    events = json.load(r)["traceEvents"]
ran = [e["name"] for e in events if e["ph"] == "X" and e.get("tid") and e["args"]["state"] == "done"]
assert ran[0] == "create_model" and "unload_model" in ran, ran
store.close()
print("stage 9 ok")
