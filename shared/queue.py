"""The job queue both sides use: the Celery app, sending a job's id to the broker, and the recovery
loop that re-sends lost messages and re-queues jobs whose lease expired. It imports no torch and
nothing from ``worker/``, so the API enqueues with it; the worker's task is ``worker.tasks``.

Messages carry only a job id, JSON-serialized. The embedded default uses kombu's filesystem
transport (a folder of message files under the data directory) so that nothing needs a server;
production points ``TUNEJOB_BROKER_URL`` at Redis.
"""

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

from celery import Celery
from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps, loads
from pydantic import BaseModel

from shared.jobs import lifecycle, orphans, predictions, retention, sweeps, webhooks
from shared.logs import Outage
from shared.schemas.jobs import JobCreate
from shared.schemas.predictions import PredictionCreate
from shared.settings import Settings, get_settings
from shared.store import idempotency
from shared.store.rows import Job
from shared.store.tenancy import Caller

log = logging.getLogger(__name__)

RUN_JOB = "tunejob.run_job"
QUEUE = "tunejob"


class FilesystemChannel(filesystem.Channel):
    """kombu's filesystem channel, with each message file and each exchange's table of bindings
    written whole before it appears.

    kombu writes a message straight into the queue folder under its final name (``*.<queue>.msg``),
    and its ``flock`` is advisory: a consumer polling the folder meanwhile (``_get`` takes no lock)
    moved and read an empty or half-written file, and the worker failed on the JSON (seen twice
    under load, issue 34). Here the message is written under a name no consumer looks at (a dot
    file) and renamed into place (``os.replace``: atomic in one folder, POSIX).

    An exchange's table (``<control folder>/<exchange>.exchange``, JSON: the queues bound to it) is
    read, changed and written back by every process that binds or deletes a queue: the API and each
    worker at its start (the task queue, the worker's pidbox and event queues). kombu creates the
    file empty and takes its lock only after opening it (``wb``, which truncates), so two processes
    starting together read an empty table (a ``JSONDecodeError``), lost each other's bindings, or
    left a table that is no longer JSON, which fails every later publish to that exchange (kombu
    5.7; ``tests/test_broker.py`` runs one bind inside another's window). Here each change holds an
    exclusive lock on a lock file of its own (``.<exchange>.exchange.lock``, never replaced) from
    its read to its write, and the table is written under another name and renamed into place, so
    a reader (``get_table``) sees the old table or the new one, whole.

    Messages are taken oldest first (their names sort by the wall-clock time they were sent; a
    message left under kombu's own unpadded name, from before an upgrade, sorts after them)."""

    def _put(self, queue, payload, **kwargs):
        # kombu's name, but its time zero-padded and the wall clock's: kombu's ``_get`` takes the
        # first name in string order, and its unpadded monotonic milliseconds put a message sent
        # after the counter gained a digit (1,000 s after boot, then 10,000 s) first in the queue
        name = f"{time.time_ns() // 1_000_000:015d}_{uuid.uuid4()}.{queue}.msg"
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(dumps(payload).encode())
            os.replace(partial, os.path.join(self.data_folder_out, name))
        except OSError as e:
            raise ChannelError(f"Cannot add file {name!r} to directory") from e

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        self._change_table(exchange, lambda table: table if binding in table else [binding, *table])

    def _delete(self, queue, exchange, routing_key, pattern, *args, **kwargs):
        # kombu's virtual channel purges the queue; filesystem.Channel's own table rewrite is replaced
        super(filesystem.Channel, self)._delete(queue, exchange, routing_key, pattern, *args, **kwargs)
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        self._change_table(exchange, lambda table: [b for b in table if b != binding])

    def _change_table(self, exchange: str, change: Callable[[list], list]) -> None:
        """Replace ``exchange``'s table of bindings with ``change(table)``, under its lock file.
        A table that is not JSON (left by kombu's own write) counts as empty: every process binds
        its queues again when it starts.

        Raises:
            ChannelError: the control folder cannot be written (kombu's error for this).
        """
        file = self._exchange_file(exchange)
        try:
            self.control_folder.mkdir(parents=True, exist_ok=True)
            with open(file.with_name(f".{file.name}.lock"), "ab") as guard:
                filesystem.lock(guard, filesystem.LOCK_EX)  # released when the file closes
                try:
                    table = [filesystem.exchange_queue_t(*b) for b in loads(file.read_bytes())]
                except FileNotFoundError:
                    table = []
                except ValueError:
                    log.warning("broker: %s was not a table of bindings; written anew", file)
                    table = []
                changed = change(table)
                if changed != table or not file.exists():
                    partial = file.with_name(f".{file.name}.{uuid.uuid4()}.part")
                    partial.write_bytes(dumps(changed).encode())
                    os.replace(partial, file)
        except OSError as e:
            raise ChannelError(f"Cannot change the bindings in {file}") from e


