"""The Celery task: claim the job in the store, run it (train it, or score a dataset with a model:
``worker.predict``, by the job's ``kind``), and record how it ended.

While a job trains, a heartbeat thread renews its lease. SIGTERM (a deploy) makes the training
loop save a checkpoint at its next optimizer step and give the job back to the queue; the worker
then exits. Every worker also runs ``shared.jobs.lifecycle.recover`` periodically (the recovery loop, ``shared.queue.recovery_loop``).

A worker process imports the training stack once, when it starts (``preload``), not per job.
"""

import gc
import logging
import os
import socket
import threading
import uuid

from celery import bootsteps, signals
from celery.exceptions import Reject
from obstore.exceptions import BaseError as ObjectStoreError

from shared.errors import UserError
from shared.jobs import lifecycle
from shared.jobs.base_models import available_models
from shared.logs import Outage, configure_logging, log_context
from shared.queue import RUN_JOB, RecoveryThread, app, send, send_trials
from shared.settings import get_settings
from shared.store import objects
from shared.store.engine import read_session
from shared.store.rows import Dataset, JobStatus

log = logging.getLogger(__name__)
STORAGE_FAILED = "the object storage (TUNEJOB_STORAGE_URL) failed; the worker's log says how"
stopping = threading.Event()  # this worker is shutting down: the running job checkpoints and is re-queued


class ShutdownReject(Reject):
    """A job's message handed back to the queue because this worker is shutting down (warm
    shutdown: ``serve``'s Ctrl-C, a deploy's SIGTERM). Expected, so logged without the traceback
    that Celery logs with every ``Reject`` (its ``log_policy_reject``), which read as an error."""


class ShutdownRejectWithoutTraceback(logging.Filter):
    """On ``celery.app.trace``: drops the traceback of a ``ShutdownReject`` record, keeps its line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ShutdownReject):
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("celery.app.trace").addFilter(ShutdownRejectWithoutTraceback())


class WorkerRecovery(bootsteps.StartStopStep):
    """A worker's ``RecoveryThread`` as a bootstep, so that it lives exactly as long as the worker:
    Celery starts it with the worker and stops it on a warm shutdown and on a cold one alike (a
    ``worker_shutdown`` signal handler misses the cold one: ``WorkController.terminate`` sends no
    signal, and the loop went on polling whatever store the process pointed at next). Celery docs,
    "Extensions and Bootsteps"."""

    def create(self, worker) -> RecoveryThread:
        return RecoveryThread()


app.steps["worker"].add(WorkerRecovery)


@signals.setup_logging.connect
def _setup_logging(**_) -> None:
    """The API's logging configuration (``shared.logs``); Celery configures none while this receiver exists."""
    configure_logging()


@signals.worker_init.connect
def _on_worker_init(**_) -> None:
    """A fresh stop flag per worker, and the training stack loaded before the worker takes its first
    job (its recovery loop is the bootstep ``WorkerRecovery``)."""
    global stopping
    stopping = threading.Event()
    # Inductor's caches (compiled kernels and graphs, e.g. int8 prediction's) on disk under the data
    # directory, where a restarted worker finds them, not in /tmp
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(get_settings().path("cache", "inductor")))
    preload()


def preload() -> None:
    """Import what every job needs once per worker process: torch, transformers, scikit-learn and
    SciPy (through ``worker.training.recipe``; ``worker.predict`` for predictions), the model class of each
    available base model, and matplotlib and tensorboardX, which draw every artifact's training
    curves and TensorBoard logs (``worker.run_logs``), so that no job's time counts these imports
    (seconds on a small CPU: docs/benchmarks.md, "Measurements behind the defaults"). Also turns
    off transformers' progress bars, for a log."""
    import matplotlib.figure  # noqa: F401
    import tensorboardX  # noqa: F401
    import transformers

    import worker.predict
    import worker.training.recipe  # noqa: F401

    # a worker's output is a service log (docker logs, journald): transformers' tqdm bars ("Loading
    # weights", "Writing model shards") drew a carriage-returned line into it at every load and save
    transformers.utils.logging.disable_progress_bar()
    for path, _ in available_models().values():
        try:
            config = transformers.AutoConfig.from_pretrained(path)
            transformers.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]
        except (OSError, ValueError, KeyError) as e:  # the job that uses it fails with the reason
            log.warning("base model %s not preloaded: %s", path.name, e)


