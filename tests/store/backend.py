"""Which database the store and conformance tests use.

SQLite by default. With ``EMBER_TEST_POSTGRES_URL`` set (e.g.
``postgresql://postgres@127.0.0.1:5432/test``) they use that PostgreSQL server instead, each run in
a fresh database created for it and dropped afterwards; if the server cannot be reached the tests
fail rather than skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from ember.store.db import normalise_url

PG_ENV = "EMBER_TEST_POSTGRES_URL"


def backend() -> str:
    return "postgresql" if os.environ.get(PG_ENV) else "sqlite"


@contextmanager
def fresh_database(tmp: Path) -> Iterator[str]:
    """A URL of an empty database of the selected backend, removed afterwards."""
    url = os.environ.get(PG_ENV)
    if not url:
        yield f"sqlite:///{tmp / 'ember.db'}"
        return
    base = make_url(normalise_url(url))
    name = f"ember_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", pool_pre_ping=True)  # survives a server restart
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
