"""How jobs end, and a sweep's side of it: the transitions that ``shared.jobs.lifecycle`` (any job)
and ``shared.jobs.sweeps`` (a sweep's trials) share. A trial's sweep is locked before the trial's
row, and asks for its next trials in the transaction that ends one (``ended``), so that no crash
comes between; ending a sweep cancels its trials here too. Later trials pass the tenant's admission
as jobs do (``admitted``: without room the sweep is paused). Below both: it imports neither.
"""

import logging
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.errors import UserError
from shared.jobs import webhooks
from shared.jobs.search import (
    ENDED,
    FAILED,
    SUCCEEDED,
    ask,
    curves,
    history,
    more_curves,
    multi_objective,
    spec_of,
    trial_hyperparameters,
    trial_template,
)
from shared.jobs.search_space import BASE_MODEL, distributions
from shared.schemas.hyperparameters import Hyperparameters
from shared.settings import get_settings
from shared.store import idempotency, quotas
from shared.store.rows import Job, JobEvent, JobStatus, Sweep, new_id, utcnow
from shared.store.tenancy import try_lock_tenant

log = logging.getLogger(__name__)

ACTIVE = (JobStatus.QUEUED, JobStatus.RUNNING)
PAUSED = "trials_paused"  # a running sweep's error while its tenant has no room for its next trials
BUDGET = "budget_spent"  # an ended sweep's error once its max_duration_seconds passed (top_up)
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


