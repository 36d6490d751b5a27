"""``tunejob sweeps create|list|get|trials|watch|cancel|delete``: hyperparameter sweeps (``POST /sweeps``)
from the command line, registered by ``client.cli.add_commands``.

``create`` takes the job options of ``tunejob jobs create`` (``--model``, ``--dataset``, ``--set`` for
the fixed hyperparameters, ...) plus the search: ``--space`` (a JSON or YAML file of
``{name: {"type", "low", "high", "log", "step", "choices"}}``), ``--objective metric[:direction]``
(repeated: several objectives, e.g. accuracy and latency_ms; ``--serving-precision``),
``--algorithm``, ``--early-stopping``, ``--max-trials``, ``--max-parallel-trials``, ``--max-duration``,
``--warm-start`` and ``--no-defaults``. ``--watch`` (and
``watch``) redraws the table of trials with the best so far until the sweep ends; exit 0 if it
succeeded, 3 if it failed, 4 if it was cancelled.
"""

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Column, Table

from client.api import Client
from client.display import age, fields_table, id_column, job_plan_table, print_json, show, show_plan, styled_status
from client.options import UsageError, add_create_arguments, job_spec
from client.watch import PLAIN_EVERY_SECONDS

EXIT_FOR = {"succeeded": 0, "failed": 3, "cancelled": 4}
WATCH_SECONDS = 2.0


def create_sweep(client: Client, args, out: Console) -> int | None:
    spec = {**job_spec(args), **read_space(args)}
    options = {
        "algorithm": args.algorithm,
        "seed": args.seed,
        "max_trials": args.max_trials,
        "max_parallel_trials": args.max_parallel_trials,
        "max_failed_trials": args.max_failed_trials,
        "max_duration_seconds": args.max_duration,
        "warm_start_from": args.warm_start,
        "include_defaults": False if args.no_defaults else None,
    }
    spec.update({k: v for k, v in options.items() if v is not None})
    objectives = [
        {"metric": metric, **({"direction": direction} if direction else {})}
        for metric, _, direction in (o.partition(":") for o in args.objective or [])
    ]
    if objectives:
        spec.update({"objective": objectives[0]} if len(objectives) == 1 else {"objectives": objectives})
    if args.serving_precision:
        spec["serving_precision"] = args.serving_precision
    if args.early_stopping:
        spec["early_stopping"] = {**spec.get("early_stopping", {}), "type": args.early_stopping}
    if args.dry_run:
        batching = (spec.get("hyperparameters") or {}).get("batching", "smart")
        show_plan(out, args, client.plan_sweep(spec), sweep_plan_table(batching))
        return None
    sweep = client.create_sweep(spec)
    show(
        out,
        args,
        sweep,
        lambda: (
            f"sweep [bold]{sweep.id}[/] {sweep.status}: {sweep.max_trials} trials of {escape(sweep.base_model)}, "
            f"{sweep.max_parallel_trials} at a time, {_objectives(sweep)}"
        ),
    )
    return watch(client, sweep.id, out) if args.watch else None


def sweep_plan_table(batching: str):
    """The main figures of a sweep's plan (``POST /sweeps?dry_run=true``), then its trial's plan
    (``job_plan_table``: the trials share their data, so one trial's plan is each trial's)."""

    def table(plan: dict) -> Group:
        objective = plan["objective"]
        sweep = fields_table(
            {
                "trials": f"{plan['max_trials']} ({plan['max_parallel_trials']} at a time)",
                "objective": f"{objective['direction']} {objective['metric']}",
                "search space": escape(_space_lines(plan["search_space"])),
                "first trials": escape(
                    "\n".join(", ".join(f"{k}={_value(v)}" for k, v in t.items()) for t in plan["first_trials"])
                ),
            }
        )
        return Group(sweep, "[bold]each trial[/]", job_plan_table(batching)(plan["trial_plan"]))

    return table


def _space_lines(space: dict[str, dict]) -> str:
    """A plan's ``search_space`` one range a line, names aligned, each as a reader would write it:
    ``learning_rate  1e-05 .. 0.001 (log)``, ``batch_size     one of 16, 32``, ``epochs  2 .. 5 (int)``
    (the whole ranges, exact, are in ``--json``)."""
    width = max(map(len, space), default=0)
    return "\n".join(f"{name:<{width}}  {_range(d)}" for name, d in space.items())


