"""Alembic environment: runs migrations on the connection handed over by ``ember.store.db.migrate``
(or, from the ``alembic`` command line, on ``sqlalchemy.url``)."""

from alembic import context
from sqlalchemy import create_engine

from ember.store.models import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    conn = config.attributes.get("connection")
    if conn is not None:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


run()