def insert_queued(
    s: Session, job: Job, message: str, claim: idempotency.Claim | None, view: Callable[[Job], BaseModel] | None
) -> Job:
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
    than ``max_failed_trials`` failed, or end it once its ``max_duration_seconds`` passed (error
    ``budget_spent``; checked whenever a trial ends and by the recovery loop's ``top_up_all``, every
    ``recovery_seconds``). Returns the new trials (queued; their ids not yet sent)."""
    if sweep.status in ENDED:
        return []
    spec = spec_of(sweep)
    trials = list(s.scalars(select(Job).where(Job.sweep_id == sweep.id)))
    counts = Counter(t.status for t in trials)
    active = counts[JobStatus.QUEUED] + counts[JobStatus.RUNNING]
    if counts[JobStatus.FAILED] > spec.max_failed_trials:
        end_sweep(
            s,
            sweep,
            FAILED,
            {
                "code": "too_many_failed_trials",
                "message": f"{counts[JobStatus.FAILED]} "
                f"trials failed, more than max_failed_trials {spec.max_failed_trials}",
            },
        )
        return []
    budget = spec.max_duration_seconds
    if (
        budget is not None
        and (active or len(trials) < spec.max_trials)
        and (utcnow() - sweep.created_at).total_seconds() >= budget
    ):
        ok = counts[JobStatus.SUCCEEDED] > 0
        end_sweep(
            s,
            sweep,
            SUCCEEDED if ok else FAILED,
            {
                "code": BUDGET,
                "message": (
                    f"the sweep ended on its budget: max_duration_seconds {budget} passed, {len(trials)} of "
                    f"{spec.max_trials} trials asked; "
                    + ("the best so far is kept" if ok else "no trial had succeeded")
                ),
            },
        )
        return []
    wanted = min(spec.max_parallel_trials - active, spec.max_trials - len(trials))
    if wanted <= 0:
        if active == 0:
            ok = counts[JobStatus.SUCCEEDED] > 0
            end_sweep(
                s,
                sweep,
                SUCCEEDED if ok else FAILED,
                None if ok else {"code": "no_trial_succeeded", "message": "no trial succeeded"},
            )
        return []
    wanted = admitted(s, sweep, wanted)
    if wanted <= 0:
        return []
    space = distributions(spec)
    ids = [t.id for t in trials]
    multi = multi_objective(spec)
    asked = ask(
        spec,
        space,
        trials,
        curves(s, ids, spec.objective.metric),
        wanted,
        more_curves(s, spec, ids) if multi else None,
        history(s, spec, space, multi),
    )
    template = trial_template(spec).model_dump(mode="json")
    try:
        hyperparameters = [trial_hyperparameters(template["hyperparameters"], params) for params, _ in asked]
    except UserError as e:
        if not trials:  # the sweep's first trials: its creation is refused
            raise
        end_sweep(s, sweep, FAILED, {"code": e.code, "message": e.message})
        return []
    new = []
    for number, ((params, attrs), hp) in enumerate(zip(asked, hyperparameters), start=len(trials)):
        model = params.get(BASE_MODEL, spec.base_model)
        job = Job(
            id=new_id("job"),
            tenant=sweep.tenant,
            base_model=model,
            task=spec.task,
            training_dataset_id=spec.training_dataset,
            validation_dataset_id=spec.validation_dataset,
            spec={**template, "base_model": model, "hyperparameters": hp},
            label_names=sweep.label_names,
            sweep_id=sweep.id,
            trial_number=number,
            trial_attrs=attrs,
        )
        new.append(insert_queued(s, job, f"trial {number} of sweep {sweep.id} queued: {params}", None, None))
    return new


def admitted(s: Session, sweep: Sweep, wanted: int) -> int:
    """How many of ``wanted`` new trials the sweep's tenant may queue now: trials pass the same
    admission as jobs (the storage quota and the active-jobs maximum, ``shared.store.quotas``). With
    no room the sweep is paused: ``error`` says why (code ``trials_paused``) until the recovery loop's
    ``top_up_all`` finds room and clears it. 0 also while another transaction of the tenant holds its
    lock (taken without waiting: ``try_lock_tenant``), to be tried again."""
    if not try_lock_tenant(s, sweep.tenant):
        return 0
    limit = get_settings().max_active_jobs_per_tenant
    active = (
        s.scalar(select(func.count()).select_from(Job).where(Job.tenant == sweep.tenant, Job.status.in_(ACTIVE))) or 0
    )
    why = (
        (
            f"tenant {sweep.tenant!r} has {active} queued or running jobs, its maximum "
            f"(TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT={limit})"
        )
        if active >= limit
        else None
    )
    if why is None:
        try:
            quotas.check_storage(s, sweep.tenant)
        except UserError as e:
            why = e.message
    if why is not None:
        if (sweep.error or {}).get("code") != PAUSED:
            log.info("sweep %s paused: %s", sweep.id, why)
        sweep.error = {"code": PAUSED, "message": f"the next trials wait: {why}; they start when room frees"}
        return 0
    if (sweep.error or {}).get("code") == PAUSED:
        sweep.error = None
    return min(wanted, limit - active)


def end_sweep(s: Session, sweep: Sweep, status: str, error: dict | None = None) -> None:
    """End the sweep ``status`` and cancel its queued and running trials; its ``sweep.<status>``
    webhook deliveries are stored in the same transaction (``shared.jobs.webhooks``)."""
    now = utcnow()
    sweep.status, sweep.finished_at, sweep.error = status, now, error
    webhooks.emit(
        s,
        sweep.tenant,
        f"sweep.{status}",
        f"evt_{sweep.id}_{status}",
        {
            "id": sweep.id,
            "object": "sweep",
            "status": status,
            "error": error,
            "finished_at": now.isoformat().replace("+00:00", "Z"),
        },
    )
    for job in s.scalars(select(Job).where(Job.sweep_id == sweep.id, Job.status.in_(ACTIVE)).with_for_update()):
        cancel_in(s, job, now, f" (sweep {sweep.id} {status}{': ' + error['message'] if error else ''})")


def stored_hyperparameters(job: Job) -> tuple[Hyperparameters, dict[str, Any] | None]:
    """The job's stored hyperparameters and its error, for its API view. A row whose stored
    hyperparameters do not validate (a trial stored before trials were checked whole, issue 34) is
    logged and shown anyway, as broken: each invalid value replaced by its default, and an error
    (code ``invalid_stored_hyperparameters``) naming those values, so that one bad row cannot fail a
    whole list (``GET /jobs``, ``/v1/fine_tuning/jobs``, ``/ui/jobs``)."""
    stored = job.spec["hyperparameters"]
    try:
        return Hyperparameters(**stored), job.error
    except ValidationError as e:
        bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
        log.error(
            "job %s: stored hyperparameters do not validate, shown with defaults for %s: %s",
            job.id,
            sorted(bad),
            e.errors(include_url=False),
        )
        kept = {k: v for k, v in stored.items() if k not in bad}
        try:
            hyperparameters = Hyperparameters(**kept)
        except ValidationError:
            hyperparameters = Hyperparameters()
        values = ", ".join(f"{k}={stored.get(k)!r}" for k in sorted(bad))
        return hyperparameters, {
            "code": "invalid_stored_hyperparameters",
            "message": f"job {job.id}'s stored "
            f"hyperparameters are invalid ({values}), shown as their defaults; this job's row "
            f"is broken: delete it",
            "stored_error": job.error,
        }
