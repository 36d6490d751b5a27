"""The ``tunejob`` commands that talk to a tunejob server over HTTP (``client.api``), with ``rich``
output: ``datasets``, ``models``, ``jobs``, ``sweeps`` (``client.sweeps``), ``predict`` and ``health``.

``tunejob.cli`` registers them beside ``serve``/``api``/``worker``/``db`` and hands them straight
to ``main`` here, so that they start without the server stack (no torch, worker, pandas, job
store or settings object). Every read command takes ``--json`` for scripts; ``-q`` prints only an id.

Exit codes: 0 done (a watched job succeeded), 1 an error (the API's, or a server that cannot be
reached), 2 a usage error, 3 the watched job failed, 4 it was cancelled, 130 Ctrl-C (which stops
watching, never the job).
"""

import argparse
import csv
import os
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Column, Table

from client import sweeps
from client.api import PREDICTION, TRAINING, Client, Kind, TunejobError
from client.display import (
    age,
    dataset_table,
    event_line,
    fields_table,
    id_column,
    job_plan_table,
    job_table,
    pivot,
    prediction_plan_table,
    prediction_table,
    print_json,
    progress,
    queue_line,
    reranked_table,
    show,
    show_plan,
    styled_status,
    texts_table,
    vectors_table,
)
from client.options import UsageError, add_create_arguments, job_spec, prediction_spec

COMMANDS = ("datasets", "models", "jobs", "sweeps", "predict", "webhooks", "health")  # add_commands' (a test checks)
EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
Handler = Callable[[Client, argparse.Namespace, Console], int | None]


# ----------------------------------------------------------------------------- the commands


def upload_dataset(client: Client, args, out: Console) -> None:
    dataset = client.upload_dataset(args.file)
    show(out, args, dataset, lambda: dataset_table(dataset))


def list_datasets(client: Client, args, out: Console) -> None:
    datasets = client.list_datasets()
    rows = [
        (d.id, escape(d.filename), f"{d.rows:,}", escape(", ".join(d.columns)), decimal(d.bytes), age(d.created_at))
        for d in datasets
    ]
    # the file's name whole (up to 32 characters a line) before its columns' names, which `datasets
    # get` lists, as far as the window allows: a fixed width, as rich shrinks the widest column first
    others = sum(max([len(r[i]) for r in rows] + [len(name)]) for i, name in ((2, "rows"), (4, "size"), (5, "age")))
    room = out.width - (id_column().min_width or 0) - others - len("columns") - 19  # 19: borders and padding
    named = max(len("filename"), min(32, room, max([len(d.filename) for d in datasets] + [0])))
    table = Table(
        id_column(),
        Column("filename", overflow="fold", width=named),  # its format: `datasets get`
        Column("rows", no_wrap=True),
        Column("columns", overflow="fold"),
        Column("size", no_wrap=True),
        Column("age", no_wrap=True),
    )
    for row in rows:
        table.add_row(*row)
    show(out, args, datasets, lambda: table)


def get_dataset(client: Client, args, out: Console) -> None:
    dataset = client.get_dataset(args.dataset_id)
    show(out, args, dataset, lambda: dataset_table(dataset))


def delete_dataset(client: Client, args, out: Console) -> None:
    client.delete_dataset(args.dataset_id)
    out.print(f"deleted dataset {args.dataset_id}")


def list_models(client: Client, args, out: Console) -> None:
    models = client.list_models()
    table = Table("name", "source", "model type")
    for m in models:
        table.add_row(escape(m.name), m.source, m.model_type or "")
    show(out, args, models, lambda: table)


def set_alias(client: Client, args, out: Console) -> None:
    alias = client.set_alias(args.name, args.job_id)
    show(out, args, alias, lambda: f"{alias.alias} -> {alias.job_id}")


def get_alias(client: Client, args, out: Console) -> None:
    alias = client.get_alias(args.name)
    table = Table("from", "to", "by", "age", title=f"{escape(alias.alias)} -> {alias.job_id}")
    for change in alias.history:
        table.add_row(
            change.from_job_id or "", change.to_job_id or "(deleted)", change.changed_by or "", age(change.changed_at)
        )
    show(out, args, alias, lambda: table)


