"""jobs: an index on created_at, for the newest-first lists of an admin (all tenants)

A tenant's list walks ix_jobs_tenant_created; an admin's (the local key of ``tunejob serve``, so
the dashboard's jobs page) scanned and sorted every job for its first 50.

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_created", "jobs", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_created", table_name="jobs")
