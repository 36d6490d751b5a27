"""Streams a running job's progress, metrics, events and phase timings to the job store in short,
batched writes."""

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from sqlalchemy.exc import OperationalError

from shared.jobs import lifecycle, sweeps
from shared.jobs.curves import MetricRow, metric_rows
from shared.logs import Outage
from shared.schemas.jobs import PHASES
from shared.settings import get_settings
from shared.store.rows import utcnow

log = logging.getLogger(__name__)


class Interrupted(Exception):
    """Raised between batches of the work before training (tokenizing) when the job must stop
    (``Reporter.interrupted``); ``reason`` is what ``should_stop`` said."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Reporter:
    """The running worker's line to the job row.

    Metrics are buffered and written together at most every ``metrics_flush_seconds``; each write
    also renews the worker's lease. ``should_stop()`` is asked once per optimizer step; it reads the
    job's cancel flag from the store at most every ``CANCEL_CHECK_SECONDS``, not once per step.

    Those two, and the other writes of training (events, checkpoints, a trial's pruning check),
    let it go on while the store does not answer (``OperationalError``: a PostgreSQL restart or
    failover, SQLite's write lock not free in time): the metrics and events stay buffered and are
    written at the next turn, a checkpoint goes unrecorded (``checkpoint``), a trial is not pruned
    then. A restart of a few seconds failed the running job (the cancel check, or a checkpoint,
    fell in it), which then waited out its lease and started again from its last checkpoint. The
    lease bounds the wait: once it has lapsed another worker may hold the job, and the first write
    that reaches the store says so (``lease_lost``).
    """

    CANCEL_CHECK_SECONDS = 1.0

    def __init__(
        self, job_id: str, worker_id: str, stop_flags: dict[str, threading.Event] | None = None, trial: bool = False
    ):
        self.job_id, self.worker_id, self.trial = job_id, worker_id, trial  # trial: of a sweep (shared.jobs.sweeps)
        self.stop_flags = stop_flags or {}  # e.g. {"shutdown": <SIGTERM seen>, "lease_lost": <heartbeat lost it>}
        self.flush_seconds = get_settings().metrics_flush_seconds
        self.deadline = time.monotonic() + get_settings().max_job_seconds
        self._metrics: list[tuple[int, float, str, float, datetime]] = []
        self._progress: dict = {}
        self._last_flush = time.monotonic()
        self._wrote_metrics = False
        self.lease_lost = False
        self._cancelled, self._next_cancel_check = False, time.monotonic()
        self._store = Outage(log, "the job store", traceback=False, per_error=False)  # its log names the job
        self._events: list[tuple[str, str, str]] = []  # not written yet: (code, message, level)

    def event(self, code: str, message: str, level: str = "info") -> None:
        """Record an event now, or, while the store does not answer, at the next write (its time is
        then the write's: listings ordered by time and by id agree)."""
        self._events.append((code, message, level))
        if not self._store.down:
            self._unless_store_down(self._write_events)

    def _write_events(self) -> None:
        while self._events:
            lifecycle.add_event(self.job_id, *self._events[0])
            del self._events[0]

    def write_pending(self) -> None:
        """Write the events an outage held back, if the store answers now: the attempt is ending
        without a flush (a failure), and its cause may be among them."""
        if self._events:
            self._unless_store_down(self._write_events)

    def log(self, step: int, epoch: float, values: dict[str, float]) -> None:
        now = utcnow()
        self._metrics.extend((step, epoch, name, float(v), now) for name, v in values.items())

    def progress(self, **fields) -> None:
        """Set job-row fields (step, epoch, total_steps, eta_seconds, train/validation metrics, device,
        timings). The first optimizer step's are written at once, so that a user sees training start."""
        self._progress.update(fields)
        if self._metrics and not self._wrote_metrics and not self._store.down:
            self._unless_store_down(self.flush)  # failed: ``heartbeat`` tries again, not every step
        else:
            self.heartbeat()

    def heartbeat(self) -> None:
        """Write what is buffered, and so renew the lease, if ``metrics_flush_seconds`` have passed
        (kept for the next turn while the store does not answer)."""
        if time.monotonic() - self._last_flush >= self.flush_seconds and not self._unless_store_down(self.flush):
            self._last_flush = time.monotonic()

    def _unless_store_down(self, call: Callable[[], object], writes: bool = True) -> bool:
        """Run ``call``; False if the store did not answer (``OperationalError``), logged once per
        outage (``shared.logs.Outage``), with its length when it ends: when a call that ``writes`` gets
        through (a store that answers reads but takes no write, such as SQLite on a full disk, is
        still down: the cancel check's reads made the log say "works again" and "fails" by turns)."""
        try:
            call()
        except OperationalError as e:
            self._store.failed(e, "training goes on, trying again")
            return False
        if writes:
            self._store.ended()
        return True

    def flush(self) -> None:
        self._write_events()
        held = lifecycle.record_progress(self.job_id, self.worker_id, self._progress, self._metrics)
        self._wrote_metrics = self._wrote_metrics or bool(self._metrics)
        self._metrics, self._progress, self._last_flush = [], {}, time.monotonic()
        self.lease_lost = self.lease_lost or not held

    def metric_rows(self) -> list[MetricRow]:
        """Every metric row of the job in the store, ordered by step: the whole run, across restarts
        (what is buffered here is not among them: ``flush`` first)."""
        return metric_rows(self.job_id)

    def should_prune(self, step: int, metrics: dict) -> bool:
        """After an evaluation at optimizer ``step`` (``metrics``): whether the sweep's pruner stops
        this trial now (``shared.jobs.sweeps.should_prune``; always False for a job outside a sweep). The
        metrics so far are written first: the other trials' pruners read them."""
        if not self.trial:
            return False
        prune: list[bool] = []

        def decide() -> None:
            self.flush()
            prune.append(sweeps.should_prune(self.job_id, step, metrics))

        if not self._unless_store_down(decide) or not prune[0]:
            return False  # not pruned, or the store (the other trials' figures) did not answer
        self.event("pruning", f"the sweep's pruner stopped this trial after its evaluation at step {step}")
        return True

    def checkpoint(
        self, step: int, path: Path | str, metrics: dict | None, keep: int, size: int | None = None
    ) -> list[str] | None:
        """Point the store at a completely written (and published) checkpoint, ``path`` its ref
        (``shared.store.objects``), ``size`` its bytes; returns the refs of the older checkpoints,
        beyond the newest ``keep``, that the store no longer lists (to delete). None when the store
        did not answer: the checkpoint is not recorded (a restart resumes from the one before; the
        next is recorded as usual) and its files are the caller's to delete."""
        old: list[str] = []

        def record() -> None:
            self.flush()  # the steps up to the checkpoint are never trained again: write their metrics first
            old.extend(lifecycle.record_checkpoint(self.job_id, step, str(path), metrics, keep, size))

        # An OperationalError at COMMIT may come after the row went in (a dropped connection): its
        # files are deleted all the same, and resuming skips a checkpoint whose files are gone
        # (lifecycle.latest_checkpoint)
        if self._unless_store_down(record):
            return old
        log.warning("the checkpoint at step %d is not recorded: the job store does not answer", step)
        return None

    def should_stop(self) -> str | None:
        """Why training must stop now, if it must: ``"shutdown"`` (the worker is shutting down),
        ``"lease_lost"`` (another worker holds the job), ``"cancelled"`` or ``"time_limit"``. Asked
        once per optimizer step.

        The stop flags are in-process events (SIGTERM, the heartbeat thread losing the lease); the
        cancel flag is a store query, made at most every ``CANCEL_CHECK_SECONDS``, so a cancel is
        seen within that time plus one optimizer step."""
        return self._stop_reason()

    def interrupted(self) -> str | None:
        """``should_stop``'s answer, asked between batches of the work before training: tokenizing
        a large training set takes minutes (1.35 million rows: two), and a cancel or a SIGTERM
        waited for the first optimizer step."""
        return self._stop_reason()

    def _stop_reason(self) -> str | None:
        if self.lease_lost:
            return "lease_lost"
        for reason, flag in self.stop_flags.items():
            if flag.is_set():
                return reason
        now = time.monotonic()
        if not self._cancelled and now >= self._next_cancel_check:
            self._unless_store_down(self._check_cancel, writes=False)
            self._next_cancel_check = now + self.CANCEL_CHECK_SECONDS
        if self._cancelled:
            return "cancelled"
        return "time_limit" if now > self.deadline else None

    def _check_cancel(self) -> None:
        self._cancelled = lifecycle.cancel_requested(self.job_id)


class PhaseTimer:
    """Wall seconds per phase of a job (``shared.schemas.jobs.Timings``), reported as ``timings``.

    Phases nest: time always counts for the innermost open phase, so an evaluation inside
    training counts as ``evaluate``, not ``train``, and the phases never overlap. Each phase's end
    is reported through ``reporter`` (buffered like the metrics).
    """

    def __init__(self, reporter=None, queued: float | None = None):
        self.reporter, self.queued = reporter, queued
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._open: list[str] = []
        self._since = 0.0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the wall time of the ``with`` block (less any phase nested in it) as ``name``."""
        self._charge()
        self._open.append(name)
        try:
            yield
        finally:
            self._charge()
            self._open.pop()
            if self.reporter is not None:
                self.reporter.progress(timings=self.timings())

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._open:
            self.seconds[self._open[-1]] += now - self._since
        self._since = now

    def timings(self) -> dict[str, float | None]:
        """``queued`` and the phases so far, in seconds (rounded to milliseconds)."""
        return {"queued": self.queued, **{name: round(s, 3) for name, s in self.seconds.items()}}


def timed(phase: str):
    """Decorator: time a method of ``worker.training.recipe.Recipe`` (anything with a ``timer``) as
    ``phase`` of its ``timer``."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(run, *args, **kwargs):
            with run.timer.phase(phase):
                return fn(run, *args, **kwargs)

        return wrapper

    return decorate


class MemoryReporter:
    """A ``Reporter`` for runs outside the job store (``tunejob doctor``, ``bench.engine_gpu_check``,
    the tests): keeps the metrics, progress fields, events and checkpoints in memory, and asks the
    run to stop (``stop_reason``: "shutdown", "cancelled", ...) once it has run ``stop_after_step``
    optimizer steps (never, by default): counted by its asking, once a step, not by the logged
    steps, which a CUDA job reads only every second or so."""

    def __init__(self, stop_after_step: int | None = None, stop_reason: str = "shutdown"):
        self.logged: list[tuple[int, float, dict]] = []  # (step, epoch, {name: value})
        self._logged_at: list[datetime] = []  # when each of ``logged`` was
        self.fields: dict = {}
        self.events: list[str] = []  # event codes
        self.messages: list[str] = []  # their messages
        self.checkpoints: list[tuple[int, Path]] = []
        self.stop_after_step, self.stop_reason = stop_after_step, stop_reason
        self.steps_run = 0

    def log(self, step: int, epoch: float, values: dict[str, float]) -> None:
        self.logged.append((step, epoch, dict(values)))
        self._logged_at.append(utcnow())

    def progress(self, **fields) -> None:
        self.fields.update(fields)

    def heartbeat(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def event(self, code: str, message: str, level: str = "info") -> None:
        self.events.append(code)
        self.messages.append(message)

    def checkpoint(
        self, step: int, path: Path | str, metrics: dict | None, keep: int = 2, size: int | None = None
    ) -> list[str]:
        self.checkpoints.append((step, Path(path)))
        return []

    def metric_rows(self) -> list[MetricRow]:
        """Every metric row logged, ordered by step (as the store gives them): a transient job's
        training curves, drawn without a database."""
        rows = [
            (step, name, float(v), at)
            for (step, _, values), at in zip(self.logged, self._logged_at)
            for name, v in values.items()
        ]
        return sorted(rows, key=lambda row: row[0])

    def should_prune(self, step: int, metrics: dict) -> bool:
        return False

    def interrupted(self) -> str | None:
        """Never: ``stop_after_step`` counts optimizer steps."""
        return None

    def should_stop(self) -> str | None:
        self.steps_run += 1
        return self.stop_reason if self.stop_after_step is not None and self.steps_run >= self.stop_after_step else None

    def series(self, name: str) -> dict[int, float]:
        """Metric ``name`` by step."""
        return {step: values[name] for step, _, values in self.logged if name in values}