def list_aliases(client: Client, args, out: Console) -> None:
    aliases = client.list_aliases()
    table = Table("alias", "job", "by", Column("updated", no_wrap=True))  # as `alias get`: an age, not ISO 8601
    for a in aliases:
        updated = datetime.fromisoformat(a["updated_at"])
        table.add_row(escape(a["alias"]), a["job_id"], a["updated_by"] or "", age(updated))
    show(out, args, aliases, lambda: table)


def delete_alias(client: Client, args, out: Console) -> None:
    client.delete_alias(args.name)
    out.print(f"deleted alias {args.name}")


def create_job(client: Client, args, out: Console) -> int | None:
    spec = job_spec(args)
    if args.dry_run:
        batching = (spec.get("hyperparameters") or {}).get("batching", "smart")
        show_plan(out, args, client.plan_job(spec), job_plan_table(batching))
        return None
    job = client.create_job(spec)
    show(out, args, job, lambda: f"job [bold]{job.id}[/] {job.status}: {job.base_model} on {job.training_dataset}")
    return watch(client, job.id, out) if args.watch else None


def watch(client: Client, job_id: str, out: Console, kind: Kind = TRAINING) -> int:
    from client.watch import (
        watch,  # rich.progress only when a job is watched: a faster start for the rest
    )

    return watch(client, job_id, out, kind)


def list_jobs(client: Client, args, out: Console) -> None:
    page = client.list_jobs(args.status, args.limit, args.cursor)
    # the model's name whole, folded if it must be (it was cut to 'all-MiniLM-L6…' at 80 columns)
    table = Table(id_column(), "status", Column("model", overflow="fold"), "progress", "age")
    for job in page.data:
        row = (
            job.id,
            styled_status(job.status),
            escape(job.base_model),
            progress(job, percent=False),
            age(job.created_at),
        )
        table.add_row(*row)
    if page.next_cursor:
        table.caption = f"more: tunejob jobs list --cursor {page.next_cursor}"
    show(out, args, page, lambda: table)


def get_job(client: Client, args, out: Console) -> None:
    job = client.get_job(args.job_id)
    show(out, args, job, lambda: job_table(job))


def job_evaluation(client: Client, args, out: Console) -> None:
    show_report(client.job_evaluation(args.job_id), args, out)


def prediction_evaluation(client: Client, args, out: Console) -> None:
    show_report(client.prediction_evaluation(args.prediction_id), args, out)


def show_report(report: dict, args, out: Console) -> None:
    """An evaluation report: its headline figures, then per class (label, entity type) precision,
    recall, F1 and support, and the labels the model does not know; --json: the whole report."""
    per_class = report.get("per_class") or report.get("per_label") or report.get("per_entity") or {}
    table = Table(
        "",
        "precision",
        "recall",
        "f1",
        "support",
        title=", ".join(f"{k} {v:.4f}" for k, v in report["metrics"].items() if v is not None),
    )
    for name, v in per_class.items():
        table.add_row(escape(name), f"{v['precision']:.4f}", f"{v['recall']:.4f}", f"{v['f1']:.4f}", str(v["support"]))
    if unknown := report.get("unknown_labels"):
        table.caption = escape(f"labels the model does not know (counted as errors): {', '.join(unknown)}")
    show(out, args, report, lambda: table)


def watch_job(client: Client, args, out: Console) -> int:
    return watch(client, args.job_id, out)


def job_events(client: Client, args, out: Console) -> None:
    if args.follow:
        for message in client.follow(args.job_id):
            if message.event == "events":
                for event in message.data:
                    print(event.model_dump_json(), flush=True) if args.json else out.print(event_line(event))
        return
    events = client.job_events(args.job_id)
    table = Table("time", "level", "code", "message")
    for e in events:
        table.add_row(f"{e.time.astimezone():%Y-%m-%d %H:%M:%S}", e.level, e.code, escape(e.message))
    show(out, args, events, lambda: table)