class FilesystemTransport(filesystem.Transport):
    """kombu's filesystem transport with ``FilesystemChannel`` (the embedded default's broker)."""

    Channel = FilesystemChannel


BROKER_TIMEOUT_SECONDS = 3.0  # the longest a Redis broker may take to connect or answer


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
            polling_interval=settings.broker_polling_seconds,  # kombu's default, 1 s, delays every job's start
        )
    elif settings.broker_key_prefix:
        transport_options["global_keyprefix"] = settings.broker_key_prefix
    if settings.celery_broker_url.startswith(("redis://", "rediss://", "redis+socket://")):
        # redis-py waits forever by default: a Redis that took connections but did not answer (stopped,
        # overloaded) held POST /jobs until the client gave up, the job stored but unsent. A worker's
        # BRPOP returns within its polling interval (1 s), well inside these.
        transport_options.update(socket_timeout=BROKER_TIMEOUT_SECONDS, socket_connect_timeout=BROKER_TIMEOUT_SECONDS)
    return {
        "broker_url": settings.celery_broker_url,
        "broker_transport": f"{__name__}:FilesystemTransport" if settings.uses_filesystem_broker else None,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        # one retry (a pooled connection that Redis closed meanwhile), then the recovery loop sends it
        "task_publish_retry_policy": {"max_retries": 1, "interval_start": 0, "interval_step": 0.5, "interval_max": 0.5},
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        "task_ignore_result": True,
        "task_default_queue": QUEUE,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # Enforced only by the prefork pool. tunejob runs the solo pool (see tunejob/cli.py), where
        # the training loop enforces TUNEJOB_MAX_JOB_SECONDS itself (worker/reporter.py).
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


def send(job_id: str, countdown: float | None = None) -> None:
    """Send a queued job's id to the broker (only after its row is committed) and record that the
    broker has it. With ``countdown``, no worker runs it before that many seconds have passed
    (Celery's ``countdown``: the message carries an ETA, which the worker that receives it waits for)."""
    app.send_task(RUN_JOB, args=[job_id], queue=QUEUE, countdown=countdown)
    lifecycle.mark_enqueued(job_id)


def submit(spec: JobCreate | PredictionCreate, caller: Caller, claim: idempotency.Claim | None = None) -> Job:
    """Check and store a job for ``caller``: a training job (``shared.jobs.lifecycle.create_job``) or a
    prediction (``shared.jobs.predictions.create_prediction``), either recording the response under an
    idempotency ``claim``; then send its id to the broker. When the broker is down the job stays
    queued and ``recovery_loop`` sends it later.

    Raises:
        UserError: the spec does not fit its model or data (see ``shared.jobs.planning.check_spec`` and
            ``shared.jobs.predictions.check_prediction``), or a quota (``shared.store.quotas``).
    """
    if isinstance(spec, PredictionCreate):
        job = predictions.create_prediction(spec, caller, claim)
    else:
        job = lifecycle.create_job(spec, caller, claim)
    try:
        send(job.id)
    except Exception:
        log.exception("job %s stored but not yet sent to the broker", job.id)
    return lifecycle.get_job(job.id, caller, kind=job.kind)


def submit_once(
    route: str, spec: JobCreate | PredictionCreate, caller: Caller, key: str | None, view: Callable[[Job], BaseModel]
) -> BaseModel | idempotency.Replay:
    """``submit`` once per ``Idempotency-Key`` ``key`` and body (``shared.store.idempotency.once``):
    the new job's API view (``view(job)``), or on a retry the first answer to replay.

    Raises:
        UserError: see ``submit``; 422 ``idempotency_key_reused`` (another body), 409
            ``idempotency_key_in_use`` (the first request with the key is still running).
    """
    job = idempotency.once(
        caller.tenant,
        route,
        key,
        idempotency.fingerprint(spec.model_dump_json()),
        lambda claim: submit(spec, caller, claim),
    )
    return job if isinstance(job, idempotency.Replay) else view(job)


def send_trials(sweep_id: str) -> None:
    """Send the sweep's queued trials whose message was never sent (just asked for). Logs, and
    leaves to ``recovery_loop``, what the broker refuses."""
    try:
        for job_id in sweeps.unsent_trials(sweep_id):
            send(job_id)
    except Exception:
        log.exception("trials of sweep %s stored but not yet sent to the broker", sweep_id)


def resend_recovered() -> None:
    for job_id in lifecycle.recover():
        send(job_id)


def top_up_sweeps() -> None:
    try:
        new = sweeps.top_up_all()
    except sweeps.SweepsFailed as e:  # the other sweeps' trials go out; the loop logs the failure
        for job_id in e.new:
            send(job_id)
        raise
    for job_id in new:
        send(job_id)


class RecoveryThread:
    """``recovery_loop`` in a daemon thread, started with its process's API or worker and stopped with
    it: ``start()``, then ``stop()`` (sets the loop's event and waits up to ``join_seconds``).
    ``extra`` chores run after the usual ones (the API adds its own, ``api.main``); ``every`` is
    the period in seconds (default ``TUNEJOB_RECOVERY_SECONDS``, read at each turn); ``chores``
    replaces the usual ones."""

    def __init__(
        self,
        join_seconds: float = 10.0,
        extra: tuple[Callable[[], object], ...] = (),
        every: Callable[[], float] | None = None,
        name: str = "tunejob-recover",
        chores: tuple[Callable[[], object], ...] | None = None,
    ):
        self.stopping, self.join_seconds = threading.Event(), join_seconds
        chores = (
            (
                resend_recovered,
                top_up_sweeps,
                retention.clean_up_files,
                orphans.collect_orphans,
                idempotency.purge_expired,
                webhooks.purge_deliveries,
            )
            if chores is None
            else chores
        )
        every = every or (lambda: get_settings().recovery_seconds)
        self.thread = threading.Thread(
            target=recovery_loop, args=(self.stopping, (*chores, *extra), every), name=name, daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(self.join_seconds)


def recovery_loop(stop: threading.Event, chores: tuple[Callable[[], object], ...], every: Callable[[], float]) -> None:
    """Every ``every()`` seconds until ``stop`` is set, run each of ``chores``; by default
    (``RecoveryThread``): re-queue jobs whose lease expired and (re-)send the messages of queued
    jobs (``shared.jobs.lifecycle.recover``), queue the trials a sweep is short of
    (``shared.jobs.sweeps.top_up_all``), apply the artifact retention and remove leftover
    files (``shared.jobs.retention.clean_up_files``) and the bucket's orphans (``shared.jobs.orphans``),
    delete expired idempotency records and old webhook deliveries (``shared.jobs.webhooks.purge_deliveries``).
    Runs in the API and in every worker; any number of copies may run at once. A chore that raises
    is tried again next time; its traceback is logged once per failure, not at every turn while it
    goes on failing the same way (a database restart: the webhook loop, every second, logged a
    traceback a second), and a line says when it works again (``shared.logs.Outage``)."""
    outages = {chore: Outage(log, chore.__name__) for chore in chores}
    while True:
        for chore in chores:
            try:
                chore()
            except Exception as e:
                outages[chore].failed(e, f"trying again every {every():g} s, logged again if it fails otherwise")
            else:
                outages[chore].ended()
        if stop.wait(every()):
            return
