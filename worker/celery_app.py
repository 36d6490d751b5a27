"""The Celery app. It imports no torch, so the API can enqueue with it.

Messages carry only a job id, JSON-serialized. The embedded default uses kombu's filesystem
transport (a folder of message files under the data directory) so that nothing needs a server;
production points ``TUNEJOB_BROKER_URL`` at Redis.
"""

import logging
import threading

from celery import Celery

from shared import jobs
from shared.settings import Settings, get_settings

log = logging.getLogger(__name__)

RUN_JOB = "tunejob.run_job"
QUEUE = "tunejob"


def celery_config(settings: Settings) -> dict:
    """Celery settings for long, single-GPU training tasks (names checked against Celery 5.7)."""
    hard_limit = settings.max_job_seconds
    transport_options: dict = {"visibility_timeout": settings.visibility_timeout or hard_limit + 3600}
    if settings.uses_filesystem_broker:
        folder = str(settings.path("broker", "queue", "x").parent)
        transport_options.update(
            data_folder_in=folder,
            data_folder_out=folder,
            control_folder=str(settings.path("broker", "control", "x").parent),
            store_processed=False,
        )
    return {
        "broker_url": settings.celery_broker_url,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        "task_ignore_result": True,
        "task_default_queue": QUEUE,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # Enforced only by the prefork pool. tunejob runs the solo pool (see shared/cli.py), where
        # the training loop enforces TUNEJOB_MAX_JOB_SECONDS itself (worker/report.py).
        "task_time_limit": hard_limit,
        "task_soft_time_limit": max(1, hard_limit - 60),
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_hijack_root_logger": False,
    }


def make_celery(settings: Settings | None = None) -> Celery:
    app = Celery("tunejob", include=["worker.tasks"])
    app.conf.update(celery_config(settings or get_settings()))
    return app


app = make_celery()


def send(job_id: str) -> None:
    """Send a queued job's id to the broker (only after its row is committed) and record that the
    broker has it."""
    app.send_task(RUN_JOB, args=[job_id], queue=QUEUE)
    jobs.mark_enqueued(job_id)


def recovery_loop(stop: threading.Event) -> None:
    """Every ``sweep_seconds`` until ``stop`` is set: re-queue jobs whose lease expired and
    (re-)send the messages of queued jobs (``shared.jobs.recover``). Runs in the API and in every
    worker; any number of copies may run at once."""
    while True:
        try:
            for job_id in jobs.recover():
                send(job_id)
        except Exception:
            log.exception("recovery pass failed; trying again in %ss", get_settings().sweep_seconds)
        if stop.wait(get_settings().sweep_seconds):
            return
