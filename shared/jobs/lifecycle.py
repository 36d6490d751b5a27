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

Jobs are of two kinds (``Job.kind``): ``train`` and ``predict`` (``shared.jobs.predictions``). Both go
through this one lifecycle; the routes of each kind see only its jobs (``shared.store.tenancy.owned_job``).

Files follow the rows: ``delete_job`` (and ``shared.jobs.uploads.delete_dataset``) leave a tombstone row (the id answers
404 saying it was deleted) and remove the files; a succeeded job's step checkpoints are deleted
(``discard_checkpoints``); ``shared.jobs.retention.clean_up_files`` applies ``artifact_retention_days`` and removes whatever
a process that died between its commit and its clean-up left behind.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.orm import Session

from shared.errors import Conflict, UserError, without_paths
from shared.jobs import trials
from shared.jobs.planning import check_spec
from shared.jobs.trials import ACTIVE, cancel_in, end_job, insert_queued
from shared.schemas.jobs import TASK_FIELDS, JobCreate, JobOut, Progress, Timings, json_safe
from shared.settings import get_settings
from shared.store import idempotency, objects, quotas
from shared.store.alias_rows import ModelAlias
from shared.store.engine import keyset_page, read_session, session_scope
from shared.store.rows import Checkpoint, Dataset, Job, JobEvent, JobMetric, JobStatus, new_id, utcnow
from shared.store.tenancy import Caller, lock_tenant, owned_job, scoped

RESUMES_FROM = {"train": "the latest checkpoint", "predict": "the last results part written"}


def to_out(job: Job) -> JobOut:
    """The API view of a job row (a broken one too: ``trials.stored_hyperparameters``)."""
    spec, (hyperparameters, error) = job.spec, trials.stored_hyperparameters(job)
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
        label_separator=spec.get("label_separator"),
        decision_threshold=spec.get("decision_threshold", 0.5),
        tune_threshold=spec.get("tune_threshold", False),
        **{k: spec.get(k) for k in TASK_FIELDS.get(job.task, ())},
        label_names=job.label_names,
        hyperparameters=hyperparameters,
        metadata=spec.get("metadata"),
        suffix=spec.get("suffix"),
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
        error=error,
        timings=Timings(**(job.timings or {})),
        files_deleted_at=job.files_deleted_at,
        sweep_id=job.sweep_id,
        trial_number=job.trial_number,
    )


def create_job(spec: JobCreate, caller: Caller, claim: idempotency.Claim | None = None) -> Job:
    """Validate a job spec against its model and data, then insert it as ``queued`` for the caller's
    tenant. With an idempotency ``claim``, the response (``to_out``) is recorded in the same
    transaction (``shared.store.idempotency``).

    The caller enqueues the job id once this returns (the row is committed by then). The job's
    ``created_at`` is when this was called, so its ``queued`` time includes the checks.

    Raises:
        UserError: see ``shared.jobs.planning.check_spec``; ``unknown_dataset`` if a dataset was deleted
            while the spec was checked; 429 ``too_many_active_jobs`` and 413
            ``storage_quota_exceeded`` (``shared.store.quotas``).
    """
    received = utcnow()
    checked = check_spec(spec, caller)
    with admission(caller) as s:
        for dataset in filter(None, [checked.train, checked.validation]):
            # Locked against a concurrent DELETE /datasets/{id}, which locks it to check for active jobs.
            row = s.get(Dataset, dataset.id, with_for_update={"read": True}, populate_existing=True)
            if row is None or row.deleted_at is not None:
                raise UserError("unknown_dataset", f"dataset {dataset.id!r} was deleted", "training_dataset")
        job = Job(
            id=new_id("job"),
            tenant=caller.tenant,
            base_model=spec.base_model,
            task=spec.task,
            training_dataset_id=checked.train.id,
            validation_dataset_id=checked.validation.id if checked.validation else None,
            spec=spec.model_dump(mode="json"),
            label_names=checked.label_names,
            created_at=received,
        )
        return insert_queued(s, job, "job created and queued", claim, to_out)


