"""Training-run metrics over steps (the console's curves) and each engine's memory.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_metrics",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("model_id", sa.String(100), nullable=False),
        sa.Column("seq_id", sa.BigInteger(), nullable=False),
        sa.Column("op", sa.String(40), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_run_metrics_model_seq", "run_metrics", ["model_id", "seq_id"])
    op.add_column("engines", sa.Column("memory_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("engines", "memory_bytes")
    op.drop_index("ix_run_metrics_model_seq", table_name="run_metrics")
    op.drop_table("run_metrics")
