r"""The job lifecycle, one story for the API and the worker. The SQL job row decides whether a job runs.

    queued --claim--> running --finish--> succeeded | failed | cancelled
       ^                 |
       +--requeue--------+  (SIGTERM on deploy; lease expired; unexpected error, up to max_restarts)
       \--cancel---------+--> cancelled

A worker *claims* a job with a compare-and-set UPDATE: it succeeds only on a queued job, or on a
running one whose lease expired. A duplicate or redelivered message for a job another worker
holds, or that has finished, therefore claims nothing and is a no-op. The running worker renews
its lease with a heartbeat; every write it makes is conditional on still holding it. ``recover``
(run periodically by the API and by every worker) re-queues jobs whose lease expired and re-sends
the message of queued jobs that never reached the broker.
"""

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import and_, delete, or_, select, update

from shared.db import session_scope
from shared.errors import NotFound
from shared.models import Checkpoint, Job, JobEvent, JobMetric, JobStatus, new_id, utcnow
from shared.planning import check_spec
from shared.schemas import Hyperparameters, JobCreate, JobOut, Progress
from shared.settings import get_settings


def to_out(job: Job) -> JobOut:
    """The API view of a job row."""
    spec = job.spec
    fraction = min(1.0, job.step / job.total_steps) if job.total_steps else 0.0
    if job.status == JobStatus.SUCCEEDED:
        fraction = 1.0
    return JobOut(
        id=job.id,
        status=job.status,
        base_model=job.base_model,
        task=job.task,
        training_dataset=job.training_dataset_id,
        validation_dataset=job.validation_dataset_id,
        validation_split=spec.get("validation_split"),
        text_column=spec["text_column"],
        text_pair_column=spec.get("text_pair_column"),
        label_column=spec["label_column"],
        label_names=job.label_names,
        hyperparameters=Hyperparameters(**spec["hyperparameters"]),
        metadata=spec.get("metadata"),
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        progress=Progress(
            step=job.step, total_steps=job.total_steps, epoch=job.epoch, fraction=fraction, eta_seconds=job.eta_seconds
        ),
        train_metrics=job.train_metrics,
        validation_metrics=job.validation_metrics,
        device=job.device,
        attempts=job.attempts,
        error=job.error,
    )


def create_job(spec: JobCreate) -> Job:
    """Validate a job spec against its model and data, then insert it as ``queued``.

    The caller enqueues the job id once this returns (the row is committed by then).

    Raises:
        UserError: see ``shared.planning.check_spec``.
    """
    checked = check_spec(spec)
    with session_scope() as s:
        job = Job(id=new_id("job"), base_model=spec.base_model, task=spec.task, training_dataset_id=checked.train.id,
                  validation_dataset_id=checked.validation.id if checked.validation else None,
                  spec=spec.model_dump(mode="json"), label_names=checked.label_names)
        s.add(job)
        s.add(JobEvent(job_id=job.id, code="created", level="info", message="job created and queued"))
        return job


def get_job(job_id: str) -> Job:
    with session_scope() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFound("job", job_id)
        return job


def cancel_requested(job_id: str) -> bool:
    with session_scope() as s:
        return bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def add_event(job_id: str, code: str, message: str, level: str = "info") -> None:
    with session_scope() as s:
        s.add(JobEvent(job_id=job_id, code=code, message=message, level=level))


def mark_enqueued(job_id: str) -> None:
    """Record that the broker accepted the job's message (the sweeper re-sends jobs without it)."""
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(enqueued_at=utcnow()))


def request_cancel(job_id: str) -> Job:
    """Cancel a job: a queued one ends ``cancelled`` now; a running one is flagged and stops at its
    next optimizer step. A finished job is left as it is.

    Raises:
        NotFound: no such job.
    """
    now = utcnow()
    with session_scope() as s:
        # Locked (PostgreSQL; SQLite's BEGIN IMMEDIATE already serializes writers), so that a claim
        # cannot slip in between reading the status and acting on it.
        job = s.get(Job, job_id, with_for_update=True)
        if job is None:
            raise NotFound("job", job_id)
        if job.status == JobStatus.QUEUED:
            job.status, job.finished_at = JobStatus.CANCELLED, now
            s.add(JobEvent(job_id=job_id, code="cancelled", level="info", message="cancelled before it started"))
        elif job.status == JobStatus.RUNNING and not job.cancel_requested:
            job.cancel_requested = True
            s.add(JobEvent(job_id=job_id, code="cancel_requested", level="info", message="cancel requested"))
        return job


def _lease_expiry() -> datetime:
    return utcnow() + timedelta(seconds=get_settings().lease_seconds)


def claim(job_id: str, worker_id: str) -> Job | None:
    """Take the job for ``worker_id`` if it is queued or its holder's lease expired.

    Returns:
        The claimed job, or None when another worker holds it or it has finished (a no-op).
    """
    now = utcnow()
    with session_scope() as s:
        claimable = or_(
            Job.status == JobStatus.QUEUED,
            and_(Job.status == JobStatus.RUNNING, Job.lease_expires_at < now),
        )
        result = s.execute(
            update(Job)
            .where(Job.id == job_id, claimable)
            .values(
                status=JobStatus.RUNNING,
                lease_owner=worker_id,
                lease_expires_at=_lease_expiry(),
                attempts=Job.attempts + 1,
                error=None,
            )
        )
        if result.rowcount != 1:
            return None
        job = s.get(Job, job_id, populate_existing=True)
        job.started_at = job.started_at or now
        s.add(JobEvent(job_id=job_id, code="started", level="info",
                       message=f"attempt {job.attempts} started on worker {worker_id}"))
        return job


