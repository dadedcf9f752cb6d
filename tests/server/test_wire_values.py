"""Malformed values at the wire boundary get a 400 that names the field (issue 22), on SQLite and
PostgreSQL: integers outside int64 in any JSON field (seq ids, token ids, counts), strings that
are not UTF-8 text (lone surrogates), custom-loss graphs of the wrong shape. Then a property test
(hypothesis) that throws generated bodies at every route of the OpenAPI document: no 5xx, and
another key's well-formed request still works afterwards."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types

from ember.server.wire import schemas
from tests.reliability.bodies import HOSTILE, HUGE, JSON_VALUES, corrupted, mutated, paths, templates
from tests.server.test_api import _model, _post_proto, _session, api_env, h


def post(client, key, path, body):
    """POST ``body`` as JSON text as Python writes it (a lone surrogate becomes ``\\ud800``)."""
    return client.post(path, content=json.dumps(body), headers={**h(key), "Content-Type": "application/json"})


@pytest.fixture
def env(tmp_path):
    with api_env(tmp_path) as e:
        client, store, (alice, bob) = e
        session = _session(client, alice)
        model = _model(client, store, alice, session)
        sampler = post(client, alice, "/api/v1/create_sampling_session",
                       {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny"}).json()
        yield client, store, alice, bob, session, model, sampler["sampling_session_id"]


def _detail(r) -> str:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["detail"]


@pytest.mark.parametrize("value", HUGE)
def test_seq_ids_outside_int64_are_a_400_naming_the_field(env, value):
    client, _, alice, _, _, model, sampler = env
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    bodies = {
        "/api/v1/save_weights_for_sampler": {"model_id": model, "seq_id": value, "path": "s1"},
        "/api/v1/save_weights": {"model_id": model, "path": "w1", "seq_id": value},
        "/api/v1/save_weights_external": {"model_id": model, "path": "e1", "seq_id": value},
        "/api/v1/load_weights": {"path": "tinker://x/weights/w", "model_id": model, "seq_id": value},
        "/api/v1/optim_step": {"model_id": model, "seq_id": value, "adam_params": {}},
        "/api/v1/asample": {"sampling_session_id": sampler, "seq_id": value, "num_samples": 1, "prompt": prompt},
    }
    bodies["ephemeral"] = {"model_id": model, "seq_id": value, "sampling_session_seq_id": 1}
    for path, body in bodies.items():
        detail = _detail(post(client, alice, "/api/v1/save_weights_for_sampler" if path == "ephemeral" else path, body))
        assert "seq_id" in detail and "64-bit integer range" in detail, (path, detail)


def test_token_ids_counts_and_nested_values_outside_int64(env):
    client, _, alice, _, session, _, sampler = env
    r = post(client, alice, "/api/v1/asample", {"sampling_session_id": sampler, "num_samples": 1,
                                                 "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2**63]}]}})
    assert "prompt.chunks[0].tokens[1]" in _detail(r)
    r = post(client, alice, "/api/v1/asample", {"sampling_session_id": sampler, "num_samples": 10**30,
                                                 "prompt": {"chunks": [{"tokens": [1]}]}})
    assert "num_samples" in _detail(r)
    r = post(client, alice, "/api/v1/load_weights", {"path": "tinker://x/weights/w", "session_id": session,
                                                      "model_seq_id": 10**400, "base_model": "tiny"})
    assert "model_seq_id" in _detail(r)
    r = post(client, alice, "/api/v1/create_model", {"session_id": session, "model_seq_id": 9, "base_model": "tiny",
                                                      "user_metadata": {"a": [{"b": -(2**70)}]}})
    assert "user_metadata.a[0].b" in _detail(r)
    r = post(client, alice, "/api/v1/asample", {"sampling_session_id": sampler, "num_samples": 1,
                                                 "prompt": {"chunks": [{"tokens": [1, 2]}]},
                                                 "target_prompt_logprobs": {"data": [1], "shape": ["a"]}})
    assert "target_prompt_logprobs" in _detail(r)
    assert client.get("/api/v1/training_runs?offset=1000000000000000000000", headers=h(alice)).status_code == 400


def test_lone_surrogates_are_refused_before_the_store(env):
    client, _, alice, _, session, _, _ = env
    assert "model_id" in _detail(post(client, alice, "/api/v1/get_info", {"model_id": "\ud800"}))
    for field in ("sdk_version", "display_name", "project_id"):
        assert field in _detail(post(client, alice, "/api/v1/create_session", {field: "a\ud800b"}))
    assert "tags[1]" in _detail(post(client, alice, "/api/v1/create_session", {"tags": ["ok", "\udfff"]}))
    assert "user_metadata" in _detail(post(client, alice, "/api/v1/create_session", {"user_metadata": {"\ud800": 1}}))
    # nothing bad was stored: the owner's session search still answers
    r = post(client, alice, "/api/v1/sessions/search", {})
    assert r.status_code == 200 and [s["session_id"] for s in r.json()["sessions"]] == [session]
    # the hot routes parse JSON themselves and refuse the same way
    assert post(client, alice, "/api/v1/optim_step", {"model_id": "\ud800", "seq_id": 2}).status_code == 400


def test_nul_characters_are_refused_before_the_store(env):
    """PostgreSQL's text refuses NUL: found by the corrupted-protobuf property test on PostgreSQL
    (a model_id holding ``\x00`` was a 500 there, not on SQLite)."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    client, _, alice, _, session, model, _ = env
    assert "model_id" in _detail(post(client, alice, "/api/v1/get_info", {"model_id": "a\x00b"}))
    assert "NUL" in _detail(post(client, alice, "/api/v1/create_session", {"user_metadata": {"k": "\x00"}}))
    assert post(client, alice, "/api/v1/optim_step", {"model_id": "a\x00", "seq_id": 2}).status_code == 400
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    for model_id in (f"{model}\x00", "\x00"):
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn="cross_entropy"),
                                           model_id=model_id, seq_id=1)
        assert "NUL" in _detail(_post_proto(client, alice, forward_backward_request_to_proto(req).SerializeToString()))
    for url in ("/api/v1/training_runs/a%00b", "/api/v1/sessions/%00", "/api/v1/checkpoints?limit=1&x=%00",
                f"/console/api/checkpoint_files?path=tinker://{model}/weights/a%00"):
        assert "NUL" in _detail(client.get(url, headers=h(alice))), url
    r = post(client, alice, "/api/v1/sessions/search", {})
    assert r.status_code == 200 and [s["session_id"] for s in r.json()["sessions"]] == [session]


