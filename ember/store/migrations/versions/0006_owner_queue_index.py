"""An index of futures by (owner, state), for the per-key quota on queued requests.

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_futures_owner_state", "futures", ["owner", "state"])


def downgrade() -> None:
    op.drop_index("ix_futures_owner_state", table_name="futures")
