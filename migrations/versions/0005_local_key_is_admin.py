"""the local key that ``tunejob serve`` writes for its own loopback user is an admin key

Single-user mode is whole with it: the machine's user can also scrape ``/metrics`` (admin only).
Keys made with ``tunejob keys create`` are left as they are.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

LOCAL_KEY = sa.text("name = 'local key (tunejob serve)' AND tenant = 'default'")


def upgrade() -> None:
    op.execute(sa.update(sa.table("api_keys", sa.column("admin"))).where(LOCAL_KEY).values(admin=True))


def downgrade() -> None:
    op.execute(sa.update(sa.table("api_keys", sa.column("admin"))).where(LOCAL_KEY).values(admin=False))
