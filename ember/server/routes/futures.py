"""``POST /api/v1/retrieve_future``: long-poll for a request's result (spec §1.5).

Held open until the request finishes or ``long_poll_s`` (default 25 s, below the SDK's 45 s read
timeout) passes, then ``try_again``. Failures are ``{"error", "category"}``; forward/backward and
sample results are protobuf, everything else JSON."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from ember.server.auth import require_owner
from ember.server.errors import not_found
from ember.server.routes.common import ember
from ember.server.wire import schemas
from ember.server.wire.training import encode_forward_backward_output
from ember.store.models import Future
from ember.store.payload import decode

router = APIRouter(prefix="/api/v1")
PROTO = "application/x-protobuf"


def render_result(row: Future) -> Response:
    """The Tinker answer for a finished future."""
    if row.state == "failed":
        return JSONResponse({"error": row.error or "request failed", "category": row.category or "unknown"})
    reply = dict(row.reply or {})
    kind = reply.pop("proto", None)
    result = decode(row.result) if row.result else {}
    if kind == "forward_backward":
        return Response(encode_forward_backward_output(result["logprobs"], result["metrics"]), media_type=PROTO)
    if kind == "sample":
        from ember.server.wire.sampling import encode_sample_response

        return Response(encode_sample_response(result, reply.get("layout")), media_type=PROTO)
    for key in reply.pop("result_keys", ()):
        if key in result:
            reply[key] = result[key]
    return JSONResponse(reply)


@router.post("/retrieve_future")
async def retrieve_future(body: schemas.RetrieveFutureRequest, request: Request, owner: str = Depends(require_owner)):
    st = ember(request)
    row = await run_in_threadpool(st.store.get_future, body.request_id, owner)
    if row is None:
        raise not_found(f"request {body.request_id!r}")
    if row.state not in ("done", "failed"):
        if not await st.waiter.wait(body.request_id, st.config.long_poll_s):
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        row = await run_in_threadpool(st.store.get_future, body.request_id, owner)
    return await run_in_threadpool(render_result, row)