@contextmanager
def admission(caller: Caller) -> Iterator[Session]:
    """A write session in which ``caller`` may store one more job of either kind: the storage
    quota checked, the tenant's row locked (one admission at a time per tenant), then the
    active-jobs quota checked.

    Raises:
        UserError: 413 ``storage_quota_exceeded``, 429 ``too_many_active_jobs`` (``shared.store.quotas``).
    """
    with read_session() as s:
        quotas.check_storage(s, caller.tenant)
    with session_scope() as s:
        lock_tenant(s, caller.tenant)
        quotas.check_active_jobs(s, caller.tenant)
        yield s


def get_job(job_id: str, caller: Caller, kind: str = "train") -> Job:
    """The job, if ``caller`` may see it and it is of ``kind`` (``train`` or ``predict``).

    Raises:
        NotFound: no such job, another tenant's, or one of another kind. Deleted: the job was
            deleted (``delete_job``).
    """
    with read_session() as s:
        return owned_job(s, job_id, caller, kind=kind)


def list_jobs(
    caller: Caller,
    limit: int,
    after: str | None = None,
    status: str | None = None,
    param: str = "after",
    kind: str = "train",
    task: str | None = None,
    sweep: str | None = None,
    metadata: dict[str, str] | None = None,
) -> tuple[list[Job], bool]:
    """The caller's jobs of ``kind`` (an admin's: all), newest first, ``limit`` at a time after job
    ``after``, optionally of one ``status``, one ``task``, one ``sweep`` (its trials) and with each
    key of ``metadata`` at its value (OpenAI's ``metadata[key]=value`` filter).

    Returns:
        (jobs, has_more).

    Raises:
        UserError: ``invalid_cursor`` (naming ``param``) when ``after`` is not one of those jobs.
    """
    mine = scoped(select(Job), Job, caller).where(Job.kind == kind)
    with read_session() as s:
        query = mine.where(Job.status == status) if status else mine
        query = query.where(Job.task == task) if task else query
        query = query.where(Job.sweep_id == sweep) if sweep else query
        for key, value in (metadata or {}).items():
            query = query.where(Job.spec[("metadata", key)].as_string() == value)
        return keyset_page(s, query, Job, after, limit, param=param, within=mine)


def list_events(job_id: str, caller: Caller, kind: str = "train") -> list[JobEvent]:
    """The job's events, oldest first.

    Raises:
        NotFound: no such job of ``kind``, or another tenant's.
    """
    with read_session() as s:
        owned_job(s, job_id, caller, kind=kind)
        return list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.time, JobEvent.id)))


def list_checkpoints(job_id: str, caller: Caller) -> list[Checkpoint]:
    """The job's recorded checkpoints, by step.

    Raises:
        NotFound: no such job, or another tenant's.
    """
    with read_session() as s:
        owned_job(s, job_id, caller)
        return list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)))


def cancel_requested(job_id: str) -> bool:
    with read_session() as s:
        return bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))


def add_event(job_id: str, code: str, message: str, level: str = "info") -> None:
    with session_scope() as s:
        s.add(JobEvent(job_id=job_id, code=code, message=without_paths(message), level=level))


def mark_enqueued(job_id: str) -> None:
    """Record that the broker accepted the job's message (the recovery loop re-sends jobs without it)."""
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(enqueued_at=utcnow()))


def request_cancel(job_id: str, caller: Caller, kind: str = "train") -> Job:
    """Cancel a job: a queued one ends ``cancelled`` now; a running one is flagged and stops at its
    next optimizer step (a prediction: after its current part). A finished job is left as it is.

    Raises:
        NotFound: no such job of ``kind``, or another tenant's.
    """
    now = utcnow()
    with session_scope() as s:
        # Locked (PostgreSQL; SQLite's BEGIN IMMEDIATE already serializes writers), so that a claim
        # cannot slip in between reading the status and acting on it.
        trials.lock_sweep_of(s, job_id)
        job = owned_job(s, job_id, caller, for_update=True, kind=kind)
        cancel_in(s, job, now)
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
        if result.rowcount != 1:  # type: ignore[attr-defined]  # DML returns a CursorResult
            return None
        job = s.get(Job, job_id, populate_existing=True)
        assert job is not None  # the row the UPDATE just claimed
        if job.started_at is None:
            job.started_at = now
            job.timings = {"queued": round((now - job.created_at).total_seconds(), 3)}
        else:  # a later attempt: its phases replace those of the one before
            job.timings = {"queued": (job.timings or {}).get("queued")}
        s.add(
            JobEvent(
                job_id=job_id,
                code="started",
                level="info",
                message=f"attempt {job.attempts} started on worker {worker_id}",
            )
        )
        return job


