"""The pictures of a run inside its model artifact: ``training_curves.png`` (``shared.jobs.curves``) and
TensorBoard event files under ``runs/`` (tensorboardX), so that ``tensorboard --logdir <model>``
on a downloaded model shows the run. Both are drawn from the metric rows the run's reporter gives
(``Reporter.metric_rows``): a stored job's rows in the store, the whole run across restarts (the store
keeps one continuous step series, see ``shared.jobs.lifecycle.discard_metrics_after``); a transient
job's (``MemoryReporter``) the rows it logged, without a database.
"""

import json
import logging
from pathlib import Path

from shared.jobs.curves import MetricRow, render_png, series_of
from shared.store.rows import Job

log = logging.getLogger(__name__)


def write_run_logs(model_dir: Path, job: Job, rows: list[MetricRow]) -> None:
    """Write ``training_curves.png`` and ``runs/events.out.tfevents.*`` into ``model_dir`` from the
    job's metric ``rows`` (all of them, ordered by step). Without rows there are no pictures; the
    model is saved all the same, with a warning in the log.
    """
    try:
        if not rows:
            log.warning("job %s has no metric rows: no training curves in its artifact", job.id)
            return
        (model_dir / "training_curves.png").write_bytes(render_png(series_of(rows), f"{job.id} · {job.base_model}"))
        write_tensorboard(model_dir / "runs", job, rows)
    except Exception:  # the pictures must not cost the job its trained model
        log.exception("training curves of job %s could not be written; the model is saved without them", job.id)


def write_tensorboard(logdir: Path, job: Job, rows: list[MetricRow]) -> None:
    """One TensorBoard event file in ``logdir``: each metric row with a value (not null) as a scalar
    at its optimizer step and wall time, tagged ``train/<name>`` or ``eval/<name>``
    (``tensorboard_tag``), and the job spec as the text ``job/spec``."""
    from tensorboardX import SummaryWriter

    with SummaryWriter(logdir=str(logdir)) as writer:
        writer.add_text("job/spec", f"```\n{json.dumps(job.spec, indent=2)}\n```", 0)
        for step, name, value, time in rows:
            if value is not None:  # null: not finite (left out, as from training_curves.png)
                writer.add_scalar(tensorboard_tag(name), value, step, walltime=time.timestamp())


def tensorboard_tag(name: str) -> str:
    """``eval_accuracy`` -> ``eval/accuracy``; ``train_loss`` -> ``train/loss``; ``learning_rate``
    -> ``train/learning_rate``."""
    if name.startswith("eval_"):
        return "eval/" + name.removeprefix("eval_")
    return "train/" + name.removeprefix("train_")
