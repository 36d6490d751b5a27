"""Webhook secrets stored encrypted (``shared.store.sealed``: Fernet with TUNEJOB_SECRET_KEY, or
the data directory's key): the columns become text wide enough for a Fernet token, and the secrets
stored in the clear until now are encrypted

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

from shared.store.sealed import seal, unseal

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

COLUMNS = ("secret", "previous_secret")


def _rewrite(change) -> None:
    bind = op.get_bind()
    webhooks = sa.table("webhooks", sa.column("id"), *(sa.column(c) for c in COLUMNS))
    for row in bind.execute(sa.select(webhooks)).all():
        bind.execute(
            sa.update(webhooks)
            .where(webhooks.c.id == row.id)
            .values({c: change(getattr(row, c)) for c in COLUMNS if getattr(row, c) is not None})
        )


def upgrade() -> None:
    with op.batch_alter_table("webhooks", schema=None) as batch_op:
        for column in COLUMNS:
            batch_op.alter_column(column, type_=sa.Text(), existing_type=sa.String(length=64))
    _rewrite(seal)


def downgrade() -> None:
    _rewrite(unseal)
    with op.batch_alter_table("webhooks", schema=None) as batch_op:
        for column in COLUMNS:
            batch_op.alter_column(column, type_=sa.String(length=64), existing_type=sa.Text())
