"""``Store``: every read and write of Ember's state, in short transactions.

The API process and the engine processes share one database. Submits are idempotent on
``(model_id, seq_id)`` / ``(sampler_id, seq_id)``: a resubmission returns the original request id.
Each model's execution cursor (``models.next_seq``) moves in the same transaction that completes the
request it ran, so a crash never leaves a result without its cursor step or the reverse.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from sqlalchemy import Connection, Engine, Row, and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.orm import sessionmaker

from ember.store.db import connect, migrate, writer
from ember.store.models import (
    ApiKey,
    Checkpoint,
    CustomLoss,
    EngineRecord,
    Future,
    ResultListener,
    RunMetric,
    SamplingSession,
    Session,
    Setting,
    TrainingModel,
)

KEY_PREFIX = "tml-"
T = TypeVar("T")
NO_AUTH_OWNER = "local"


def utcnow() -> datetime:
    """Naive UTC now (the store's time convention)."""
    return datetime.now(UTC).replace(tzinfo=None)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Conflict(ValueError):
    """A request that contradicts stored state (reported as a 4xx with the message, never 409)."""


class Gone(ValueError):
    """The object existed but has ended (finished session, unloaded or lost model): HTTP 410."""


class NotLive(ValueError):
    """``Store.submit(live=True)``: the model cannot take requests. ``kind``: ``missing`` (no such
    model for this owner: 404), ``gone`` (its session or the model ended: 410) or ``failed`` (its
    creation failed: 400)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PendingFuture:
    """What the engine's scheduler needs to know about a queued request (no payload)."""

    id: str
    op: str
    model_id: str | None
    sampler_id: str | None
    seq_id: int | None
    n_tokens: int
    created_at: datetime


@dataclass(frozen=True)
class ModelCursor:
    next_seq: int
    status: str


# the columns of a PendingFuture, in its field order (the engine's queue reads)
_PENDING_COLUMNS = (
    Future.id,
    Future.op,
    Future.model_id,
    Future.sampler_id,
    Future.seq_id,
    Future.n_tokens,
    Future.created_at,
)

# Prebuilt statements of the hot paths (a submit, an engine tick): Core statements on the tables,
# compiled once and cached, instead of ORM units of work.
_FUTURES = Future.__table__
_MODELS = TrainingModel.__table__
_MODEL_STATE = (
    select(
        TrainingModel.next_seq,
        TrainingModel.status,
        TrainingModel.status_detail,
        TrainingModel.owner,
        Session.id.label("session_id"),
        Session.status.label("session_status"),
        Session.end_reason,
    )
    .outerjoin(Session, Session.id == TrainingModel.session_id)
    .where(TrainingModel.id == bindparam("mid"))
)
_PENDING_WITH_CURSORS = (
    select(*_PENDING_COLUMNS, TrainingModel.next_seq, TrainingModel.status)
    .outerjoin(TrainingModel, TrainingModel.id == Future.model_id)
    .where(Future.base_model == bindparam("base_model"), Future.state == "pending")
    .order_by(Future.created_at, Future.id)
    .limit(bindparam("limit"))
)
_INSERT_FUTURE = insert(_FUTURES)
_GET_FUTURE = select(_FUTURES).where(_FUTURES.c.id == bindparam("fid"), _FUTURES.c.owner == bindparam("owner"))
_FINISH_DONE = (
    update(_FUTURES)
    .where(_FUTURES.c.id == bindparam("fid"))
    .values(state="done", result=bindparam("result"), finished_at=bindparam("now"), payload=None)
)
_FINISH_FAILED = (
    update(_FUTURES)
    .where(_FUTURES.c.id == bindparam("fid"))
    .values(
        state="failed",
        error=bindparam("error"),
        category=bindparam("category"),
        finished_at=bindparam("now"),
        payload=None,
    )
)
_ADVANCE = (  # a model's requests up to nxt - 1 ran (``last_request_time``: when its last one did)
    update(_MODELS)
    .where(_MODELS.c.id == bindparam("mid"), _MODELS.c.next_seq < bindparam("nxt"))
    .values(next_seq=bindparam("nxt"), last_request_time=bindparam("now"))
)

_CLAIM_NEXT = (  # a model's next request if it is an op and the model is active (``finish(claim_next=True)``)
    update(_FUTURES)
    .where(
        _FUTURES.c.model_id == bindparam("mid"),
        _FUTURES.c.seq_id == bindparam("nxt"),
        _FUTURES.c.state == "pending",
        _FUTURES.c.op != "forward_backward",
        _FUTURES.c.model_id.in_(
            select(_MODELS.c.id).where(_MODELS.c.id == bindparam("mid"), _MODELS.c.status == "active")
        ),
    )
    .values(state="running", started_at=bindparam("now"))
    .returning(*(_FUTURES.c[c.key] for c in _PENDING_COLUMNS), _FUTURES.c.payload)
)

_ENGINES = EngineRecord.__table__
_HEARTBEAT = update(_ENGINES).where(_ENGINES.c.base_model == bindparam("bm")).values(heartbeat_at=bindparam("now"))
_BEAT_MEMORY = _HEARTBEAT.values(memory_bytes=bindparam("mem"))
_INSERT_METRICS = insert(RunMetric.__table__)
_PROGRESS = _HEARTBEAT.values(
    memory_bytes=bindparam("mem"),
    passes=_ENGINES.c.passes + bindparam("passes"),
    tokens=_ENGINES.c.tokens + bindparam("tokens"),
    busy_seconds=_ENGINES.c.busy_seconds + bindparam("seconds"),
    last_pass_seconds=bindparam("seconds"),
    last_pass_tokens=bindparam("tokens"),
)


def _check_live(model_id: str, owner: str, m) -> None:
    """``NotLive`` unless the row of ``_MODEL_STATE`` says the owner's model can take requests
    (the same rules and messages as the API's ``live_model``)."""
    if m is None or m.owner != owner or m.session_id is None:
        raise NotLive("missing", f"model {model_id!r} not found")
    if m.session_status != "active":
        raise NotLive(
            "gone",
            f"session {m.session_id!r} is {m.session_status} ({m.end_reason}); start a new ServiceClient",
        )
    if m.status in ("lost", "unloaded"):
        raise NotLive("gone", f"model {model_id} is {m.status}: {m.status_detail}")
    if m.status == "failed":
        raise NotLive("failed", f"model {model_id} could not be created: {m.status_detail}")


class Store:
    """Repository over Ember's tables (see :mod:`ember.store.models`)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write_engine = writer(engine)
        self._write = sessionmaker(self._write_engine, expire_on_commit=False)
        # SQLite takes one writer at a time; threads of this process queue here instead of in
        # SQLite's busy handler, whose sleeps (up to 100 ms) collapse throughput under contention.
        self._write_lock = threading.Lock() if engine.dialect.name == "sqlite" else nullcontext()

    @classmethod
    def open(cls, url: str, pool_size: int = 10, run_migrations: bool = True) -> Store:
        """Connect to ``url`` and (by default) migrate the schema to the newest revision."""
        engine = connect(url, pool_size)
        if run_migrations:
            migrate(engine)
        return cls(engine)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def read(self) -> Iterator[OrmSession]:
        with self._read() as s:
            yield s

    @contextmanager
    def write(self) -> Iterator[OrmSession]:
        """A write transaction: committed on success, rolled back on error."""
        with self._write_lock, self._write.begin() as s:
            yield s

    @contextmanager
    def write_core(self) -> Iterator[Connection]:
        """``write`` on a Core connection, for the hot paths (a submit, an engine's tick and
        finish) that run only Core statements: without the ORM session's unit of work a
        transaction costs about half as much."""
        with self._write_lock, self._write_engine.begin() as conn:
            yield conn

    def close(self) -> None:
        self.engine.dispose()

    # -- settings ---------------------------------------------------------------------------------

    def setting(self, key: str, make: Callable[[], str]) -> str:
        """The stored value of ``key``; created with ``make()`` on first use (race-safe)."""
        with self.read() as s:
            row = s.get(Setting, key)
            if row is not None:
                return row.value
        try:
            with self.write() as s:
                s.add(Setting(key=key, value=make()))
        except IntegrityError:
            pass
        with self.read() as s:
            return s.get(Setting, key).value  # type: ignore[union-attr]

    # -- API keys ---------------------------------------------------------------------------------

    def create_api_key(self, name: str = "") -> tuple[str, str]:
        """A new key: returns ``(key_id, key)``; only the key's hash is stored."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = "key-" + secrets.token_hex(6)
        with self.write() as s:
            s.add(ApiKey(id=key_id, name=name, key_hash=hash_key(key), created_at=utcnow()))
        return key_id, key

    def owner_of_key(self, key: str) -> str | None:
        """The key id owning ``key``, or ``None`` if unknown or revoked."""
        with self.read() as s:
            row = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
            return row.id if row is not None and row.revoked_at is None else None

    def get_api_key(self, key_id: str) -> ApiKey | None:
        with self.read() as s:
            return s.get(ApiKey, key_id)

    def key_active(self, key_id: str) -> bool:
        """Whether the API key ``key_id`` exists and is not revoked."""
        row = self.get_api_key(key_id)
        return row is not None and row.revoked_at is None

    def list_api_keys(self) -> list[ApiKey]:
        with self.read() as s:
            return list(s.scalars(select(ApiKey).order_by(ApiKey.created_at)))

    def revoke_api_key(self, key_id: str) -> bool:
        with self.write() as s:
            row = s.get(ApiKey, key_id)
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = utcnow()
            return True

    # -- sessions ---------------------------------------------------------------------------------

    def create_session(
        self, owner: str, display_name: str | None, tags: list, user_metadata: dict, sdk_version: str | None,
        project_id: str | None = None,
    ) -> str:
        sid = str(uuid.uuid4())
        now = utcnow()
        with self.write() as s:
            s.add(
                Session(
                    id=sid,
                    owner=owner,
                    display_name=display_name,
                    project_id=project_id,
                    tags=list(tags),
                    user_metadata=dict(user_metadata),
                    sdk_version=sdk_version,
                    created_at=now,
                    last_heartbeat=now,
                )
            )
        return sid

    def get_session(self, session_id: str, owner: str) -> Session | None:
        with self.read() as s:
            row = s.get(Session, session_id)
            return row if row is not None and row.owner == owner else None

    def active_session(self, session_id: str, owner: str) -> Session:
        """The owner's active session; ``KeyError`` if unknown, ``Gone`` if ended."""
        row = self.get_session(session_id, owner)
        if row is None:
            raise KeyError(f"session {session_id!r} not found")
        if row.status != "active":
            raise Gone(f"session {session_id!r} is {row.status} ({row.end_reason}); start a new ServiceClient")
        return row

    def heartbeat(self, session_id: str, owner: str) -> str:
        """Record a heartbeat; returns the session's status (``KeyError`` if unknown)."""
        with self.write() as s:
            row = s.get(Session, session_id)
            if row is None or row.owner != owner:
                raise KeyError(f"session {session_id!r} not found")
            if row.status == "active":
                row.last_heartbeat = utcnow()
            return row.status

    def end_session(self, session_id: str, status: str, reason: str) -> list[str]:
        """Finish or expire a session and queue unloads for its models; returns their ids."""
        with self.write() as s:
            row = s.get(Session, session_id)
            if row is None or row.status != "active":
                return []
            row.status, row.end_reason, row.ended_at = status, reason, utcnow()
            models = list(
                s.scalars(
                    select(TrainingModel).where(
                        TrainingModel.session_id == session_id, TrainingModel.status.in_(("creating", "active"))
                    )
                )
            )
            for m in models:
                self._queue_unload(s, m, f"session {session_id} {status}: {reason}")
            for sampler in s.scalars(select(SamplingSession).where(SamplingSession.session_id == session_id)):
                self._new_future(s, sampler.owner, sampler.base_model, "unload_sampler", None, sampler_id=sampler.id)
            return [m.id for m in models]

    def expire_idle_sessions(self, timeout_s: float) -> list[str]:
        """End sessions whose last heartbeat is older than ``timeout_s``; returns their ids."""
        cutoff = utcnow() - timedelta(seconds=timeout_s)
        with self.read() as s:
            ids = list(s.scalars(select(Session.id).where(Session.status == "active", Session.last_heartbeat < cutoff)))
        for sid in ids:
            self.end_session(sid, "expired", f"no heartbeat for {timeout_s:g} s")
        return ids

    def assign_project(self, session_id: str, owner: str, project_id: str) -> bool:
        """Put the owner's session in ``project_id``; False if there is no such session."""
        with self.write() as s:
            row = s.get(Session, session_id)
            if row is None or row.owner != owner:
                return False
            row.project_id = project_id
            return True

    def search_sessions(
        self,
        owner: str,
        match: Callable[[Session], bool],
        limit: int,
        *,
        session_id: str | None = None,
        name_words: Sequence[str] = (),
        after: tuple[datetime, str] | None = None,
    ) -> list[tuple[Session, int, int]]:
        """The owner's sessions newest first (``created_at``, then id, both descending), starting
        after the ``(created_at, id)`` key ``after``, that match ``session_id`` or contain every
        word of ``name_words`` in their display name (case-insensitively; either one, when both
        are given) and ``match(session)``; at most ``limit``, each with its training runs'
        checkpoint count and bytes."""
        q = select(Session).where(Session.owner == owner)
        by_name = [func.lower(Session.display_name).contains(w.lower(), autoescape=True) for w in name_words]
        if session_id is not None or by_name:
            q = q.where(or_(*([Session.id == session_id] if session_id is not None else []),
                            *([and_(*by_name)] if by_name else [])))
        if after is not None:
            q = q.where(or_(Session.created_at < after[0], and_(Session.created_at == after[0], Session.id < after[1])))
        q = q.order_by(Session.created_at.desc(), Session.id.desc())
        found: list[Session] = []
        with self.read() as s:
            for row in s.scalars(q.execution_options(yield_per=200)):
                if match(row):
                    found.append(row)
                    if len(found) == limit:
                        break
            sizes = {}
            if found:
                runs = select(TrainingModel.id).where(TrainingModel.session_id.in_([r.id for r in found]))
                counts = (
                    select(TrainingModel.session_id, func.count(Checkpoint.tinker_path), func.sum(Checkpoint.size_bytes))
                    .join(Checkpoint, Checkpoint.model_id == TrainingModel.id)
                    .where(Checkpoint.model_id.in_(runs), Checkpoint.state == "ready")
                    .group_by(TrainingModel.session_id)
                )
                sizes = {sid: (n, int(b or 0)) for sid, n, b in s.execute(counts)}
        return [(r, *sizes.get(r.id, (0, 0))) for r in found]

    def list_sessions(self, owner: str, limit: int, offset: int) -> list[Session]:
        with self.read() as s:
            q = select(Session).where(Session.owner == owner).order_by(Session.created_at.desc(), Session.id)
            return list(s.scalars(q.limit(limit).offset(offset)))

    def session_children(self, session_id: str) -> tuple[list[str], list[str]]:
        """``(training run ids, sampler ids)`` of a session."""
        with self.read() as s:
            runs = s.scalars(select(TrainingModel.id).where(TrainingModel.session_id == session_id))
            samplers = s.scalars(select(SamplingSession.id).where(SamplingSession.session_id == session_id))
            return sorted(runs), sorted(samplers)

    def session_requests(self, session_id: str, limit: int = 100_000) -> list[Row]:
        """The newest ``limit`` requests still stored (finished ones are purged after the retention
        window) of a session's training runs and samplers, oldest first: id, op, model_id,
        sampler_id, seq_id, n_tokens, state, error and the created/started/finished times."""
        runs = select(TrainingModel.id).where(TrainingModel.session_id == session_id)
        samplers = select(SamplingSession.id).where(SamplingSession.session_id == session_id)
        f = _FUTURES.c
        q = (
            select(f.id, f.op, f.model_id, f.sampler_id, f.seq_id, f.n_tokens, f.state, f.error,
                   f.created_at, f.started_at, f.finished_at)
            .where(or_(f.model_id.in_(runs), f.sampler_id.in_(samplers)))
            .order_by(f.created_at.desc(), f.id.desc())
            .limit(limit)
        )
        with self.engine.connect() as conn:
            return list(conn.execute(q))[::-1]

    # -- models -----------------------------------------------------------------------------------

    def model_and_session(self, model_id: str, owner: str) -> tuple[TrainingModel | None, Session | None]:
        """The owner's model and its session, in one read."""
        with self.read() as s:
            m = s.get(TrainingModel, model_id)
            if m is None or m.owner != owner:
                return None, None
            return m, s.get(Session, m.session_id)

    def get_model(self, model_id: str, owner: str | None) -> TrainingModel | None:
        """The model if it exists and ``owner`` owns it (any owner when ``owner`` is None)."""
        with self.read() as s:
            row = s.get(TrainingModel, model_id)
            return row if row is not None and (owner is None or row.owner == owner) else None

    def submit_model(
        self,
        *,
        owner: str,
        session_id: str,
        model_seq_id: int,
        base_model: str,
        lora: dict,
        optimizer_config: dict,
        user_metadata: dict,
        op: str,
        payload: bytes,
        reply: dict | None = None,
    ) -> str:
        """Create model ``{session}:train:{n}`` and queue its creation (seq 0); idempotent."""
        model_id = f"{session_id}:train:{model_seq_id}"
        now = utcnow()
        try:
            with self.write() as s:
                existing = s.get(TrainingModel, model_id)
                if existing is None:
                    s.add(
                        TrainingModel(
                            id=model_id,
                            session_id=session_id,
                            owner=owner,
                            base_model=base_model,
                            lora=lora,
                            optimizer_config=optimizer_config,
                            user_metadata=user_metadata,
                            status="creating",
                            next_seq=0,
                            created_at=now,
                            last_request_time=now,
                        )
                    )
                    s.flush()
                    fid = self._new_future(s, owner, base_model, op, payload, model_id=model_id, seq_id=0, reply=reply)
                    return fid
        except IntegrityError:
            pass
        with self.read() as s:
            fid = s.scalar(select(Future.id).where(Future.model_id == model_id, Future.seq_id == 0))
        if fid is None:
            raise Conflict(f"model {model_id} exists but has no creation request")
        return fid

    def list_models(self, owner: str, limit: int, offset: int) -> tuple[list[TrainingModel], int]:
        with self.read() as s:
            q = select(TrainingModel).where(TrainingModel.owner == owner)
            total = s.scalar(select(func.count()).select_from(q.subquery())) or 0
            rows = s.scalars(q.order_by(TrainingModel.created_at.desc(), TrainingModel.id).limit(limit).offset(offset))
            return list(rows), total

    def _queue_unload(self, s: OrmSession, m: TrainingModel, reason: str) -> None:
        m.status, m.status_detail = "unloaded", reason
        self._new_future(s, m.owner, m.base_model, "unload_model", None, model_id=m.id)

    # -- futures ----------------------------------------------------------------------------------

    def _new_future(
        self,
        s: OrmSession,
        owner: str,
        base_model: str,
        op: str,
        payload: bytes | None,
        *,
        model_id: str | None = None,
        sampler_id: str | None = None,
        seq_id: int | None = None,
        n_tokens: int = 0,
        state: str = "pending",
        error: str | None = None,
        reply: dict | None = None,
    ) -> str:
        fid = str(uuid.uuid4())
        now = utcnow()
        s.add(
            Future(
                id=fid,
                owner=owner,
                base_model=base_model,
                op=op,
                model_id=model_id,
                sampler_id=sampler_id,
                seq_id=seq_id,
                n_tokens=n_tokens,
                state=state,
                payload=payload,
                reply=reply,
                error=error,
                category="user" if error else None,
                created_at=now,
                finished_at=now if state in ("done", "failed") else None,
            )
        )
        return fid

    @staticmethod
    def _keyed_query(model_id: str | None, sampler_id: str | None, seq_id: int):
        if model_id is not None:
            return select(Future.id).where(Future.model_id == model_id, Future.seq_id == seq_id)
        return select(Future.id).where(Future.sampler_id == sampler_id, Future.seq_id == seq_id)

    def _existing(self, model_id: str | None, sampler_id: str | None, seq_id: int) -> str | None:
        with self.read() as s:
            return s.scalar(self._keyed_query(model_id, sampler_id, seq_id))

    # -- custom losses ----------------------------------------------------------------------------

    def create_custom_loss(self, *, owner: str, session_id: str, seq: int, program: dict) -> str:
        """Store a loss uploaded with ``create_custom_loss`` (``program``: validated by
        :func:`ember.lossgraph.validate_program`) as ``{session}:loss:{seq}`` and return the id of its
        future, finished at once with ``{"loss_id"}``. A resubmission of ``(session, seq)`` returns
        the same future."""
        loss_id = f"{session_id}:loss:{seq}"
        fid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"ember-custom-loss:{loss_id}"))
        try:
            with self.write() as s:
                if s.get(CustomLoss, loss_id) is not None:
                    return fid
                now = utcnow()
                s.add(
                    CustomLoss(
                        id=loss_id,
                        owner=owner,
                        session_id=session_id,
                        seq=seq,
                        name=program["name"],
                        inputs=program["inputs"],
                        graph={"nodes": program["nodes"]},
                        created_at=now,
                    )
                )
                s.flush()
                s.add(
                    Future(
                        id=fid,
                        owner=owner,
                        base_model="",
                        op="create_custom_loss",
                        state="done",
                        reply={"loss_id": loss_id, "type": "create_custom_loss"},
                        created_at=now,
                        finished_at=now,
                    )
                )
        except IntegrityError:  # a concurrent resubmission stored it first
            pass
        return fid

    def get_custom_loss(self, loss_id: str, owner: str) -> dict | None:
        """The owner's loss ``loss_id`` as a program (``{"name", "inputs", "nodes", "session_id"}``)."""
        with self.read() as s:
            row = s.get(CustomLoss, loss_id)
            if row is None or row.owner != owner:
                return None
            return {"name": row.name, "inputs": row.inputs, "nodes": row.graph["nodes"], "session_id": row.session_id}

    def submit(
        self,
        *,
        owner: str,
        base_model: str,
        op: str,
        payload: bytes | None,
        model_id: str | None = None,
        sampler_id: str | None = None,
        seq_id: int | None = None,
        n_tokens: int = 0,
        rejected: str | None = None,
        checkpoint: Checkpoint | None = None,
        overwrite: bool = False,
        reply: dict | None = None,
        live: bool = False,
    ) -> str:
        """Queue a request and return its request id; a resubmission of ``(model, seq_id)`` or
        ``(sampler, seq_id)`` returns the original id. ``rejected`` records a request that failed
        validation: it still takes its seq_id, so the model's later requests are not held up.
        ``checkpoint`` is registered (pending) in the same transaction, refusing a name clash
        unless ``overwrite``. ``live``: first check, in the same transaction, that ``owner``'s
        model can take requests (its session is active, the model neither ended nor failed), else
        raise :class:`NotLive` (the API's hot routes: one transaction per submit)."""
        keyed = seq_id is not None and (model_id is not None or sampler_id is not None)
        try:
            with self.write() if checkpoint is not None else self.write_core() as s:
                m = s.execute(_MODEL_STATE, {"mid": model_id}).first() if model_id is not None else None
                if live and model_id is not None:
                    _check_live(model_id, owner, m)
                # A resubmission answers the original request. Looked up first where the insert
                # below cannot find it: a seq_id already executed, or a checkpoint whose name the
                # original registered; otherwise the insert's unique key finds it (except below).
                stale = m is not None and seq_id is not None and seq_id < m.next_seq
                if keyed and (stale or checkpoint is not None or m is None):
                    fid = s.scalar(self._keyed_query(model_id, sampler_id, seq_id))  # type: ignore[arg-type]
                    if fid is not None:
                        return fid
                if stale:
                    raise Conflict(f"seq_id {seq_id} of model {model_id} was already executed (next is {m.next_seq})")
                if checkpoint is not None and rejected is None:
                    self._register_checkpoint(s, checkpoint, overwrite)
                fid = str(uuid.uuid4())
                failed = rejected is not None
                now = utcnow()
                s.execute(
                    _INSERT_FUTURE,
                    {
                        "id": fid,
                        "owner": owner,
                        "base_model": base_model,
                        "op": op,
                        "model_id": model_id,
                        "sampler_id": sampler_id,
                        "seq_id": seq_id,
                        "n_tokens": n_tokens,
                        "state": "failed" if failed else "pending",
                        "payload": None if failed else payload,
                        "reply": reply,
                        "error": rejected,
                        "category": "user" if failed else None,
                        "created_at": now,
                        "finished_at": now if failed else None,
                    },
                )
                return fid
        except IntegrityError:
            # a concurrent or repeated submission of the same (model or sampler, seq_id)
            if keyed:
                fid = self._existing(model_id, sampler_id, seq_id)  # type: ignore[arg-type]
                if fid is not None:
                    return fid
            raise

    def get_future(self, request_id: str, owner: str) -> Row | None:
        """The owner's request ``request_id`` (every column of ``futures``), else None."""
        with self.engine.connect() as conn:
            return conn.execute(_GET_FUTURE, {"fid": request_id, "owner": owner}).first()

    def cancel_sample(self, request_id: str, owner: str) -> bool | None:
        """Fail the owner's sampling request ``request_id`` as cancelled if no engine has claimed it
        yet (samplers have no execution order, so nothing waits on it). ``True``: cancelled,
        ``False``: already running or finished, or not a sampling request (nothing to do), ``None``:
        no such request of this owner."""
        with self.write() as s:
            # one conditional statement: an engine's claim (pending -> running) either came first
            # (nothing cancelled) or finds the row failed
            done = s.execute(
                update(Future)
                .where(Future.id == request_id, Future.owner == owner, Future.op == "sample", Future.state == "pending")
                .values(
                    state="failed", error="cancelled by the client", category="user", payload=None, finished_at=utcnow()
                )
            ).rowcount
            if done:
                return True
            return False if s.scalar(select(Future.id).where(Future.id == request_id, Future.owner == owner)) else None

    def finished_among(self, request_ids: Sequence[str]) -> set[str]:
        """The ids among ``request_ids`` that are done or failed."""
        if not request_ids:
            return set()
        with self.read() as s:
            q = select(Future.id).where(Future.id.in_(list(request_ids)), Future.state.in_(("done", "failed")))
            return set(s.scalars(q))

    def usage(self, owner: str, what: str) -> int:
        """What ``owner`` holds now, for its quotas: ``training_runs`` (models creating or active),
        ``samplers`` (samplers of active sessions), ``checkpoint_bytes`` (ready and pending
        checkpoints) or ``queued_requests`` (futures pending or running)."""
        with self.read() as s:
            if what == "training_runs":
                q = select(func.count()).select_from(TrainingModel).where(
                    TrainingModel.owner == owner, TrainingModel.status.in_(("creating", "active")))
            elif what == "samplers":
                q = select(func.count()).select_from(SamplingSession).join(
                    Session, Session.id == SamplingSession.session_id).where(
                    SamplingSession.owner == owner, Session.status == "active")
            elif what == "checkpoint_bytes":
                q = select(func.coalesce(func.sum(Checkpoint.size_bytes), 0)).where(
                    Checkpoint.owner == owner, Checkpoint.state.in_(("ready", "pending")))
            elif what == "queued_requests":
                q = select(func.count()).select_from(Future).where(
                    Future.owner == owner, Future.state.in_(("pending", "running")))
            else:
                raise ValueError(f"unknown usage {what!r}")
            return int(s.scalar(q) or 0)

    def queue_counts(self) -> dict[tuple[str, str], int]:
        """Number of futures by ``(base_model, state)``."""
        with self.read() as s:
            q = select(Future.base_model, Future.state, func.count()).group_by(Future.base_model, Future.state)
            return {(b, st): n for b, st, n in s.execute(q)}

    def purge_futures(self, older_than_s: float) -> int:
        """Delete finished futures older than the retention window (their results were fetched)."""
        cutoff = utcnow() - timedelta(seconds=older_than_s)
        with self.write() as s:
            res = s.execute(delete(Future).where(Future.state.in_(("done", "failed")), Future.finished_at < cutoff))
            return res.rowcount or 0

    # -- engine side ------------------------------------------------------------------------------

    def pending(self, base_model: str, limit: int = 10_000) -> list[PendingFuture]:
        """Queued requests of one base model, oldest first (no payloads)."""
        with self.read() as s:
            q = (
                select(*_PENDING_COLUMNS)
                .where(Future.base_model == base_model, Future.state == "pending")
                .order_by(Future.created_at, Future.id)
                .limit(limit)
            )
            return [PendingFuture(*row) for row in s.execute(q)]

    def pending_with_cursors(
        self, base_model: str, limit: int = 10_000
    ) -> tuple[list[PendingFuture], dict[str, ModelCursor]]:
        """``pending`` and the ``cursors`` of their models, in one query."""
        with self.read() as s:
            return self._pending_with_cursors(s, base_model, limit)

    @staticmethod
    def _pending_with_cursors(
        s: OrmSession | Connection, base_model: str, limit: int
    ) -> tuple[list[PendingFuture], dict[str, ModelCursor]]:
        pending, cursors = [], {}
        for *row, next_seq, status in s.execute(_PENDING_WITH_CURSORS, {"base_model": base_model, "limit": limit}):
            f = PendingFuture(*row)
            pending.append(f)
            if f.model_id is not None and next_seq is not None:
                cursors[f.model_id] = ModelCursor(next_seq, status)
        return pending, cursors

    def take(
        self,
        base_model: str,
        choose: Callable[[list[PendingFuture], dict[str, ModelCursor]], tuple[T, Sequence[str]]],
        limit: int = 10_000,
    ) -> tuple[T | None, dict[str, bytes | None]]:
        """The engine's tick in one transaction: read the queued requests of ``base_model`` with
        their models' cursors (``pending_with_cursors``), let ``choose(pending, cursors)`` pick
        ``(plan, ids)``, and claim ``ids`` (``claim``). Returns ``(plan, payloads)``; ``(None, {})``
        when nothing is queued."""
        with self.write_core() as s:
            pending, cursors = self._pending_with_cursors(s, base_model, limit)
            if not pending:
                return None, {}
            plan, ids = choose(pending, cursors)
            return plan, self._claim(s, ids)

    def cursors(self, model_ids: Sequence[str]) -> dict[str, ModelCursor]:
        if not model_ids:
            return {}
        with self.read() as s:
            q = select(TrainingModel.id, TrainingModel.next_seq, TrainingModel.status).where(
                TrainingModel.id.in_(list(set(model_ids)))
            )
            return {mid: ModelCursor(n, st) for mid, n, st in s.execute(q)}

    def claim(self, ids: Sequence[str]) -> dict[str, bytes | None]:
        """Mark requests running and return their payloads."""
        if not ids:
            return {}
        with self.write_core() as s:
            return self._claim(s, ids)

    @staticmethod
    def _claim(s: OrmSession | Connection, ids: Sequence[str]) -> dict[str, bytes | None]:
        if not ids:
            return {}
        q = (
            update(_FUTURES)
            .where(_FUTURES.c.id.in_(list(ids)))
            .values(state="running", started_at=utcnow())
            .returning(_FUTURES.c.id, _FUTURES.c.payload)
        )
        return dict(s.execute(q).all())

    def finish(
        self,
        outcomes: Sequence[tuple[str, bytes | None, str | None, str | None]],
        advance: dict[str, int] | None = None,
        model_status: dict[str, tuple[str, str | None]] | None = None,
        checkpoints: dict[str, tuple[str, int | None]] | None = None,
        progress: tuple[str, int, int, float, int | None, dict | None] | None = None,
        claim_next: bool = False,
        metrics: Sequence[tuple[str, int, str, dict[str, float]]] = (),
    ) -> list[tuple[PendingFuture, bytes | None]]:
        """Record results in one transaction: ``outcomes`` = ``(id, result, error, category)``;
        ``advance`` = new ``next_seq`` per model; ``model_status`` = ``(status, detail)`` per model;
        ``checkpoints`` = ``(state, size_bytes)`` per tinker path (``failed`` ones are removed);
        ``progress`` = ``(base_model, passes, tokens, seconds, memory_bytes, ranks)``: the engine's
        ``engine_progress``; ``metrics`` = ``(model_id, seq_id, op, {name: value})`` of finished
        training requests (``run_metrics``).

        ``claim_next``: in the same transaction, claim (mark running) the queued request of every
        advanced, active model that is next in its ``seq_id`` order and is not a forward_backward
        (typically the optim_step sent right after a forward_backward), and return it with its
        payload: the engine runs it at once instead of in its next tick."""
        now = utcnow()
        done = [{"fid": fid, "result": result, "now": now} for fid, result, error, _ in outcomes if error is None]
        failed = [
            {"fid": fid, "error": error, "category": category or "server", "now": now}
            for fid, _, error, category in outcomes
            if error is not None
        ]
        with self.write_core() as s:
            if progress is not None:
                self._progress(s, *progress)
            if done:
                s.execute(_FINISH_DONE, done)
            if metrics:
                s.execute(_INSERT_METRICS, [{"model_id": mid, "seq_id": seq, "op": op, "metrics": values,
                                             "created_at": now} for mid, seq, op, values in metrics])
            if failed:
                s.execute(_FINISH_FAILED, failed)
            if advance:
                s.execute(_ADVANCE, [{"mid": mid, "nxt": nxt, "now": now} for mid, nxt in advance.items()])
            for mid, (status, detail) in (model_status or {}).items():
                s.execute(update(_MODELS).where(_MODELS.c.id == mid).values(status=status, status_detail=detail))
            for path, (state, size) in (checkpoints or {}).items():
                if state == "failed":
                    s.execute(delete(Checkpoint).where(Checkpoint.tinker_path == path, Checkpoint.state == "pending"))
                else:
                    s.execute(
                        update(Checkpoint).where(Checkpoint.tinker_path == path).values(state=state, size_bytes=size)
                    )
            if not (claim_next and advance):
                return []
            claimed = []
            for mid, nxt in advance.items():
                claimed += s.execute(_CLAIM_NEXT, {"mid": mid, "nxt": nxt, "now": now}).all()
            return [(PendingFuture(*row[:-1]), row[-1]) for row in claimed]

    def register_engine(
        self, base_model: str, pid: int, capabilities: Sequence[str] = ("train",), doorbell_port: int | None = None
    ) -> int:
        """Record a (re)started engine; returns its generation."""
        now = utcnow()
        with self.write() as s:
            row = s.get(EngineRecord, base_model)
            if row is None:
                row = EngineRecord(base_model=base_model, generation=0)
                s.add(row)
            row.generation = (row.generation or 0) + 1
            row.pid, row.status, row.detail, row.started_at, row.heartbeat_at = pid, "starting", None, now, now
            row.capabilities = list(capabilities)
            row.doorbell_port = doorbell_port
            row.ranks = None
            return row.generation

    def engine_ranks(self, base_model: str, ranks: dict) -> None:
        """Record the processes of an engine that spans several (shown by ``ember status``)."""
        with self.write() as s:
            s.execute(update(EngineRecord).where(EngineRecord.base_model == base_model).values(ranks=ranks))

    def engine_ready(self, base_model: str, status: str = "ready") -> None:
        """Set the engine's status (``ready``; ``stopped`` when it exits cleanly)."""
        with self.write() as s:
            s.execute(update(EngineRecord).where(EngineRecord.base_model == base_model).values(status=status))

    def engine_progress(self, base_model: str, passes: int, tokens: int, seconds: float,
                        memory_bytes: int | None = None, ranks: dict | None = None) -> None:
        """Heartbeat plus work counters (``passes`` packed passes of ``tokens`` tokens) and the
        engine's memory in use (accelerator memory, or resident memory on the CPU); ``ranks``:
        the engine's processes anew (``engine_ranks``; an engine on Ray actors: with each one's
        memory), in the same transaction."""
        with self.write() as s:
            self._progress(s, base_model, passes, tokens, seconds, memory_bytes, ranks)

    @staticmethod
    def _progress(s: OrmSession | Connection, base_model: str, passes: int, tokens: int, seconds: float,
                  memory_bytes: int | None = None, ranks: dict | None = None) -> None:
        params = {"bm": base_model, "now": utcnow()}
        if ranks is not None:
            s.execute(update(_ENGINES).where(_ENGINES.c.base_model == base_model).values(ranks=ranks))
        if passes:
            s.execute(_PROGRESS, {**params, "passes": passes, "tokens": tokens, "seconds": seconds,
                                  "mem": memory_bytes})
        elif memory_bytes is not None:
            s.execute(_BEAT_MEMORY, {**params, "mem": memory_bytes})
        else:
            s.execute(_HEARTBEAT, params)

    def run_metrics(self, model_id: str, owner: str, after_seq: int = 0, limit: int = 10_000) -> list[dict]:
        """The owner's model's metric points after ``after_seq`` in ``seq_id`` order (``[]`` for
        another key's model): ``{"seq_id", "op", "step", "metrics", "time"}``, where ``step`` counts
        the model's ``optim_step`` points before this one."""
        with self.read() as s:
            if s.scalar(select(TrainingModel.id).where(TrainingModel.id == model_id,
                                                      TrainingModel.owner == owner)) is None:
                return []
            steps = s.scalar(select(func.count()).select_from(RunMetric).where(
                RunMetric.model_id == model_id, RunMetric.op == "optim_step", RunMetric.seq_id <= after_seq)) or 0
            rows = s.execute(select(RunMetric.seq_id, RunMetric.op, RunMetric.metrics, RunMetric.created_at)
                             .where(RunMetric.model_id == model_id, RunMetric.seq_id > after_seq)
                             .order_by(RunMetric.seq_id).limit(limit)).all()
        points = []
        for seq, op, values, at in rows:
            points.append({"seq_id": seq, "op": op, "step": steps, "metrics": values,
                           "time": at.replace(tzinfo=UTC).isoformat()})
            steps += op == "optim_step"
        return points

    def samplers_of(self, owner: str, limit: int = 200) -> list[SamplingSession]:
        """The owner's sampling sessions, newest first."""
        with self.read() as s:
            return list(s.scalars(select(SamplingSession).where(SamplingSession.owner == owner)
                                  .order_by(SamplingSession.created_at.desc()).limit(limit)))

    def owner_queue(self, owner: str) -> dict[str, int]:
        """The owner's unfinished requests by state."""
        with self.read() as s:
            q = (select(Future.state, func.count()).where(Future.owner == owner, Future.state.in_(("pending", "running")))
                 .group_by(Future.state))
            return dict(s.execute(q).all())

    # -- result listeners (API processes notified when requests finish) --------------------------

    def listen_results(self, listener_id: str, host: str, port: int, stale_after_s: float = 120.0) -> None:
        """Register (or refresh) an API process's result doorbell; prunes listeners not refreshed
        for ``stale_after_s``."""
        now = utcnow()
        with self.write() as s:
            row = s.get(ResultListener, listener_id)
            if row is None:
                s.add(ResultListener(id=listener_id, host=host, port=port, heartbeat_at=now))
            else:
                row.host, row.port, row.heartbeat_at = host, port, now
            s.execute(
                delete(ResultListener).where(ResultListener.heartbeat_at < now - timedelta(seconds=stale_after_s))
            )

    def unlisten_results(self, listener_id: str) -> None:
        with self.write() as s:
            s.execute(delete(ResultListener).where(ResultListener.id == listener_id))

    def result_listeners(self, host: str) -> list[int]:
        """Ports of the API processes on ``host`` that want result notifications."""
        with self.read() as s:
            return list(s.scalars(select(ResultListener.port).where(ResultListener.host == host)))

    def engines(self) -> list[EngineRecord]:
        with self.read() as s:
            return list(s.scalars(select(EngineRecord).order_by(EngineRecord.base_model)))

    def engine_lost(self, base_model: str, detail: str) -> tuple[int, int]:
        """The engine of ``base_model`` is gone: fail its pending and running requests and mark the
        models it held as lost. Returns ``(futures failed, models lost)``."""
        now = utcnow()
        with self.write() as s:
            s.execute(
                update(EngineRecord).where(EngineRecord.base_model == base_model).values(status="dead", detail=detail)
            )
            res = s.execute(
                update(Future)
                .where(Future.base_model == base_model, Future.state.in_(("pending", "running")))
                .values(state="failed", error=detail, category="server", finished_at=now, payload=None)
            )
            lost = s.execute(
                update(TrainingModel)
                .where(TrainingModel.base_model == base_model, TrainingModel.status.in_(("creating", "active")))
                .values(status="lost", status_detail=detail)
            )
            s.execute(delete(Checkpoint).where(Checkpoint.base_model == base_model, Checkpoint.state == "pending"))
            return res.rowcount or 0, lost.rowcount or 0

    # -- checkpoints ------------------------------------------------------------------------------

    def _register_checkpoint(self, s: OrmSession, ckpt: Checkpoint, overwrite: bool) -> None:
        old = s.get(Checkpoint, ckpt.tinker_path)
        if old is not None:
            if old.state == "pending":
                raise Conflict(f"checkpoint {ckpt.tinker_path} is being written by another request")
            if not overwrite:
                raise Conflict(f"checkpoint {ckpt.tinker_path} already exists; pass overwrite=True or pick a new name")
            s.delete(old)
            s.flush()
        s.add(ckpt)

    def get_checkpoint(self, tinker_path: str, owner: str | None, allow_public: bool = False) -> Checkpoint | None:
        """A checkpoint the owner may see (its own, or a public one when ``allow_public``)."""
        with self.read() as s:
            row = s.get(Checkpoint, tinker_path)
            if row is None or row.state == "failed":
                return None
            if owner is None or row.owner == owner or (allow_public and row.public):
                return row
            return None

    def list_checkpoints(
        self, owner: str, model_id: str | None = None, limit: int = 1000, offset: int = 0
    ) -> tuple[list[Checkpoint], int]:
        with self.read() as s:
            q = select(Checkpoint).where(Checkpoint.owner == owner, Checkpoint.state == "ready")
            if model_id is not None:
                q = q.where(Checkpoint.model_id == model_id)
            total = s.scalar(select(func.count()).select_from(q.subquery())) or 0
            rows = s.scalars(
                q.order_by(Checkpoint.created_at.desc(), Checkpoint.tinker_path).limit(limit).offset(offset)
            )
            return list(rows), total

    def update_checkpoint(self, tinker_path: str, owner: str, **values) -> Checkpoint | None:
        with self.write() as s:
            row = s.get(Checkpoint, tinker_path)
            if row is None or row.owner != owner or row.state != "ready":
                return None
            for k, v in values.items():
                setattr(row, k, v)
            return row

    def delete_checkpoint(self, tinker_path: str, owner: str | None) -> Checkpoint | None:
        """Remove the row (the caller deletes the files); returns it, or ``None`` if not found."""
        with self.write() as s:
            row = s.get(Checkpoint, tinker_path)
            if row is None or (owner is not None and row.owner != owner) or row.state == "pending":
                return None
            s.delete(row)
            return row

    def uri_referenced(self, uri: str) -> bool:
        """Whether a checkpoint row still points at the files ``uri`` (copies share their source's)."""
        with self.read() as s:
            return bool(s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.uri == uri)))

    def copy_checkpoint(
        self, source_path: str, owner: str, run_id: str, session_id: str, expires_at: datetime | None
    ) -> Checkpoint:
        """Create training run ``run_id`` (weights only: status ``unloaded``, it cannot train) holding a
        copy of the checkpoint ``source_path`` (the owner's or a published one) that shares its files;
        same kind and name. The source row is locked, so a concurrent delete either runs first (the
        copy fails: ``KeyError``) or sees the copy's reference and keeps the files. Idempotent: the
        same copy again returns the existing one; a different run of that id raises ``Conflict``."""
        now = utcnow()
        with self.write() as s:
            src = s.scalars(select(Checkpoint).where(Checkpoint.tinker_path == source_path).with_for_update()).first()
            if src is None or src.state != "ready" or not (src.owner == owner or src.public):
                raise KeyError(source_path)
            segment = source_path[len("tinker://") :].split("/")[1]
            path = f"tinker://{run_id}/{segment}/{src.name}"
            existing = s.get(Checkpoint, path)
            if existing is not None:
                if existing.owner == owner and existing.uri == src.uri:
                    return existing
                raise Conflict(f"checkpoint {path} already exists")
            if s.get(TrainingModel, run_id) is not None:
                raise Conflict(f"training run {run_id} already exists")
            s.add(
                TrainingModel(
                    id=run_id,
                    session_id=session_id,
                    owner=owner,
                    base_model=src.base_model,
                    lora=src.lora,
                    optimizer_config=src.optimizer_config,
                    user_metadata={"copied_from": source_path},
                    status="unloaded",
                    status_detail=f"a copy of {source_path}: weights only, it cannot be trained",
                    next_seq=0,
                    created_at=now,
                    last_request_time=now,
                )
            )
            copy = Checkpoint(
                tinker_path=path,
                owner=owner,
                model_id=run_id,
                kind=src.kind,
                name=src.name,
                uri=src.uri,
                state="ready",
                base_model=src.base_model,
                lora=src.lora,
                optimizer_config=src.optimizer_config,
                user_metadata=src.user_metadata,
                size_bytes=src.size_bytes,
                public=False,
                encrypted=src.encrypted,
                created_at=now,
                expires_at=expires_at,
            )
            s.add(copy)
            s.flush()
            return copy

    def expired_checkpoints(self) -> list[Checkpoint]:
        with self.read() as s:
            q = select(Checkpoint).where(Checkpoint.expires_at.is_not(None), Checkpoint.expires_at < utcnow())
            return list(s.scalars(q.where(Checkpoint.state == "ready")))

    # -- sampling sessions ------------------------------------------------------------------------

    def create_sampling_session(
        self,
        *,
        owner: str,
        session_id: str,
        seq: int,
        base_model: str,
        model_path: str | None,
        weights_uri: str | None,
        source_model_id: str | None = None,
    ) -> str:
        """Sampler ``{session}:sample:{seq}``; idempotent (a retry returns the same id)."""
        sid = self.sampler_id(session_id, seq)
        try:
            with self.write() as s:
                if s.get(SamplingSession, sid) is None:
                    s.add(
                        SamplingSession(
                            id=sid,
                            session_id=session_id,
                            owner=owner,
                            base_model=base_model,
                            model_path=model_path,
                            weights_uri=weights_uri,
                            source_model_id=source_model_id,
                            created_at=utcnow(),
                        )
                    )
        except IntegrityError:
            pass
        return sid

    @staticmethod
    def sampler_id(session_id: str, seq: int) -> str:
        """The id of sampler ``seq`` of a session."""
        return f"{session_id}:sample:{seq}"

    def get_sampling_session(self, sampler_id: str, owner: str | None) -> SamplingSession | None:
        with self.read() as s:
            row = s.get(SamplingSession, sampler_id)
            return row if row is not None and (owner is None or row.owner == owner) else None

    # A sampler's clients number their requests in blocks: client (clone) k uses seq_ids
    # [k * CLONE_SPAN, (k + 1) * CLONE_SPAN); the original client is 0 (spec §1.8).
    CLONE_SPAN = 1_000_000_000

    def join_sampler(self, sampler_id: str, owner: str) -> int | None:
        """``join_sampling_session``: a new client number of ``owner``'s sampler (1, 2, 3, ...; the
        original client is 0), counted by one atomic increment, so concurrent joins, from any API
        process, never share one. ``None`` if the sampler is not ``owner``'s; :class:`Conflict`
        (nothing counted) past ``CLONE_SPAN - 1`` clients, whose seq_id blocks would overflow a
        64-bit integer."""
        table = SamplingSession.__table__
        with self.write() as s:
            counter = s.scalar(
                update(table)
                .where(table.c.id == sampler_id, table.c.owner == owner)
                .values(clients=table.c.clients + 1)
                .returning(table.c.clients)
            )
            if counter is not None and counter >= self.CLONE_SPAN:
                raise Conflict(f"sampler {sampler_id} already has {self.CLONE_SPAN - 1} clients; create a new one")
            return counter

    def sampler_completions(
        self, sampler_id: str, owner: str, clone: int, prev_cursor: int
    ) -> tuple[list[tuple[str, str]], int] | None:
        """``retrieve_futures`` for client ``clone`` of ``owner``'s sampler: ``(completions,
        cursor)`` with ``completions`` = ``(request_id, state)`` (``done`` or ``failed``) in seq_id
        order; ``None`` if the sampler is not ``owner``'s.

        An answer stamps the requests it reports (``futures.reported``) with its cursor
        ``prev_cursor + 1``, in one statement. A poll with ``prev_cursor = c`` reports the finished
        requests not stamped yet or stamped after ``c``: the client has seen every answer up to its
        cursor, and a poll re-sent after a lost answer gets the same completions again (restamped
        alike). Without any, the cursor stays ``prev_cursor``. The common empty poll only reads
        (no write lock)."""
        lo = clone * self.CLONE_SPAN
        unseen = (
            (_FUTURES.c.sampler_id == sampler_id)
            & (_FUTURES.c.seq_id >= lo)
            & (_FUTURES.c.seq_id < lo + self.CLONE_SPAN)
            & _FUTURES.c.state.in_(("done", "failed"))
            & (_FUTURES.c.reported.is_(None) | (_FUTURES.c.reported > prev_cursor))
        )
        with self.read() as s:
            if s.scalar(select(SamplingSession.owner).where(SamplingSession.id == sampler_id)) != owner:
                return None
            if s.scalar(select(_FUTURES.c.id).where(unseen).limit(1)) is None:
                return [], prev_cursor
        with self.write() as s:
            rows = s.execute(
                update(_FUTURES)
                .where(unseen)
                .values(reported=prev_cursor + 1)
                .returning(_FUTURES.c.id, _FUTURES.c.state, _FUTURES.c.seq_id)
            ).all()
        rows.sort(key=lambda r: r.seq_id)
        return [(r.id, r.state) for r in rows], prev_cursor + 1 if rows else prev_cursor
