"""A sweep's report (``GET /sweeps/{id}/report/{name}``), drawn from its rows when asked, so that it is
never stale and nothing is stored: ``trials.csv`` (the trials table) and Optuna's matplotlib
pictures of the rebuilt study, ``optimization_history.png`` and ``param_importances.png``
(``optuna.visualization.matplotlib``; importances by fANOVA, Hutter et al. 2014).
"""

import csv
import io
from typing import TYPE_CHECKING, cast

from shared.errors import NotFound, UserError
from shared.jobs import search, sweeps
from shared.store.engine import read_session
from shared.store.tenancy import Caller

if TYPE_CHECKING:  # matplotlib is imported only to draw
    from matplotlib.figure import Figure

NAMES = ("trials.csv", "optimization_history.png", "param_importances.png")


def report_file(sweep_id: str, name: str, caller: Caller) -> tuple[bytes, str]:
    """The report file ``name`` (one of ``NAMES``) of the caller's sweep, and its media type.

    Raises:
        NotFound: no such sweep (or another tenant's), or no such file. UserError 409
            ``not_enough_trials``: a picture needs a completed trial (importances: two, with different values).
    """
    if name not in NAMES:
        raise NotFound("report file", name, "report")
    with read_session() as s:
        spec, trials, trial_curves = sweeps.trials_of(s, sweeps.owned_sweep(s, sweep_id, caller))
    if name == "trials.csv":
        return trials_csv(spec, trials, trial_curves).encode(), "text/csv"
    import matplotlib

    matplotlib.use("Agg")  # no display: draw into memory
    import optuna.visualization.matplotlib as plots

    study = search.study_of(spec, search.distributions(spec), trials, trial_curves, asked=len(trials))
    completed = [t for t in study.get_trials(deepcopy=False) if t.value is not None]
    if len(completed) < (2 if name == "param_importances.png" else 1) or (
            name == "param_importances.png" and len({t.value for t in completed}) < 2):
        raise UserError("not_enough_trials", f"sweep {sweep_id!r} has {len(completed)} completed trials: too few "
                        f"for {name}", "name", status=409)
    draw = plots.plot_optimization_history if name == "optimization_history.png" else plots.plot_param_importances
    axes = draw(study)
    figure = cast("Figure", axes.figure)  # a plot's own figure, never a subfigure
    figure.set_size_inches(8, 5)
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return out.getvalue(), "image/png"


def trials_csv(spec, trials, trial_curves) -> str:
    """One row per trial: number, job id, status, each searched hyperparameter, value, steps."""
    out = io.StringIO()
    names = list(spec.search_space)
    writer = csv.writer(out)
    writer.writerow(["number", "job_id", "status", *names, "value", "steps", "started_at", "finished_at"])
    for t in trials:
        params = search.params_of(t, spec)
        writer.writerow([t.trial_number, t.id, t.status, *(params[n] for n in names),
                         search.best_value(trial_curves[t.id], spec), t.step, t.started_at, t.finished_at])
    return out.getvalue()
