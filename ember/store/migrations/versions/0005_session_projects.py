"""Session projects: ``sessions.project_id``, set by ``create_session`` or
``PUT /sessions/{id}/project`` (Ember's projects are labels for search; NULL: the default project).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("project_id", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("project_id")
