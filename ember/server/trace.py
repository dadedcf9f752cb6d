"""A session's timeline as a trace that Perfetto (ui.perfetto.dev) and chrome://tracing open: the
Trace Event Format's JSON (``RestClient.export_session_trace``).

One track per training run and sampler: each request is a slice from the moment an engine took it
to the moment it finished, named by its operation (``forward_backward``, ``optim_step``, ``sample``,
...), with its id, seq_id, tokens, state and error as arguments; the wait in the queue before it
is an async slice on the same track's queue lane; a request that failed before running (rejected
at submit, cancelled, failed with its engine) is an instant. The session itself is a slice on track
0. Requests are kept for the store's retention window after they finish
(``ServerConfig.future_retention_s``), so a trace covers the session's last hour of finished work
and everything still queued or running."""

from __future__ import annotations

from datetime import datetime

_PID = 1


def _us(t: datetime, origin: datetime) -> float:
    return (t - origin).total_seconds() * 1e6


MAX_REQUESTS = 100_000  # the newest requests of a session that a trace shows (~25 MB of JSON)


def session_trace(session, requests, now: datetime, truncated: bool = False) -> dict:
    """The trace of ``session`` (a ``sessions`` row) and its ``requests`` (``Store.session_requests``)
    at time ``now`` (naive UTC, as the store's times); timestamps are microseconds since the
    session's creation. ``truncated``: older requests were left out."""
    origin = session.created_at
    tracks: dict[str, int] = {}
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": _PID, "args": {"name": f"Ember session {session.id}"}},
        {"ph": "M", "name": "thread_name", "pid": _PID, "tid": 0, "args": {"name": "session"}},
        {"ph": "X", "name": f"session ({session.status})", "pid": _PID, "tid": 0, "ts": 0.0,
         "dur": _us(session.ended_at or now, origin),
         "args": {"session_id": session.id, "display_name": session.display_name, "end_reason": session.end_reason}},
    ]
    for r in requests:
        owner = r.model_id or r.sampler_id or "other"
        tid = tracks.get(owner)
        if tid is None:
            tid = tracks[owner] = len(tracks) + 1
            kind = "training run" if r.model_id else "sampler"
            events.append({"ph": "M", "name": "thread_name", "pid": _PID, "tid": tid, "args": {"name": f"{kind} {owner}"}})
        args = {"request_id": r.id, "seq_id": r.seq_id, "tokens": r.n_tokens, "state": r.state}
        if r.error:
            args["error"] = r.error
        queued_until = r.started_at or r.finished_at or now
        if queued_until > r.created_at:
            common = {"cat": "queue", "name": f"{r.op} queued", "id": r.id, "pid": _PID, "tid": tid}
            events.append({**common, "ph": "b", "ts": _us(r.created_at, origin)})
            events.append({**common, "ph": "e", "ts": _us(queued_until, origin)})
        if r.started_at is not None:
            end = r.finished_at or now
            events.append({"ph": "X", "name": r.op, "cat": "request", "pid": _PID, "tid": tid,
                           "ts": _us(r.started_at, origin), "dur": _us(end, r.started_at), "args": args})
        elif r.finished_at is not None:  # failed without running
            events.append({"ph": "i", "s": "t", "name": r.op, "cat": "request", "pid": _PID, "tid": tid,
                           "ts": _us(r.finished_at, origin), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"session_id": session.id, "exported_at": now.isoformat() + "Z", "requests": len(requests),
                         "truncated": truncated}}