@signals.task_postrun.connect
def _clear_log_context(**_) -> None:
    """After a task (and Celery's "succeeded in" line, which names the job), no job's context: the
    worker's next lines ("Task … received") belonged to the job it had run last."""
    log_context.set("-")


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
        outage = Outage(log, f"the heartbeat of job {self.job_id}")  # a traceback once, not every turn
        while not self.stopped.wait(get_settings().lease_seconds / 4):
            try:
                if not lifecycle.heartbeat(self.job_id, self.worker_id):
                    self.lease_lost.set()
                    return
            except Exception as e:
                outage.failed(e, "retrying, logged again if it fails otherwise")
            else:
                outage.ended()


@app.task(name=RUN_JOB)
def run_job(job_id: str) -> str:
    """Run job ``job_id`` (either kind) if this worker can claim it; a no-op when another worker holds it or it
    has finished (duplicate or redelivered messages). Returns how it ended."""
    if stopping.is_set():  # Celery may deliver one more message during warm shutdown
        raise ShutdownReject(f"worker shutting down; job {job_id} left for another worker", requeue=True)
    log_context.set(f"job {job_id}")  # set by every task: the solo pool runs them one after another in one thread
    worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    job = lifecycle.claim(job_id, worker_id)
    if job is None:
        log.info("job %s: not claimable (finished, cancelled or held by another worker); skipped", job_id)
        return "skipped"
    heartbeat = Heartbeat(job_id, worker_id)
    heartbeat.start()
    try:
        try:
            outcome = run_claimed_job(job, worker_id, heartbeat)
        finally:
            heartbeat.stopped.set()
        record_outcome(job, worker_id, outcome)
    finally:
        release_device_memory()  # after the job is recorded: the user does not wait for it
    return outcome


def record_outcome(job, worker_id: str, outcome: str) -> None:
    """End the job in the store as ``run_claimed_job`` left it (or hand it back to the queue); a
    succeeded job's checkpoints are deleted, its model is in the artifacts; a pruned trial's are
    deleted too. A sweep's trial then sends the trials its end queued (``shared.jobs.sweeps``)."""
    job_id = job.id
    if outcome in (JobStatus.SUCCEEDED, JobStatus.CANCELLED, JobStatus.PRUNED):
        if lifecycle.finish(job_id, worker_id, outcome) and outcome in (JobStatus.SUCCEEDED, JobStatus.PRUNED):
            lifecycle.discard_checkpoints(job_id)
    elif outcome == "time_limit":
        lifecycle.finish(
            job_id,
            worker_id,
            JobStatus.FAILED,
            {"code": "time_limit", "message": f"ran past TUNEJOB_MAX_JOB_SECONDS={get_settings().max_job_seconds}"},
        )
    elif outcome == "shutdown" and lifecycle.requeue(
        job_id,
        worker_id,
        "requeued",
        "worker shut down (SIGTERM)",
        restart=False,
        then=f"; resumes from {lifecycle.RESUMES_FROM[job.kind]}",
    ):
        send(job_id)
    if job.sweep_id is not None:  # the trials its end asked for (shared.jobs.sweeps)
        send_trials(job.sweep_id)


