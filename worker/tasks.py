"""The Celery task: claim the job in the store, train it, and record how it ended.

While a job trains, a heartbeat thread renews its lease. SIGTERM (a deploy) makes the training
loop save a checkpoint at its next optimizer step and give the job back to the queue; the worker
then exits. Every worker also runs ``shared.jobs.recover`` periodically (the reaper and sweeper).
"""

import gc
import logging
import os
import socket
import threading
import uuid
from pathlib import Path

from celery import signals
from celery.exceptions import Reject

from shared import jobs
from shared.db import session_scope
from shared.errors import UserError
from shared.models import Dataset, JobStatus
from shared.settings import get_settings
from worker.celery_app import RUN_JOB, app, recovery_loop, send

log = logging.getLogger(__name__)
stopping = threading.Event()  # this worker is shutting down: the running job checkpoints and is re-queued


@signals.worker_init.connect
def _on_worker_init(**_) -> None:
    """A fresh stop flag per worker, and its recovery loop (reaper and sweeper)."""
    global stopping
    stopping = threading.Event()
    threading.Thread(target=recovery_loop, args=(stopping,), name="tunejob-recover", daemon=True).start()


@signals.worker_shutting_down.connect  # warm shutdown: SIGTERM or SIGINT
@signals.worker_shutdown.connect
def _on_shutdown(**_) -> None:
    stopping.set()


class Heartbeat(threading.Thread):
    """Renews a job's lease every ``lease_seconds / 4`` until stopped; notes it if the lease is lost."""

    def __init__(self, job_id: str, worker_id: str):
        super().__init__(name=f"heartbeat-{job_id}", daemon=True)
        self.job_id, self.worker_id = job_id, worker_id
        self.stopped, self.lease_lost = threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(get_settings().lease_seconds / 4):
            try:
                if not jobs.heartbeat(self.job_id, self.worker_id):
                    self.lease_lost.set()
                    return
            except Exception:
                log.exception("heartbeat for job %s failed; retrying", self.job_id)


@app.task(name=RUN_JOB)
def run_job(job_id: str) -> str:
    """Train job ``job_id`` if this worker can claim it; a no-op when another worker holds it or it
    has finished (duplicate or redelivered messages). Returns how it ended."""
    if stopping.is_set():  # Celery may deliver one more message during warm shutdown
        raise Reject(f"worker shutting down; job {job_id} left for another worker", requeue=True)
    worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    job = jobs.claim(job_id, worker_id)
    if job is None:
        log.info("job %s: not claimable (finished, cancelled or held by another worker); skipped", job_id)
        return "skipped"
    heartbeat = Heartbeat(job_id, worker_id)
    heartbeat.start()
    try:
        outcome = train_claimed_job(job, worker_id, heartbeat)
    finally:
        heartbeat.stopped.set()
        release_device_memory()
    if outcome in (JobStatus.SUCCEEDED, JobStatus.CANCELLED):
        jobs.finish(job_id, worker_id, outcome)
    elif outcome == "time_limit":
        jobs.finish(job_id, worker_id, JobStatus.FAILED, {
            "code": "time_limit", "message": f"ran past TUNEJOB_MAX_JOB_SECONDS={get_settings().max_job_seconds}"})
    elif outcome == "shutdown" and jobs.requeue(job_id, worker_id, "requeued", "worker shut down (SIGTERM); "
                                                 "resumes from the checkpoint it saved", restart=False):
        send(job_id)
    return outcome


def train_claimed_job(job, worker_id: str, heartbeat: Heartbeat) -> str:
    """Load the job's data and train it; map errors to the job's end (failed now, or re-queued)."""
    from worker.data import load_job_data  # torch is imported only when a job runs
    from worker.device import resolve_device
    from worker.report import Reporter
    from worker.train import fine_tune

    reporter = Reporter(job.id, worker_id, stop_flags={"shutdown": stopping,
                                                        "lease_lost": heartbeat.lease_lost})
    try:
        device, note = resolve_device(get_settings().device)
        if note:
            reporter.event("device", note, level="warning")
        with session_scope() as s:
            train = s.get(Dataset, job.training_dataset_id)
            validation = s.get(Dataset, job.validation_dataset_id) if job.validation_dataset_id else None
        checkpoint = jobs.latest_checkpoint(job.id)
        jobs.discard_metrics_after(job.id, checkpoint.step if checkpoint else 0)
        return fine_tune(job, load_job_data(job.spec, train, validation), device, reporter,
                         Path(checkpoint.path) if checkpoint else None)
    except UserError as e:  # deterministic: the same input fails the same way, so no retry
        jobs.finish(job.id, worker_id, JobStatus.FAILED, {"code": e.code, "message": e.message})
        return JobStatus.FAILED
    except Exception as e:
        log.exception("job %s failed unexpectedly", job.id)
        message = f"{type(e).__name__}: {e}"
        if jobs.requeue(job.id, worker_id, "job_restarted", f"unexpected error, retrying: {message}", restart=True):
            send(job.id)
        return "error"


def release_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