def job_metrics(client: Client, args, out: Console) -> None:
    rows = client.job_metrics(args.job_id)
    if args.json:
        return print_json(rows)
    names, by_step = pivot(rows)
    if args.csv:
        writer = csv.writer(sys.stdout)
        writer.writerow(["step", "epoch", *names])
        for step, (epoch, values) in by_step.items():
            writer.writerow([step, epoch, *(values.get(n, "") for n in names)])
        return
    left_out: list[str] = []
    if args.metric:
        if unknown := [m for m in args.metric if m not in names]:
            raise UsageError(f"--metric {unknown[0]!r}: job {args.job_id} has no such metric; it has {names}")
        names = args.metric
    else:  # as many columns as the window holds (rich would cut every one to a few letters), loss and validation first
        first = sorted(names, key=lambda n: not (n == "train_loss" or n.startswith("eval_")))
        names, left_out = fitting_columns(first, out.width)
    table = Table("step", "epoch", *names)
    for step, (epoch, values) in by_step.items():
        table.add_row(str(step), f"{epoch:.2f}", *(f"{values[n]:.4g}" if n in values else "" for n in names))
    out.print(table)
    if left_out:
        out.print(
            f"{len(left_out)} more metric(s) than this window ({out.width} columns) shows: {', '.join(left_out)}; "
            "choose with --metric NAME (repeatable), or print them all with --csv or --json"
        )


def fitting_columns(names: list[str], width: int) -> tuple[list[str], list[str]]:
    """The first of ``names`` whose columns fit in ``width`` characters beside step and epoch (a
    column as wide as its name or a ``.4g`` value, plus its borders), and the rest."""
    used = 2 * (len("epoch") + 3) + 1
    for i, name in enumerate(names):
        used += max(len(name), len("-1.234e-05")) + 3
        if used > width:
            return names[:i], names[i:]
    return names, []


def cancel_job(client: Client, args, out: Console) -> None:
    job = client.cancel_job(args.job_id)
    message = {
        "cancelled": "cancelled",
        "running": "cancel requested: it stops at its next optimizer step (or batch of tokenizing)",
    }
    out.print(f"job {job.id}: {message.get(job.status, f'already {job.status}, nothing to cancel')}")


def delete_job(client: Client, args, out: Console) -> None:
    client.delete_job(args.job_id)
    out.print(f"deleted job {args.job_id}")


# how each task's model loads (the download's closing line): an embedding model said pipeline("text-classification")
LOADERS = {
    "token_classification": 'transformers.pipeline("token-classification", model="{}", aggregation_strategy="simple")',
    "embedding": 'sentence_transformers.SentenceTransformer("{}")',
    "reranking": 'sentence_transformers.CrossEncoder("{}")',
}


def download_model(client: Client, args, out: Console) -> None:
    task = client.get_job(args.job_id).task
    directory = client.download_model(args.job_id, args.output or Path(args.job_id))
    loader = LOADERS.get(task, 'transformers.pipeline("text-classification", model="{}")').format(directory)
    out.print(
        f"the model of {args.job_id} is in {directory}/; load it with {loader}, "
        f"its training curves with tensorboard --logdir {directory}/runs"
    )


def plot_job(client: Client, args, out: Console) -> None:
    path = Path(args.output or f"{args.job_id}.png")
    path.write_bytes(client.plot_png(args.job_id))
    out.print(f"training curves of {args.job_id} written to {path}")


def create_prediction(client: Client, args, out: Console) -> int | None:
    spec = prediction_spec(args)
    if args.dry_run:
        show_plan(out, args, client.plan_prediction(spec), prediction_plan_table)
        return None
    prediction = client.create_prediction(spec)
    show(
        out,
        args,
        prediction,
        lambda: f"prediction [bold]{prediction.id}[/] {prediction.status}: {prediction.model} on {prediction.dataset}",
    )
    return watch(client, prediction.id, out, PREDICTION) if args.watch else None


