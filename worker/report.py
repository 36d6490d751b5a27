"""Streams a running job's progress, metrics and events to the job store in short, batched writes."""

import threading
import time
from datetime import datetime
from pathlib import Path

from shared import jobs
from shared.models import utcnow
from shared.settings import get_settings


class Reporter:
    """The running worker's line to the job row.

    Metrics are buffered and written together at most every ``metrics_flush_seconds``; each write
    also renews the worker's lease. ``should_stop()`` is asked once per optimizer step.
    """

    def __init__(self, job_id: str, worker_id: str, stop_flags: dict[str, threading.Event] | None = None):
        self.job_id, self.worker_id = job_id, worker_id
        self.stop_flags = stop_flags or {}  # e.g. {"shutdown": <SIGTERM seen>, "lease_lost": <heartbeat lost it>}
        self.flush_seconds = get_settings().metrics_flush_seconds
        self.deadline = time.monotonic() + get_settings().max_job_seconds
        self._metrics: list[tuple[int, float, str, float, datetime]] = []
        self._progress: dict = {}
        self._last_flush = time.monotonic()
        self.lease_lost = False

    def event(self, code: str, message: str, level: str = "info") -> None:
        jobs.add_event(self.job_id, code, message, level)

    def log(self, step: int, epoch: float, values: dict[str, float]) -> None:
        now = utcnow()
        self._metrics.extend((step, epoch, name, float(v), now) for name, v in values.items())

    def progress(self, **fields) -> None:
        """Set job-row fields (step, epoch, total_steps, eta_seconds, train/validation metrics, device)."""
        self._progress.update(fields)
        self.heartbeat()

    def heartbeat(self) -> None:
        """Write what is buffered, and so renew the lease, if ``metrics_flush_seconds`` have passed."""
        if time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        held = jobs.report(self.job_id, self.worker_id, self._progress, self._metrics)
        self._metrics, self._progress, self._last_flush = [], {}, time.monotonic()
        self.lease_lost = self.lease_lost or not held

    def checkpoint(self, step: int, path: Path, metrics: dict | None, keep: int) -> list[Path]:
        """Point the store at a completely written checkpoint; returns the older checkpoint
        directories, beyond the newest ``keep``, that the store no longer lists (to delete)."""
        self.flush()  # the steps up to the checkpoint are never trained again: write their metrics first
        return jobs.record_checkpoint(self.job_id, step, str(path), metrics, keep)

    def should_stop(self) -> str | None:
        """Why training must stop now, if it must: ``"shutdown"`` (the worker is shutting down),
        ``"lease_lost"`` (another worker holds the job), ``"cancelled"`` or ``"time_limit"``."""
        if self.lease_lost:
            return "lease_lost"
        for reason, flag in self.stop_flags.items():
            if flag.is_set():
                return reason
        if jobs.cancel_requested(self.job_id):
            return "cancelled"
        return "time_limit" if time.monotonic() > self.deadline else None