def heartbeat(job_id: str, worker_id: str) -> bool:
    """Renew the lease of a running job. Returns False if ``worker_id`` no longer holds it."""
    with session_scope() as s:
        result = s.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)
            .values(lease_expires_at=_lease_expiry())
        )
        return result.rowcount == 1  # type: ignore[attr-defined]  # DML returns a CursorResult


def discard_metrics_after(job_id: str, step: int) -> None:
    """Drop metric rows past ``step``: an attempt that died after its last checkpoint logged them,
    and the resumed attempt trains those steps again."""
    with session_scope() as s:
        s.execute(delete(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > step))


def requeue(job_id: str, worker_id: str, code: str, message: str, restart: bool, then: str = "") -> bool:
    """Give a running job back to the queue (the caller then enqueues it), ``message`` saying why
    and ``then`` what comes next ("; retrying in 30 s"), said only if it is re-queued.

    ``restart`` counts it against ``max_restarts`` (the worker failed), as opposed to a deploy's
    SIGTERM. A job out of restarts ends ``failed`` instead. Returns True if it was re-queued.
    """
    with session_scope() as s:
        trials.lock_sweep_of(s, job_id)
        job = s.get(Job, job_id)
        if job is None or job.status != JobStatus.RUNNING or job.lease_owner != worker_id:
            return False
        return _requeue_or_fail(s, job, code, message, restart, then)


def _requeue_or_fail(s, job: Job, code: str, message: str, restart: bool, then: str = "") -> bool:
    """Re-queue ``job`` (its row locked), or end it: ``failed`` once out of restarts, ``cancelled``
    when a cancel was asked for (its worker stopped before it saw it: killed, shut down, out of
    lease; such a job was re-queued, resumed and trained on, or failed ``too_many_restarts``).
    Returns True if it was re-queued."""
    message = without_paths(message)  # often a library's exception: no server path in any response
    job.lease_owner, job.lease_expires_at, job.enqueued_at = None, None, None
    if job.cancel_requested:
        job.eta_seconds = None
        end_job(s, job, JobStatus.CANCELLED, utcnow())
        s.add(
            JobEvent(
                job_id=job.id, code="cancelled", level="info", message=f"cancelled; its worker stopped first: {message}"
            )
        )
        trials.ended(s, job)
        return False
    if restart and job.restarts >= get_settings().max_restarts:
        job.error = {"code": "too_many_restarts", "message": f"gave up after {job.restarts} restarts; last: {message}"}
        end_job(s, job, JobStatus.FAILED, utcnow())
        s.add(JobEvent(job_id=job.id, code="failed", level="error", message=job.error["message"]))
        trials.ended(s, job)
        return False
    job.status = JobStatus.QUEUED
    job.restarts += restart
    s.add(JobEvent(job_id=job.id, code=code, level="warning", message=message + then))  # then: not said of an end
    return True


