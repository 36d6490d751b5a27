"""SQLAlchemy 2.0 models of the job store: datasets, jobs, job metrics, checkpoints and job events;
API keys and idempotency records.

The job row is the source of truth for a job's lifecycle (see ``shared.jobs``); the broker only
carries job ids. Datasets and jobs belong to a tenant (the tenant of the API key that created
them); metrics, events, checkpoints and artifacts belong to their job's tenant (``shared.store.tenancy``).
"""

import secrets
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

DEFAULT_TENANT = "default"  # owns the rows created before API keys existed, and the local key of `tunejob serve`


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class UTCDateTime(TypeDecorator):
    """Stores naive UTC (SQLite has no time zones), returns timezone-aware UTC datetimes."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect):
        return value.astimezone(UTC).replace(tzinfo=None) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect):
        return value.replace(tzinfo=UTC) if value is not None else None


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class JobStatus:
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PRUNED = "pruned"  # a sweep's trial its pruner stopped early (shared.jobs.sweeps): metrics kept, weights deleted
    FINISHED = (SUCCEEDED, FAILED, CANCELLED, PRUNED)


class Dataset(Base):
    __tablename__ = "datasets"
    __table_args__ = (Index("ix_datasets_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("ds"))
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT)
    filename: Mapped[str] = mapped_column(String(255))  # the uploader's name, for display only
    format: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(Text)  # server-chosen: under the data dir, or a key in the bucket (store.objects)
    rows: Mapped[int] = mapped_column(Integer)
    columns: Mapped[list[Any]]
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None]  # DELETE /datasets/{id}: the file is gone, the row is a tombstone


class Job(Base):
    """A training job (``kind`` train) or a batch prediction (``kind`` predict, ``shared.jobs.predictions``),
    which uses the columns as commented: its model in ``base_model``, the dataset it scores in
    ``training_dataset_id``, rows written / rows in ``step`` / ``total_steps``, its result
    (``shared.schemas.predictions.PredictionResult``) in ``train_metrics``."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_created", "created_at"),  # an admin's lists (all tenants), newest first
        Index("ix_jobs_status_created", "status", "created_at"),
        Index("ix_jobs_tenant_created", "tenant", "created_at"),
        Index("ix_jobs_tenant_status", "tenant", "status"),
        UniqueConstraint("sweep_id", "trial_number", name="uq_jobs_sweep_trial"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("job"))
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT)
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)
    base_model: Mapped[str] = mapped_column(String(255))  # predict: the model as given, "job_…" or a base model
    kind: Mapped[str] = mapped_column(String(16), default="train", server_default="train")  # train | predict
    task: Mapped[str] = mapped_column(String(32))
    training_dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))  # predict: the dataset scored
    validation_dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"))
    spec: Mapped[dict[str, Any]]  # the validated POST /jobs (POST /predictions) body
    label_names: Mapped[list[Any] | None]  # classification: index -> label name
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    enqueued_at: Mapped[datetime | None]  # the broker accepted the message
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    step: Mapped[int] = mapped_column(default=0)  # predict: input rows scored and written
    total_steps: Mapped[int | None]  # predict: rows of the dataset
    epoch: Mapped[float] = mapped_column(Float, default=0.0)
    eta_seconds: Mapped[float | None]
    device: Mapped[str | None] = mapped_column(String(64))
    train_metrics: Mapped[dict[str, Any] | None]  # predict: its result (shared.schemas.predictions.PredictionResult)
    validation_metrics: Mapped[dict[str, Any] | None]
    error: Mapped[dict[str, Any] | None]  # {"code", "message"}
    # Lease: which worker holds the job and until when (renewed by its heartbeat).
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)  # times a worker claimed the job
    restarts: Mapped[int] = mapped_column(default=0)  # re-queued after its worker died or failed unexpectedly
    timings: Mapped[dict[str, Any] | None]  # seconds per phase (shared.schemas.jobs.Timings)
    files_deleted_at: Mapped[datetime | None]  # checkpoints and artifacts removed (DELETE or retention)
    # bytes under artifacts/<job>/ (its model, or its prediction's results) when it ended, for the
    # tenant's storage quota (shared.store.quotas); None before it ended, or ended before 0015
    files_bytes: Mapped[int | None] = mapped_column(BigInteger)
    deleted_at: Mapped[datetime | None]  # DELETE /jobs/{id}: the row is a tombstone, the id answers 404
    # A queued job's estimated run time from its dry-run plan (shared.jobs.positions.estimate_queued),
    # computed once in the background; planned_at says it was tried (the estimate may be None).
    plan_seconds: Mapped[float | None]
    planned_at: Mapped[datetime | None]
    # A sweep's trial (shared.jobs.sweeps): its sweep, its number there (unique per sweep), and the Optuna
    # trial system attributes its sampler and pruner keep (e.g. ``grid_id``, ASHA's ``completed_rung_0``).
    sweep_id: Mapped[str | None] = mapped_column(ForeignKey("sweeps.id"), index=True)
    trial_number: Mapped[int | None]
    trial_attrs: Mapped[dict[str, Any] | None]