@pytest.mark.parametrize("bad", [["x"], {"a": 1}, 5, None])
def test_custom_loss_graphs_of_the_wrong_shape_are_a_400(env, bad):
    client, _, alice, _, session, _, _ = env
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
             {"op": "call_function", "name": "neg", "target": "torch.neg", "args": [{"ref": bad}], "kwargs": {}},
             {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "neg"}, {"dict": {}}]}], "kwargs": {}}]
    for arg in ({"ref": bad}, {"dtype": bad}, {"layout": bad}, {"memory_format": bad}, {"float": bad}):
        nodes[1]["args"] = [arg]
        r = post(client, alice, "/api/v1/create_custom_loss", {
            "session_id": session, "custom_loss_seq_id": 1, "name": "l", "inputs": [{"name": "logprobs", "rank": 1}],
            "graph": {"format": 1, "nodes": nodes}})
        assert r.status_code == 400 and "node 1" in r.json()["detail"], r.text
    nodes[1] = {"op": "call_function", "name": "g", "target": "getattr", "args": [{"ref": "logprobs"}, ["shape"]],
                "kwargs": {}}
    r = post(client, alice, "/api/v1/create_custom_loss", {
        "session_id": session, "custom_loss_seq_id": 2, "name": "l", "inputs": [{"name": "logprobs", "rank": 1}],
        "graph": {"format": 1, "nodes": nodes}})
    assert r.status_code == 400 and "getattr" in r.json()["detail"], r.text


