"""The job lifecycle's (``shared.jobs.lifecycle``) side of sweeps: a trial's sweep is locked before
the trial's row, and told in the same transaction when the trial ends (``shared.jobs.sweeps``)."""

import logging
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.schemas.jobs import Hyperparameters
from shared.store.rows import Job, JobStatus, Sweep

log = logging.getLogger(__name__)
NO_CHECKPOINTS = (JobStatus.SUCCEEDED, JobStatus.PRUNED)  # jobs whose step checkpoints are deleted when they end


def lock_sweep_of(s: Session, *job_ids: str) -> None:
    """Lock the sweeps of those of ``job_ids`` that are trials, before their job rows: every
    transaction that ends a trial takes its sweep's lock first, then job rows (``shared.jobs.sweeps``
    cancels a sweep's trials with its lock held), so that two never wait on each other."""
    ids = s.scalars(select(Job.sweep_id).where(Job.id.in_(job_ids), Job.sweep_id.isnot(None)).distinct()).all()
    for sweep_id in sorted(ids):
        s.get(Sweep, sweep_id, with_for_update=True)


def ended(s: Session, job: Job) -> None:
    """If ``job`` is a trial that has just ended in transaction ``s``, let its sweep ask for the
    next trials in that transaction (``shared.jobs.sweeps.trial_ended``): no crash comes between."""
    if job.sweep_id is None or job.status not in JobStatus.FINISHED:
        return
    from shared.jobs import sweeps  # it builds on shared.jobs.lifecycle, which imports this module

    sweeps.trial_ended(s, job)


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
        log.error("job %s: stored hyperparameters do not validate, shown with defaults for %s: %s",
                  job.id, sorted(bad), e.errors(include_url=False))
        kept = {k: v for k, v in stored.items() if k not in bad}
        try:
            hyperparameters = Hyperparameters(**kept)
        except ValidationError:
            hyperparameters = Hyperparameters()
        values = ", ".join(f"{k}={stored.get(k)!r}" for k in sorted(bad))
        return hyperparameters, {"code": "invalid_stored_hyperparameters", "message": f"job {job.id}'s stored "
                                 f"hyperparameters are invalid ({values}), shown as their defaults; this job's row "
                                 f"is broken: delete it", "stored_error": job.error}