def list_predictions(client: Client, args, out: Console) -> None:
    page = client.list_predictions(args.status, args.limit, args.cursor)
    # 80 columns: the model's id whole (folded, never cut); the dataset is in `predict get`
    statuses = max([len(p.status) for p in page.data] + [len("status")])
    table = Table(
        id_column(),
        Column("status", min_width=statuses),
        Column("model", overflow="fold"),
        "rows",
        Column("age", no_wrap=True),
    )
    for p in page.data:
        table.add_row(
            p.id,
            styled_status(p.status),
            escape(p.model),
            queue_line(p) or f"{p.progress.rows_done:,}/{p.progress.total_rows:,}",
            age(p.created_at),
        )
    if page.next_cursor:
        table.caption = f"more: tunejob predict list --cursor {page.next_cursor}"
    show(out, args, page, lambda: table)


def get_prediction(client: Client, args, out: Console) -> None:
    prediction = client.get_prediction(args.prediction_id)
    show(out, args, prediction, lambda: prediction_table(prediction))


def watch_prediction(client: Client, args, out: Console) -> int:
    return watch(client, args.prediction_id, out, PREDICTION)


def download_predictions(client: Client, args, out: Console) -> None:
    path = client.download_predictions(
        args.prediction_id, args.output or f"{args.prediction_id}.{args.format}", args.format
    )
    out.print(f"the predictions of {args.prediction_id} are in {path}")


def cancel_prediction(client: Client, args, out: Console) -> None:
    prediction = client.cancel_prediction(args.prediction_id)
    message = {"cancelled": "cancelled", "running": "cancel requested: it stops after the part it is scoring"}
    out.print(f"prediction {prediction.id}: {message.get(prediction.status, f'already {prediction.status}')}")


def delete_prediction(client: Client, args, out: Console) -> None:
    client.delete_prediction(args.prediction_id)
    out.print(f"deleted prediction {args.prediction_id}")


def predict_texts(client: Client, args, out: Console) -> None:
    answer = client.predict(args.job_id, args.texts)
    show(out, args, answer, lambda: texts_table(args.texts, answer["predictions"]))


def embed_texts(client: Client, args, out: Console) -> None:
    answer = client.embed(args.job_id, args.texts)
    show(out, args, answer, lambda: vectors_table(args.texts, answer["embeddings"]))


def rerank_texts(client: Client, args, out: Console) -> None:
    answer = client.rerank(args.job_id, args.query, args.documents, args.top_n)
    show(out, args, answer, lambda: reranked_table(args.documents, answer["results"]))


def create_webhook(client: Client, args, out: Console) -> None:
    webhook = client.create_webhook(args.endpoint, args.events, args.description)
    show(
        out,
        args,
        webhook,
        lambda: fields_table(
            {
                "id": webhook.id,
                "url": escape(webhook.url),
                "events": ", ".join(webhook.events),
                "secret": f"{webhook.secret}  (shown only now: verify each delivery's webhook-signature with it)",
            }
        ),
    )


def list_webhooks(client: Client, args, out: Console) -> None:
    hooks = client.list_webhooks()
    table = Table(id_column(), Column("url", overflow="fold"), "events", "age")
    for w in hooks:
        table.add_row(w.id, escape(w.url), ", ".join(w.events), age(w.created_at))
    show(out, args, hooks, lambda: table)


def webhook_deliveries(client: Client, args, out: Console) -> None:
    page = client.webhook_deliveries(args.webhook_id, args.limit, args.cursor)
    types = max([len(d.event_type) for d in page.data] + [len("type")])
    table = Table(Column("event", overflow="fold"), Column("type", min_width=types), "status", "tries", "answer", "age")
    for d in page.data:
        answer = str(d.response_status) if d.response_status else escape(d.error or "")
        status = (
            f"{d.status}, next {age(d.next_attempt_at)}" if d.status == "pending" and d.next_attempt_at else d.status
        )
        table.add_row(d.event_id, d.event_type, status, str(d.attempts), answer, age(d.created_at))
    if page.next_cursor:
        table.caption = f"more: tunejob webhooks deliveries {args.webhook_id} --cursor {page.next_cursor}"
    show(out, args, page, lambda: table)


