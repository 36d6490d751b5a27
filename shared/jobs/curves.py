"""Training curves of a job, drawn from its metric rows: the API's ``GET /jobs/{id}/plot.png`` and
the artifact's ``training_curves.png`` (see ``worker.run_logs``) are the same picture.

Three panels sharing the step axis: train loss (and validation loss) with the learning rate; the
other validation metrics; real tokens/s with padding efficiency. matplotlib draws it with the
Agg canvas (``Figure`` without pyplot: no GUI backend, safe in the API's threads), and is
imported only when a picture is drawn, so that it costs the API's start-up nothing.
"""

import io
import math
from datetime import datetime

from sqlalchemy import select

from shared.store.engine import read_session
from shared.store.rows import JobMetric

Series = dict[str, tuple[list[int], list[float]]]  # metric name -> (steps, values)
MetricRow = tuple[int, str, float | None, datetime]  # (step, name, value: null if not finite, time)
SCORES = ("accuracy", "f1", "precision", "recall")  # validation metrics in [0, 1] (any averaging: f1_macro, …)
MIN_SPAN = 0.1  # a panel of other metrics spans at least this share of its values' magnitude


def metric_rows(job_id: str) -> list[MetricRow]:
    """The job's metric rows in the store, ordered by step."""
    with read_session() as s:
        rows = s.execute(
            select(JobMetric.step, JobMetric.name, JobMetric.value, JobMetric.time)
            .where(JobMetric.job_id == job_id)
            .order_by(JobMetric.step, JobMetric.id)
        )
        return [(step, name, value, time) for step, name, value, time in rows]


def series_of(rows: list[MetricRow]) -> Series:
    """One (steps, values) series per metric name; non-finite values (a diverged loss: null in the
    store, ``shared.jobs.lifecycle.record_progress``) are left out."""
    series: Series = {}
    for step, name, value, _ in rows:
        if value is not None and math.isfinite(value):
            steps, values = series.setdefault(name, ([], []))
            steps.append(step)
            values.append(value)
    return series


def render_png(series: Series, title: str) -> bytes:
    """The training curves as PNG bytes (about 900 x 1000 pixels)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 10), dpi=100, layout="constrained")
    fig.suptitle(title)
    loss_ax, eval_ax, speed_ax = fig.subplots(3, 1, sharex=True)

    _plot(loss_ax, series, {"train_loss": "train loss", "eval_loss": "validation loss"}, "loss")
    _plot(loss_ax.twinx(), series, {"learning_rate": "learning rate"}, "learning rate", color="tab:gray")
    names = sorted(n for n in series if n.startswith("eval_") and n != "eval_loss")
    _plot(eval_ax, series, {n: n.removeprefix("eval_") for n in names}, "validation")
    if names:
        eval_ax.set_ylim(*panel_range(names, series))
    _plot(speed_ax, series, {"tokens_per_second": "real tokens/s"}, "tokens/s")
    _plot(
        speed_ax.twinx(), series, {"padding_efficiency": "padding efficiency"}, "padding efficiency", color="tab:gray"
    )
    speed_ax.set_xlabel("step (optimizer steps)")

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def panel_range(names: list[str], series: Series) -> tuple[float, float]:
    """The y range of the validation panel, so that a flat result looks flat: [0, 1] (with a small
    margin) when every metric is a score in [0, 1] (accuracy, F1, precision, recall); otherwise the
    values' range, widened to at least ``MIN_SPAN`` of their magnitude (matplotlib's own range
    around a single point is ±0.0005, which makes any difference look dramatic).

    Raises:
        ValueError: none of ``names`` has a value.
    """
    values = [v for n in names for v in series[n][1]]
    lo, hi = min(values), max(values)
    if all(n.removeprefix("eval_").startswith(SCORES) for n in names) and 0 <= lo and hi <= 1:
        return -0.02, 1.02
    span = max(hi - lo, MIN_SPAN * max(abs(lo), abs(hi)), 1e-3)
    middle = (lo + hi) / 2
    return middle - 0.55 * span, middle + 0.55 * span


def _plot(ax, series: Series, labels: dict[str, str], ylabel: str, color: str | None = None) -> None:
    """Draw ``labels``' series on ``ax`` (points for series evaluated now and then, lines for
    per-step ones); a panel with none of them says so."""
    drawn = [n for n in labels if n in series]
    for name in drawn:
        steps, values = series[name]
        style = {"marker": "o", "markersize": 4} if name.startswith("eval_") else {"linewidth": 1}
        ax.plot(steps, values, label=labels[name], **({"color": color} if color else {}), **style)
    ax.set_ylabel(ylabel)
    if drawn:
        ax.legend(loc="upper left" if color is None else "upper right", fontsize="small")
    elif color is None:
        ax.text(0.5, 0.5, f"no {ylabel} metrics yet", ha="center", va="center", transform=ax.transAxes)
