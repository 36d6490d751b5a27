"""The prediction recipe for one job (kind ``predict``), top to bottom: setup (the model and the
data), score_parts (the dataset streamed a part at a time, each part scored with
``shared.inference.loop.predict_texts``, or embedded with ``shared.inference.embed.embed_texts`` for
an embedding model, and written atomically), finish (the result summary and, with a ``label_column``,
the test set's evaluation report: ``evaluate_test_set``). Memory holds one part's rows and results
(``predict_part_rows``), however large the dataset.

A resumed attempt (the worker died, or was shut down) skips the rows of the parts already written
(``shared.jobs.predictions``: their counts are in the parts' metadata), so no row is scored or written
twice. Cancel, shutdown, lease loss and the time limit are checked between parts
(``worker.reporter.Reporter.should_stop``).
"""

import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch

from shared.data.labels import read_job_table
from shared.data.problems import Problems
from shared.errors import UserError
from shared.inference.embed import LoadedEmbedder, embed_texts, load_embedder
from shared.inference.int8 import Int8Model
from shared.inference.loop import LoadedModel, ModelCache, load_for_inference, predict_texts
from shared.jobs.base_models import resolve_model
from shared.jobs.gold import gold_columns
from shared.jobs.prediction_results import (
    PART_COUNTS,
    embedding_table,
    id_type,
    part_counts,
    result_tables,
    results_dir,
    results_table,
    write_part,
    written_parts,
)
from shared.jobs.predictions import PredictionBatch, max_tokens, parts_of, prediction_batches
from shared.schemas.predictions import PredictionCreate
from shared.settings import get_settings
from shared.store import artifacts, objects, quotas
from shared.store.engine import read_session
from shared.store.rows import Dataset, Job
from worker.device import describe
from worker.evaluation import sequence_report, write_report
from worker.reporter import Reporter

INT8_WAYS = {
    "compiled": "int8: torchao PT2E dynamic quantization compiled by inductor, under bf16 autocast",
    "eager": "int8: eager dynamic quantization of the Linear layers (torch.ao quantize_dynamic)",
}


@dataclass
class Scoring:
    """Everything ``setup`` builds for one prediction job, and its counts so far (``PART_COUNTS``)."""

    job: Job
    spec: PredictionCreate
    loaded: LoadedModel | LoadedEmbedder
    dataset: Dataset
    directory: Path  # where its parts are written
    parts: int  # parts written (by earlier attempts, then this one)
    counts: dict[str, int]
    files_bytes: int  # of the parts written (the tenant's storage quota counts them as they come)
    started: float = 0.0  # perf_counter when this attempt started scoring
    scored: dict[str, int] | None = None  # counts of this attempt (for its rates)


def predict(job: Job, device: torch.device, reporter: Reporter) -> str:
    """Score every row of the job's dataset with its model, resuming after the parts already written.

    Returns ``"succeeded"``, or why it stopped early (``Reporter.should_stop``).

    Raises:
        shared.errors.UserError: the model is gone or cannot predict, or the data no longer passes
            the checks it passed at submit (the job fails without retry).
    """
    run = setup(job, device, reporter)
    outcome = score_parts(run, reporter)
    if outcome != "completed":
        if outcome != "lease_lost":
            reporter.flush()
        return outcome
    finish(run, reporter)
    return "succeeded"


def model_directory(ref: str) -> Path:
    """The directory of the model a prediction names: a training job's artifact, or a base model.

    Raises:
        UserError: ``model_deleted`` when the job's model was deleted after the prediction was queued.
    """
    if not ref.startswith("job_"):
        return resolve_model(ref)
    directory = artifacts.local_model(ref)
    if directory is None:
        raise UserError("model_deleted", f"model {ref!r}: the training job's model was deleted", "model")
    return directory


_model_caches: dict[str, ModelCache] = {}  # by device and kind


