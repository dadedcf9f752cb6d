"""``POST /api/v1/retrieve_future``: long-poll for a request's result (spec §1.5), and
``POST /api/v1/retrieve_futures``: long-poll for the finished requests of a sampling client
(spec §1.6, flag ``sample_use_retrieve_futures``).

``retrieve_future`` is held open until the request finishes or ``long_poll_s`` (default 25 s,
below the SDK's 45 s read timeout) passes, then answers ``try_again``. Failures are ``{"error", "category"}``; forward/backward and
sample results are protobuf, everything else JSON."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from ember.doorbell import Outcome
from ember.server.auth import require_owner
from ember.server.errors import ApiError, not_found
from ember.server.routes.common import ember
from ember.server.wire import schemas
from ember.server.wire.training import encode_forward_backward_output
from ember.store.payload import decode

router = APIRouter(prefix="/api/v1")
PROTO = "application/x-protobuf"


def render_result(row) -> Response:
    """The Tinker answer for a finished future (a row of ``Store.get_future``)."""
    return render(row.state, row.reply, row.result, row.error, row.category)


def render(state: str, reply: dict | None, result: bytes | None, error: str | None, category: str | None) -> Response:
    """The Tinker answer for a finished request (``reply``: what the API stored at submit)."""
    if state == "failed":
        return JSONResponse({"error": error or "request failed", "category": category or "unknown"})
    reply = dict(reply or {})
    kind = reply.pop("proto", None)
    result = decode(result) if result else {}
    if kind == "forward_backward":
        return Response(encode_forward_backward_output(result["logprobs"], result["metrics"]), media_type=PROTO)
    if kind == "sample":
        from ember.server.wire.sampling import encode_sample_response

        return Response(encode_sample_response(result, reply.get("layout")), media_type=PROTO)
    for key in reply.pop("result_keys", ()):
        if key in result:
            reply[key] = result[key]
    return JSONResponse(reply)


@dataclass(frozen=True)
class Pending:
    """A request that has not finished, and what the API stored to answer it."""

    reply: dict | None


def _answer(store, request_id: str, owner: str) -> Response | Pending | None:
    """One thread-pool hop: the rendered answer if the request finished, ``Pending`` if not,
    ``None`` if it does not exist (or is not the owner's)."""
    row = store.get_future(request_id, owner)
    if row is None:
        return None
    if row.state not in ("done", "failed"):
        return Pending(row.reply)
    return render_result(row)


@router.post("/cancel_future")
def cancel_future(body: schemas.RetrieveFutureRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    """Cancel an abandoned sampling request (the SDK sends this when ``sample_cancel_enabled``): it
    fails with "cancelled by the client" unless an engine already took it (then nothing happens)."""
    if ember(request).store.cancel_sample(body.request_id, owner) is None:
        raise not_found(f"request {body.request_id!r}")
    return {}


@router.post("/retrieve_future")
async def retrieve_future(body: schemas.RetrieveFutureRequest, request: Request, owner: str = Depends(require_owner)):
    st = ember(request)
    mark = st.waiter.mark()
    reply = st.recent_submit(body.request_id, owner)
    answer: Response | Pending | None = None
    if reply is not None:
        # Queued here moments ago by a hot route: no store read. Its outcome is here if an
        # engine's datagram brought it; else it is still pending, or it finished without a
        # datagram reaching us, which the waiter's poll finds (at the latest every interval).
        outcome = st.waiter.recent(body.request_id)
        if isinstance(outcome, Outcome):
            return render(outcome.state, reply, outcome.result, outcome.error, outcome.category)
        answer = None if outcome else Pending(reply)
    if answer is None:
        answer = await run_in_threadpool(_answer, st.store, body.request_id, owner)
    if answer is None:
        raise not_found(f"request {body.request_id!r}")
    deadline = time.monotonic() + st.config.long_poll_s
    while isinstance(answer, Pending):
        left = deadline - time.monotonic()
        woke = False if left <= 0 else await st.waiter.wait(body.request_id, left, since=mark)
        if not woke:
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        if isinstance(woke, Outcome):  # the engine's datagram carried what it committed: no read back
            return render(woke.state, answer.reply, woke.result, woke.error, woke.category)
        mark = st.waiter.mark()
        answer = await run_in_threadpool(_answer, st.store, body.request_id, owner)
        if answer is None:  # purged meanwhile (cannot happen within the retention window)
            raise not_found(f"request {body.request_id!r}")
    return answer


async def outcome(st, request_id: str, owner: str, timeout_s: float) -> tuple[str, dict, str | None]:
    """``(state, result, error)`` of a request once it has finished (for routes that answer with
    the result itself rather than a future); 504 after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        mark = st.waiter.mark()
        row = await run_in_threadpool(st.store.get_future, request_id, owner)
        if row is None:
            raise not_found(f"request {request_id!r}")
        if row.state in ("done", "failed"):
            return row.state, decode(row.result) if row.result else {}, row.error
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(504, f"request {request_id} did not finish within {timeout_s:g} s")
        woke = await st.waiter.wait(request_id, left, since=mark)
        if isinstance(woke, Outcome):
            return woke.state, decode(woke.result) if woke.result else {}, woke.error


def _completion(request_id: str, state: str) -> dict:
    """The SDK's ``FutureCompletion`` for a request that is ``done`` or ``failed``."""
    if state == "failed":
        return {"state": "failed", "request_id": request_id}
    # the payload size is optional: the SDK then fetches the result without reserving its size
    return {"state": "finished", "request_id": request_id, "response_payload_uncompressed_size": None}


@router.post("/retrieve_futures")
async def retrieve_futures(
    body: schemas.RetrieveFuturesRequest, request: Request, owner: str = Depends(require_owner)
) -> dict:
    """The sampling requests of one client of a sampler that finished since ``prev_cursor``, and
    the cursor to send next (see ``Store.sampler_completions``); the SDK then fetches each result
    with ``retrieve_future``. Held open (up to ``long_poll_s``, or ``timeout`` if shorter) until
    one exists; ``timeout: 0`` answers at once. Re-reads the store whenever an engine's datagram
    says something finished, and at the latest every two waiter intervals (engines on other hosts,
    lost datagrams). ``retrieved_request_ids`` needs nothing: finished futures are purged after
    the retention window anyway."""
    st = ember(request)
    target = body.target
    wait_s = st.config.long_poll_s if body.timeout is None else min(body.timeout, st.config.long_poll_s)
    deadline = time.monotonic() + wait_s
    while True:
        mark = st.waiter.mark()  # before the read: a request finishing during it rings after the mark
        found = await run_in_threadpool(
            st.store.sampler_completions, target.sampling_session_id, owner, target.cloned_sampler_id, body.prev_cursor
        )
        if found is None:
            raise not_found(f"sampler {target.sampling_session_id!r}")
        completions, cursor = found
        left = deadline - time.monotonic()
        if completions or left <= 0:
            return {"completions": [_completion(rid, state) for rid, state in completions], "cursor": cursor}
        await st.waiter.next_ring(min(left, st.waiter.interval_s * 2), since=mark)
