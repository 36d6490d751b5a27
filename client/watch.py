"""``tunejob jobs watch``: a live ``rich`` progress bar that follows a job to its end (the stream,
or polling where the server has none), then its final metrics.

The bar shows step/total, epoch, the latest train loss, the latest value of
``metric_for_best_model`` on the validation set, real tokens/s and padding efficiency (both over
the attempt so far) and the server's ETA; the job's events are printed above it as they happen.
"""

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from client.api import Client
from client.cli import event_line, fields_table, final_summary, styled_status
from shared.schemas import JobOut

EXIT_CODES = {"succeeded": 0, "failed": 3, "cancelled": 4}


def watch(client: Client, job_id: str, out: Console) -> int:
    """Follow job ``job_id`` until it ends; print its final metrics. Returns the exit code:
    0 succeeded, 3 failed, 4 cancelled (EXIT_CODES).

    Raises:
        TunejobError: no such job, or the server stopped answering.
        KeyboardInterrupt: Ctrl-C; the job goes on.
    """
    job = client.get_job(job_id)
    bar = Progress(TextColumn("{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[details]}"), console=out)
    with bar:
        task = bar.add_task(job_id, total=None, status="", details="")
        for message in client.follow(job_id):
            if message.event == "events":
                for event in message.data:
                    bar.console.print(event_line(event))
            elif message.event in ("progress", "end"):
                job = message.data
                bar.update(task, completed=job.progress.step, total=job.progress.total_steps,
                           status=styled_status(job.status), details=details(job))
    table = fields_table({})
    table.title = f"job {job.id} {styled_status(job.status)}"
    final_summary(table, job)
    out.print(table)
    return EXIT_CODES.get(job.status, 1)


def details(job: JobOut) -> str:
    """``epoch 1.25 · loss 0.4321 · val accuracy 0.9100 · 12,345 tok/s · padding 93% · ETA 1:05``."""
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
    if p.eta_seconds is not None and job.status == "running":
        minutes, seconds = divmod(int(p.eta_seconds), 60)
        parts.append(f"ETA {minutes}:{seconds:02d}")
    return " · ".join(parts)
