"""How the client commands draw tunejob's resources with ``rich``: tables of datasets, jobs and
predictions, a job's final summary, event lines; ``--json`` and ``-q`` output (``show``)."""

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, TypeAdapter
from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Column, Table

from shared.schemas.jobs import DatasetOut, EventOut, JobOut, MetricOut, metric_text
from shared.schemas.predictions import PredictionOut

STATUS_STYLE = {
    "queued": "yellow",
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "magenta",
    "pruned": "blue",
}


def show_plan(out: Console, args, plan: dict, table: Callable[[dict], Any] | None = None) -> None:
    """A dry run's plan: JSON on stdout with ``--json`` (for scripts), else ``table(plan)`` (its
    main figures; the whole plan with ``--json``) or, without one, highlighted JSON on ``out``."""
    if getattr(args, "json", False):
        print_json(plan)
    elif table is not None:
        out.print(table(plan))
        out.print("[dim]dry run: nothing was queued; --json prints the whole plan[/]")
    else:
        out.print_json(data=plan)


def estimate(plan: dict) -> str:
    """A plan's ``estimated_seconds`` and its basis (the newest succeeded job of the same model)."""
    seconds = plan.get("estimated_seconds")
    return escape(plan["estimate_basis"] if seconds is None else f"{seconds:,.0f} s ({plan['estimate_basis']})")


def job_plan_table(batching: str) -> Callable[[dict], Table]:
    """The table of a job's plan (``POST /jobs?dry_run=true``) trained with ``batching``."""

    def table(plan: dict) -> Table:
        lengths, efficiency = plan["token_lengths"], plan["padding_efficiency"]
        return fields_table(
            {
                "examples": f"{plan['examples']:,} ({plan['truncated_examples']:,} cut at max_length)",
                "tokens per example": f"mean {lengths['mean']:.1f}, max {lengths['max']:,}",
                "steps": f"{plan['total_steps']:,} ({plan['steps_per_epoch']:,} an epoch, "
                f"{plan['micro_batches_per_epoch']:,} micro-batches an epoch)",
                "padding efficiency": f"{efficiency[batching]['unrounded']:.3f} ({batching}; on a CUDA worker's "
                f"buckets {efficiency[batching]['bucketed']:.3f}); "
                + ", ".join(f"{name} {e['unrounded']:.3f}" for name, e in efficiency.items() if name != batching),
                "estimated time": estimate(plan),
                **({"notes": escape("; ".join(plan["notes"]))} if plan.get("notes") else {}),
            }
        )

    return table


def prediction_plan_table(plan: dict) -> Table:
    """The table of a prediction's plan (``POST /predictions?dry_run=true``)."""
    return fields_table(
        {
            "rows": f"{plan['rows']:,} ({plan['truncated']:,} cut at max_length {plan['max_length']:,})",
            "task": plan["task"],
            "tokens": f"{plan['tokens']:,} ({plan['padded_tokens']:,} computed with padding: "
            f"efficiency {plan['padding_efficiency']:.3f})",
            "estimated time": estimate(plan),
            **({"notes": escape("; ".join(plan["notes"]))} if plan.get("notes") else {}),
        }
    )


def show(out: Console, args, value: Any, table: Callable[[], Any]) -> None:
    """``value`` as JSON with ``--json``, only its id with ``-q``, else ``table()`` drawn by rich."""
    if getattr(args, "json", False):
        print_json(value)
    elif getattr(args, "quiet", False):
        print(value.id, flush=True)
    else:
        out.print(table())


def print_json(value: Any) -> None:
    """pydantic models (and lists of them) through pydantic's JSON; anything else through json."""
    if isinstance(value, BaseModel) or (isinstance(value, list) and value and isinstance(value[0], BaseModel)):
        shape: Any = type(value) if isinstance(value, BaseModel) else list.__class_getitem__(type(value[0]))
        print(TypeAdapter(shape).dump_json(value, indent=2).decode(), flush=True)
    else:
        print(json.dumps(value, indent=2, default=str), flush=True)


def dataset_table(d: DatasetOut) -> Table:
    return fields_table(
        {
            "id": d.id,
            "filename": escape(d.filename),
            "format": d.format,
            "rows": f"{d.rows:,}",
            "columns": escape(", ".join(d.columns)),
            "size": decimal(d.bytes),
            "sha256": d.sha256,
            "created": f"{d.created_at.astimezone():%Y-%m-%d %H:%M:%S} ({age(d.created_at)})",
        }
    )