def ping_webhook(client: Client, args, out: Console) -> None:
    delivery = client.ping_webhook(args.webhook_id)
    show(
        out,
        args,
        delivery,
        lambda: f"ping {delivery.event_id} queued; see `tunejob webhooks deliveries {args.webhook_id}`",
    )


def delete_webhook(client: Client, args, out: Console) -> None:
    client.delete_webhook(args.webhook_id)
    out.print(f"deleted webhook {args.webhook_id}")


def health(client: Client, args, out: Console) -> None:
    answer = client.wait_until_up(args.wait) if args.wait else client.health()
    show(out, args, answer, lambda: f"tunejob at {client.url}: {answer.get('status', answer)}")


# ----------------------------------------------------------------------------- the parser


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Register ``datasets``, ``models``, ``jobs`` and ``health`` on the ``tunejob`` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        help="the tunejob server (default: $TUNEJOB_URL, else http://127.0.0.1:8000); "
        "the API key comes from $TUNEJOB_API_KEY, else <$TUNEJOB_DATA_DIR or ~/.tunejob>/api_key",
    )
    read = argparse.ArgumentParser(add_help=False, parents=[common])
    read.add_argument("--json", action="store_true", help="print JSON, for scripts")
    quiet = argparse.ArgumentParser(add_help=False, parents=[read])
    quiet.add_argument("-q", "--quiet", action="store_true", help="print only the id")

    def command(group, name: str, handler: Handler, help_: str, parent=common) -> argparse.ArgumentParser:
        p = group.add_parser(name, help=help_, description=help_, parents=[parent])
        p.set_defaults(handler=handler)
        return p

    datasets = commands.add_parser("datasets", help="upload and manage datasets (client)").add_subparsers(
        dest="subcommand", required=True
    )
    command(datasets, "upload", upload_dataset, "upload a CSV, TSV, JSONL or Parquet file", quiet).add_argument(
        "file", type=Path
    )
    command(datasets, "list", list_datasets, "the datasets, newest first", read)
    command(datasets, "get", get_dataset, "one dataset", read).add_argument("dataset_id")
    command(datasets, "delete", delete_dataset, "delete a dataset").add_argument("dataset_id")

    models = command(
        commands,
        "models",
        list_models,
        "the base models that can be fine-tuned; `models alias`: your names for fine-tuned models (client)",
        read,
    )
    models_commands = models.add_subparsers(dest="subcommand")
    command(models_commands, "list", list_models, "the base models (as `tunejob models`, the others' way)", read)
    alias = models_commands.add_parser(
        "alias", help="names for fine-tuned models that predictions follow"
    ).add_subparsers(dest="alias_command", required=True)
    p = command(alias, "set", set_alias, "point NAME (a slug) at a succeeded job, creating or moving it", read)
    p.add_argument("name")
    p.add_argument("job_id")
    command(alias, "get", get_alias, "the job NAME names and its history", read).add_argument("name")
    command(alias, "list", list_aliases, "your aliases", read)
    command(alias, "delete", delete_alias, "remove an alias").add_argument("name")

    jobs = commands.add_parser("jobs", help="create, follow and download fine-tuning jobs (client)").add_subparsers(
        dest="subcommand", required=True
    )
    add_create_arguments(command(jobs, "create", create_job, "create a fine-tuning job (or plan it: --dry-run)", quiet))
    p = command(jobs, "list", list_jobs, "the jobs, newest first", read)
    p.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled", "pruned"])
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--cursor", help="next_cursor of the previous page")
    command(jobs, "get", get_job, "one job: status, progress, metrics, error", read).add_argument("job_id")
    command(
        jobs,
        "watch",
        watch_job,
        "follow a job with a live progress bar until it ends; exit 0 if it "
        "succeeded, 3 if it failed, 4 if it was cancelled, 5 if its sweep pruned it",
    ).add_argument("job_id")
    command(
        jobs,
        "evaluation",
        job_evaluation,
        "the evaluation report of a succeeded job's model: per-class "
        "figures (--json: the whole report, with the confusion matrix and mistakes)",
        read,
    ).add_argument("job_id")
    p = command(jobs, "events", job_events, "the job's events", read)
    p.add_argument("job_id")
    p.add_argument("--follow", action="store_true", help="print new events as they happen, until the job ends")
    p = command(jobs, "metrics", job_metrics, "the metric series, one row per step", read)
    p.add_argument("job_id")
    p.add_argument("--csv", action="store_true", help="print CSV")
    p.add_argument(
        "--metric",
        action="append",
        metavar="NAME",
        help="only this metric's column (repeatable); default: as many as fit",
    )
    command(jobs, "cancel", cancel_job, "cancel a job (a running one stops at its next optimizer step)").add_argument(
        "job_id"
    )
    command(jobs, "delete", delete_job, "delete a finished job and its files").add_argument("job_id")
    p = command(jobs, "download", download_model, "download the trained model, extracted, ready for pipeline()")
    p.add_argument("job_id")
    p.add_argument("-o", "--output", type=Path, help="directory to create (default: ./<job id>)")
    p = command(jobs, "plot", plot_job, "save the training curves as a PNG")
    p.add_argument("job_id")
    p.add_argument("-o", "--output", type=Path, help="file (default: ./<job id>.png)")

    sweeps.add_commands(commands, command, quiet, read)
    add_predict_commands(commands, command, quiet, read)

    hooks = commands.add_parser("webhooks", help="endpoints that hear when jobs end (client)").add_subparsers(
        dest="subcommand", required=True
    )
    p = command(hooks, "create", create_webhook, "register an endpoint; prints its secret once", quiet)
    p.add_argument("endpoint", metavar="URL", help="where deliveries are POSTed (not the server: that is --url)")
    p.add_argument("events", nargs="+", metavar="EVENT", help="e.g. job.succeeded job.failed prediction.succeeded")
    p.add_argument("--description")
    command(hooks, "list", list_webhooks, "the endpoints, newest first", read)
    p = command(hooks, "deliveries", webhook_deliveries, "an endpoint's delivery log, newest first", read)
    p.add_argument("webhook_id")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--cursor", type=int, help="next_cursor of the previous page")
    command(hooks, "ping", ping_webhook, "send a signed test event to an endpoint", read).add_argument("webhook_id")
    command(hooks, "delete", delete_webhook, "delete an endpoint and its log").add_argument("webhook_id")

    command(commands, "health", health, "is the server up? (client)", read).add_argument(
        "--wait", type=float, metavar="SECONDS", help="wait this long for a server that is starting"
    )


