"""retrieve_futures cursors, join_sampling_session counters, server-side custom losses

* ``futures.reported``: the ``retrieve_futures`` cursor value under which a finished sampling request
  was last reported (NULL: not reported yet).
* ``sampling_sessions.clients``: how many clients joined the sampler (``join_sampling_session``);
  the original client is 0.
* ``custom_losses``: losses uploaded with ``create_custom_loss`` (a traced graph, as plain data).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("futures") as batch:
        batch.add_column(sa.Column("reported", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.add_column(sa.Column("clients", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "custom_losses",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("owner", sa.String(length=32), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("graph", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("session_id", "seq", name="uq_custom_losses_session_seq"),
    )
    op.create_index("ix_custom_losses_owner", "custom_losses", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_custom_losses_owner", table_name="custom_losses")
    op.drop_table("custom_losses")
    with op.batch_alter_table("sampling_sessions") as batch:
        batch.drop_column("clients")
    with op.batch_alter_table("futures") as batch:
        batch.drop_column("reported")
