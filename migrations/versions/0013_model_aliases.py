"""model aliases and their history (issue 37)

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

import shared.store.rows  # custom column types (UTCDateTime)

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_aliases",
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("updated_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.Column("updated_by", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("tenant", "alias"),
    )
    op.create_table(
        "model_alias_changes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("from_job_id", sa.String(length=32), nullable=True),
        sa.Column("to_job_id", sa.String(length=32), nullable=True),
        sa.Column("changed_by", sa.String(length=64), nullable=True),
        sa.Column("changed_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_model_alias_changes_alias", "model_alias_changes", ["tenant", "alias", "id"])


def downgrade() -> None:
    op.drop_table("model_alias_changes")
    op.drop_table("model_aliases")
