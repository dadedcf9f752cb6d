"""The processes of an engine that spans several (ember serve --nproc): rank, pid, device, layout.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("engines", sa.Column("ranks", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("engines", "ranks")
