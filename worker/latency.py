"""A sweep trial's ``latency_ms`` objective, measured by the worker once the trial's model is saved
(``shared.inference.latency``: the sync predict code at the sweep's ``serving_precision``, on the
first validation texts) and stored as the metric ``eval_latency_ms`` at the trial's last step, the
row the sweep's study reads (``shared.jobs.search.more_curves``) when the trial ends."""

from pathlib import Path

import torch

from shared.data.columns import JobColumns
from shared.inference.latency import REPEATS, TEXTS, latency_ms
from shared.jobs import sweeps
from shared.schemas.sweeps import LATENCY
from worker.data import JobData
from worker.reporter import Reporter


def record_latency(
    job, data: JobData, model_dir: Path, device: torch.device, reporter: Reporter, step: int, epoch: float
) -> float | None:
    """Measure and store the saved model's latency if ``job`` is a trial of a sweep with a
    ``latency_ms`` objective; returns it (None otherwise).

    Raises:
        UserError: the model cannot be loaded at the sweep's precision (e.g. int8 on a GPU).
    """
    precision = sweeps.serving_precision(job.sweep_id) if job.sweep_id else None
    if precision is None:
        return None
    frame = (data.validation if data.validation is not None and len(data.validation) else data.train).head(TEXTS)
    cols = JobColumns.of(job.spec)
    texts = [v if isinstance(v, str) else " ".join(map(str, v)) for v in frame[cols.text]]  # tokens: joined
    pairs = [str(v) for v in frame[cols.text_pair]] if cols.text_pair else None
    value = latency_ms(model_dir, device, precision, texts, pairs)
    reporter.log(step, epoch, {f"eval_{LATENCY}": value})
    reporter.flush()
    reporter.event(
        LATENCY,
        f"latency_ms {value:.2f}: the median of {REPEATS} predictions of {len(texts)} validation texts at {precision}",
    )
    return value
