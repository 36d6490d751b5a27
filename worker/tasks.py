"""The Celery task: claim the job in the store, train, and record how it ended."""

import logging
import os
import socket
import uuid

from shared import jobs
from shared.db import session_scope
from shared.errors import UserError
from shared.models import Dataset, JobStatus
from shared.settings import get_settings
from worker.celery_app import RUN_JOB, app

log = logging.getLogger(__name__)


@app.task(name=RUN_JOB)
def run_job(job_id: str) -> str:
    """Train job ``job_id`` if this worker can claim it; a no-op when another worker holds it or it
    has finished (duplicate or redelivered messages). Returns how it ended."""
    worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    job = jobs.claim(job_id, worker_id)
    if job is None:
        log.info("job %s: not claimable (finished, cancelled or held by another worker); skipped", job_id)
        return "skipped"
    from worker.data import load_job_data  # torch is imported only when a job runs
    from worker.device import resolve_device
    from worker.report import Reporter
    from worker.train import fine_tune

    reporter = Reporter(job_id, worker_id)
    reporter.event("started", f"attempt {job.attempts} on worker {worker_id}")
    try:
        device, note = resolve_device(get_settings().device)
        if note:
            reporter.event("device", note, level="warning")
        with session_scope() as s:
            train = s.get(Dataset, job.training_dataset_id)
            validation = s.get(Dataset, job.validation_dataset_id) if job.validation_dataset_id else None
        data = load_job_data(job.spec, train, validation)
        outcome = fine_tune(job, data, device, reporter, jobs.latest_checkpoint(job_id))
    except UserError as e:
        jobs.finish(job_id, worker_id, JobStatus.FAILED, {"code": e.code, "message": e.message})
        return JobStatus.FAILED
    except Exception as e:
        log.exception("job %s failed", job_id)
        jobs.finish(job_id, worker_id, JobStatus.FAILED, {"code": "training_error", "message": f"{type(e).__name__}: {e}"})
        return JobStatus.FAILED
    if outcome == "lease_lost":
        log.warning("job %s: lease lost to another worker; stopped without writing", job_id)
        return outcome
    jobs.finish(job_id, worker_id, outcome)
    return outcome