def add_predict_commands(commands: argparse._SubParsersAction, command, quiet, read) -> None:
    """``tunejob predict create|list|get|watch|events|download|evaluation|cancel|delete|texts|embed|rerank``."""
    predict = commands.add_parser(
        "predict", help="score datasets or texts with a trained model (client)"
    ).add_subparsers(dest="subcommand", required=True)
    p = command(predict, "create", create_prediction, "score every row of a dataset (or plan it: --dry-run)", quiet)
    p.add_argument("--spec", type=Path, help="a JSON body of POST /predictions; the options below override it")
    p.add_argument(
        "--model",
        help="a succeeded job id (an embedding job's results are vectors), or a base model with a classification head",
    )
    p.add_argument("--dataset", help="the dataset id to score")
    p.add_argument("--text-column")
    p.add_argument("--text-pair-column")
    p.add_argument("--id-column", help="a column naming each row in the results (default: the row index)")
    p.add_argument(
        "--label-column",
        help="a column of gold labels: the prediction also writes an evaluation report (tunejob predict evaluation ID)",
    )
    p.add_argument(
        "--count-unknown-labels",
        action="store_true",
        default=None,
        help="with --label-column: score "
        "rows whose label the model does not know as errors (else such a test set is refused)",
    )
    p.add_argument("--batch-size", type=int)
    p.add_argument("--max-length", type=int, help="tokens per text at most (default: the model's limit)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (rows, tokens, padding efficiency, time); nothing is queued",
    )
    p.add_argument("--watch", action="store_true", help="then follow it as `tunejob predict watch` does")
    p = command(predict, "list", list_predictions, "the prediction jobs, newest first", read)
    p.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"])
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--cursor", help="next_cursor of the previous page")
    command(predict, "get", get_prediction, "one prediction job: status, progress, result", read).add_argument(
        "prediction_id"
    )
    command(
        predict,
        "watch",
        watch_prediction,
        "follow a prediction job until it ends; exit 0 if it succeeded, 3 if it failed, 4 if it was cancelled",
    ).add_argument("prediction_id")
    p = command(predict, "download", download_predictions, "download the results: one row per input row, in order")
    p.add_argument("prediction_id")
    p.add_argument("--format", choices=["jsonl", "csv", "parquet"], default="jsonl")
    p.add_argument("-o", "--output", type=Path, help="file (default: ./<id>.<format>)")
    command(
        predict,
        "evaluation",
        prediction_evaluation,
        "the evaluation report of a prediction made with --label-column: per-class figures (--json: the whole report)",
        read,
    ).add_argument("prediction_id")
    command(predict, "cancel", cancel_prediction, "cancel a prediction job").add_argument("prediction_id")
    command(predict, "delete", delete_prediction, "delete a finished prediction job and its results").add_argument(
        "prediction_id"
    )
    p = command(predict, "texts", predict_texts, "score a few texts at once with a trained model's job id", read)
    p.add_argument("job_id")
    p.add_argument("texts", nargs="+")
    p = command(
        predict,
        "embed",
        embed_texts,
        "embed a few texts at once with an embedding job's id (or a base "
        "model's name); --json prints the whole vectors",
        read,
    )
    p.add_argument("job_id")
    p.add_argument("texts", nargs="+")
    p = command(
        predict,
        "rerank",
        rerank_texts,
        "order a few documents by their relevance to a query with a reranking job",
        read,
    )
    p.add_argument("job_id")
    p.add_argument("query")
    p.add_argument("documents", nargs="+")
    p.add_argument("--top-n", type=int, help="only the best N documents")


