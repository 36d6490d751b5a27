"""The job lifecycle's (``shared.jobs.lifecycle``) side of sweeps: a trial's sweep is locked before
the trial's row, and told in the same transaction when the trial ends (``shared.jobs.sweeps``)."""

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.store.rows import Job, JobStatus, Sweep

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
