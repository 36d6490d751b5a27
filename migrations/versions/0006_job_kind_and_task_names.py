"""jobs get a kind ('train' or 'predict') and room for longer task names

A prediction job shares the jobs table and lifecycle with training (claim, lease, progress, events,
cancel, resume); ``kind`` tells the worker which recipe runs. Task names such as
``token_classification`` (20 characters) need more than the first schema's 16.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), nullable=False, server_default="train"))
        batch_op.alter_column("task", existing_type=sa.String(length=16), type_=sa.String(length=32))


def downgrade() -> None:
    op.execute("DELETE FROM jobs WHERE kind != 'train'")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.alter_column("task", existing_type=sa.String(length=32), type_=sa.String(length=16))
        batch_op.drop_column("kind")
