"""A labelled test set scored by a prediction job (``label_column``, issue 37): its labels are read
and checked as the model's training job read its own (``shared.data.columns.JobColumns``: class
names, ``multi_label`` lists split by the job's ``label_separator``, regression targets), so that
the report's metrics are the validation report's (``worker.evaluation``).

Labels the model does not know are found at submit, when the whole label column is read anyway:
the request is refused (422 ``unknown_labels``, naming each with its first row) unless it sets
``count_unknown_labels``; then their rows are scored and counted as errors, as ``trainer.evaluate``
counts them. No torch here: the API imports this module.
"""

from shared.data.columns import JobColumns
from shared.data.labels import scan_job_data
from shared.errors import UserError
from shared.schemas.predictions import PredictionCreate
from shared.store import objects
from shared.store.engine import read_session
from shared.store.rows import Dataset, Job

REPORTED = ("classification", "multi_label", "regression")  # token_classification: predictions read raw text


def check_task(spec: PredictionCreate, task: str) -> None:
    """Refuse a ``label_column`` for a model whose report a prediction cannot compute.

    Raises:
        UserError: ``unsupported_task`` (422, naming ``label_column``) for a token_classification model.
    """
    if spec.label_column is not None and task not in REPORTED:
        raise UserError(
            "unsupported_task",
            f"model {spec.model!r} is {'an' if task[0] in 'aeiou' else 'a'} {task} model: a label_column is scored for "
            f"{', '.join(REPORTED)} models only"
            + (" (predictions read raw text, not tagged words)" if task == "token_classification" else ""),
            "label_column",
        )


def gold_columns(spec: PredictionCreate, task: str, model_ref: str) -> JobColumns:
    """The columns of a prediction's test set, its labels read with the ``label_separator`` and
    ``allow_large_targets`` of the model's training job (``model_ref``; a base model: the defaults)."""
    with read_session() as s:
        model_job = s.get(Job, model_ref) if model_ref.startswith("job_") else None
        trained = JobColumns.of(model_job.spec) if model_job is not None else None
    return JobColumns(
        task,
        spec.text_column,
        spec.text_pair_column,
        spec.label_column,
        trained.allow_large_targets if trained else False,
        trained.label_separator if trained else None,
    )


def check_gold_labels(
    spec: PredictionCreate, dataset: Dataset, task: str, model_ref: str, label_names: list[str] | None
) -> list[str]:
    """Read and check the label column of a prediction's dataset (every row, as a training job's
    labels are checked). Returns the labels the model does not know (``count_unknown_labels``
    allowed them), in the dataset's class order.

    Raises:
        UserError (422, naming ``label_column``): the validation report of unusable label cells
            (row, column, value); ``unknown_labels``, naming each unknown label and its first row,
            unless ``spec.count_unknown_labels``.
    """
    cols = gold_columns(spec, task, model_ref)
    summary = scan_job_data(objects.dataset_file(dataset), dataset.format, dataset.filename, cols)
    if label_names is None:  # regression
        return []
    unknown = [name for name in summary.names or [] if name not in label_names]
    if unknown and not spec.count_unknown_labels:
        named = ", ".join(f"{name!r} (first in row {summary.first_row[name]})" for name in unknown[:20])
        raise UserError(
            "unknown_labels",
            f"{dataset.filename!r}: label column {spec.label_column!r} holds labels "
            f"model {spec.model!r} does not know: {named}{' ...' if len(unknown) > 20 else ''}; it knows "
            f"{label_names}. Fix the labels, or set count_unknown_labels to score those rows as errors",
            "label_column",
        )
    return unknown
