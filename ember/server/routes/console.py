"""The web console: static pages at ``/console`` and the JSON they read at ``/console/api``.

The pages (``ember/server/console/``) sign in with an API key, kept in the browser's session
storage and sent as ``X-API-Key`` on every call, so the console sees exactly what that key's SDK
sees: its sessions, training runs with their metric curves, checkpoints, samplers and queue, plus
the engines' utilisation (shared, no other key's data). Checkpoint listing, deletion and the
playground use the public routes (``/api/v1/…``, ``/oai/api/v1/…``); this module adds only what
they lack: an overview, a run's metric points (``run_metrics``, written by the engine as requests
finish) and signed download URLs for any of the key's checkpoints.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse

from ember.server.auth import require_owner
from ember.server.errors import not_found
from ember.server.routes.common import ember, iso, parse_tinker_path
from ember.server.routes.rest import MAX_OFFSET, session_status, signed_file_urls
from ember.store.repo import utcnow

STATIC = Path(__file__).resolve().parent.parent / "console"
PAGES = {"": "index.html", "console.js": "console.js", "console.css": "console.css"}
MAX_POINTS = 10_000  # metric points per call (the page asks again from the last one it has)
router = APIRouter()


@router.get("/console", include_in_schema=False)
@router.get("/console/{name}", include_in_schema=False)
def page(name: str = ""):
    if name not in PAGES:
        raise not_found(f"console page {name!r}")
    media = {"js": "text/javascript", "css": "text/css"}.get(name.rpartition(".")[2], "text/html")
    return FileResponse(STATIC / PAGES[name], media_type=media, headers={"cache-control": "no-cache"})


@router.get("/console/api/overview")
def overview(request: Request, owner: str = Depends(require_owner)) -> dict:
    """The key's sessions, runs, samplers and queue, and every engine's state and counters."""
    st = ember(request)
    store = st.store
    runs, total = store.list_models(owner, 200, 0)
    now = utcnow()
    return {
        "owner": owner,
        "time": now.replace(tzinfo=UTC).isoformat(),
        "sessions": [{"session_id": s.id, "created_at": iso(s.created_at), "display_name": s.display_name,
                      "status": (session_status(s) or {"type": s.status})["type"],
                      "last_heartbeat": iso(s.last_heartbeat)} for s in store.list_sessions(owner, 200, 0)],
        "training_runs": [{"training_run_id": m.id, "session_id": m.session_id, "base_model": m.base_model,
                           "lora_rank": m.lora["rank"], "status": m.status, "status_detail": m.status_detail,
                           "created_at": iso(m.created_at), "last_request_time": iso(m.last_request_time)}
                          for m in runs],
        "training_runs_total": total,
        "samplers": [{"sampler_id": s.id, "session_id": s.session_id, "base_model": s.base_model,
                      "model_path": s.model_path, "created_at": iso(s.created_at)} for s in store.samplers_of(owner)],
        "queue": {"mine": store.owner_queue(owner),
                  "by_base_model": _by_base_model(store.queue_counts())},
        "engines": [{"base_model": e.base_model, "status": e.status, "pid": e.pid, "generation": e.generation,
                     "passes": e.passes, "tokens": e.tokens, "busy_seconds": e.busy_seconds,
                     "last_pass_seconds": e.last_pass_seconds, "last_pass_tokens": e.last_pass_tokens,
                     "memory_bytes": e.memory_bytes, "started_at": iso(e.started_at),
                     "heartbeat_age_s": (now - e.heartbeat_at).total_seconds() if e.heartbeat_at else None}
                    for e in store.engines()],
    }


def _by_base_model(counts: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (base, state), n in counts.items():
        if state in ("pending", "running"):
            out.setdefault(base, {})[state] = n
    return out


@router.get("/console/api/training_runs/{run_id}/metrics")
def run_metrics(
    run_id: str, request: Request, after_seq: int = Query(0, ge=0, le=MAX_OFFSET), owner: str = Depends(require_owner)
) -> dict:
    """The run's metric points after ``after_seq`` (``seq_id`` order), at most ``MAX_POINTS``:
    ``{"points": [{"seq_id", "op", "step", "metrics", "time"}], "more": bool}``."""
    st = ember(request)
    if st.store.get_model(run_id, owner) is None:
        raise not_found(f"training run {run_id!r}")
    points = st.store.run_metrics(run_id, owner, after_seq, MAX_POINTS + 1)
    return {"points": points[:MAX_POINTS], "more": len(points) > MAX_POINTS}


@router.get("/console/api/checkpoint_files")
def checkpoint_files(request: Request, path: str = Query(..., max_length=400), owner: str = Depends(require_owner)):
    """Signed, self-authorising download URLs of every file of one of the key's checkpoints."""
    st = ember(request)
    parse_tinker_path(path)
    ckpt = st.store.get_checkpoint(path, owner)
    if ckpt is None or ckpt.state != "ready":
        raise not_found(f"checkpoint {path!r}")
    urls, expires = signed_file_urls(st, request, ckpt)
    sizes = dict(st.storage.list_files(ckpt.uri))
    return {"files": [{"name": name, "size_bytes": sizes.get(name), "url": url} for name, url in urls.items()],
            "expires": datetime.fromtimestamp(expires, UTC).isoformat()}
