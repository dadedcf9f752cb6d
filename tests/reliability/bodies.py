"""Generated request bodies for fuzzing the API: hostile JSON values, a well-formed body for
each route (what the SDK sends) and mutations that put a hostile value anywhere in one. Used by
the in-process property tests (``tests/server/test_wire_values.py``) and the live fuzzer
(``tests/reliability/fuzz.py``)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

HUGE = [10**30, 2**63, 2**64 + 1, -(2**63) - 1]

JSON_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
    st.sampled_from(["\ud800", "a\udfffb", "a\x00b", "", "tml-x", "tinker://a/weights/b", "s:train:0"]),
)
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


def templates(session, model, sampler) -> list[tuple[str, str, dict]]:
    """A well-formed body for each route that takes one (what the SDK sends), for mutation."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    return [
        ("POST", "/api/v1/create_session", {"tags": ["t"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"}),
        ("POST", "/api/v1/session_heartbeat", {"session_id": session}),
        ("POST", "/api/v1/create_model", {"session_id": session, "model_seq_id": 7, "base_model": "tiny",
                                          "lora_config": {"rank": 4, "seed": 1}, "user_metadata": {"a": 1}}),
        ("POST", "/api/v1/get_info", {"model_id": model}),
        ("POST", "/api/v1/optim_step", {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-4}}),
        ("POST", "/api/v1/save_weights", {"model_id": model, "path": "w", "seq_id": 3, "ttl_seconds": 60}),
        ("POST", "/api/v1/save_weights_for_sampler", {"model_id": model, "seq_id": 4, "sampling_session_seq_id": 2}),
        ("POST", "/api/v1/save_weights_external", {"model_id": model, "path": "e", "seq_id": 5}),
        ("POST", "/api/v1/load_weights", {"path": f"tinker://{model}/weights/w", "model_id": model, "seq_id": 6}),
        ("POST", "/api/v1/load_weights", {"path": f"tinker://{model}/weights/w", "session_id": session,
                                          "model_seq_id": 8, "base_model": "tiny"}),
        ("POST", "/api/v1/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 5,
                                                     "base_model": "tiny"}),
        ("POST", "/api/v1/asample", {"sampling_session_id": sampler, "seq_id": 1, "num_samples": 1, "prompt": prompt,
                                     "sampling_params": {"max_tokens": 2, "seed": 3, "top_k": 5, "stop": [1]},
                                     "target_prompt_logprobs": {"data": [1, 2], "shape": [2, 1]}}),
        ("POST", "/api/v1/retrieve_futures", {"target": {"type": "sampling_session", "sampling_session_id": sampler},
                                              "prev_cursor": 0, "timeout": 0}),
        ("POST", "/api/v1/create_custom_loss", {"session_id": session, "custom_loss_seq_id": 1, "name": "l",
                                                "inputs": [{"name": "logprobs", "rank": 1}],
                                                "graph": {"format": 1, "nodes": []}}),
        ("POST", "/api/v1/sessions/search", {"limit": 5, "user_metadata": {"k": "v"}}),
        ("PUT", f"/api/v1/sessions/{session}/project", {"project_id": "p"}),
        ("POST", "/api/v1/copy_weights", {"source_path": f"tinker://{model}/weights/w", "session_id": session,
                                          "model_seq_id": 9}),
    ]


SPECIAL = HUGE + [10**400, -1, 0, 2**31, 2**62, "\ud800", "a\udfffb", "", None, True, [], {}, [[[[[[1]]]]]]]
HOSTILE = st.one_of(st.sampled_from(SPECIAL), st.sampled_from(SPECIAL), st.sampled_from(SPECIAL),
                    st.integers(), st.floats(), st.text(max_size=6), JSON_VALUES)


def paths(body, prefix=()):
    """Every key path of a nested body (dict keys and list indices)."""
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from paths(v, (*prefix, k))


def mutated(body, path, value):
    body = json.loads(json.dumps(body))
    target = body
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return body


def corrupted(body: bytes, data, at_least: int = 0) -> bytes:
    """``body`` with ``at_least``–4 edits at places hypothesis draws: a byte overwritten, a few
    bytes inserted, or one cut (a protobuf body the SDK encoded, broken as a network or a hostile
    client would break it)."""
    out = bytearray(body)
    for _ in range(data.draw(st.integers(at_least, 4))):
        i = data.draw(st.integers(0, len(out) - 1))
        action = data.draw(st.sampled_from(["set", "insert", "cut"]))
        if action == "set":
            out[i] = data.draw(st.integers(0, 255))
        elif action == "insert":
            out[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        elif len(out) > 1:
            del out[i]
    return bytes(out)
