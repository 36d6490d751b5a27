"""``tunejob jobs watch`` and ``tunejob predict watch``: a live ``rich`` progress bar that follows a
job to its end (the stream, or polling where the server has none), then its outcome.

For a training job the bar shows step/total, epoch, the latest train loss, the latest value of
``metric_for_best_model`` on the validation set, real tokens/s and padding efficiency (both over
the attempt so far) and the server's ETA; for a prediction job rows done/total, rows/s and the
ETA. The job's events are printed above the bar as they happen.

Without a terminal (a CI log, ``nohup``, a pipe) a live bar draws nothing until the end, so there
the same fields are printed as a plain line (``PlainLines``) when the status changes and at most
every ``PLAIN_EVERY_SECONDS`` in between.
"""

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from client.api import TRAINING, Client, Kind
from client.display import (
    event_line,
    fields_table,
    final_summary,
    prediction_summary,
    queue_line,
    styled_status,
)
from shared.schemas.jobs import JobOut
from shared.schemas.predictions import PredictionOut

EXIT_CODES = {"succeeded": 0, "failed": 3, "cancelled": 4, "pruned": 5}
PLAIN_EVERY_SECONDS = 30.0


class LiveBar:
    """A ``rich`` progress bar on a terminal; events are printed above it."""

    def __init__(self, out: Console, job_id: str):
        self.bar = Progress(
            TextColumn("{task.fields[status]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[details]}"),
            console=out,
        )
        self.task = self.bar.add_task(job_id, total=None, status="", details="")

    def __enter__(self) -> "LiveBar":
        self.bar.start()
        return self

    def __exit__(self, *_) -> None:
        self.bar.stop()

    def print(self, line) -> None:
        self.bar.console.print(line)

    def update(self, job: JobOut | PredictionOut) -> None:
        done, total = position(job)
        self.bar.update(self.task, completed=done, total=total, status=styled_status(job.status), details=details(job))


class PlainLines:
    """Progress as plain lines, for output that is not a terminal: ``<id> running 120/400 · epoch
    0.90 · loss 0.4321 · … · ETA 1:05``, when the status changes and at most every ``every`` seconds."""

    def __init__(self, out: Console, job_id: str, every: float | None = None):
        self.out, self.job_id = out, job_id
        self.every = PLAIN_EVERY_SECONDS if every is None else every
        self.last_status: str | None = None
        self.last_time = float("-inf")

    def __enter__(self) -> "PlainLines":
        return self

    def __exit__(self, *_) -> None:
        pass

    def print(self, line) -> None:
        self.out.print(line)

    def update(self, job: JobOut | PredictionOut) -> None:
        now = time.monotonic()
        if job.status == self.last_status and now - self.last_time < self.every:
            return
        self.last_status, self.last_time = job.status, now
        done, total = position(job)
        fields = " · ".join(p for p in (f"{done}/{total if total is not None else '?'}", details(job)) if p)
        self.out.print(f"{self.job_id} {job.status} {fields}", highlight=False, soft_wrap=True)


def watch(client: Client, job_id: str, out: Console, kind: Kind = TRAINING) -> int:
    """Follow job ``job_id`` (of ``kind``) until it ends; print its outcome. Returns the exit code:
    0 succeeded, 3 failed, 4 cancelled, 5 pruned (a sweep's trial stopped early; EXIT_CODES).

    Raises:
        TunejobError: no such job, or the server stopped answering.
        KeyboardInterrupt: Ctrl-C; the job goes on.
    """
    job = client.get_of_kind(job_id, kind)
    with (LiveBar if out.is_terminal else PlainLines)(out, job_id) as shown:
        for message in client.follow(job_id, kind=kind):
            if message.event == "events":
                for event in message.data:
                    shown.print(event_line(event))
            elif message.event in ("progress", "end"):
                job = message.data
                shown.update(job)
    table = fields_table({})
    table.title = f"{'prediction' if isinstance(job, PredictionOut) else 'job'} {job.id} {styled_status(job.status)}"
    prediction_summary(table, job) if isinstance(job, PredictionOut) else final_summary(table, job)
    out.print(table)
    return EXIT_CODES.get(job.status, 1)


def position(job: JobOut | PredictionOut) -> tuple[int, int | None]:
    """(done, total): optimizer steps of a training job, rows of a prediction job."""
    if isinstance(job, PredictionOut):
        return job.progress.rows_done, job.progress.total_rows or None
    return job.progress.step, job.progress.total_steps


def details(job: JobOut | PredictionOut) -> str:
    """``epoch 1.25 · loss 0.4321 · val accuracy 0.9100 · 12,345 tok/s · padding 93% · ETA 1:05``
    for training, ``61 rows/s · ETA 0:12`` for a prediction."""
    if job.queue is not None:  # queued: its place and estimated start, from the stream's progress messages
        return queue_line(job)
    parts = prediction_details(job) if isinstance(job, PredictionOut) else training_details(job)
    if job.progress.eta_seconds is not None and job.status == "running":
        minutes, seconds = divmod(int(job.progress.eta_seconds), 60)
        parts.append(f"ETA {minutes}:{seconds:02d}")
    return " · ".join(parts)


def training_details(job: JobOut) -> list[str]:
    train, val, p = job.train_metrics or {}, job.validation_metrics or {}, job.progress
    parts = [f"epoch {p.epoch:.2f}"]
    if train.get("loss") is not None:
        parts.append(f"loss {train['loss']:.4f}")
    metric = job.hyperparameters.metric_for_best_model
    if val.get(metric) is not None:
        parts.append(f"val {metric} {val[metric]:.4f}")
    if train.get("tokens_per_second") is not None:
        parts.append(f"{train['tokens_per_second']:,.0f} tok/s")
    if train.get("padding_efficiency") is not None:
        parts.append(f"padding {train['padding_efficiency']:.0%}")
    return parts


def prediction_details(job: PredictionOut) -> list[str]:
    rate = job.progress.rows_per_second
    return [f"{rate:,.0f} rows/s"] if rate is not None else []
