"""``create_custom_loss`` and ``forward_backward`` with ``loss_fn="custom"`` at the API (no engine):
uploads are checked against the allow-list, stored once per ``(session, seq)``, usable only by the
models of their session and key, and a custom request carries the loss's program and inputs."""

import numpy as np
import torch
from fastapi.testclient import TestClient
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from tinker.proto.request_conv import forward_backward_request_to_proto

from ember.store.payload import decode
from tests.server import test_api
from tests.server.test_api import _model, _post_proto, _session, h

env = test_api.env  # the API-without-engine fixture


def margin(logprobs, ref_logprobs, sign):
    return -torch.nn.functional.logsigmoid(sign * (logprobs - ref_logprobs).sum()), {}


def _upload(client: TestClient, key: str, session: str, seq: int = 0, graph: dict | None = None):
    handle = trace_loss(margin, {"logprobs": 1, "ref_logprobs": 1, "sign": 0}, session)
    body = {"session_id": session, "custom_loss_seq_id": seq, "name": handle.name,
            "inputs": [x.model_dump() for x in handle.inputs],
            "graph": graph if graph is not None else encode_graph(handle).model_dump(), "type": "create_custom_loss"}
    return client.post("/api/v1/create_custom_loss", json=body, headers=h(key))


def _custom_body(model_id, seq, loss_id, **inputs):
    arrays = {k: np.asarray(v, np.float32) for k, v in inputs.items()}  # the SDK types lists of known keys only
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], **arrays})
    fb = types.ForwardBackwardInput(data=[d], loss_fn="custom", loss_fn_config={"loss_id": loss_id} if loss_id else None)
    req = types.ForwardBackwardRequest(forward_backward_input=fb, model_id=model_id, seq_id=seq)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_custom_loss_upload_and_use(env):
    client, store, (alice, bob) = env
    session = _session(client, alice)
    r = _upload(client, alice, session)
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    assert _upload(client, alice, session).json()["request_id"] == rid  # a resubmission: the same future
    done = client.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=h(alice))
    assert done.json() == {"loss_id": f"{session}:loss:0", "type": "create_custom_loss"}
    loss_id = done.json()["loss_id"]

    model = _model(client, store, alice, session)
    ok = _post_proto(client, alice, _custom_body(model, 1, loss_id, ref_logprobs=[-1.0, -2.0, -0.5], sign=[1.0]))
    assert ok.status_code == 200, ok.text
    (pending,) = [f for f in store.pending(BASE_MODEL) if f.op == "forward_backward"]
    payload = decode(store.claim([pending.id])[pending.id])
    assert payload["loss_fn"] == "custom" and payload["custom_loss"]["name"] == "margin"
    assert [x["name"] for x in payload["custom_loss"]["inputs"]] == ["logprobs", "ref_logprobs", "sign"]
    inputs = payload["datums"][0]["loss_inputs"]
    assert inputs["sign"].shape == () and inputs["ref_logprobs"].tolist() == [-1.0, -2.0, -0.5]

    # bad requests take their seq_id and answer 400 with a detail naming the problem
    bad = [
        (_custom_body(model, 2, loss_id, ref_logprobs=[-1.0, -2.0, -0.5]), "sign"),
        (_custom_body(model, 3, loss_id, ref_logprobs=[-1.0, -2.0], sign=[1.0, 2.0]), "rank 0"),
        (_custom_body(model, 4, None), "loss_id"),
        (_custom_body(model, 5, f"{session}:loss:7"), "unknown loss_id"),
    ]
    other_session = _session(client, alice)
    assert _upload(client, alice, other_session).status_code == 200
    bad.append((_custom_body(model, 6, f"{other_session}:loss:0", ref_logprobs=[0.0] * 3, sign=[1.0]),
                "another session"))
    for body, message in bad:
        r = _post_proto(client, alice, body)
        assert r.status_code == 400 and message in r.json()["detail"], r.text

    # another key sees neither the session nor the loss
    assert _upload(client, bob, session).status_code == 404
    bob_model = _model(client, store, bob, _session(client, bob))
    r = _post_proto(client, bob, _custom_body(bob_model, 1, loss_id, ref_logprobs=[0.0] * 3, sign=[1.0]))
    assert r.status_code == 400 and "unknown loss_id" in r.json()["detail"]


def test_uploads_outside_the_allow_list_get_400(env):
    client, _, (alice, _) = env
    session = _session(client, alice)
    graph = encode_graph(trace_loss(margin, {"logprobs": 1, "ref_logprobs": 1, "sign": 0}, session)).model_dump()
    call = next(n for n in graph["nodes"] if n["op"] == "call_function")
    call["target"] = "builtins.eval"
    r = _upload(client, alice, session, graph=graph)
    assert r.status_code == 400 and "'builtins.eval' is not allowed" in r.json()["detail"]
    r = _upload(client, alice, session, graph={"format": 1, "nodes": "x"})
    assert r.status_code == 400 and "nodes" in r.json()["detail"]
    r = client.post("/api/v1/create_custom_loss", json={"session_id": session}, headers=h(alice))
    assert r.status_code in (400, 422) and "detail" in r.json()


BASE_MODEL = "tiny"