def job_table(job: JobOut) -> Table:
    validation = job.validation_dataset or f"split {job.validation_split} of the training set"
    rows = {
        "id": job.id,
        "status": styled_status(job.status),
        "model": escape(job.base_model),
        "task": job.task,
        "training dataset": job.training_dataset,
        "validation": validation,
        "columns": escape(
            ", ".join(
                f"{name.removesuffix('_columns').removesuffix('_column')} {value!r}"
                for name, value in job.column_fields().items()
            )
        ),
        "created": f"{job.created_at.astimezone():%Y-%m-%d %H:%M:%S} ({age(job.created_at)})",
        "progress": progress(job),
        "device": job.device or "",
        "attempts": str(job.attempts),
        **files_deleted(job.files_deleted_at),
    }
    table = fields_table(rows)
    # name=value pairs, so that a narrow window wraps between them, never inside a number
    chosen = job.hyperparameters.model_dump(mode="json", exclude_defaults=True)
    table.add_row("hyperparameters", escape(", ".join(f"{k}={json.dumps(whole(v))}" for k, v in chosen.items())))
    final_summary(table, job)
    return table


def whole(value: Any) -> Any:
    """A float with no fraction as the integer a user wrote (``epochs`` is a float: ``--set epochs=2``
    is stored as 2.0); anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def files_deleted(when: datetime | None) -> dict[str, str]:
    """A ``files`` row for a job whose model or results were deleted (retention), else nothing."""
    return {} if when is None else {"files": f"deleted {when.astimezone():%Y-%m-%d %H:%M:%S} ({age(when)})"}


def prediction_table(p: PredictionOut) -> Table:
    columns = (
        f"text {p.text_column!r}"
        + (f", pair {p.text_pair_column!r}" if p.text_pair_column else "")
        + (f", id {p.id_column!r}" if p.id_column else "")
        + (f", label {p.label_column!r}" if p.label_column else "")
    )
    table = fields_table(
        {
            "id": p.id,
            "status": styled_status(p.status),
            "model": escape(p.model),
            "task": p.task,
            "dataset": p.dataset,
            "columns": escape(columns),
            "created": f"{p.created_at.astimezone():%Y-%m-%d %H:%M:%S} ({age(p.created_at)})",
            "rows": f"{p.progress.rows_done:,}/{p.progress.total_rows:,} ({p.progress.fraction:.0%})",
            "device": p.device or "",
            "attempts": str(p.attempts),
            **files_deleted(p.files_deleted_at),
            **({"queue": queue_line(p)} if p.queue else {}),
        }
    )
    prediction_summary(table, p, rows=False)  # its "rows" row has them: they were shown twice
    return table


def texts_table(texts: list[str], predictions: list[dict[str, Any]]) -> Table:
    """One row per text: the text and its prediction (``prediction_text``)."""
    table = Table(Column("text", overflow="fold"), "prediction")
    for text, row in zip(texts, predictions, strict=True):
        table.add_row(escape(text), escape(prediction_text(text, row)))
    return table


def vectors_table(texts: list[str], vectors: list[list[float]]) -> Table:
    """One row per text: the text, its vector's size and first values (``--json`` prints them all)."""
    table = Table(Column("text", overflow="fold"), "dimensions", "vector")
    for text, vector in zip(texts, vectors, strict=True):
        table.add_row(escape(text), str(len(vector)), "[" + ", ".join(f"{v:.4f}" for v in vector[:4]) + ", …]")
    return table


def reranked_table(documents: list[str], results: list[dict[str, Any]]) -> Table:
    """One row per result, best first: its rank, the document's position in the request, its
    relevance score and the document."""
    table = Table("rank", "document", "relevance", Column("text", overflow="fold"))
    for rank, result in enumerate(results, 1):
        i = result["index"]
        table.add_row(str(rank), str(i), f"{result['relevance_score']:.4f}", escape(documents[i]))
    return table


def prediction_text(text: str, row: dict[str, Any]) -> str:
    """A prediction in a few words: classification's label and score, multi_label's labels,
    token_classification's entities (``PER carol, LOC New York``: the text at their offsets), or
    regression's value."""
    if "entities" in row:
        return ", ".join(f"{e['entity_group']} {text[e['start'] : e['end']]}" for e in row["entities"]) or "no entity"
    if "labels" in row:
        return ", ".join(map(str, row["labels"])) or "no label"
    if "label" in row:
        return f"{row['label']} ({row['score']:.3f})"
    return metric_text(row.get("value"))


def id_column() -> Column:
    """Ids are copied and pasted: never cut short, whatever the terminal's width."""
    return Column("id", no_wrap=True, min_width=len("job_0123456789abcdef"))


