"""REST endpoints of ``RestClient``: training runs, checkpoints (list, delete, publish, TTL,
download URLs), weights_info and sessions; plus the signed download route itself."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response, StreamingResponse

from ember.server.auth import require_owner
from ember.server.errors import ApiError, bad_request, not_found
from ember.server.routes.common import (
    KINDS,
    active_session,
    check_name,
    checkpoint_json,
    ember,
    expiry,
    iso,
    parse_tinker_path,
    str_metadata,
    tinker_path,
)
from ember.server.routes.training import tinker_lora
from ember.server.trace import MAX_REQUESTS, session_trace
from ember.server.wire import schemas
from ember.storage import sign_token, verify_token
from ember.store.models import TrainingModel
from ember.store.repo import Conflict, utcnow

MAX_OFFSET = 2**31 - 1  # listing offsets (a larger one lists nothing and would overflow the store's integers)
router = APIRouter(prefix="/api/v1")


def _training_run(st, m: TrainingModel) -> dict:
    ckpts, _ = st.store.list_checkpoints(m.owner, model_id=m.id)
    last = next((c for c in ckpts if c.kind == "training"), None)
    last_sampler = next((c for c in ckpts if c.kind == "sampler"), None)
    return {
        "training_run_id": m.id,
        "base_model": m.base_model,
        "model_owner": m.owner,
        "is_lora": m.lora["rank"] > 0,  # rank 0: full fine-tuning
        "corrupted": m.status == "failed",
        "lora_rank": m.lora["rank"] or None,
        "last_request_time": iso(m.last_request_time),
        "last_checkpoint": checkpoint_json(last) if last else None,
        "last_sampler_checkpoint": checkpoint_json(last_sampler) if last_sampler else None,
        "user_metadata": str_metadata(m.user_metadata) or {},
    }


def _owned_run(st, owner: str, run_id: str) -> TrainingModel:
    m = st.store.get_model(run_id, owner)
    if m is None:
        raise not_found(f"training run {run_id!r}")
    return m


@router.get("/training_runs")
def list_training_runs(
    request: Request, limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0, le=MAX_OFFSET),
    owner: str = Depends(require_owner),
) -> dict:
    st = ember(request)
    rows, total = st.store.list_models(owner, limit, offset)
    return {"training_runs": [_training_run(st, m) for m in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    return _training_run(st, _owned_run(st, owner, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    _owned_run(st, owner, run_id)
    rows, _ = st.store.list_checkpoints(owner, model_id=run_id)
    return {"checkpoints": [checkpoint_json(c) for c in rows]}


@router.get("/checkpoints")
def list_user_checkpoints(
    request: Request, limit: int = Query(100, ge=1, le=1000), offset: int = Query(0, ge=0, le=MAX_OFFSET),
    owner: str = Depends(require_owner),
) -> dict:
    rows, total = ember(request).store.list_checkpoints(owner, limit=limit, offset=offset)
    return {"checkpoints": [checkpoint_json(c) for c in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


def _path_of(run_id: str, checkpoint_id: str) -> str:
    """``{kind segment}/{name}`` of a route -> the tinker path (400 if malformed)."""
    segment, _, name = checkpoint_id.partition("/")
    if segment not in KINDS or not name:
        raise bad_request(f"checkpoint id {checkpoint_id!r} must be <weights|sampler_weights|external_weights>/<name>")
    check_name(name, "checkpoint name")
    return tinker_path(run_id, KINDS[segment], name)


def _owned_checkpoint(st, owner: str, run_id: str, checkpoint_id: str):
    path = _path_of(run_id, checkpoint_id)
    ckpt = st.store.get_checkpoint(path, owner)
    if ckpt is None or ckpt.state != "ready":
        raise not_found(f"checkpoint {path!r}")
    return ckpt


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def publish(run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    path = _owned_checkpoint(st, owner, run_id, checkpoint_id).tinker_path
    st.store.update_checkpoint(path, owner, public=True)
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish")
def unpublish(run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    if "/" not in checkpoint_id:  # DELETE .../checkpoints/weights/publish: a checkpoint named "publish"
        return delete_checkpoint(run_id, f"{checkpoint_id}/publish", request, owner)
    st = ember(request)
    path = _owned_checkpoint(st, owner, run_id, checkpoint_id).tinker_path
    st.store.update_checkpoint(path, owner, public=False)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl")
def set_ttl(
    run_id: str, checkpoint_id: str, body: schemas.CheckpointTtlRequest, request: Request,
    owner: str = Depends(require_owner),
) -> dict:
    st = ember(request)
    path = _owned_checkpoint(st, owner, run_id, checkpoint_id).tinker_path
    st.store.update_checkpoint(path, owner, expires_at=expiry(body.ttl_seconds))
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
def external_weights_urls(run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    """Self-authorising URLs for every file of an external export (spec §4 "Download")."""
    st = ember(request)
    ckpt = _owned_checkpoint(st, owner, run_id, checkpoint_id)
    if ckpt.kind != "external":
        raise bad_request(f"{ckpt.tinker_path} is not an external_weights checkpoint; export one with save_weights_external")
    urls, expires = signed_file_urls(st, request, ckpt)
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}


def signed_file_urls(st, request: Request, ckpt) -> tuple[dict[str, str], float]:
    """``({file name: self-authorising URL}, expiry as a Unix time)`` of a checkpoint's files; a
    URL expires with the checkpoint, and after ``download_url_ttl_s`` at the latest."""
    expires = time.time() + st.config.download_url_ttl_s
    if ckpt.expires_at is not None:
        expires = min(expires, ckpt.expires_at.replace(tzinfo=UTC).timestamp())
    base = (st.config.public_url or str(request.base_url)).rstrip("/")
    urls = {}
    for name, _size in st.storage.list_files(ckpt.uri):
        token = sign_token(st.secret, {"p": ckpt.tinker_path, "f": name}, expires)
        urls[name] = f"{base}/api/v1/download/{token}"
    return urls, expires


@router.get("/download/{token}")
def download(token: str, request: Request):
    """A file of an external export, or a session's trace (``trace_export``), for whoever holds
    a valid signed token (no API key)."""
    st = ember(request)
    try:
        claims = verify_token(st.secret, token)
    except ValueError as e:
        raise ApiError(403, str(e)) from None
    if "s" in claims:
        return _session_trace(st, claims["s"], claims["o"])
    ckpt = st.store.get_checkpoint(claims["p"], None)
    if ckpt is None or ckpt.state != "ready":
        raise not_found("checkpoint")
    name = claims["f"]
    files = dict(st.storage.list_files(ckpt.uri))
    if name not in files:
        raise not_found(f"file {name!r}")
    handle = st.storage.open_file(ckpt.uri, name)

    def chunks():
        with handle:
            while block := handle.read(1 << 20):
                yield block

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"content-length": str(files[name]),
                                      "content-disposition": f'attachment; filename="{name}"'})


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    path = _path_of(run_id, checkpoint_id)
    ckpt = st.store.delete_checkpoint(path, owner)
    if ckpt is None:
        raise not_found(f"checkpoint {path!r}")
    if not st.store.uri_referenced(ckpt.uri):  # a copy may share these files
        st.storage.delete(ckpt.uri)
    return {}


@router.post("/copy_weights")
def copy_weights(
    body: schemas.CopyWeightsRequest,
    request: Request,
    owner: str = Depends(require_owner),
    idempotency_key: str | None = Header(None, alias="X-Idempotency-Key"),
) -> dict:
    """A weights-only training run holding a copy of a checkpoint (the owner's or a published one)
    that shares its files. With ``session_id`` + ``model_seq_id`` the run is
    ``{session}:train:{model_seq_id}``; otherwise it gets its own id, the same for retries with one
    ``X-Idempotency-Key``. Ember has no projects: ``destination_project_id`` is accepted and unused."""
    st = ember(request)
    parse_tinker_path(body.source_path)
    expires = expiry(body.ttl_seconds)
    if body.session_id is not None:
        active_session(st, owner, body.session_id)
        if body.model_seq_id is None or body.model_seq_id < 0:
            raise bad_request("copy_weights with session_id needs model_seq_id >= 0")
        session_id, run_id = body.session_id, f"{body.session_id}:train:{body.model_seq_id}"
    else:
        key = idempotency_key or secrets.token_hex(16)
        tag = hashlib.sha256(f"{owner}\0{body.source_path}\0{key}".encode()).hexdigest()[:24]
        session_id = f"copy-{tag}"
        run_id = f"{session_id}:train:0"
    try:
        ckpt = st.store.copy_checkpoint(body.source_path, owner, run_id, session_id, expires)
    except KeyError:
        raise not_found(f"checkpoint {body.source_path!r}") from None
    except Conflict as e:
        raise bad_request(str(e)) from None
    return {"tinker_path": ckpt.tinker_path}


@router.post("/weights_info")
def weights_info(body: schemas.WeightsInfoRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    parse_tinker_path(body.tinker_path)
    ckpt = st.store.get_checkpoint(body.tinker_path, owner, allow_public=True)
    if ckpt is None or ckpt.state != "ready":
        raise not_found(f"checkpoint {body.tinker_path!r}")
    lora = tinker_lora(ckpt.lora)
    return {"base_model": ckpt.base_model, "is_lora": lora["rank"] > 0, "lora_rank": lora["rank"] or None,
            "train_attn": lora["train_attn"], "train_mlp": lora["train_mlp"], "train_unembed": lora["train_unembed"],
            "optimizer_config": ckpt.optimizer_config}


@router.get("/sessions")
def list_sessions(
    request: Request, limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0, le=MAX_OFFSET),
    owner: str = Depends(require_owner),
) -> dict:
    return {"sessions": [s.id for s in ember(request).store.list_sessions(owner, limit, offset)]}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    row = st.store.get_session(session_id, owner)
    if row is None:
        raise not_found(f"session {session_id!r}")
    runs, samplers = st.store.session_children(session_id)
    return {"training_run_ids": runs, "sampler_ids": samplers,
            "user_metadata": str_metadata(row.user_metadata), "display_name": row.display_name}


DEFAULT_PROJECT = "default"  # the project of a session created without one
FINISH_REASONS = ("success", "errored", "interrupted")


@router.put("/sessions/{session_id}/project")
def assign_session_project(
    session_id: str, body: schemas.AssignProjectRequest, request: Request, owner: str = Depends(require_owner)
) -> dict:
    """Move a session to another project (Ember's projects are labels that ``sessions/search``
    filters by; every project is its owner's)."""
    if not ember(request).store.assign_project(session_id, owner, body.project_id):
        raise not_found(f"session {session_id!r}")
    return {}


def session_status(row) -> dict | None:
    """The SDK's ``SessionStatus`` of a session: active, or finished by its client with a reason;
    None for one that ended without a heartbeat (neither finished nor known to be running)."""
    if row.status == "active":
        return {"type": "active"}
    if row.status == "finished":
        reason = row.end_reason if row.end_reason in FINISH_REASONS else "success"
        return {"type": "client_finished", "reason": {"type": reason}, "detail": None}
    return None


def _status_matches(row, queries: list[schemas.SessionStatusQueryBody] | None) -> bool:
    if queries is None:
        return True
    status = session_status(row)
    if status is None:
        return False
    for q in queries:
        if q.type == status["type"] and (q.reasons is None or status.get("reason", {}).get("type") in q.reasons):
            return True
    return False  # Ember never cancels nor fails a session: those queries match nothing


@router.post("/sessions/search")
def search_sessions(body: schemas.SessionSearchRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    """A page of the caller's sessions, newest first (``RestClient.search_sessions``). A key sees
    only its own sessions, so ``accessible`` searches the caller's, and ``user`` finds sessions
    only when it names the caller (its owner id, as ``SessionSummary.owner`` reports it)."""
    if body.owner.type == "user" and owner not in (body.owner.owner_urns or ()):
        return {"sessions": [], "next_cursor": None}
    projects = set(body.project_ids) if body.project_ids is not None else None

    def match(row) -> bool:
        if projects is not None and (row.project_id or DEFAULT_PROJECT) not in projects:
            return False
        meta = str_metadata(row.user_metadata) or {}
        return all(meta.get(k) == v for k, v in body.user_metadata.items()) and _status_matches(row, body.statuses)

    after = None
    if body.cursor is not None:
        after = (body.cursor.last_created_at.astimezone(UTC).replace(tzinfo=None), body.cursor.last_session_id)
    words = body.display_name.split() if body.display_name else ()
    found = ember(request).store.search_sessions(owner, match, body.limit + 1, session_id=body.session_id,
                                                 name_words=words, after=after)
    page = found[: body.limit]
    sessions = [
        {"session_id": row.id, "created_at": iso(row.created_at), "owner": row.owner,
         "project_id": row.project_id or DEFAULT_PROJECT, "status": session_status(row), "checkpoints_count": n,
         "display_name": row.display_name, "user_metadata": str_metadata(row.user_metadata),
         "checkpoint_storage_bytes": size}
        for row, n, size in page
    ]
    more = len(found) > body.limit
    cursor = {"last_created_at": iso(page[-1][0].created_at), "last_session_id": page[-1][0].id} if more else None
    return {"sessions": sessions, "next_cursor": cursor}


@router.get("/sessions/{session_id}/trace_export")
def trace_export(session_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    """A self-authorising URL of the session's timeline (``ember.server.trace``), built when it is
    downloaded, so it is always ready and up to date."""
    st = ember(request)
    if st.store.get_session(session_id, owner) is None:
        raise not_found(f"session {session_id!r}")
    token = sign_token(st.secret, {"s": session_id, "o": owner}, time.time() + st.config.download_url_ttl_s)
    base = (st.config.public_url or str(request.base_url)).rstrip("/")
    return {"status": "ready", "url": f"{base}/api/v1/download/{token}"}


def _session_trace(st, session_id: str, owner: str) -> Response:
    row = st.store.get_session(session_id, owner)
    if row is None:
        raise not_found(f"session {session_id!r}")
    requests = st.store.session_requests(session_id, MAX_REQUESTS + 1)
    trace = session_trace(row, requests[-MAX_REQUESTS:], utcnow(), truncated=len(requests) > MAX_REQUESTS)
    return Response(json.dumps(trace), media_type="application/json",
                    headers={"content-disposition": f'attachment; filename="{session_id}.json"'})
