"""Ember's durable state: sessions, models, futures, checkpoints, sampling sessions and API keys.

SQLAlchemy 2 over SQLite (WAL, short transactions, busy timeout) by default, PostgreSQL by URL.
The API process writes requests as future rows; engine processes pick them up and write results.
"""

from ember.store.db import connect, default_sqlite_url
from ember.store.repo import Store

__all__ = ["Store", "connect", "default_sqlite_url"]