class Sweep(Base):
    """A hyperparameter sweep (``shared.jobs.sweeps``): its validated ``POST /sweeps`` body, and its
    state. Its trials are ``Job`` rows with its ``sweep_id``; Optuna's study is rebuilt from them."""

    __tablename__ = "sweeps"
    __table_args__ = (Index("ix_sweeps_tenant_created", "tenant", "created_at"), Index("ix_sweeps_status", "status"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("sweep"))
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT)
    status: Mapped[str] = mapped_column(
        String(16), default="queued"
    )  # queued | running | succeeded | failed | cancelled
    spec: Mapped[dict[str, Any]]
    label_names: Mapped[list[Any] | None]  # classification: index -> label name, as its trials get them
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None]
    error: Mapped[dict[str, Any] | None]  # {"code", "message"} of a failed sweep
    deleted_at: Mapped[datetime | None]  # DELETE /sweeps/{id}: a tombstone, the id answers 404


class JobMetric(Base):
    __tablename__ = "job_metrics"
    __table_args__ = (Index("ix_job_metrics_job_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int]
    epoch: Mapped[float] = mapped_column(Float)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float | None] = mapped_column(Float)  # null: the value was NaN or Infinity
    time: Mapped[datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_job_step", "job_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int]
    path: Mapped[str] = mapped_column(Text)
    metrics: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    bytes: Mapped[int | None] = mapped_column(BigInteger)  # its files' (None: recorded before 0015)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_time", "job_id", "time"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    time: Mapped[datetime] = mapped_column(default=utcnow)
    level: Mapped[str] = mapped_column(String(16))
    code: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)


class ApiKey(Base):
    """An API key. Only its SHA-256 is stored; ``prefix`` (its first characters, not enough to use
    it) finds the row and names the key in ``tunejob keys list``."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("key"))
    tenant: Mapped[str] = mapped_column(String(64))
    admin: Mapped[bool] = mapped_column(default=False)  # sees every tenant's datasets and jobs
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # hex SHA-256 of the whole key
    name: Mapped[str | None] = mapped_column(String(255))  # a label for people
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


class IdempotencyRecord(Base):
    """The first outcome of a POST sent with an ``Idempotency-Key`` (``shared.store.idempotency``).

    The unique constraint decides which of two concurrent requests with the same key does the work.
    ``status_code`` is None while that request is still in progress.
    """

    __tablename__ = "idempotency_records"
    __table_args__ = (UniqueConstraint("tenant", "route", "key", name="uq_idempotency_tenant_route_key"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(64))
    route: Mapped[str] = mapped_column(String(64))  # e.g. "POST /jobs"
    key: Mapped[str] = mapped_column(String(255))
    fingerprint: Mapped[str] = mapped_column(String(64))  # SHA-256 of the request body
    status_code: Mapped[int | None]
    response: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