def model_cache(device: torch.device, embedding: bool = False) -> ModelCache:
    """The prediction models this worker keeps on ``device`` (``TUNEJOB_WORKER_MODEL_CACHE``), so
    that a model's next prediction job loads nothing and compiles nothing (int8's compiled model
    is kept with it); ``embedding``: the embedding models' cache (``load_embedder``)."""
    key = f"{device}|{'embedding' if embedding else 'head'}"
    if key not in _model_caches:
        _model_caches[key] = ModelCache(
            max(1, get_settings().worker_model_cache), device, load=load_embedder if embedding else load_for_inference
        )
    return _model_caches[key]


def release_models() -> None:
    """Drop the cached prediction models (a training job on CUDA needs the memory)."""
    for cache in _model_caches.values():
        cache.clear()


def setup(job: Job, device: torch.device, reporter: Reporter) -> Scoring:
    """Load the model on ``device`` (or take it from the worker's ``model_cache``) and find the
    parts an earlier attempt wrote."""
    start = time.perf_counter()
    spec = PredictionCreate.model_validate(job.spec)
    directory, cache = model_directory(job.base_model), model_cache(device, job.task == "embedding")
    key = f"{directory}|{spec.precision}"
    cached = key in cache.keys()
    loaded = cache.get(key, directory, spec.precision).loaded
    if isinstance(loaded.model, Int8Model):
        reporter.event(
            "int8",
            INT8_WAYS[loaded.model.way]
            + (f" (the compiled model failed: {loaded.model.fallback})" if loaded.model.fallback else "")
            + (" (kept loaded by this worker since an earlier job: not compiled again)" if cached else ""),
            level="warning" if loaded.model.fallback else "info",
        )
    with read_session() as s:
        dataset = s.get(Dataset, job.training_dataset_id)
    directory = results_dir(job.id)
    parts = written_parts(directory)
    files_bytes = (quotas.artifacts_bytes(job.id) or 0) if parts else 0
    run = Scoring(job, spec, loaded, dataset, directory, len(parts), part_counts(parts), files_bytes)
    if parts:
        reporter.event("resumed", f"resuming after {run.counts['rows']} rows already written in {len(parts)} parts")
    reporter.progress(
        device=describe(device),
        step=run.counts["rows"],
        timings={**(job.timings or {}), "load": round(time.perf_counter() - start, 3)},
    )
    return run


def score_parts(run: Scoring, reporter: Reporter) -> str:
    """Score the rows after those already written, ``predict_part_rows`` at a time; write each
    part, then report progress. Returns ``"completed"`` or why it stopped."""
    problems = Problems(run.dataset.filename)
    batches = prediction_batches(run.dataset, run.spec, problems)
    run.started, run.scored = time.perf_counter(), dict.fromkeys(PART_COUNTS, 0)
    max_length = run.spec.max_length  # resolved at submit (shared.jobs.predictions.stored_spec)
    for part in parts_of(batches, get_settings().predict_part_rows, run.counts["rows"]):
        problems.raise_if_any()  # the file changed since the job was submitted
        if reason := reporter.should_stop():
            return reason
        table, counts = score_part(run, part, max_length)
        run.files_bytes += write_part(run.directory, run.parts, table, counts)
        run.parts += 1
        for name in PART_COUNTS:
            run.counts[name] += counts[name]
            run.scored[name] += counts[name]
        report_progress(run, reporter)
    problems.raise_if_any()
    return "completed"


