"""sweeps: hyperparameter searches whose trials are jobs

A ``sweeps`` row holds a search's spec and state; each trial is a ``jobs`` row with ``sweep_id`` and
``trial_number`` (unique per sweep: no two trials share a number), and ``trial_attrs``, the Optuna
trial system attributes its sampler and pruner keep (``shared.jobs.sweeps``). A pruned trial ends with
the job status ``pruned`` (the status column is free text: no schema change).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(length=32), primary_key=True),
        sa.Column("tenant", sa.String(length=64), nullable=False, server_default="default"),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("label_names", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("deleted_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_sweeps_tenant_created", "sweeps", ["tenant", "created_at"])
    op.create_index("ix_sweeps_status", "sweeps", ["status"])
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sweep_id", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("trial_number", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("trial_attrs", sa.JSON(), nullable=True))
        batch_op.create_foreign_key("fk_jobs_sweep_id", "sweeps", ["sweep_id"], ["id"])
        batch_op.create_index("ix_jobs_sweep_id", ["sweep_id"])
        batch_op.create_unique_constraint("uq_jobs_sweep_trial", ["sweep_id", "trial_number"])


def downgrade() -> None:
    op.execute("DELETE FROM jobs WHERE sweep_id IS NOT NULL")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint("uq_jobs_sweep_trial", type_="unique")
        batch_op.drop_index("ix_jobs_sweep_id")
        batch_op.drop_constraint("fk_jobs_sweep_id", type_="foreignkey")
        batch_op.drop_column("trial_attrs")
        batch_op.drop_column("trial_number")
        batch_op.drop_column("sweep_id")
    op.drop_index("ix_sweeps_status", table_name="sweeps")
    op.drop_index("ix_sweeps_tenant_created", table_name="sweeps")
    op.drop_table("sweeps")