def _range(d: dict) -> str:
    """One ``Distribution`` (as JSON) in a few words: ``low .. high`` with ``int``, ``log`` and a
    step other than an int's 1 in parentheses, or ``one of`` the choices."""
    if d["type"] == "categorical":
        return "one of " + ", ".join(v if isinstance(v, str) else json.dumps(v) for v in d["choices"])
    notes = ["int"] if d["type"] == "int" else []
    notes += ["log"] if d["log"] else []
    notes += [f"step {d['step']:g}"] if d["step"] is not None and not (d["type"] == "int" and d["step"] == 1) else []
    return f"{d['low']:g} .. {d['high']:g}" + (f" ({', '.join(notes)})" if notes else "")


def read_space(args) -> dict[str, Any]:
    """``--space FILE`` as ``{"search_space": ...}`` (a file holding ``search_space`` itself, or a
    whole sweep body, is taken as it is); ``{}`` without one."""
    if args.space is None:
        return {}
    import yaml  # PyYAML (a dependency of the project)

    path: Path = args.space
    try:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as e:  # a YAMLError is no ValueError
        raise UsageError(f"--space {path}: {e}") from e
    if not isinstance(data, dict):
        raise UsageError(f"--space {path}: expected an object of hyperparameter ranges")
    return data if "search_space" in data else {"search_space": data}


def list_sweeps(client: Client, args, out: Console) -> None:
    page = client.list_sweeps(args.limit, args.cursor)
    # 80 columns: statuses whole, trials as ended/max, the best without its job (`sweeps get` has both)
    statuses = max([len(s.status) for s in page.data] + [len("status")])
    table = Table(
        Column("id", no_wrap=True, min_width=len("sweep_0123456789abcdef")),
        Column("status", min_width=statuses),
        Column("model", overflow="fold"),
        Column("trials", no_wrap=True),
        Column("best", no_wrap=True),
        Column("age", no_wrap=True),
    )
    for s in page.data:
        ended = sum(n for status, n in s.trials.items() if status not in ("queued", "running"))
        best = f"#{s.best_trial.trial_number} {s.best_trial.value:.4g}" if s.best_trial else "-"
        table.add_row(
            s.id, styled_status(s.status), escape(s.base_model), f"{ended}/{s.max_trials}", best, age(s.created_at)
        )
    if page.next_cursor:
        table.caption = f"more: tunejob sweeps list --cursor {page.next_cursor}"
    show(out, args, page, lambda: table)


def get_sweep(client: Client, args, out: Console) -> None:
    sweep = client.get_sweep(args.sweep_id)
    show(out, args, sweep, lambda: sweep_table(sweep))


def sweep_trials(client: Client, args, out: Console) -> None:
    trials = client.sweep_trials(args.sweep_id)
    if args.json:
        print_json(trials)
    else:
        out.print(trials_table(trials, client.get_sweep(args.sweep_id), out.width))


def watch_sweep(client: Client, args, out: Console) -> int:
    return watch(client, args.sweep_id, out)


def cancel_sweep(client: Client, args, out: Console) -> None:
    sweep = client.cancel_sweep(args.sweep_id)
    out.print(f"sweep {sweep.id}: {styled_status(sweep.status)} ({_counts(sweep)})")


def delete_sweep(client: Client, args, out: Console) -> None:
    client.delete_sweep(args.sweep_id)
    out.print(f"deleted sweep {args.sweep_id} and its trials")


def watch(client: Client, sweep_id: str, out: Console) -> int:
    """Redraw the sweep and its trials every ``WATCH_SECONDS`` until it ends; the exit code of its
    end. Without a terminal (a CI log, a pipe: a redrawn table would print nothing until the end),
    a line when the sweep's status or trial counts change and at most every
    ``PLAIN_EVERY_SECONDS``, then the tables once it ends (as ``client.watch`` does for a job)."""
    live = Live(console=out, auto_refresh=False) if out.is_terminal else None
    said, said_at = "", float("-inf")
    with live or contextlib.nullcontext():
        while True:
            sweep, trials = client.get_sweep(sweep_id), client.sweep_trials(sweep_id)
            tables = Group(sweep_table(sweep), trials_table(trials, sweep, out.width))
            if live is not None:
                live.update(tables, refresh=True)
            elif (line := f"sweep {sweep.id} {sweep.status} · {_counts(sweep)}") != said or (
                time.monotonic() - said_at >= PLAIN_EVERY_SECONDS
            ):
                out.print(f"{line} of {sweep.max_trials} · best {_best(sweep)}")
                said, said_at = line, time.monotonic()
            if sweep.finished_at is not None:
                if live is None:
                    out.print(tables)
                return EXIT_FOR.get(sweep.status, 1)
            time.sleep(WATCH_SECONDS)