def score_part(run: Scoring, part: PredictionBatch, max_length: int) -> tuple[pa.Table, dict[str, int]]:
    """One part's results table and its ``PART_COUNTS``: vectors from an embedding model, else the
    rows of its task."""
    if isinstance(run.loaded, LoadedEmbedder):
        embedded = embed_texts(run.loaded, part.texts, max_length=max_length, batch_size=run.spec.batch_size)
        return embedding_table(part.ids, embedded.vectors, id_type(run.job.spec)), {
            "rows": len(part.texts),
            "truncated": embedded.truncated,
            "tokens": embedded.real_tokens,  # as predict_texts counts them: computed, after truncation
            "padded_tokens": embedded.padded_tokens,
        }
    predictions = predict_texts(
        run.loaded, part.texts, part.pairs, max_length, max_tokens(run.spec.batch_size, max_length)
    )
    table = results_table(part.ids, run.loaded.task, run.loaded.label_names, predictions.rows, id_type(run.job.spec))
    return table, {
        "rows": len(part.texts),
        "truncated": predictions.truncated,
        "tokens": predictions.tokens,
        "padded_tokens": predictions.padded_tokens,
    }


def result(run: Scoring) -> dict:
    """The job's ``PredictionResult``: the counts so far, with this attempt's rates."""
    seconds = max(time.perf_counter() - run.started, 1e-9)
    counts = run.counts
    return {
        **counts,
        "max_length": run.spec.max_length,
        "padding_efficiency": counts["tokens"] / counts["padded_tokens"] if counts["padded_tokens"] else None,
        "tokens_per_second": run.scored["tokens"] / seconds if run.scored["rows"] else None,
        "rows_per_second": run.scored["rows"] / seconds if run.scored["rows"] else None,
    }


def report_progress(run: Scoring, reporter: Reporter) -> None:
    """Rows done, rows/s and ETA on the job row (buffered, as training's progress)."""
    summary = result(run)
    left = (run.job.total_steps or 0) - run.counts["rows"]
    eta = left / summary["rows_per_second"] if summary["rows_per_second"] else None
    reporter.progress(step=run.counts["rows"], eta_seconds=eta, train_metrics=summary, files_bytes=run.files_bytes)


def finish(run: Scoring, reporter: Reporter) -> None:
    """Write the final result and say what was truncated."""
    summary = result(run)
    reporter.progress(step=run.counts["rows"], total_steps=run.counts["rows"], eta_seconds=0.0, train_metrics=summary)
    reporter.flush()
    reporter.event(
        "results",
        f"{summary['rows']} rows scored; {summary['truncated']} texts longer than "
        f"max_length {run.spec.max_length} were truncated",
    )
    if run.spec.label_column is not None:
        evaluate_test_set(run, reporter)


def evaluate_test_set(run: Scoring, reporter: Reporter) -> dict:
    """The evaluation report of a labelled test set (``worker.evaluation.sequence_report``, the
    validation report's metrics), computed from the written results (every part, those of earlier
    attempts too) and the dataset's labels read as the model's training job read its own
    (``shared.jobs.gold``); written next to the results as ``evaluation.json`` with its pictures,
    each published. Labels the model does not know (``count_unknown_labels``) count as errors and
    are named in an event and in the report's ``unknown_labels``. Returns the report."""
    cols = gold_columns(run.spec, run.loaded.task, run.job.base_model)
    assert cols.label is not None  # the spec has a label_column
    table, _ = read_job_table(objects.dataset_file(run.dataset), run.dataset.format, run.dataset.filename, cols)
    rows = [row for part in result_tables(written_parts(run.directory)) for row in part.to_pylist()]
    report = sequence_report(
        run.loaded.task,
        run.loaded.label_names,
        table[cols.label].tolist(),
        rows,
        table[cols.text].tolist(),
        run.loaded.decision_threshold,
    )
    report = write_report(run.directory, report)
    for name in [artifacts.EVALUATION, *report["figures"]]:
        objects.store().publish(run.directory / name)
    figures = ", ".join(f"{k} {v:.4f}" for k, v in report["metrics"].items() if v is not None)
    unknown = report.get("unknown_labels") or []
    counted = f"; labels the model does not know, counted as errors: {', '.join(map(repr, unknown))}" if unknown else ""
    reporter.event(
        "evaluation",
        f"test set report on {report['rows']} rows: {figures}{counted}",
        level="warning" if unknown else "info",
    )
    return report
