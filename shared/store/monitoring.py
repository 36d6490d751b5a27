"""What the job store says about the service right now, for Prometheus (read at scrape time by
``api.metrics.StoreCollector``): jobs by status, the queue, and each running job's latest report."""

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select

from shared.settings import get_settings
from shared.store.engine import read_session
from shared.store.rows import Job, JobEvent, JobStatus, utcnow

# Event codes written when a job (re-)enters the queue (``shared.jobs.lifecycle.create_job`` and
# ``_requeue_or_fail``): the newest of them is when a queued job started waiting.
QUEUED_EVENT_CODES = ("created", "requeued", "job_restarted")
STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, *JobStatus.FINISHED)


@dataclass
class RunningJob:
    """A running job's row as its worker last reported it (``shared.jobs.lifecycle.record_progress``,
    called by ``worker.reporter.Reporter``)."""

    id: str
    base_model: str
    device: str | None
    worker: str | None  # the lease owner: host:pid:attempt
    step: int
    total_steps: int | None
    train_metrics: dict  # tokens_per_second, padding_efficiency, memory_mb, peak_memory_mb, ...
    heartbeat_age_seconds: float | None  # since the worker last renewed the lease


@dataclass
class StoreSnapshot:
    jobs_by_status: dict[str, int]  # every status, 0 included
    oldest_queued_seconds: float  # how long the longest-waiting queued job has waited; 0 when none
    running: list[RunningJob]


def snapshot(now: datetime | None = None) -> StoreSnapshot:
    """Three indexed queries in one short read transaction: counts by status, the oldest queued
    job's wait (since its newest event in ``QUEUED_EVENT_CODES``, so a re-queued job counts from
    its re-queueing, not its creation), and the running jobs' rows.

    The heartbeat age is ``lease_seconds`` minus the lease's remaining time: every lease renewal
    (``shared.jobs.lifecycle.heartbeat`` and ``report``) sets the expiry to now + ``TUNEJOB_LEASE_SECONDS``.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the store did not answer.
    """
    now = now or utcnow()
    lease = timedelta(seconds=get_settings().lease_seconds)
    with read_session() as s:
        counts = dict(s.execute(select(Job.status, func.count()).group_by(Job.status)).all())
        entered = (
            select(func.max(JobEvent.time).label("entered"))
            .join(Job, Job.id == JobEvent.job_id)
            .where(Job.status == JobStatus.QUEUED, JobEvent.code.in_(QUEUED_EVENT_CODES))
            .group_by(JobEvent.job_id)
            .subquery()
        )
        oldest = s.scalar(select(func.min(entered.c.entered)))
        running = [
            RunningJob(
                job.id,
                job.base_model,
                job.device,
                job.lease_owner,
                job.step,
                job.total_steps,
                job.train_metrics or {},
                (now - (job.lease_expires_at - lease)).total_seconds() if job.lease_expires_at else None,
            )
            for job in s.scalars(select(Job).where(Job.status == JobStatus.RUNNING).order_by(Job.id))
        ]
    return StoreSnapshot(
        jobs_by_status={status: counts.get(status, 0) for status in STATUSES},
        oldest_queued_seconds=max(0.0, (now - oldest).total_seconds()) if oldest else 0.0,
        running=running,
    )
