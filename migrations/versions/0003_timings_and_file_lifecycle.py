"""job timings, deleted jobs and datasets (tombstones), removed job files

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 10:40:00
"""

import sqlalchemy as sa
from alembic import op

import shared.store.rows  # custom column types (UTCDateTime)

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("timings", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("files_deleted_at", shared.store.rows.UTCDateTime(), nullable=True))
        batch_op.add_column(sa.Column("deleted_at", shared.store.rows.UTCDateTime(), nullable=True))
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deleted_at", shared.store.rows.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
        batch_op.drop_column("files_deleted_at")
        batch_op.drop_column("timings")
