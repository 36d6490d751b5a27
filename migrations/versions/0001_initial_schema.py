"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-21 05:53:05.936014
"""

import sqlalchemy as sa
from alembic import op

import shared.store.rows  # custom column types (UTCDateTime)

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("format", sa.String(length=16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("columns", sa.JSON(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("base_model", sa.String(length=255), nullable=False),
        sa.Column("task", sa.String(length=16), nullable=False),
        sa.Column("training_dataset_id", sa.String(length=32), nullable=False),
        sa.Column("validation_dataset_id", sa.String(length=32), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("label_names", sa.JSON(), nullable=True),
        sa.Column("created_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.Column("updated_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.Column("enqueued_at", shared.store.rows.UTCDateTime(), nullable=True),
        sa.Column("started_at", shared.store.rows.UTCDateTime(), nullable=True),
        sa.Column("finished_at", shared.store.rows.UTCDateTime(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=True),
        sa.Column("epoch", sa.Float(), nullable=False),
        sa.Column("eta_seconds", sa.Double(), nullable=True),
        sa.Column("device", sa.String(length=64), nullable=True),
        sa.Column("train_metrics", sa.JSON(), nullable=True),
        sa.Column("validation_metrics", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", shared.store.rows.UTCDateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["training_dataset_id"],
            ["datasets.id"],
        ),
        sa.ForeignKeyConstraint(
            ["validation_dataset_id"],
            ["datasets.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_status_created", ["status", "created_at"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", shared.store.rows.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoints_job_step", ["job_id", "step"], unique=False)

    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("time", shared.store.rows.UTCDateTime(), nullable=False),
        sa.Column("level", sa.String(length=16), nullable=False),
        sa.Column("code", sa.String(length=64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.create_index("ix_job_events_job_time", ["job_id", "time"], unique=False)

    op.create_table(
        "job_metrics",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Float(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("time", shared.store.rows.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.create_index("ix_job_metrics_job_step", ["job_id", "step"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.drop_index("ix_job_metrics_job_step")

    op.drop_table("job_metrics")
    with op.batch_alter_table("job_events", schema=None) as batch_op:
        batch_op.drop_index("ix_job_events_job_time")

    op.drop_table("job_events")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_job_step")

    op.drop_table("checkpoints")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_status_created")

    op.drop_table("jobs")
    op.drop_table("datasets")
