"""tenants on datasets and jobs, API keys, idempotency records

Rows created before this revision belong to the tenant "default" (the tenant of the local key that
`tunejob serve` creates on loopback), so a single-user installation keeps seeing its jobs.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

import shared.store.rows  # custom column types (UTCDateTime)

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("datasets", "jobs"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.add_column(sa.Column("tenant", sa.String(length=64), nullable=False, server_default="default"))
            batch_op.create_index(f"ix_{table}_tenant_created", ["tenant", "created_at"])
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.create_index("ix_jobs_tenant_status", ["tenant", "status"])

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=True),
        sa.Column("created_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.Column("revoked_at", shared.store.rows.UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),
    )
    op.create_index("ix_api_keys_prefix", "api_keys", ["prefix"])

    op.create_table(
        "idempotency_records",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("route", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("created_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant", "route", "key", name="uq_idempotency_tenant_route_key"),
    )
    op.create_index("ix_idempotency_records_created_at", "idempotency_records", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_records_created_at", table_name="idempotency_records")
    op.drop_table("idempotency_records")
    op.drop_index("ix_api_keys_prefix", table_name="api_keys")
    op.drop_table("api_keys")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_tenant_status")
    for table in ("jobs", "datasets"):
        # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35) rather than batch mode's copy of the table,
        # whose DROP TABLE of the old copy the foreign keys of other tables would refuse.
        with op.batch_alter_table(table, recreate="never") as batch_op:
            batch_op.drop_index(f"ix_{table}_tenant_created")
            batch_op.drop_column("tenant")
