"""Helpers shared by the routes: state access, ownership and liveness checks, tinker paths."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from fastapi import Request

from ember.server.app import EmberState
from ember.server.config import ServedModel
from ember.server.errors import ApiError, bad_request, gone, not_found
from ember.store.models import Checkpoint, TrainingModel
from ember.store.repo import Conflict, Gone, NotLive, utcnow

SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
KINDS = {v: k for k, v in SEGMENTS.items()}
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
TTL_MIN_S, TTL_MAX_S = 3600, 10 * 365 * 24 * 3600


def ember(request: Request) -> EmberState:
    return request.app.state.ember


def iso(dt: datetime | None) -> str | None:
    return None if dt is None else dt.replace(tzinfo=UTC).isoformat()


def served_model(st: EmberState, name: str) -> ServedModel:
    model = st.config.models.get(name)
    if model is None:
        raise bad_request(f"base_model {name!r} is not served here; available: {sorted(st.config.models)}")
    return model


def check_name(name: str, field: str = "path") -> str:
    """A checkpoint name: letters, digits, ``_ . -``; no ``/``, no leading dot (no path traversal)."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise bad_request(
            f"{field} {name!r} is not a valid checkpoint name: use 1-200 letters, digits, '_', '.', '-' "
            "(no '/', no leading '.', no '..')"
        )
    return name


def expiry(ttl_seconds: int | None) -> datetime | None:
    if ttl_seconds is None:
        return None
    if not TTL_MIN_S <= ttl_seconds <= TTL_MAX_S:
        raise bad_request(f"ttl_seconds={ttl_seconds} must be between {TTL_MIN_S} (1 hour) and {TTL_MAX_S} (10 years)")
    return utcnow() + timedelta(seconds=ttl_seconds)


def live_model(st: EmberState, owner: str, model_id: str) -> TrainingModel:
    """The owner's model, ready to take requests: 404 if unknown, 410 if its session or the model
    ended, 400 if its creation failed."""
    model, session = st.store.model_and_session(model_id, owner)
    if model is None or session is None:
        raise not_found(f"model {model_id!r}")
    if session.status != "active":
        raise gone(f"session {session.id!r} is {session.status} ({session.end_reason}); start a new ServiceClient")
    if model.status in ("lost", "unloaded"):
        raise gone(f"model {model_id} is {model.status}: {model.status_detail}")
    if model.status == "failed":
        raise bad_request(f"model {model_id} could not be created: {model.status_detail}")
    return model


_MODEL_CACHE_SIZE = 4096


def hot_model(st: EmberState, owner: str, model_id: str) -> tuple[TrainingModel, bool]:
    """The owner's model for the hot submit routes (forward_backward, optim_step): ``(model,
    checked)``. A model this process already saw live comes from its cache without a read (a
    model's id, owner, session and base model never change) with ``checked`` False: the submit
    must then pass ``live=True``, which checks liveness inside its own transaction. Otherwise
    ``live_model`` (which caches it) and ``checked`` True."""
    cache = st.models
    model = cache.get(model_id)
    if model is not None and model.owner == owner:
        return model, False
    model = live_model(st, owner, model_id)
    if len(cache) >= _MODEL_CACHE_SIZE:
        cache.clear()
    cache[model_id] = model
    return model, True


def active_session(st: EmberState, owner: str, session_id: str):
    try:
        return st.store.active_session(session_id, owner)
    except KeyError:
        raise not_found(f"session {session_id!r}") from None
    except Gone as e:
        raise gone(str(e)) from None


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://{run}/{segment}/{name}`` -> ``(run, kind, name)``; 400 if malformed."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise bad_request(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0]:
        raise bad_request(f"{path!r} must look like tinker://<run>/<weights|sampler_weights|external_weights>/<name>")
    check_name(parts[2], "checkpoint name")
    return parts[0], KINDS[parts[1]], parts[2]


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{SEGMENTS[kind]}/{name}"


def readable_checkpoint(st: EmberState, owner: str, path: str) -> Checkpoint:
    """A ready checkpoint the owner may load (its own or a published one), else 404."""
    parse_tinker_path(path)
    ckpt = st.store.get_checkpoint(path, owner, allow_public=True)
    if ckpt is None or ckpt.state != "ready":
        raise not_found(f"checkpoint {path!r}")
    return ckpt


def submit(st: EmberState, **kwargs) -> str:
    """``Store.submit`` with its conflicts reported as 400 (never 409: the SDK retries those) and,
    with ``live=True``, a model that cannot take requests as ``live_model`` reports it (404, 410
    or 400; not recorded as a rejection)."""
    st.quota.check(kwargs["owner"], "queued_requests")
    try:
        rid = st.store.submit(**kwargs)
    except Conflict as e:
        raise bad_request(str(e)) from None
    except NotLive as e:
        st.models.pop(kwargs.get("model_id"), None)
        err = ApiError({"missing": 404, "gone": 410}.get(e.kind, 400), str(e))
        err.rejectable = False  # type: ignore[attr-defined]
        raise err from None
    st.ring(kwargs["base_model"])
    return rid


@contextmanager
def sequenced(
    st: EmberState, owner: str, model: TrainingModel, op: str, seq_id: int, checked: bool = True
) -> Iterator[None]:
    """Around the validation and submission of a model's request with ``seq_id``: a 4xx raised
    inside records the request as rejected, so it still takes its seq_id and the model's later
    requests (which the SDK numbers after it) are not held up waiting for it. ``checked=False``
    (a model from ``hot_model``'s cache): before recording a rejection, check that the model is
    live, so that a dead model answers 404/410 as it would have before validation."""
    try:
        yield
    except ApiError as e:
        if 400 <= e.status_code < 500 and getattr(e, "rejectable", True):
            if not checked:
                try:
                    live_model(st, owner, model.id)
                except ApiError:
                    st.models.pop(model.id, None)
                    raise
            reject(st, owner, model, op, seq_id, str(e.detail))
        raise


def reject(st: EmberState, owner: str, model: TrainingModel, op: str, seq_id: int, message: str) -> ApiError:
    """Record a request that failed validation and return the 400 to raise."""
    from ember.store.payload import encode

    try:
        st.store.submit(
            owner=owner, base_model=model.base_model, op="rejected", payload=encode({"error": message, "op": op}),
            model_id=model.id, seq_id=seq_id,
        )
    except Conflict:
        pass
    return bad_request(message)


def str_metadata(meta: dict | None) -> dict[str, str] | None:
    """``user_metadata`` as the SDK's response types want it (string values)."""
    if meta is None:
        return None
    return {str(k): v if isinstance(v, str) else str(v) for k, v in meta.items()}


def checkpoint_json(c: Checkpoint) -> dict:
    return {
        "checkpoint_id": f"{SEGMENTS[c.kind]}/{c.name}",
        "checkpoint_type": c.kind,
        "time": iso(c.created_at),
        "tinker_path": c.tinker_path,
        "size_bytes": c.size_bytes,
        "public": bool(c.public),
        "user_metadata": str_metadata(c.user_metadata),
        "expires_at": iso(c.expires_at),
    }
