"""Tables of Ember's store (SQLAlchemy 2 typed ORM mappings).

Every user-visible object carries ``owner``: the id of the API key that created it (``local`` when
the server runs with ``--no-auth``). Times are naive UTC.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    """An API key, stored as a SHA-256 hash (the key itself is shown once, at creation)."""

    __tablename__ = "api_keys"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class Setting(Base):
    """Server-wide values shared by every process (e.g. the URL-signing secret)."""

    __tablename__ = "settings"
    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class Session(Base):
    """A client session (``ServiceClient``); it ends on finish or after missing heartbeats."""

    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(32), index=True)
    display_name: Mapped[str | None] = mapped_column(String(500), nullable=True)
    project_id: Mapped[str | None] = mapped_column(String(200), nullable=True)  # a label; None: the default
    tags: Mapped[list] = mapped_column(JSON, default=list)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    sdk_version: Mapped[str | None] = mapped_column(String(50), nullable=True)
    status: Mapped[str] = mapped_column(String(20), default="active")  # active | finished | expired
    end_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class TrainingModel(Base):
    """A training run: one LoRA adapter on a base model, id ``{session}:train:{n}``.

    ``next_seq`` is the engine's execution cursor: the seq_id of the next request to run."""

    __tablename__ = "models"
    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    owner: Mapped[str] = mapped_column(String(32), index=True)
    base_model: Mapped[str] = mapped_column(String(200))
    lora: Mapped[dict] = mapped_column(JSON)  # rank, seed, train_attn, train_mlp, train_unembed
    optimizer_config: Mapped[dict] = mapped_column(JSON)
    user_metadata: Mapped[dict] = mapped_column(JSON, default=dict)
    # creating | active | unloaded | failed | lost
    status: Mapped[str] = mapped_column(String(20), default="creating")
    status_detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    next_seq: Mapped[int] = mapped_column(BigInteger, default=1)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    last_request_time: Mapped[datetime] = mapped_column(DateTime)


class Future(Base):
    """One asynchronous operation: a request (internal encoding) and, once run, its result."""

    __tablename__ = "futures"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(32))
    base_model: Mapped[str] = mapped_column(String(200))
    op: Mapped[str] = mapped_column(String(40))
    model_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    sampler_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    seq_id: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    n_tokens: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(20), default="pending")  # pending | running | done | failed
    payload: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    # What the API answers once the request is done (server-owned; the engine never reads it).
    reply: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    result: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    category: Mapped[str | None] = mapped_column(String(20), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    # retrieve_futures: the cursor under which this finished sampling request was last reported
    reported: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    __table_args__ = (
        UniqueConstraint("model_id", "seq_id", name="uq_futures_model_seq"),
        UniqueConstraint("sampler_id", "seq_id", name="uq_futures_sampler_seq"),
        Index("ix_futures_base_state", "base_model", "state"),
        Index("ix_futures_state_finished", "state", "finished_at"),
        Index("ix_futures_owner_state", "owner", "state"),  # per-key queue quotas
    )


class Checkpoint(Base):
    """Saved weights: ``training`` (adapter + optimizer), ``sampler`` or ``external`` (exported)."""

    __tablename__ = "checkpoints"
    tinker_path: Mapped[str] = mapped_column(String(400), primary_key=True)
    owner: Mapped[str] = mapped_column(String(32), index=True)
    model_id: Mapped[str] = mapped_column(String(100), index=True)
    kind: Mapped[str] = mapped_column(String(20))  # training | sampler | external
    name: Mapped[str] = mapped_column(String(200))
    uri: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(20), default="pending")  # pending | ready | failed
    base_model: Mapped[str] = mapped_column(String(200))
    lora: Mapped[dict] = mapped_column(JSON)
    optimizer_config: Mapped[dict] = mapped_column(JSON)
    user_metadata: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    encrypted: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)


class SamplingSession(Base):
    """A sampler: a base model, optionally with adapter weights (a sampler checkpoint or snapshot)."""

    __tablename__ = "sampling_sessions"
    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(64), index=True)
    owner: Mapped[str] = mapped_column(String(32), index=True)
    base_model: Mapped[str] = mapped_column(String(200))
    model_path: Mapped[str | None] = mapped_column(String(400), nullable=True)
    weights_uri: Mapped[str | None] = mapped_column(Text, nullable=True)
    source_model_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    clients: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # join_sampling_session count


class CustomLoss(Base):
    """A loss uploaded with ``create_custom_loss``: the traced graph as plain data (spec §2 #24),
    rebuilt by the engine from its allow-list; usable by the models of its session."""

    __tablename__ = "custom_losses"
    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    owner: Mapped[str] = mapped_column(String(32), index=True)
    session_id: Mapped[str] = mapped_column(String(64))
    seq: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(200))
    inputs: Mapped[list] = mapped_column(JSON)  # [{"name", "rank"}], logprobs first
    graph: Mapped[dict] = mapped_column(JSON)  # {"format": 1, "nodes": [...]}
    created_at: Mapped[datetime] = mapped_column(DateTime)

    __table_args__ = (UniqueConstraint("session_id", "seq", name="uq_custom_losses_session_seq"),)


class EngineRecord(Base):
    """One engine process (one per base model): liveness and cumulative work counters."""

    __tablename__ = "engines"
    base_model: Mapped[str] = mapped_column(String(200), primary_key=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    status: Mapped[str] = mapped_column(String(20), default="starting")  # starting | warming up | ready | dead
    detail: Mapped[str | None] = mapped_column(Text, nullable=True)
    generation: Mapped[int] = mapped_column(Integer, default=0)
    capabilities: Mapped[list] = mapped_column(JSON, default=list)  # e.g. ["train", "sample"]
    # UDP port on 127.0.0.1 where the engine listens for "work queued" datagrams (see ember.doorbell)
    doorbell_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime, nullable=True)
    passes: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    busy_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    last_pass_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    last_pass_tokens: Mapped[int] = mapped_column(Integer, default=0)
    memory_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # accelerator (else resident) memory
    # an engine of several processes: {"ep", "tp", "ranks": [{"rank", "pid", "device"}, ...]}; None: one process
    ranks: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class RunMetric(Base):
    """The metrics of one finished training request (``forward_backward``, ``forward`` or
    ``optim_step``) of a model, as its result reported them: the console's curves. A point's step
    is the number of the model's ``optim_step`` rows before it (``seq_id`` order)."""

    __tablename__ = "run_metrics"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(String(100))
    seq_id: Mapped[int] = mapped_column(BigInteger)
    op: Mapped[str] = mapped_column(String(40))
    metrics: Mapped[dict] = mapped_column(JSON)  # name -> float
    created_at: Mapped[datetime] = mapped_column(DateTime)

    __table_args__ = (Index("ix_run_metrics_model_seq", "model_id", "seq_id"),)


class ResultListener(Base):
    """An API process waiting for results: engines on the same host send a UDP datagram to
    ``127.0.0.1:port`` after they finish requests, so long-polls answer without waiting for the
    next database poll (see :mod:`ember.doorbell`). Rows are refreshed by the API's reaper and
    pruned when stale."""

    __tablename__ = "result_listeners"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    port: Mapped[int] = mapped_column(Integer)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime)
