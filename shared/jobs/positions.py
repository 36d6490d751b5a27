"""Where a queued job stands: its place in the queue and when a worker is expected to take it.

The queue is every tenant's queued jobs of both kinds, oldest first (the order the API sends them
to the broker, which workers take them in). The estimated start simulates the workers: as many as
jobs run now (at least one; the store does not know idle workers), each free when its running job's
ETA (``Job.eta_seconds``, less the time since the worker reported it) has passed; each job ahead
goes to the worker that is free first and keeps it for its dry-run plan's ``estimated_seconds``.

The plan estimate of a queued job (``Job.plan_seconds``) is computed once, in the background, by
the API's recovery loop (``estimate_queued``): a dry run tokenizes the whole dataset, which is too
slow for a request. Until it is there, and when a plan has no estimate (no succeeded job on that
model yet), the jobs behind it have no estimated start (``null``).
"""

import heapq
import logging
import math
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from shared.schemas.queue import QueuePosition
from shared.store.engine import read_session, session_scope
from shared.store.rows import Job, JobStatus, utcnow
from shared.store.tenancy import Caller

log = logging.getLogger(__name__)
PLANS_PER_SWEEP = 5  # queued jobs planned per sweep: a dry run tokenizes a whole dataset


def queue_positions(s: Session, now: datetime | None = None) -> dict[str, QueuePosition]:
    """The place and estimated start of every queued job, by job id (one read of the queued and
    running jobs' rows)."""
    now = now or utcnow()
    queued = s.execute(
        select(Job.id, Job.plan_seconds).where(Job.status == JobStatus.QUEUED).order_by(Job.created_at, Job.id)
    ).all()
    if not queued:
        return {}
    running = s.execute(select(Job.eta_seconds, Job.updated_at).where(Job.status == JobStatus.RUNNING)).all()
    free_in = [remaining(eta, reported, now) for eta, reported in running] or [0.0]
    heapq.heapify(free_in)
    positions = {}
    for ahead, (job_id, plan_seconds) in enumerate(queued):
        start = heapq.heappop(free_in)  # math.inf: unknown
        known = math.isfinite(start)
        positions[job_id] = QueuePosition(
            position=ahead + 1,
            ahead=ahead,
            estimated_start_seconds=round(start, 1) if known else None,
            estimated_start_at=now + timedelta(seconds=start) if known else None,
        )
        heapq.heappush(free_in, start + (plan_seconds if plan_seconds is not None else math.inf))
    return positions


def moved(before: QueuePosition | None, after: QueuePosition | None, seconds: float = 5.0) -> bool:
    """Whether a job's place changed enough to tell a stream: another position, an estimate that
    appeared or went, or an estimated start that moved by ``seconds`` or more (it drifts a little on
    every read, as the running jobs' ETAs are re-read)."""
    if before is None or after is None:
        return before is not after
    if (before.position, before.estimated_start_at is None) != (after.position, after.estimated_start_at is None):
        return True
    return (
        after.estimated_start_at is not None
        and before.estimated_start_at is not None
        and abs((after.estimated_start_at - before.estimated_start_at).total_seconds()) >= seconds
    )


def remaining(eta_seconds: float | None, reported_at: datetime, now: datetime) -> float:
    """Seconds until a running job ends: its ETA as last reported, less the time since; unknown
    (``math.inf``) before its worker reported one."""
    if eta_seconds is None:
        return math.inf
    return max(0.0, eta_seconds - (now - reported_at).total_seconds())


def with_positions(views: list) -> list:
    """``views`` (``JobOut`` or ``PredictionOut``), each queued one with its ``queue`` filled in."""
    if any(v.status == JobStatus.QUEUED for v in views):
        with read_session() as s:
            positions = queue_positions(s)
        for view in views:
            view.queue = positions.get(view.id) if view.status == JobStatus.QUEUED else None
    return views


def estimate_queued() -> int:
    """Plan up to PLANS_PER_SWEEP queued jobs that have no plan estimate yet, oldest first, and store
    each one's ``estimated_seconds`` (``shared.jobs.planning.plan_job``,
    ``shared.jobs.predictions.plan_prediction``) as ``Job.plan_seconds``. A plan that fails (its dataset
    was deleted meanwhile) stores none. Returns how many were planned."""
    with read_session() as s:
        todo = s.execute(
            select(Job.id, Job.kind, Job.tenant, Job.spec)
            .where(Job.status == JobStatus.QUEUED, Job.planned_at.is_(None))
            .order_by(Job.created_at, Job.id)
            .limit(PLANS_PER_SWEEP)
        ).all()
    for job_id, kind, tenant, spec in todo:
        try:
            seconds = plan_estimate(kind, spec, Caller(tenant))
        except Exception as e:
            log.warning("no plan estimate for queued job %s: %s", job_id, e)
            seconds = None
        with session_scope() as s:
            s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
                .values(plan_seconds=seconds, planned_at=utcnow())
            )
    return len(todo)


def plan_estimate(kind: str, spec: dict, caller: Caller) -> float | None:
    """The dry-run plan's ``estimated_seconds`` of a stored job spec of ``kind``."""
    from shared.jobs import planning, predictions
    from shared.schemas.jobs import JobCreate
    from shared.schemas.predictions import PredictionCreate

    if kind == predictions.KIND:
        plan = predictions.plan_prediction(predictions.check_prediction(PredictionCreate.model_validate(spec), caller))
    else:
        plan = planning.plan_job(planning.check_spec(JobCreate.model_validate(spec), caller))
    return plan["estimated_seconds"]