def heartbeat(job_id: str, worker_id: str) -> bool:
    """Renew the lease of a running job. Returns False if ``worker_id`` no longer holds it."""
    with session_scope() as s:
        result = s.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)
            .values(lease_expires_at=_lease_expiry())
        )
        return result.rowcount == 1


def discard_metrics_after(job_id: str, step: int) -> None:
    """Drop metric rows past ``step``: an attempt that died after its last checkpoint logged them,
    and the resumed attempt trains those steps again."""
    with session_scope() as s:
        s.execute(delete(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > step))


def requeue(job_id: str, worker_id: str, code: str, message: str, restart: bool) -> bool:
    """Give a running job back to the queue (the caller then enqueues it).

    ``restart`` counts it against ``max_restarts`` (the worker failed), as opposed to a deploy's
    SIGTERM. A job out of restarts ends ``failed`` instead. Returns True if it was re-queued.
    """
    with session_scope() as s:
        job = s.get(Job, job_id)
        if job is None or job.status != JobStatus.RUNNING or job.lease_owner != worker_id:
            return False
        return _requeue_or_fail(s, job, code, message, restart)


def _requeue_or_fail(s, job: Job, code: str, message: str, restart: bool) -> bool:
    job.lease_owner, job.lease_expires_at, job.enqueued_at = None, None, None
    if restart and job.restarts >= get_settings().max_restarts:
        job.status, job.finished_at = JobStatus.FAILED, utcnow()
        job.error = {"code": "too_many_restarts",
                     "message": f"gave up after {job.restarts} restarts; last: {message}"}
        s.add(JobEvent(job_id=job.id, code="failed", level="error", message=job.error["message"]))
        return False
    job.status = JobStatus.QUEUED
    job.restarts += restart
    s.add(JobEvent(job_id=job.id, code=code, level="warning", message=message))
    return True


def recover() -> list[str]:
    """The reaper and the sweeper, safe to run from any number of processes at once.

    Re-queues running jobs whose lease expired (``job_restarted``; ``failed`` after
    ``max_restarts``), and returns the ids of queued jobs whose message must be (re-)sent: never
    sent, or sent over ``resend_after_seconds`` ago (a broker that lost it). The caller sends
    them and calls ``mark_enqueued``; a duplicate message is harmless (see ``claim``).
    """
    settings, now = get_settings(), utcnow()
    with session_scope() as s:
        expired = s.scalars(select(Job).where(Job.status == JobStatus.RUNNING, Job.lease_expires_at < now)
                            .with_for_update(skip_locked=True)).all()
        for job in expired:
            _requeue_or_fail(s, job, "job_restarted",
                             f"lease of worker {job.lease_owner} expired at {job.lease_expires_at:%H:%M:%S}; "
                             "resuming from the latest checkpoint", restart=True)
        grace = now - timedelta(seconds=settings.sweep_seconds)
        stale = now - timedelta(seconds=settings.resend_after_seconds)
        return list(s.scalars(select(Job.id).where(
            Job.status == JobStatus.QUEUED,
            or_(and_(Job.enqueued_at.is_(None), Job.updated_at < grace), Job.enqueued_at < stale),
        )))


def report(
    job_id: str,
    worker_id: str,
    progress: dict[str, Any] | None = None,
    metrics: list[tuple[int, float, str, float, datetime]] = (),
) -> bool:
    """One short transaction from the running worker: renew the lease, update progress fields and
    append metric rows ``(step, epoch, name, value, time)``. Returns False (and writes nothing) if
    ``worker_id`` no longer holds the job."""
    with session_scope() as s:
        result = s.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)
            .values(lease_expires_at=_lease_expiry(), **(progress or {}))
        )
        if result.rowcount != 1:
            return False
        s.add_all(
            JobMetric(job_id=job_id, step=st, epoch=ep, name=n, value=v, time=t) for st, ep, n, v, t in metrics
        )
        return True


def record_checkpoint(job_id: str, step: int, path: str, metrics: dict[str, Any] | None, keep: int) -> list[Path]:
    """Point the store at a checkpoint (call only once it is completely written) and forget all but
    the newest ``keep``. Returns the forgotten checkpoints' directories, for the caller to delete."""
    with session_scope() as s:
        s.add(Checkpoint(job_id=job_id, step=step, path=path, metrics=metrics))
        s.flush()
        old = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                        .order_by(Checkpoint.step.desc()).offset(keep)).all()
        for checkpoint in old:
            s.delete(checkpoint)
        return [Path(c.path) for c in old]


def latest_checkpoint(job_id: str) -> Checkpoint | None:
    """The newest complete checkpoint recorded for the job whose directory still exists."""
    with session_scope() as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()))
        return next((c for c in rows if Path(c.path).is_dir()), None)


def finish(job_id: str, worker_id: str, status: str, error: dict[str, str] | None = None) -> bool:
    """End a running job held by ``worker_id``. Returns False if it no longer holds it."""
    with session_scope() as s:
        result = s.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)
            .values(status=status, error=error, finished_at=utcnow(), lease_owner=None, lease_expires_at=None,
                    eta_seconds=0.0 if status == JobStatus.SUCCEEDED else None)
        )
        if result.rowcount == 1:
            level = "info" if status != JobStatus.FAILED else "error"
            message = status if error is None else f"{status}: {error['message']}"
            s.add(JobEvent(job_id=job_id, code=status, level=level, message=message))
        return result.rowcount == 1
