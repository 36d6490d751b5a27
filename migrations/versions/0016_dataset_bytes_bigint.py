"""``datasets.bytes`` as a 64-bit integer: a 4-byte one (PostgreSQL's ``integer``) holds at most
2 GiB - 1, below the default largest upload (``TUNEJOB_MAX_UPLOAD_BYTES``, 2 GiB). SQLite's
integers are 64-bit either way. A downgrade fails on PostgreSQL once a dataset of 2 GiB or more
is recorded (its size no longer fits).

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.alter_column("bytes", existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("datasets", schema=None) as batch_op:
        batch_op.alter_column("bytes", existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False)
