"""How jobs end, and a sweep's side of it: the transitions that ``shared.jobs.lifecycle`` (any job)
and ``shared.jobs.sweeps`` (a sweep's trials) share. A trial's sweep is locked before the trial's
row, and asks for its next trials in the transaction that ends one (``ended``), so that no crash
comes between; ending a sweep cancels its trials here too. Below both: it imports neither.
"""

import logging
from collections import Counter
from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.jobs import webhooks
from shared.jobs.search import ENDED, FAILED, SUCCEEDED, ask, curves, distributions, spec_of, trial_template
from shared.store import idempotency
from shared.store.rows import Job, JobEvent, JobStatus, Sweep, new_id, utcnow

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)
NO_CHECKPOINTS = (JobStatus.SUCCEEDED, JobStatus.PRUNED)  # jobs whose step checkpoints are deleted when they end


def lock_sweep_of(s: Session, *job_ids: str) -> None:
    """Lock the sweeps of those of ``job_ids`` that are trials, before their job rows: every
    transaction that ends a trial takes its sweep's lock first, then job rows (``shared.jobs.sweeps``
    cancels a sweep's trials with its lock held), so that two never wait on each other."""
    ids = s.scalars(select(Job.sweep_id).where(Job.id.in_(job_ids), Job.sweep_id.isnot(None)).distinct()).all()
    for sweep_id in sorted(i for i in ids if i is not None):
        s.get(Sweep, sweep_id, with_for_update=True)


def ended(s: Session, job: Job) -> None:
    """If ``job`` is a trial that has just ended in transaction ``s``, lock its sweep and ``top_up``
    it in that transaction. A failure to ask does not undo the trial's end: the recovery loop asks
    again (``shared.jobs.sweeps.top_up_all``)."""
    if job.sweep_id is None or job.status not in JobStatus.FINISHED:
        return
    sweep = s.get(Sweep, job.sweep_id, with_for_update=True, populate_existing=True)
    if sweep is None:
        return
    try:
        with s.begin_nested():
            top_up(s, sweep)
    except Exception:
        log.exception("sweep %s: asking for the next trials failed; the recovery loop tries again", sweep.id)


def insert_queued(s: Session, job: Job, message: str, claim: idempotency.Claim | None,
                  view: Callable[[Job], BaseModel] | None) -> Job:
    """Add ``job`` (queued) and its ``created`` event to session ``s``; with an idempotency
    ``claim``, record its API view (``view(job)``, once the row's defaults are filled) as the 201
    answer in the same transaction."""
    s.add(job)
    s.add(JobEvent(job_id=job.id, code="created", level="info", message=message))
    s.flush()
    if claim is not None and view is not None:
        idempotency.complete(s, claim, 201, view(job).model_dump(mode="json"))
    return job


def end_job(s: Session, job: Job, status: str, now: datetime) -> None:
    """Set a job's final status, end time and ``timings.total``, and its webhook deliveries (``webhooks.job_ended``)."""
    job.status, job.finished_at = status, now
    job.timings = {**(job.timings or {}), "total": round((now - job.created_at).total_seconds(), 3)}
    webhooks.job_ended(s, job)


def cancel_in(s: Session, job: Job, now: datetime, why: str = "") -> None:
    """Row locked: a queued job ends cancelled (a trial's sweep goes on), a running one is flagged to stop."""
    if job.status == JobStatus.QUEUED:
        end_job(s, job, JobStatus.CANCELLED, now)
        s.add(JobEvent(job_id=job.id, code="cancelled", level="info", message="cancelled before it started" + why))
        ended(s, job)
    elif job.status == JobStatus.RUNNING and not job.cancel_requested:
        job.cancel_requested = True
        s.add(JobEvent(job_id=job.id, code="cancel_requested", level="info", message="cancel requested" + why))


def top_up(s: Session, sweep: Sweep) -> list[Job]:
    """In session ``s``, with the sweep's row locked: queue trials up to ``max_parallel_trials``
    active and ``max_trials`` in all; end the sweep once every trial has ended, or fail it once more
    than ``max_failed_trials`` failed. Returns the new trials (queued; their ids not yet sent)."""
    if sweep.status in ENDED:
        return []
    spec = spec_of(sweep)
    trials = list(s.scalars(select(Job).where(Job.sweep_id == sweep.id)))
    counts = Counter(t.status for t in trials)
    active = counts[JobStatus.QUEUED] + counts[JobStatus.RUNNING]
    if counts[JobStatus.FAILED] > spec.max_failed_trials:
        end_sweep(s, sweep, FAILED, {"code": "too_many_failed_trials", "message": f"{counts[JobStatus.FAILED]} "
                                     f"trials failed, more than max_failed_trials {spec.max_failed_trials}"})
        return []
    wanted = min(spec.max_parallel_trials - active, spec.max_trials - len(trials))
    if wanted <= 0:
        if active == 0:
            ok = counts[JobStatus.SUCCEEDED] > 0
            end_sweep(s, sweep, SUCCEEDED if ok else FAILED,
                      None if ok else {"code": "no_trial_succeeded", "message": "no trial succeeded"})
        return []
    space = distributions(spec)
    asked = ask(spec, space, trials, curves(s, [t.id for t in trials], spec.objective.metric), wanted)
    template = trial_template(spec).model_dump(mode="json")
    new = []
    for number, (params, attrs) in enumerate(asked, start=len(trials)):
        job = Job(id=new_id("job"), tenant=sweep.tenant, base_model=spec.base_model, task=spec.task,
                  training_dataset_id=spec.training_dataset, validation_dataset_id=spec.validation_dataset,
                  spec={**template, "hyperparameters": {**template["hyperparameters"], **params}},
                  label_names=sweep.label_names, sweep_id=sweep.id, trial_number=number, trial_attrs=attrs)
        new.append(insert_queued(s, job, f"trial {number} of sweep {sweep.id} queued: {params}", None, None))
    return new


def end_sweep(s: Session, sweep: Sweep, status: str, error: dict | None = None) -> None:
    """End the sweep ``status`` and cancel its queued and running trials; its ``sweep.<status>``
    webhook deliveries are stored in the same transaction (``shared.jobs.webhooks``)."""
    now = utcnow()
    sweep.status, sweep.finished_at, sweep.error = status, now, error
    webhooks.emit(s, sweep.tenant, f"sweep.{status}", f"evt_{sweep.id}_{status}",
                  {"id": sweep.id, "object": "sweep", "status": status, "error": error,
                   "finished_at": now.isoformat().replace("+00:00", "Z")})
    for job in s.scalars(select(Job).where(Job.sweep_id == sweep.id, Job.status.in_(ACTIVE))
                         .with_for_update()):
        cancel_in(s, job, now, f" (sweep {sweep.id} {status})")
