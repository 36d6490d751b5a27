"""webhooks and their deliveries; a queued job's estimated run time from its dry-run plan

Follows 0007 (sweeps) and 0008 (ui sessions).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

import shared.store.rows  # custom column types (UTCDateTime)

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("plan_seconds", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("planned_at", shared.store.rows.UTCDateTime(), nullable=True))
    op.create_table(
        "webhooks",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("secret", sa.String(length=64), nullable=False),
        sa.Column("description", sa.String(length=255), nullable=True),
        sa.Column("created_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_webhooks_tenant_created", "webhooks", ["tenant", "created_at"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("webhook_id", sa.String(length=32), nullable=False),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.Column("lease_expires_at", shared.store.rows.UTCDateTime(), nullable=True),
        sa.Column("response_status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.Column("delivered_at", shared.store.rows.UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(["webhook_id"], ["webhooks.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("webhook_id", "event_id", name="uq_webhook_deliveries_event"),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["status", "next_attempt_at"])
    op.create_index("ix_webhook_deliveries_webhook", "webhook_deliveries", ["webhook_id", "id"])


def downgrade() -> None:
    op.drop_table("webhook_deliveries")
    op.drop_table("webhooks")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("planned_at")
        batch_op.drop_column("plan_seconds")
