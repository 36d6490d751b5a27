"""Webhook deliveries keep a log of their attempts (time, status code, error, duration); an
endpoint keeps its previous secret for a day after a rotation

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

import shared.store.rows  # custom column types (UTCDateTime)

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempt_log", sa.JSON(), nullable=True))
    with op.batch_alter_table("webhooks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("previous_secret", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("previous_secret_expires_at", shared.store.rows.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("webhooks", schema=None) as batch_op:
        batch_op.drop_column("previous_secret_expires_at")
        batch_op.drop_column("previous_secret")
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.drop_column("attempt_log")