def fields_table(rows: dict[str, str]) -> Table:
    table = Table(show_header=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for name, value in rows.items():
        table.add_row(name, value)
    return table


def pivot(rows: list[MetricOut]) -> tuple[list[str], dict[int, tuple[float, dict[str, float | None]]]]:
    """Metric rows -> (metric names in first-seen order, {step: (epoch, {name: value})})."""
    names: dict[str, None] = {}
    by_step: dict[int, tuple[float, dict[str, float | None]]] = {}
    for row in rows:
        names.setdefault(row.name)
        by_step.setdefault(row.step, (row.epoch, {}))[1][row.name] = row.value
    return list(names), by_step


def progress(job: JobOut, percent: bool = True) -> str:
    """``12/40 (30%)`` (``12/40`` without ``percent``); for a queued job its place in the queue
    (``queue_line``); for a running job before its first step, what it is doing (``starting``)."""
    p = job.progress
    if job.queue is not None:
        return queue_line(job)
    if not p.total_steps:
        return starting(job) if job.status == "running" else ""
    return f"{p.step}/{p.total_steps}" + (f" ({p.fraction:.0%})" if percent else "")


def starting(job: JobOut) -> str:
    """What a running job does before its first optimizer step, from the phases it has ended
    (``timings``, each 0 until then): a large training set takes minutes to tokenize, and nothing
    else said the job was moving."""
    if not job.timings.load:
        return "loading the data and the model"
    return "tokenizing" if not job.timings.tokenize else "starting to train"


def queue_line(job: JobOut | PredictionOut) -> str:
    """``#3 in queue · starts in ~4:05`` (or ``· start unknown`` without an estimate); empty unless
    the job is queued."""
    if job.queue is None:
        return ""
    q = job.queue
    if q.estimated_start_seconds is None:
        return f"#{q.position} in queue · start unknown"
    minutes, seconds = divmod(int(round(q.estimated_start_seconds)), 60)
    return f"#{q.position} in queue · starts in ~{minutes}:{seconds:02d}"


def age(when: datetime) -> str:
    """``when`` as time passed: ``3m ago``; a time to come as time left: ``in 4m``."""
    seconds = (datetime.now(UTC) - when.astimezone(UTC)).total_seconds()
    ahead, seconds = seconds < 0, abs(seconds)
    for unit, length in [("d", 86400), ("h", 3600), ("m", 60)]:
        if seconds >= length:
            span = f"{seconds // length:.0f}{unit}"
            break
    else:
        span = f"{seconds:.0f}s"
    return f"in {span}" if ahead else f"{span} ago"


def final_summary(table: Table, job: JobOut) -> None:
    """Add the job's outcome to a two-column table: validation metrics (last evaluation), training
    throughput, phase timings (servers that report them) and the error, if any."""
    for name, value in (job.validation_metrics or {}).items():
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            value = f"tunejob jobs evaluation {job.id}"  # token_classification's per_entity: a table of its own
        table.add_row(f"validation {name}", escape(metric_text(value)))
    train = job.train_metrics or {}
    for name in ("loss", "tokens_per_second", "padding_efficiency", "train_seconds", "skipped_steps"):
        if train.get(name) is not None:
            value = f"{train[name]:,.1f}" if name.endswith("seconds") else metric_text(train[name])  # not 20.5952
            table.add_row(f"train {name.removeprefix('train_')}", value)
    timings = getattr(job, "timings", None)  # servers with phase timings
    if isinstance(timings, BaseModel):
        timings = timings.model_dump()
    if timings:
        table.add_row("timings (s)", ", ".join(f"{k} {v:.1f}" for k, v in timings.items() if v is not None))
    if job.error:
        table.add_row("[red]error[/]", escape(f"{job.error.get('code')}: {job.error.get('message')}"))


def prediction_summary(table: Table, p: PredictionOut, rows: bool = True) -> None:
    """Add a prediction job's outcome to a two-column table: rows (unless the table has them
    already: ``rows`` False), truncation, throughput, where to download the results, the error if any."""
    for name, value in (p.result.model_dump() if p.result else {}).items():
        if value is not None and (rows or name != "rows"):
            table.add_row(name.replace("_", " "), metric_text(value))
    if p.results_url:
        table.add_row("results", f"tunejob predict download {p.id} --format jsonl|csv|parquet")
    if p.error:
        table.add_row("[red]error[/]", escape(f"{p.error.get('code')}: {p.error.get('message')}"))


def event_line(event: EventOut) -> str:
    """``12:03:04 started: attempt 1 started on worker …``, coloured by level, in local time."""
    color = {"warning": "yellow", "error": "red"}.get(event.level, "dim")
    return f"[{color}]{event.time.astimezone():%H:%M:%S} {event.code}[/]: {escape(event.message)}"


def styled_status(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"
