"""The floor of any Tinker server's overhead: what the official SDK and its HTTP round trips cost
when the server does no work at all.

An ASGI app under uvicorn (the stack ``ember serve`` uses) that answers the calls of a LoRA
training loop from memory: ``forward_backward`` and ``optim_step`` are answered with a request id
and ``retrieve_future`` with a finished result at once (a fixed forward_backward output of the
request's shape; no store, no engine, no model). ``bench/service_overhead.py --floor`` times the
same SDK loop against it, so the service's added time can be split into what the SDK costs
anyway and what Ember adds. Not a server to use: it trains nothing.

Usage: python bench/sdk_floor.py PORT
"""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np

from ember.server.wire.training import encode_forward_backward_output, parse_forward_backward

_ids = itertools.count(1)
_results: dict[str, tuple[str, bytes]] = {}  # request id -> (content type, body)


def _json(obj) -> tuple[str, bytes]:
    return "application/json", json.dumps(obj).encode()


def _answer(path: str, body: bytes) -> tuple[str, bytes]:
    if path == "/api/v1/forward_backward":
        msg = parse_forward_backward(body)
        rid = f"r{next(_ids)}"
        n = [sum(len(c.encoded_text.tokens) // 4 for c in d.model_input) for d in msg.data]
        out = encode_forward_backward_output([np.zeros(k, np.float32) for k in n], {"loss:sum": 0.0})
        _results[rid] = ("application/x-protobuf", out)
        return _json({"request_id": rid, "model_id": msg.model_id})
    req = json.loads(body or b"{}")
    if path == "/api/v1/optim_step":
        rid = f"r{next(_ids)}"
        _results[rid] = _json({"type": "optim_step", "metrics": {}})
        return _json({"request_id": rid, "model_id": req["model_id"]})
    if path == "/api/v1/retrieve_future":
        return _results.pop(req["request_id"])
    if path == "/api/v1/create_session":
        return _json({"session_id": "floor", "type": "create_session"})
    if path == "/api/v1/create_model":
        rid = f"r{next(_ids)}"
        mid = f"floor:train:{req['model_seq_id']}"
        _results[rid] = _json({"model_id": mid, "type": "create_model"})
        return _json({"request_id": rid, "model_id": mid})
    if path == "/api/v1/get_info":
        return _json({"type": "get_info", "model_id": req["model_id"], "is_lora": True, "lora_rank": 8,
                      "model_data": {"arch": "qwen3", "model_name": "floor", "tokenizer_id": None},
                      "model_name": "floor"})
    if path == "/api/v1/session_heartbeat":
        return _json({"type": "session_heartbeat"})
    return _json({})  # client/config, telemetry, finish: nothing to say


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    ctype, out = _answer(scope["path"], body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