def recover() -> list[str]:
    """Expired leases and lost messages, safe to run from any number of processes at once.

    Re-queues running jobs whose lease expired (``job_restarted``; ``failed`` after
    ``max_restarts``), and returns the ids of queued jobs whose message must be (re-)sent: those
    it re-queued, at once, and those never sent (after a grace: their creator is sending them)
    or sent over ``resend_after_seconds`` ago (a broker that lost it). The caller sends them and
    calls ``mark_enqueued``; a duplicate message is harmless (see ``claim``).
    """
    settings, now = get_settings(), utcnow()
    with session_scope() as s:
        is_expired = and_(Job.status == JobStatus.RUNNING, Job.lease_expires_at < now)
        trials.lock_sweep_of(s, *s.scalars(select(Job.id).where(is_expired, Job.sweep_id.isnot(None))).all())
        expired = s.scalars(select(Job).where(is_expired).with_for_update(skip_locked=True)).all()
        requeued = [
            job.id
            for job in expired
            if _requeue_or_fail(
                s,
                job,
                "job_restarted",
                f"lease of worker {job.lease_owner} expired at {job.lease_expires_at:%H:%M:%S}",
                restart=True,
                then=f"; resuming from {RESUMES_FROM[job.kind]}",
            )
        ]
        grace = now - timedelta(seconds=settings.recovery_seconds)
        stale = now - timedelta(seconds=settings.resend_after_seconds)
        unsent = s.scalars(
            select(Job.id).where(
                Job.status == JobStatus.QUEUED,
                or_(and_(Job.enqueued_at.is_(None), Job.updated_at < grace), Job.enqueued_at < stale),
            )
        )
        return requeued + [job_id for job_id in unsent if job_id not in requeued]


def record_progress(
    job_id: str,
    worker_id: str,
    progress: dict[str, Any] | None = None,
    metrics: Sequence[tuple[int, float, str, float, datetime]] = (),
) -> bool:
    """One short transaction from the running worker: renew the lease, update progress fields and
    append metric rows ``(step, epoch, name, value, time)``. Non-finite values (NaN, Infinity) are
    stored as null: JSON and SQLite have no NaN. Returns False (and writes nothing) if
    ``worker_id`` no longer holds the job."""
    with session_scope() as s:
        result = s.execute(
            update(Job)
            .where(Job.id == job_id, Job.lease_owner == worker_id, Job.status == JobStatus.RUNNING)
            .values(lease_expires_at=_lease_expiry(), **json_safe(progress or {}))
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]  # DML returns a CursorResult
            return False
        s.add_all(
            JobMetric(job_id=job_id, step=st, epoch=ep, name=n, value=json_safe(v), time=t)
            for st, ep, n, v, t in metrics
        )
        return True


def record_checkpoint(
    job_id: str, step: int, path: str, metrics: dict[str, Any] | None, keep: int, size: int | None = None
) -> list[str]:
    """Point the store at a checkpoint (once completely written, and published: ``shared.store.objects``),
    ``size`` its bytes (the tenant's quota); forget all but the newest ``keep``. Returns the
    forgotten ones' refs, for the caller to delete (``objects.store().remove``)."""
    with session_scope() as s:
        s.add(Checkpoint(job_id=job_id, step=step, path=path, metrics=json_safe(metrics), bytes=size))
        s.flush()
        newest_first = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())
        old = s.scalars(newest_first.offset(keep)).all()
        for checkpoint in old:
            s.delete(checkpoint)
        return [c.path for c in old]


def latest_checkpoint(job_id: str) -> Checkpoint | None:
    """The newest complete checkpoint recorded for the job whose files still exist (on disk, or in the bucket)."""
    with read_session() as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()))
        return next((c for c in rows if objects.store().files(c.path)), None)


def succeeded_message(job: Job) -> str:
    """The last event of a succeeded job, its outcome in a line (it read "succeeded: succeeded"): a
    prediction's rows; a training job's steps and its last validation figure by
    ``metric_for_best_model``, the figure ``jobs get`` and the dashboard show."""
    if job.kind == "predict":
        return f"{job.step:,} rows scored"
    metric = (job.spec.get("hyperparameters") or {}).get("metric_for_best_model", "loss")
    value = (job.validation_metrics or {}).get(metric)
    figure = f"; validation {metric} {value:.4g}" if isinstance(value, (int, float)) else ""
    return f"after {job.step:,} steps{figure}"


