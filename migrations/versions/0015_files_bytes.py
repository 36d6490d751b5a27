"""The bytes of each checkpoint and of each ended job's artifacts, recorded as they are written, so
that a tenant's storage quota is a sum over its rows (``shared.store.quotas``) instead of a listing
of every tenant's checkpoints and artifacts (in the bucket: every object) on each upload and job.
Rows written before stay NULL and count 0.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("bytes", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("files_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("files_bytes")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("bytes")
