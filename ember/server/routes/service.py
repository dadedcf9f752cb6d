"""Bootstrap and session endpoints: client config, capabilities, sessions, heartbeats, telemetry."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ember.server.auth import JWT_ORG, is_jwt, require_owner
from ember.server.errors import bad_request, gone, not_found
from ember.server.routes.common import ember
from ember.server.wire.schemas import (
    ClientConfigRequest,
    CreateSessionRequest,
    FinishSessionRequest,
    SessionHeartbeatRequest,
)

router = APIRouter(prefix="/api/v1")


@router.post("/client/config")
def client_config(body: ClientConfigRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    """Feature flags for the SDK (spec §1.6); the server's ``--client-config`` overrides defaults."""
    return dict(ember(request).config.client_config)


@router.post("/auth/token")
def auth_token(request: Request, owner: str = Depends(require_owner)) -> dict:
    """A short-lived JWT for the caller's credential (client flag ``pjwt_auth_enabled``; see
    ``ember.server.auth``)."""
    return {"jwt": ember(request).auth.issue_jwt(owner)}


def _own_key(request: Request, owner: str):
    """The API key row presented in ``X-API-Key`` (not a JWT; not under ``--no-auth``)."""
    st = ember(request)
    if not st.config.auth:
        raise bad_request("this server runs with --no-auth: it checks no keys (manage keys with `ember keys`)")
    if is_jwt(request.headers.get("x-api-key", "")):
        raise bad_request("present the API key itself, not a token exchanged for it")
    key = st.store.get_api_key(owner)
    if key is None:
        raise not_found("API key")
    return st, key


@router.get("/auth/apikey/me")
def own_api_key(request: Request, owner: str = Depends(require_owner)) -> dict:
    """The presented key's public metadata (``tinker auth login`` checks a key with it): its
    number (the hex of its id), name, and Ember's one organisation; no user email."""
    _, key = _own_key(request, owner)
    return {"key_id": int(key.id.removeprefix("key-"), 16), "name": key.name, "note": "",
            "details": {"org_details": {"name": JWT_ORG}, "user_details": {"email": ""}}}


@router.delete("/auth/apikey/me")
def revoke_own_api_key(request: Request, owner: str = Depends(require_owner)) -> dict:
    """Revoke the presented key, and only it (``tinker auth logout``); at once in this process,
    within the auth cache time (10 s) in other API processes."""
    st, key = _own_key(request, owner)
    st.store.revoke_api_key(key.id)
    st.auth.forget(request.headers["x-api-key"])
    return {}


@router.post("/client/dynamic_config")
def dynamic_config(body: ClientConfigRequest, owner: str = Depends(require_owner)) -> dict:
    # sample_cancel_enabled: abandoned sampling futures are cancelled (POST /cancel_future)
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}


@router.get("/get_server_capabilities")
def server_capabilities(request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    engines = {e.base_model: e for e in st.store.engines()}
    models = []
    for name, m in st.config.models.items():
        caps = engines[name].capabilities if name in engines else []
        models.append(
            {"model_name": name, "max_context_length": m.limits.max_seq_len, "trainable": True,
             "sampleable": "sample" in caps}
        )
    return {"supported_models": models}


@router.get("/healthz")
def healthz(request: Request) -> dict:
    st = ember(request)
    engines = {e.base_model: e.status for e in st.store.engines()}
    return {"status": "ok", "engines": {name: engines.get(name, "absent") for name in st.config.models}}


@router.post("/telemetry")
def telemetry(owner: str = Depends(require_owner)) -> dict:
    return {"status": "accepted"}


@router.post("/create_session")
def create_session(body: CreateSessionRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    sid = ember(request).store.create_session(
        owner, body.display_name, body.tags, body.user_metadata or {}, body.sdk_version, body.project_id
    )
    return {"session_id": sid, "type": "create_session"}


@router.post("/session_heartbeat")
def session_heartbeat(body: SessionHeartbeatRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    try:
        status = ember(request).store.heartbeat(body.session_id, owner)
    except KeyError:
        raise not_found(f"session {body.session_id!r}") from None
    if status != "active":
        raise gone(f"session {body.session_id} is {status}")
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(
    session_id: str, request: Request, body: FinishSessionRequest | None = None, owner: str = Depends(require_owner)
) -> dict:
    st = ember(request)
    if st.store.get_session(session_id, owner) is None:
        raise not_found(f"session {session_id!r}")
    reason = ((body.reason or {}).get("type") if body else None) or "success"
    st.store.end_session(session_id, "finished", reason)
    return {}

