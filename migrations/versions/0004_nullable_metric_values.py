"""metric values may be null: a non-finite value (NaN, Infinity) is stored as null

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.alter_column("value", existing_type=sa.Float(), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM job_metrics WHERE value IS NULL")
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.alter_column("value", existing_type=sa.Float(), nullable=False)