def sweep_table(sweep) -> Table:
    """``sweeps get`` (and ``watch``'s head): the sweep's figures a row each, its search space one
    range a line (as ``--dry-run`` prints it, ``_space_lines``), the best and default trials, the
    front, the history and the error."""
    table = Table(show_header=False, box=None)
    space = {name: d.model_dump() for name, d in sweep.search_space.items()}
    for name, value in [
        ("sweep", sweep.id),
        ("status", styled_status(sweep.status)),
        ("model", escape(sweep.base_model)),
        ("objective", _objectives(sweep)),
        ("search", f"{sweep.algorithm}, pruning {sweep.early_stopping}"),
        ("search space", escape(_space_lines(space))),
        ("trials", f"{_counts(sweep)} of {sweep.max_trials} ({sweep.max_parallel_trials} at a time)"),
        ("best", _best(sweep)),
        ("default", _default(sweep)),
    ]:
        table.add_row(f"[bold]{name}[/]", value)
    if len(sweep.objectives) > 1:  # the Pareto front, one trial a line
        front = [
            f"#{p.trial_number} " + ", ".join(f"{o.metric} {_value(v)}" for o, v in zip(sweep.objectives, p.values))
            for p in sweep.pareto_trials
        ]
        table.add_row("[bold]front[/]", "\n".join(front) or "-")
    if sweep.history:  # greyed: the earlier sweeps' trials, not this one's
        h, best = sweep.history, sweep.history.best
        table.add_row(
            "[dim]history[/]",
            f"[dim]{h.trials} trials of {', '.join(h.sweeps)}"
            f"{f', best {best.value:.4g} ({best.job_id})' if best else ''}[/]",
        )
    if sweep.error:
        table.add_row("[bold]error[/]", escape(sweep.error.get("message", "")))
    return table


def trials_table(trials, sweep, width: int | None = None) -> Table:
    """The trials by number: each objective's value, steps, then the parameters that fit in
    ``width`` characters (all without it; the others named in the caption); with several
    objectives a ``front`` column marks the Pareto front's trials (``*``)."""
    names = sorted({name for t in trials for name in t.params})
    metrics = [o.metric for o in sweep.objectives]
    front = {p.trial_number for p in sweep.pareto_trials}
    rows = [
        [
            str(t.number),
            t.job_id,
            t.status,
            *(_value(v) for v in t.values),
            *(["*" if t.number in front else ""] if len(metrics) > 1 else []),
            str(t.steps),
            *(_value(t.params.get(n)) for n in names),
        ]
        for t in trials
    ]
    headers = ["#", "id", "status", *metrics, *(["front"] if len(metrics) > 1 else []), "steps", *names]
    # every value whole (a status, a learning rate); names break after their underscores
    widths = [max([len(r[i]) for r in rows] + [len(max(h.split("_"), key=len))]) for i, h in enumerate(headers)]
    shown = len(headers)
    if width is not None:  # the parameters that fit (a column: its width, padding and a border)
        used = 1 + sum(w + 3 for w in widths[: len(headers) - len(names)])
        shown = len(headers) - len(names)
        while shown < len(headers) and used + widths[shown] + 3 <= width:
            used, shown = used + widths[shown] + 3, shown + 1
    columns = [Column(h.replace("_", "_\n"), overflow="fold", min_width=w) for h, w in zip(headers[:shown], widths)]
    columns[0], columns[1] = Column("#", min_width=1), id_column()
    defaults = [t.number for t in trials if t.default]
    captions = [f"#{defaults[0]}: the default hyperparameters"] if defaults else []
    if left := headers[shown:]:
        captions.append(f"not shown: {', '.join(left)} (--json, or a wider window)")
    table = Table(*columns, caption="; ".join(captions) or None)
    for row in rows:
        table.add_row(*row[:2], styled_status(row[2]), *row[3:shown])
    return table


