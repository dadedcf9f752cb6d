"""Database engines: SQLite (WAL, busy timeout, ``BEGIN IMMEDIATE`` writes) or PostgreSQL, and
schema migrations with Alembic.

SQLite allows one writer at a time. A deferred transaction that reads and then writes can fail
with "database is locked" without waiting (its lock upgrade would deadlock), so every write
transaction here starts with ``BEGIN IMMEDIATE``: it takes the write lock up front and waits up to
the busy timeout for it. Reads use plain deferred transactions and, in WAL mode, never block.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

SQLITE_BUSY_TIMEOUT_MS = 60_000
_MIGRATIONS = Path(__file__).with_name("migrations")


def default_sqlite_url(home: str | Path) -> str:
    """The SQLite database under Ember's home folder."""
    return f"sqlite:///{Path(home).expanduser().resolve() / 'ember.db'}"


def normalise_url(url: str) -> str:
    """Accept ``postgresql://`` / ``postgres://`` and use the psycopg 3 driver for them."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def connect(url: str, pool_size: int = 10) -> Engine:
    """An engine for ``url`` with Ember's connection settings (see the module docstring)."""
    url = normalise_url(url)
    if make_url(url).get_backend_name() == "sqlite":
        return _sqlite_engine(url, pool_size)
    return create_engine(url, pool_size=pool_size, max_overflow=2 * pool_size, pool_pre_ping=True)


def _sqlite_engine(url: str, pool_size: int) -> Engine:
    path = make_url(url).database
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        pool_size=pool_size,
        max_overflow=4 * pool_size,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (below)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


def writer(engine: Engine) -> Engine:
    """The same engine, with write transactions that take SQLite's write lock at BEGIN."""
    if engine.dialect.name == "sqlite":
        return engine.execution_options(sqlite_begin="IMMEDIATE")
    return engine


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest Alembic revision (idempotent, safe to run at every start)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    with writer(engine).begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
