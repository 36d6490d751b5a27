r"""Batch prediction jobs (job kind ``predict``): checking a request, storing it as a job, planning it.
Its results on disk and their download stream: ``shared.jobs.prediction_results``.

A prediction is a job like a training job: same row, same lifecycle (``shared.jobs``: claim,
lease, heartbeat, progress, events, cancel, resume), same queue. Its columns are used as:
``base_model`` the model as given (``job_…`` or a base model name; for an alias, the job id it
named at submit), ``task`` that model's task,
``training_dataset_id`` the dataset scored, ``spec`` the ``PredictionCreate`` body,
``label_names`` the model's classes, ``step``/``total_steps`` rows written/rows in the dataset,
``train_metrics`` the result (``PredictionResult``).

No torch here: the API imports this module (the tokenizer only for a dry run).
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.data.batching import bucket_width, job_ladder, token_budget_batches
from shared.data.columns import check_text
from shared.data.formats import MAX_PROBLEMS
from shared.data.problems import Problems
from shared.data.read import read_batches
from shared.errors import UserError, without_paths
from shared.inference.heads import task_of
from shared.jobs import aliases
from shared.jobs.base_models import TRANSFORMERS_IMPORT, resolve_model
from shared.jobs.gold import check_gold_labels, check_task
from shared.jobs.lifecycle import admission, insert_queued
from shared.jobs.models import trained_model
from shared.jobs.planning import (
    TOKENIZE_ROWS,
    RowSample,
    estimate_seconds,
    max_input_length,
    sample_note,
    token_counts,
    visible_dataset,
)
from shared.schemas.jobs import Timings
from shared.schemas.predictions import (
    PredictionCreate,
    PredictionOut,
    PredictionProgress,
    PredictionResult,
)
from shared.settings import get_settings
from shared.store import idempotency, objects
from shared.store.engine import read_session
from shared.store.rows import Dataset, Job, JobStatus, new_id, utcnow
from shared.store.tenancy import Caller

KIND = "predict"
TASKS = ("classification", "regression", "multi_label", "token_classification", "embedding")


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class PredictionModel:
    """The model a prediction uses: ``ref`` (a job id, an alias resolved, or a base model's name),
    its directory, task, classes and longest input (tokens)."""

    ref: str
    directory: Path
    task: str
    label_names: list[str] | None
    limit: int | None


def head_of(directory: Path, name: str) -> tuple[str, list[str] | None]:
    """(task, class or tag names in logit order, None for regression) of a model directory, from
    its config (``transformers.AutoConfig``), as ``shared.inference`` will load it (``task_of``).

    Raises:
        UserError (422, naming ``model``): ``unsupported_model`` when its config cannot be read;
            ``model_without_head`` when it has no head (a plain encoder such as all-MiniLM-L6-v2);
            ``unsupported_task`` for another head (question answering, ...).
    """
    with TRANSFORMERS_IMPORT:
        from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UserError(
            "unsupported_model", f"model {name!r} cannot be loaded: {without_paths(str(e))}", "model"
        ) from None
    try:
        task = task_of(config)
    except ValueError as e:
        architectures = config.architectures or []
        if not any("For" in a for a in architectures):
            raise UserError(
                "model_without_head",
                f"model {name!r} has no classification or regression head "
                f"({', '.join(architectures) or 'no architecture'}): fine-tune it with POST /jobs, "
                "then predict with the job's id",
                "model",
            ) from None
        raise UserError("unsupported_task", f"model {name!r} cannot be used for predictions: {e}", "model") from None
    return task, [config.id2label[i] for i in range(config.num_labels)] if task != "regression" else None


def prediction_model(ref: str, caller: Caller) -> PredictionModel:
    """The model ``ref`` names: a succeeded training job of ``caller``'s tenant (``job_…``, or one
    of the tenant's aliases: ``shared.jobs.aliases.resolve``), else a base model (``shared.jobs.base_models``).

    Raises:
        UserError (naming ``model``): ``unknown_model`` (404 for a job id that does not exist or is
            another tenant's, 422 for an unknown base model name), ``model_deleted`` (404),
            ``model_not_ready`` (409) for a job that has not succeeded, ``model_files_deleted``
            (409), ``model_without_head`` and ``unsupported_task`` (422).
    """
    ref = aliases.resolve(ref, caller)
    if not ref.startswith("job_"):
        try:
            directory = resolve_model(ref)
        except UserError as e:
            raise UserError(e.code, e.message.replace("base_model", "model"), "model") from None
        task, names = head_of(directory, ref)
        return PredictionModel(ref, directory, task, names, max_input_length(directory))
    job, directory = trained_model(ref, caller)
    if job.task not in TASKS:
        raise UserError(
            "unsupported_task",
            f"model {ref!r} was trained for {job.task}; predictions support {', '.join(TASKS)}",
            "model",
        )
    limit = embedding_limit(directory) if job.task == "embedding" else max_input_length(directory)
    return PredictionModel(ref, directory, job.task, job.label_names, limit)


def embedding_limit(directory: Path) -> int | None:
    """An embedding model's longest input in tokens: its ``max_seq_length``
    (``sentence_bert_config.json``, the job's ``max_length``), as ``SentenceTransformer`` loads it."""
    try:
        return json.loads((directory / "sentence_bert_config.json").read_text())["max_seq_length"]
    except (OSError, ValueError, KeyError):
        return max_input_length(directory)


# ----------------------------------------------------------------------------- the data


@dataclass
class PredictionBatch:
    """Consecutive checked rows of the dataset scored: ``start`` is the 0-based index of the first;
    ``ids`` the ``id_column`` values as text, or the row indices."""

    start: int
    texts: list[str]
    pairs: list[str] | None
    ids: list


def _columns(spec: PredictionCreate) -> list[tuple[str, str]]:
    """(column, request field) of each column a prediction reads and scores (its ``label_column``
    is read by ``shared.jobs.gold``)."""
    return [
        (c, f)
        for c, f in [
            (spec.text_column, "text_column"),
            (spec.text_pair_column, "text_pair_column"),
            (spec.id_column, "id_column"),
        ]
        if c is not None
    ]


def prediction_batches(dataset: Dataset, spec: PredictionCreate, problems: Problems) -> Iterator[PredictionBatch]:
    """Read and check the columns a prediction uses, batch by batch (``shared.data.read.read_batches``):
    texts must be non-empty strings (as for training; a list of words, such as a token
    classification dataset's words column, is refused too: ``_text_problem``), ids present scalars.
    Problems go to ``problems`` (the caller raises them); no batch is yielded after the first one."""
    columns = _columns(spec)
    texts = tuple(c for c, param in columns if param != "id_column")  # Parquet lists read, to be named
    for batch in read_batches(
        objects.dataset_file(dataset),
        dataset.format,
        dataset.filename,
        [c for c, _ in columns],
        problems,
        list_columns=texts,
    ):
        for column, param in columns:
            check = _id_problem if param == "id_column" else _text_problem
            for i, value in enumerate(batch.values[column]):
                if (message := check(value)) is not None:
                    code = "missing_value" if message in ("is missing", "is empty") else f"invalid_{param[:-7]}"
                    problems.add(batch.start + i + 1, column, value, message, code, param)
        if problems.items:
            continue  # keep reading to report up to MAX_PROBLEMS, but hand out no data
        ids = (
            [_id_text(v) for v in batch.values[spec.id_column]]
            if spec.id_column
            else list(range(batch.start, batch.start + batch.size))
        )
        yield PredictionBatch(
            batch.start,
            batch.values[spec.text_column],
            batch.values[spec.text_pair_column] if spec.text_pair_column else None,
            ids,
        )


class RepeatedIds:
    """Finds ``id_column`` values that more than one row holds, in bounded memory: each id kept as
    a 64-bit hash (``pandas.util.hash_array``) with its row, 16 bytes a row (1.5 million rows:
    24 MB), compared once every batch is read. Results are named by id (OpenAI's batch API refuses
    a repeated ``custom_id`` too). Two different ids share a hash with odds of about n² / 2^65
    (6e-8 at 1.5 million rows)."""

    def __init__(self) -> None:
        self.hashes: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []

    def add(self, batch: PredictionBatch) -> None:
        import pandas as pd

        self.hashes.append(pd.util.hash_array(np.asarray(batch.ids, dtype=object)))
        self.rows.append(np.arange(batch.start, batch.start + len(batch.ids)))

    def report(self, problems: Problems, column: str) -> None:
        """Each row (the first ``MAX_PROBLEMS``) whose id an earlier row holds, as a problem naming
        that row (``duplicate_id``, 1-based rows as every report)."""
        if not self.hashes:
            return
        hashes, rows = np.concatenate(self.hashes), np.concatenate(self.rows)
        order = np.argsort(hashes, kind="stable")  # a hash's rows in row order
        hashes, rows = hashes[order], rows[order]
        new = np.r_[True, hashes[1:] != hashes[:-1]]
        first = rows[new][np.cumsum(new) - 1]  # each row's first row with its id
        repeats = np.flatnonzero(~new)
        for i in repeats[np.argsort(rows[repeats], kind="stable")][:MAX_PROBLEMS]:  # the earliest rows
            message = f"repeats the id of row {first[i] + 1}: results are named by id, so ids must differ"
            problems.add(int(rows[i]) + 1, column, None, message, "duplicate_id", "id_column")


def _text_problem(value) -> str | None:
    """What is wrong with a text cell (``check_text``), a list said to be one (CoNLL's ``tokens``)."""
    if isinstance(value, (list, tuple)):
        return (
            "holds a list, not text: predictions read raw text, one string a row (for a list of words, "
            "join them with spaces)"
        )
    return check_text(value)


def _id_problem(value) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return "is missing"
    if isinstance(value, (dict, list, tuple, bytes, float)):
        return "holds a nested, binary or float value; ids are text or integers"
    return None


def _id_text(value) -> str:
    """An id as text, as a CSV cell holds it (a JSON ``true`` is ``true``)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def parts_of(batches: Iterator[PredictionBatch], size: int, skip: int = 0) -> Iterator[PredictionBatch]:
    """The rows of ``batches`` after the first ``skip``, regrouped ``size`` rows at a time (the
    last group may be smaller)."""
    texts, pairs, ids, start = [], [], [], skip
    for batch in batches:
        cut = max(0, skip - batch.start)
        texts += batch.texts[cut:]
        pairs += (batch.pairs or [])[cut:]
        ids += batch.ids[cut:]
        taken = 0
        while len(texts) - taken >= size:
            end = taken + size
            yield PredictionBatch(start, texts[taken:end], pairs[taken:end] or None, ids[taken:end])
            taken, start = end, start + size
        texts, pairs, ids = texts[taken:], pairs[taken:], ids[taken:]
    if texts:
        yield PredictionBatch(start, texts, pairs or None, ids)


# ----------------------------------------------------------------------------- submit and plan


@dataclass
class CheckedPrediction:
    """A prediction request that passed ``check_prediction``, with what was loaded to check it."""

    spec: PredictionCreate
    model: PredictionModel
    dataset: Dataset
    max_length: int
    caller: Caller


def check_prediction(spec: PredictionCreate, caller: Caller) -> CheckedPrediction:
    """Check a request against its model and data before anything is stored or queued, reading
    the data in batches.

    Raises:
        UserError: see ``prediction_model``; ``max_length_too_long`` (422) beyond the model's limit;
            ``invalid_text_pair_column`` (422) for a token_classification model (one text a row);
            ``unknown_dataset`` (422); ``missing_column`` (422, naming the field and the column); a
            validation report of unusable cells (``missing_value``, ``invalid_text``, ``invalid_id``,
            ``duplicate_id``: ``RepeatedIds``);
            with a ``label_column``, ``shared.jobs.gold.check_gold_labels``'s.
    """
    model = prediction_model(spec.model, caller)
    if spec.text_pair_column and model.task in ("token_classification", "embedding"):
        raise UserError(
            "invalid_text_pair_column",
            f"model {spec.model!r} is {'an' if model.task == 'embedding' else 'a'} {model.task} model: it reads one "
            "text a row; leave text_pair_column out",
            "text_pair_column",
        )
    if model.task == "embedding" and spec.precision not in ("auto", "fp32"):
        raise UserError(
            "invalid_precision",
            f"model {spec.model!r} is an embedding model: embeddings are computed in fp32, not {spec.precision}",
            "precision",
        )
    check_task(spec, model.task)
    if spec.max_length and model.limit and spec.max_length > model.limit:
        raise UserError(
            "max_length_too_long",
            f"max_length {spec.max_length} is longer than model {spec.model!r} accepts ({model.limit} tokens)",
            "max_length",
        )
    with read_session() as s:
        dataset = visible_dataset(s, spec.dataset, "dataset", caller)
    for column, param in _columns(spec) + ([(spec.label_column, "label_column")] if spec.label_column else []):
        if column not in dataset.columns:
            raise UserError(
                "missing_column",
                f"column {column!r} ({param}) not found in {dataset.filename!r}; its columns are {dataset.columns}",
                param,
            )
    problems, repeated = Problems(dataset.filename), RepeatedIds()
    for batch in prediction_batches(dataset, spec, problems):
        if spec.id_column:
            repeated.add(batch)
    repeated.report(problems, spec.id_column or "")
    problems.raise_if_any()
    if spec.label_column is not None:
        check_gold_labels(spec, dataset, model.task, model.ref, model.label_names)
    return CheckedPrediction(spec, model, dataset, spec.max_length or model.limit or 512, caller)


def create_prediction(spec: PredictionCreate, caller: Caller, claim: idempotency.Claim | None = None) -> Job:
    """Check a request (``check_prediction``) and insert it as a ``queued`` job of kind ``predict``
    for the caller's tenant; with an idempotency ``claim``, its response is recorded in the same
    transaction. The caller enqueues the job id once this returns.

    Raises:
        UserError: see ``check_prediction``; ``unknown_dataset`` or ``model_deleted`` if the dataset
            or the model's job was deleted while it was checked; 429 ``too_many_active_jobs`` and 413
            ``storage_quota_exceeded``.
    """
    received = utcnow()
    checked = check_prediction(spec, caller)
    with admission(caller) as s:
        # Locked against a concurrent DELETE /datasets/{id} (DELETE /jobs/{id} of the model), which
        # locks it to check for active jobs.
        row = s.get(Dataset, checked.dataset.id, with_for_update={"read": True}, populate_existing=True)
        if row is None or row.deleted_at is not None:
            raise UserError("unknown_dataset", f"dataset {spec.dataset!r} was deleted", "dataset")
        model_job = s.get(Job, checked.model.ref, with_for_update={"read": True}, populate_existing=True)
        if model_job is not None and model_job.deleted_at is not None:
            raise UserError("model_deleted", f"model {spec.model!r} was deleted", "model", 404)
        job = Job(
            id=new_id("job"),
            tenant=caller.tenant,
            kind=KIND,
            base_model=checked.model.ref,  # an alias resolved
            task=checked.model.task,
            training_dataset_id=row.id,
            spec=stored_spec(checked),
            label_names=checked.model.label_names,
            total_steps=row.rows,
            created_at=received,
        )
        return insert_queued(s, job, "prediction created and queued", claim, to_out)


def stored_spec(checked: CheckedPrediction) -> dict:
    """The request as the job stores it: ``max_length`` resolved (the model's limit when not given),
    so that the plan, the worker and the job's view use one number."""
    return checked.spec.model_copy(update={"max_length": checked.max_length}).model_dump(mode="json")


def plan_prediction(checked: CheckedPrediction) -> dict:
    """What a prediction will compute, from its tokenized texts (``PredictionPlan``): rows, real
    tokens after truncation, texts truncated, padded tokens with each part's texts batched as a
    CPU worker batches them (a CUDA worker pads to the bucket ladder: a little more), padding
    efficiency, and an estimated duration from the newest succeeded prediction on the same model
    (None when there is none). A file of more than ``TUNEJOB_DRY_RUN_ROWS`` rows is planned from
    a random sample of them (``planning.RowSample``), the counts scaled to the whole, and the
    plan says so (``sampled_rows``, ``notes``)."""
    with TRANSFORMERS_IMPORT:
        from transformers import AutoTokenizer
        from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()  # no warning for texts longer than max_length: we count them
    tokenizer = AutoTokenizer.from_pretrained(checked.model.directory)
    spec, max_length = checked.spec, checked.max_length
    ladder = job_ladder(max_length, None, False, cuda=False)
    rows = sampled = truncated = tokens = padded = 0
    sample = RowSample(checked.dataset.rows)  # a large file: a sample of its rows, the counts scaled
    batches = prediction_batches(checked.dataset, spec, Problems(checked.dataset.filename))
    for part in parts_of(batches, get_settings().predict_part_rows):
        take = sample.take(len(part.texts))
        rows += len(part.texts)
        texts = [part.texts[i] for i in take]
        pairs = [part.pairs[i] for i in take] if part.pairs else None
        if not texts:
            continue
        full = np.concatenate(
            [
                token_counts(
                    tokenizer, texts[a : a + TOKENIZE_ROWS], pairs[a : a + TOKENIZE_ROWS] if pairs else None, max_length
                )
                for a in range(0, len(texts), TOKENIZE_ROWS)
            ]
        )
        lengths = np.minimum(full, max_length)
        sampled, tokens = sampled + len(full), tokens + int(lengths.sum())
        truncated += int((full > max_length).sum())
        padded += padded_tokens(lengths, max_tokens(spec.batch_size, max_length), ladder)
    scale = rows / sampled if sampled else 1.0
    return {
        "rows": rows,
        "task": checked.model.task,
        "label_names": checked.model.label_names,
        "max_length": max_length,
        "tokens": round(tokens * scale),
        "truncated": round(truncated * scale),
        "padded_tokens": round(padded * scale),
        "padding_efficiency": tokens / padded if padded else 1.0,
        **estimate_seconds(checked.model.ref, padded * scale, checked.caller, kind=KIND, precision=spec.precision),
        **({"sampled_rows": sampled, "notes": [sample_note(sampled, rows, "rows")]} if sampled < rows else {}),
    }


def padded_tokens(lengths: np.ndarray, budget: int, ladder: list[int]) -> int:
    """Tokens computed for texts of ``lengths`` batched as ``shared.inference`` batches them
    (``token_budget_batches``), each batch padded to its longest member's width on ``ladder``."""
    return sum(
        len(batch) * bucket_width(ladder, int(lengths[batch].max()))
        for batch in token_budget_batches(lengths, budget, ladder)
    )


def max_tokens(batch_size: int, max_length: int) -> int:
    """Padded tokens per forward pass: ``batch_size`` texts of ``max_length``, and more shorter ones."""
    return batch_size * max_length


# ----------------------------------------------------------------------------- the API view


def to_out(job: Job) -> PredictionOut:
    """The API view of a prediction job row."""
    spec, result = job.spec, job.train_metrics
    total = job.total_steps or 0
    done = total if job.status == JobStatus.SUCCEEDED else job.step
    return PredictionOut(
        id=job.id,
        status=job.status,
        model=job.base_model,
        task=job.task,
        dataset=job.training_dataset_id,
        model_alias=spec["model"] if spec["model"] != job.base_model else None,
        text_column=spec["text_column"],
        text_pair_column=spec.get("text_pair_column"),
        id_column=spec.get("id_column"),
        label_column=spec.get("label_column"),
        batch_size=spec["batch_size"],
        max_length=spec.get("max_length"),
        precision=spec.get("precision", "auto"),
        label_names=job.label_names,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        progress=PredictionProgress(
            rows_done=done,
            total_rows=total,
            fraction=min(1.0, done / total) if total else 0.0,
            rows_per_second=(result or {}).get("rows_per_second"),
            eta_seconds=job.eta_seconds,
        ),
        result=PredictionResult(**result) if result else None,
        results_url=f"/predictions/{job.id}/results" if job.status == JobStatus.SUCCEEDED else None,
        evaluation_url=(
            f"/predictions/{job.id}/evaluation"
            if job.status == JobStatus.SUCCEEDED and spec.get("label_column")
            else None
        ),
        device=job.device,
        attempts=job.attempts,
        error=job.error,
        timings=Timings(**(job.timings or {})),
        files_deleted_at=job.files_deleted_at,
    )
