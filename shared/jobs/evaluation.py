"""Evaluation reports (issue 37), as the worker wrote them (``worker.evaluation``): a training job's,
``evaluation.json`` in its model (``GET /jobs/{id}/evaluation``), and a prediction's with a
``label_column``, next to its results (``GET /predictions/{id}/evaluation``). Read through the
object store, so an API host without the files on its disk reads them from the bucket. No torch
here: the API imports this module."""

import json
from pathlib import Path

from shared.errors import Conflict, NotFound, UserError
from shared.jobs.lifecycle import get_job
from shared.jobs.prediction_results import results_dir
from shared.jobs.predictions import KIND
from shared.store import artifacts, objects
from shared.store.tenancy import Caller


def job_evaluation(job_id: str, caller: Caller) -> dict:
    """The report written with a succeeded training job's model, as ``worker.evaluation`` wrote it.

    Raises:
        NotFound, Deleted: see ``shared.jobs.lifecycle.get_job``; ``NotFound`` also for a succeeded
            job without a report (it had no validation rows, or its model was deleted).
        UserError: ``no_evaluation`` (404) for an embedding or reranking job, whose ranking
            figures are its validation metrics.
        Conflict: ``job_not_succeeded`` (409), the job has not succeeded (yet).
    """
    job = get_job(job_id, caller)
    if job.task in ("embedding", "reranking"):
        raise UserError(
            "no_evaluation",
            f"job {job_id!r} is {'an' if job.task == 'embedding' else 'a'} {job.task} job: it has no evaluation report; its retrieval figures are "
            "its validation_metrics (and eval_* metric series)",
            "job_id",
            404,
        )
    if job.status != "succeeded":
        raise Conflict(
            "job_not_succeeded", f"job {job_id!r} is {job.status}: its evaluation report is written when it succeeds"
        )
    report = read_report(artifacts.model_dir(job_id) / artifacts.EVALUATION)
    if report is None:
        raise NotFound("evaluation report of job", job_id)
    return report


def prediction_report_file(prediction_id: str, caller: Caller, name: str = artifacts.EVALUATION) -> Path:
    """A file of the report of a succeeded prediction with a ``label_column`` on this host:
    ``evaluation.json`` or one of its ``figures``.

    Raises:
        NotFound, Deleted: see ``shared.jobs.lifecycle.get_job``; ``NotFound`` also for a
            prediction without a ``label_column`` or a figure its report does not have.
        Conflict: ``prediction_not_succeeded`` (409); ``results_deleted`` (409) once its files were
            removed (``TUNEJOB_ARTIFACT_RETENTION_DAYS``).
    """
    job = get_job(prediction_id, caller, kind=KIND)
    if not job.spec.get("label_column"):
        raise UserError(
            "no_evaluation",
            f"prediction {prediction_id!r} was made without a label_column: it has no evaluation report",
            "prediction_id",
            404,
        )
    if job.status != "succeeded":
        raise Conflict(
            "prediction_not_succeeded",
            f"prediction {prediction_id!r} is {job.status}: its evaluation report is written when it succeeds",
        )
    store = objects.store()
    path = store.local(store.ref(results_dir(prediction_id) / name)) if job.files_deleted_at is None else None
    if path is None and name == artifacts.EVALUATION:
        raise Conflict(
            "results_deleted",
            f"prediction {prediction_id!r}: its results were deleted (TUNEJOB_ARTIFACT_RETENTION_DAYS)",
        )
    if path is None:
        raise NotFound(f"figure of prediction {prediction_id!r}", name)
    return path


def prediction_evaluation(prediction_id: str, caller: Caller) -> dict:
    """The report of a succeeded prediction's labelled test set (``prediction_report_file``)."""
    return json.loads(prediction_report_file(prediction_id, caller).read_text())


def read_report(path: Path) -> dict | None:
    """The report at ``path`` (under the data directory), read here or from the bucket; None if absent."""
    store = objects.store()
    local = store.local(store.ref(path))
    return json.loads(local.read_text()) if local is not None else None