# -- property test ---------------------------------------------------------------------------------

def _routes(app) -> list[tuple[str, str, list[str]]]:
    """(method, path, body field names) of every POST/PUT/GET route of the OpenAPI document."""
    out = []
    for path, ops in app.openapi()["paths"].items():
        for method, op in ops.items():
            ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
            model = getattr(schemas, ref.rsplit("/", 1)[1]) if ref else None
            out.append((method.upper(), path, list(model.model_fields) if model else []))
    return out


@settings(max_examples=int(os.environ.get("EMBER_FUZZ_EXAMPLES", "400")), deadline=None, derandomize="EMBER_FUZZ_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_bodies_never_get_a_5xx(env, data):
    """Three examples in four: a well-formed body with one value (anywhere in it) replaced by a
    hostile one; the others: any route of the OpenAPI document with generated fields."""
    client, _, alice, bob, session, model, sampler = env
    if data.draw(st.integers(0, 3)):  # three in four
        method, path, body = data.draw(st.sampled_from(templates(session, model, sampler)))
        where = data.draw(st.sampled_from(list(paths(body))))
        body = mutated(body, where, data.draw(HOSTILE))
    else:
        method, path, fields = data.draw(st.sampled_from(_routes(client.app)))
        path = path.replace("{", "").replace("}", "")  # path parameters: their own names, unknown ids
        known = {"session_id": session, "model_id": model, "sampling_session_id": sampler}
        body = {f: data.draw(st.one_of(JSON_VALUES, st.just(known.get(f, "x")))) for f in fields
                if data.draw(st.booleans())}
        body.update(data.draw(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=2)))
    if path.endswith("forward_backward"):
        r = _post_proto(client, alice, data.draw(st.binary(max_size=64)))
    elif method in ("POST", "PUT"):
        r = client.request(method, path, content=json.dumps(body), headers={**h(alice), "Content-Type": "application/json"})
    else:
        # query strings carry text: JSON-escape it (httpx cannot send a lone surrogate at all)
        r = client.request(method, path, params={json.dumps(k): json.dumps(v) for k, v in body.items()},
                           headers=h(alice))
    assert r.status_code < 500, (method, path, body, r.status_code, r.text)
    if r.status_code >= 400:  # a JSON body that says what was wrong (OpenAI's shape on its routes)
        said = r.json()
        assert said.get("detail") or path.startswith("/oai/") and said["error"]["message"], r.text
    # another key's well-formed work still goes through
    assert post(client, bob, "/api/v1/create_session", {"tags": []}).status_code == 200


@settings(max_examples=int(os.environ.get("EMBER_FUZZ_EXAMPLES", "200")), deadline=None,
          derandomize="EMBER_FUZZ_EXAMPLES" not in os.environ, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_protobuf_bodies_never_get_a_5xx(env, data):
    """SDK-encoded forward_backward bodies (cross_entropy and stable_reinforce with provenance)
    with bytes overwritten, inserted or cut: a 4xx with a detail, or accepted; never a 5xx."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    client, _, alice, _, _, model, _ = env
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "advantages": [0.0, 1.0, 1.0]})
    if data.draw(st.booleans()):
        d = d.with_provenance(model_input=[types.PromptProvenanceSpan(sequence_id="r:0", length=3)],
                              loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="r:0", length=3)])
    loss = data.draw(st.sampled_from(["cross_entropy", "stable_reinforce", "ppo"]))
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=[d], loss_fn=loss),
                                       model_id=model, seq_id=data.draw(st.integers(1, 50)))
    body = corrupted(forward_backward_request_to_proto(req).SerializeToString(), data, at_least=1)
    r = _post_proto(client, alice, body)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert r.json().get("detail"), r.text