def run_claimed_job(job, worker_id: str, heartbeat: Heartbeat) -> str:
    """Run the job's recipe (``train_job`` or ``worker.predict.predict``, by its ``kind``) on this
    worker's device; map errors to the job's end (failed now, or re-queued)."""
    from worker.device import (
        resolve_device,  # imported by ``preload``; the API imports this module without torch
    )
    from worker.reporter import Interrupted, Reporter

    try:
        reporter = Reporter(
            job.id,
            worker_id,
            stop_flags={"shutdown": stopping, "lease_lost": heartbeat.lease_lost},
            trial=job.sweep_id is not None,
        )
    except Exception as e:  # the job stayed claimed, its error unsaid, until its lease expired
        return restart_after(job, worker_id, e)
    try:
        device, note = resolve_device(get_settings().device)
        if note:
            reporter.event("device", note, level="warning")
        return recipe(job.kind)(job, device, reporter)
    except Interrupted as e:  # cancelled (or the worker stopping) while it tokenized: nothing trained yet
        reporter.write_pending()
        return e.reason
    except UserError as e:  # deterministic: the same input fails the same way, so no retry
        reporter.write_pending()
        lifecycle.finish(
            job.id,
            worker_id,
            JobStatus.FAILED,
            {"code": e.code, "message": e.message, **({"problems": e.problems} if e.problems else {})},
        )
        return JobStatus.FAILED
    except Exception as e:
        reporter.write_pending()
        return restart_after(job, worker_id, e)


def restart_after(job, worker_id: str, e: Exception) -> str:
    """Log an unexpected error ``e`` of ``job`` and restart the job after its backoff
    (``restart_countdown``): ``"restarted"``; else ``"failed"`` (its ``max_restarts`` used up, the
    job failed; or its lease lost: another worker holds it; ``lifecycle.requeue``)."""
    log.exception("job %s failed unexpectedly", job.id, exc_info=e)
    # obstore's message is a page of Rust debug output naming the bucket's internal address:
    # for the operator's log, not for the tenant's event
    message = STORAGE_FAILED if isinstance(e, ObjectStoreError) else f"{type(e).__name__}: {e}"
    countdown = restart_countdown(job.restarts)
    if lifecycle.requeue(
        job.id,
        worker_id,
        "job_restarted",
        f"unexpected error: {message}",
        restart=True,
        then=f"; retrying in {countdown:g} s",
    ):
        send(job.id, countdown=countdown)
        return "restarted"  # what Celery's log line says the task returned ("succeeded in 73.3s: 'error'" misled)
    return JobStatus.FAILED


def restart_countdown(restarts: int) -> float:
    """Seconds before a job that failed unexpectedly for the ``restarts + 1``-th time runs again:
    ``restart_backoff_seconds x 2^restarts`` (exponential backoff, as Celery's ``retry_backoff``),
    so that a passing fault (a full disk, a flaky file system) has time to clear before the job's
    ``max_restarts`` are used up."""
    return get_settings().restart_backoff_seconds * 2**restarts


def recipe(kind: str):
    """What runs a job of ``kind``: ``train_job``, or ``worker.predict.predict``."""
    if kind == "predict":
        from worker.predict import predict

        return predict
    return train_job


def train_job(job, device, reporter) -> str:
    """Load the job's data and train it, resuming from its latest checkpoint (``worker.training.recipe``)."""
    from worker.data import load_job_data
    from worker.reporter import PhaseTimer
    from worker.training.recipe import fine_tune

    if device.type == "cuda":
        from worker.predict import release_models

        release_models()
    timer = PhaseTimer(reporter, queued=(job.timings or {}).get("queued"))
    with read_session() as s:
        train = s.get(Dataset, job.training_dataset_id)
        validation = s.get(Dataset, job.validation_dataset_id) if job.validation_dataset_id else None
    checkpoint = lifecycle.latest_checkpoint(job.id)
    lifecycle.discard_metrics_after(job.id, checkpoint.step if checkpoint else 0)
    with timer.phase("load"):
        data = load_job_data(job.spec, train, validation)
    return fine_tune(job, data, device, reporter, objects.store().local(checkpoint.path) if checkpoint else None, timer)


def release_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