def finish(job_id: str, worker_id: str, status: str, error: dict[str, str] | None = None) -> bool:
    """End a running job held by ``worker_id`` (a ``timings`` event): a succeeded job's or pruned trial's checkpoints
    are forgotten (the caller deletes them: ``discard_checkpoints``), a trial's sweep goes on. False: not held."""
    if error is not None:
        error = {**error, "message": without_paths(error["message"])}
    files_bytes = quotas.artifacts_bytes(job_id)  # the tenant's quota: its own objects, once
    with session_scope() as s:
        trials.lock_sweep_of(s, job_id)
        job = s.get(Job, job_id, with_for_update=True, populate_existing=True)
        if job is None or job.status != JobStatus.RUNNING or job.lease_owner != worker_id:
            return False
        job.error, job.lease_owner, job.lease_expires_at = error, None, None
        job.files_bytes = files_bytes
        end_job(s, job, status, utcnow())
        job.eta_seconds = 0.0 if status == JobStatus.SUCCEEDED else None
        level = "info" if status != JobStatus.FAILED else "error"
        message = status if error is None else f"{status}: {error['message']}"
        if status == JobStatus.SUCCEEDED:
            message = succeeded_message(job)
        s.add(JobEvent(job_id=job_id, code="timings", level="info", message=describe_timings(job.timings or {})))
        s.add(JobEvent(job_id=job_id, code=status, level=level, message=message))  # the last event: how it ended
        if status in trials.NO_CHECKPOINTS:
            s.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id))
        trials.ended(s, job)
        return True


def describe_timings(timings: dict[str, float | None]) -> str:
    """One line, e.g. ``seconds: queued 0.21, load 1.05, ..., total 15.4``."""
    return "seconds: " + ", ".join(
        f"{name} {timings[name]:.2f}" for name in Timings.model_fields if timings.get(name) is not None
    )


# ----------------------------------------------------------------------------- files


def discard_checkpoints(job_id: str) -> None:
    """Delete the checkpoint directory of a job that ``finish`` recorded as succeeded (its step
    checkpoints and best-model links: the artifact has the model) or pruned (its weights are not
    kept). A directory left by a worker that died before this is removed by ``shared.jobs.retention.clean_up_files``."""
    objects.remove_job_files(job_id, "checkpoints")


ROUTES = {"train": "/jobs", "predict": "/predictions"}  # where a job of each kind is reached


def delete_job(job_id: str, caller: Caller, kind: str = "train") -> None:
    """``DELETE /jobs/{id}`` (``/predictions/{id}``): remove a finished job's checkpoints, artifacts
    (a prediction's results), metrics and events, and keep its row as a tombstone, so that its id
    answers 404 saying it was deleted.

    Raises:
        NotFound, Deleted: see ``get_job``. Conflict (409): the job is queued or running
            (``job_not_finished``), it is the model of a queued or running prediction (``model_in_use``)
            or of a model alias (``model_has_alias``).
    """
    now = utcnow()
    with session_scope() as s:
        job = owned_job(s, job_id, caller, for_update=True, kind=kind)
        if job.status in ACTIVE:
            raise Conflict(
                "job_not_finished",
                f"job {job_id!r} is {job.status}; cancel it first "
                f"(POST {ROUTES[kind]}/{job_id}/cancel), then delete it once it has stopped",
            )
        predicting = s.scalars(
            select(Job.id).where(Job.kind == "predict", Job.base_model == job_id, Job.status.in_(ACTIVE))
        ).all()
        if predicting:
            raise Conflict(
                "model_in_use",
                f"job {job_id!r} is the model of {len(predicting)} queued or running "
                f"prediction(s): {', '.join(predicting[:5])}; wait for them to finish or cancel them",
            )
        aliases = s.scalars(
            select(ModelAlias.alias).where(ModelAlias.job_id == job_id).order_by(ModelAlias.alias)
        ).all()
        if aliases:  # deleting it would break every client that predicts by the alias
            raise Conflict(
                "model_has_alias",
                f"job {job_id!r} is the model of alias(es) {', '.join(map(repr, aliases[:5]))}; move them to "
                f"another job (PUT /models/aliases/{aliases[0]}) or delete them first",
            )
        job.deleted_at, job.files_deleted_at = now, job.files_deleted_at or now
        for child in (JobMetric, JobEvent, Checkpoint):
            s.execute(delete(child).where(child.job_id == job_id))
    objects.remove_job_files(job_id, "checkpoints", "artifacts")