def _objectives(sweep) -> str:
    return ", ".join(f"{o.direction} {o.metric}" for o in sweep.objectives) + (
        f" (latency at {sweep.serving_precision})" if any(o.metric == "latency_ms" for o in sweep.objectives) else ""
    )


def _counts(sweep) -> str:
    return ", ".join(f"{n} {status}" for status, n in sweep.trials.items() if n) or "none yet"


def _best(sweep) -> str:
    best = sweep.best_trial
    return f"#{best.trial_number} {best.value:.4g} ({best.job_id})" if best else "-"


def _default(sweep) -> str:
    """The default trial (``include_defaults``): its value, for comparing with the best."""
    d = sweep.default_trial
    return f"#{d.number} {_value(d.value)} {styled_status(d.status)} ({d.job_id})" if d else "-"


def _value(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def add_commands(commands, command, quiet, read) -> None:
    """Register ``tunejob sweeps ...`` (``command``, ``quiet`` and ``read`` as in ``client.cli.add_commands``)."""
    sweeps = commands.add_parser(
        "sweeps", help="hyperparameter sweeps: many trials, poor ones pruned, the best kept (client)"
    ).add_subparsers(dest="subcommand", required=True)
    p = command(sweeps, "create", create_sweep, "create a sweep (or plan it: --dry-run)", quiet)
    add_create_arguments(p)
    p.add_argument(
        "--space",
        type=Path,
        metavar="FILE",
        help="a JSON file (or YAML: .yaml, .yml) of {name: {type: float|int|categorical, low, high, log, step, "
        "choices}}; {name: {}} takes tunejob's range for the model's size; without it: tunejob's ranges for "
        "learning_rate, batch_size, warmup_ratio, weight_decay and epochs, those --set leaves out",
    )
    p.add_argument(
        "--objective",
        action="append",
        help="METRIC[:maximize|minimize], e.g. accuracy (default: the jobs' metric_for_best_model, loss or "
        "ndcg@10; default direction: the metric's); repeat it for several objectives (the Pareto front), e.g. "
        "--objective accuracy --objective latency_ms",
    )
    p.add_argument(
        "--serving-precision",
        choices=["fp32", "bf16", "int8"],
        help="the precision latency_ms is measured at (default fp32)",
    )
    p.add_argument("--algorithm", choices=["tpe", "random", "grid"])
    p.add_argument("--seed", type=int)
    p.add_argument("--early-stopping", choices=["asha", "median", "none"])
    p.add_argument("--max-trials", type=int)
    p.add_argument("--max-parallel-trials", type=int)
    p.add_argument("--max-failed-trials", type=int)
    p.add_argument("--max-duration", type=int, metavar="SECONDS", help="a budget for the whole sweep")
    p.add_argument(
        "--warm-start",
        action="append",
        metavar="SWEEP_ID",
        help="an earlier sweep of the same task and model whose finished trials join the study as history (repeatable)",
    )
    p.add_argument(
        "--no-defaults", action="store_true", help="no default trial (trial 0 runs the fixed hyperparameters otherwise)"
    )
    p = command(sweeps, "list", list_sweeps, "the sweeps, newest first", read)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--cursor", help="next_cursor of the previous page")
    command(sweeps, "get", get_sweep, "one sweep: status, trials by status, the best trial", read).add_argument(
        "sweep_id"
    )
    command(
        sweeps, "trials", sweep_trials, "the trials: number, job, parameters, status, value, steps", read
    ).add_argument("sweep_id")
    command(
        sweeps,
        "watch",
        watch_sweep,
        "a live table of the trials until the sweep ends; exit 0 if it "
        "succeeded, 3 if it failed, 4 if it was cancelled",
    ).add_argument("sweep_id")
    command(sweeps, "cancel", cancel_sweep, "cancel a sweep and every trial of it").add_argument("sweep_id")
    command(sweeps, "delete", delete_sweep, "delete an ended sweep and its trials").add_argument("sweep_id")