def main(argv: list[str]) -> int:
    """Run one client command (``argv`` starts with one of COMMANDS); returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="tunejob", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_commands(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Call the command's handler with a client; turn errors into a message and an exit code."""
    out = Console(stderr=getattr(args, "quiet", False) or getattr(args, "json", False))
    errors = Console(stderr=True)
    try:
        with Client(args.url) as client:
            return args.handler(client, args, out) or 0
    except TunejobError as e:
        errors.print(f"[red]error[/]: {escape(str(e))}")
        for problem in e.problems or []:
            column = f", column {problem['column']!r}" if problem.get("column") is not None else ""  # a whole line
            errors.print(f"  row {problem.get('row')}{column}: {escape(str(problem.get('message')))}")
        return EXIT_ERROR
    except UsageError as e:
        errors.print(f"[red]usage[/]: {escape(str(e))}")
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `tunejob jobs metrics ID --csv | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error as Python exits
        return EXIT_ERROR
    except OSError as e:  # a local file: an upload that is not there, `-o` into a folder that is not
        errors.print(f"[red]error[/]: {escape(str(e))}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        job, prediction = getattr(args, "job_id", None), getattr(args, "prediction_id", None)
        sweep = getattr(args, "sweep_id", None)
        hint = (
            f" (tunejob predict cancel {prediction} stops it)"
            if prediction
            else f" (tunejob jobs cancel {job} stops it)"
            if job
            else f" (tunejob sweeps cancel {sweep} stops it)"
            if sweep
            else ""
        )
        errors.print("stopped watching; the job goes on" + hint)
        return EXIT_INTERRUPTED
