"""A sweep's report (``GET /sweeps/{id}/report/{name}``), drawn from its rows when asked, so that it is
never stale and nothing is stored: ``trials.csv`` (the trials table) and matplotlib pictures of
the rebuilt study, ``optimization_history.png``, ``param_importances.png`` and, for a sweep of several
objectives, ``pareto_front.png`` (the pictures of ``optuna.visualization.matplotlib``, drawn without
pyplot; importances by fANOVA, Hutter et al. 2014; the front is ``Study.best_trials``). A warm
start's history (``shared.jobs.search.history``) is drawn in grey on the history and the front as
"earlier sweeps": not trials of this sweep, so off its best-so-far line and its front, as
``GET /sweeps/{id}`` leaves them off its ``best_trial`` and ``pareto_trials``.
"""

import csv
import io
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import optuna
from optuna.trial import FrozenTrial

from shared.errors import NotFound, UserError
from shared.jobs import search, sweeps
from shared.jobs.search_space import distributions
from shared.store.engine import read_session
from shared.store.tenancy import Caller

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAMES = ("trials.csv", "optimization_history.png", "param_importances.png", "pareto_front.png")
WITH_HISTORY = ("optimization_history.png", "pareto_front.png")  # the pictures that draw a warm start's trials
HISTORY_COLOR = "tab:gray"


def report_file(sweep_id: str, name: str, caller: Caller) -> tuple[bytes, str]:
    """The report file ``name`` (one of ``NAMES``) of the caller's sweep, and its media type.

    Raises:
        NotFound: no such sweep (or another tenant's), or no such file. UserError 409
            ``not_enough_trials``: a picture needs a completed trial (importances: two, with different values);
            ``single_objective``: ``pareto_front.png`` of a sweep with one objective.
    """
    if name not in NAMES:
        raise NotFound("report file", name, "report")
    with read_session() as s:
        spec, trials, trial_curves = sweeps.trials_of(s, sweeps.owned_sweep(s, sweep_id, caller))
        more = search.more_curves(s, spec, [t.id for t in trials])
        past = (
            search.history(s, spec, distributions(spec), multi=search.multi_objective(spec))
            if name in WITH_HISTORY
            else []
        )
    if name == "trials.csv":
        return trials_csv(spec, trials, trial_curves, more).encode(), "text/csv"
    if name == "pareto_front.png" and not search.multi_objective(spec):
        raise UserError(
            "single_objective", f"sweep {sweep_id!r} has one objective: no Pareto front", "name", status=409
        )
    study = search.study_of(
        spec, distributions(spec), trials, trial_curves, more=more if name == "pareto_front.png" else None
    )
    completed = [t for t in study.get_trials(deepcopy=False) if t.values is not None]
    if len(completed) < (2 if name == "param_importances.png" else 1) or (
        name == "param_importances.png" and len({t.value for t in completed}) < 2
    ):
        raise UserError(
            "not_enough_trials",
            f"sweep {sweep_id!r} has {len(completed)} completed trials: too few for {name}",
            "name",
            status=409,
        )
    return picture(study, name, tuple(o.metric for o in spec.all_objectives), past), "image/png"


def picture(
    study: optuna.Study,
    name: str,
    labels: tuple[str, ...] = ("objective 0", "objective 1"),
    past: list[FrozenTrial] | None = None,
) -> bytes:
    """The picture ``name`` of ``study`` (``drawing``) as PNG bytes (800 x 500 pixels), rendered by
    the Agg canvas, never through pyplot, whose global state is not thread-safe (the API draws in its
    threads: issue 34)."""
    out = io.BytesIO()
    drawing(study, name, labels, past).savefig(out, format="png")
    return out.getvalue()


def drawing(
    study: optuna.Study,
    name: str,
    labels: tuple[str, ...] = ("objective 0", "objective 1"),
    past: list[FrozenTrial] | None = None,
) -> "Figure":
    """``optimization_history.png`` (each completed trial's value by trial number, and the best so
    far), ``pareto_front.png`` (each completed trial by its first two objectives, ``labels``; the
    front, ``Study.best_trials``, in red) or ``param_importances.png``
    (``optuna.importance.get_param_importances``: fANOVA) of ``study``, on a
    ``matplotlib.figure.Figure`` of one axes. ``past``: a warm start's trials (``search.history``,
    built with ``multi`` for a sweep of several objectives: the trials its study holds), drawn in grey as "earlier sweeps" and counted in neither
    the best so far nor the front; on the history, the completed ones at trial numbers -n to -1 in
    their order (before this sweep's trial 0)."""
    from matplotlib.figure import Figure

    earlier = [t for t in past or [] if t.values is not None]
    figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    axes = figure.subplots()
    if name == "optimization_history.png":
        completed = [(t.number, t.value) for t in study.get_trials(deepcopy=False) if t.value is not None]
        numbers, values = [n for n, _ in completed], [v for _, v in completed]
        better: Callable[[float, float], float] = (
            max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min
        )
        best = list(itertools.accumulate(values, better))
        if earlier:
            axes.scatter(
                range(-len(earlier), 0), [t.values[0] for t in earlier], color=HISTORY_COLOR, label="earlier sweeps"
            )
        axes.scatter(numbers, values, label="objective value")
        axes.plot(numbers, best, color="tab:red", label="best value")
        axes.set(
            title="Optimization history",
            xlabel="trial (earlier sweeps' before 0)" if earlier else "trial",
            ylabel="objective value",
        )
        axes.legend()
    elif name == "pareto_front.png":
        front = {t.number for t in study.best_trials}
        done = [t for t in study.get_trials(deepcopy=False) if t.values is not None]
        for label, color, points in (
            ("earlier sweeps", HISTORY_COLOR, earlier),
            ("trial", "tab:blue", [t for t in done if t.number not in front]),
            ("best trial (the front)", "tab:red", [t for t in done if t.number in front]),
        ):
            if points:
                axes.scatter([t.values[0] for t in points], [t.values[1] for t in points], color=color, label=label)
        axes.set(title="Pareto front", xlabel=labels[0], ylabel=labels[1])
        axes.legend()
    else:
        importances = optuna.importance.get_param_importances(study)
        names = list(importances)[::-1]  # the most important on top
        axes.barh(names, [importances[n] for n in names])
        axes.set(title="Hyperparameter importances (fANOVA)", xlabel="importance")
    return figure


def trials_csv(spec, trials, trial_curves, more) -> str:
    """One row per trial: number, job id, status, each searched hyperparameter, value (the first
    objective's), each further objective's value (``search.values_of``), steps."""
    out = io.StringIO()
    names, others = list(spec.search_space), [o.metric for o in spec.all_objectives[1:]]
    writer = csv.writer(out)
    writer.writerow(["number", "job_id", "status", *names, "value", *others, "steps", "started_at", "finished_at"])
    for t in trials:
        params = search.params_of(t, spec)
        writer.writerow(
            [
                t.trial_number,
                t.id,
                t.status,
                *(params[n] for n in names),
                *search.values_of(trial_curves[t.id], more[t.id], spec),
                t.step,
                t.started_at,
                t.finished_at,
            ]
        )
    return out.getvalue()
