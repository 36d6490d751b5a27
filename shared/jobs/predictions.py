r"""Batch prediction jobs (job kind ``predict``): checking a request, storing it as a job, planning it,
the layout of its results on disk, and streaming them back in the format asked for.

A prediction is a job like a training job: same row, same lifecycle (``shared.jobs``: claim,
lease, heartbeat, progress, events, cancel, resume), same queue. Its columns are used as:
``base_model`` the model as given (``job_…`` or a base model name; for an alias, the job id it
named at submit), ``task`` that model's task,
``training_dataset_id`` the dataset scored, ``spec`` the ``PredictionCreate`` body,
``label_names`` the model's classes, ``step``/``total_steps`` rows written/rows in the dataset,
``train_metrics`` the result (``PredictionResult``).

Results are Parquet parts under ``artifacts/<job>/predictions/part-<n>.parquet``, each holding
``predict_part_rows`` consecutive input rows (the last may hold fewer), written once, atomically
(a temporary file renamed), with its counts in the file's metadata. A resumed attempt skips the
rows of the parts already written, so no row is scored twice. Columns: ``id`` (the ``id_column``
value as text, or the 0-based row index), then per task (``result_fields``): ``label``, ``score``
and ``probabilities`` (a struct with one field per class, in class order) for classification;
``value`` for regression; ``labels`` (a list) and ``probabilities`` for multi_label; ``entities``
(a list of structs ``ENTITY``) for token_classification; ``embedding`` (a fixed-size list of float32,
the model's vector size, unit length) for an embedding model (``embedding_table``).

No torch here: the API imports this module (the tokenizer only for a dry run).
"""

import fnmatch
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from shared.data.batching import bucket_width, job_ladder, token_budget_batches
from shared.data.columns import check_text
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
    estimate_seconds,
    max_input_length,
    visible_dataset,
)
from shared.schemas.jobs import Timings, json_safe
from shared.schemas.predictions import (
    PredictionCreate,
    PredictionOut,
    PredictionProgress,
    PredictionResult,
)
from shared.settings import get_settings
from shared.store import artifacts, idempotency, objects
from shared.store.engine import read_session
from shared.store.rows import Dataset, Job, JobStatus, new_id, utcnow
from shared.store.tenancy import Caller, owned_job

KIND = "predict"
TASKS = ("classification", "regression", "multi_label", "token_classification", "embedding")
PART_GLOB = "part-*.parquet"
MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv", "parquet": "application/vnd.apache.parquet"}
# Written in each part's Parquet metadata, summed over the parts for the job's result.
PART_COUNTS = ("rows", "truncated", "tokens", "padded_tokens")
# One entity of a token_classification row (``shared.inference.loop.entity_rows``).
ENTITY = pa.struct([("entity_group", pa.string()), ("score", pa.float64()), ("word", pa.string()),
                    ("start", pa.int64()), ("end", pa.int64())])


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
        raise UserError("unsupported_model", f"model {name!r} cannot be loaded: {without_paths(str(e))}",
                        "model") from None
    try:
        task = task_of(config)
    except ValueError as e:
        architectures = config.architectures or []
        if not any("For" in a for a in architectures):
            raise UserError("model_without_head", f"model {name!r} has no classification or regression head "
                            f"({', '.join(architectures) or 'no architecture'}): fine-tune it with POST /jobs, "
                            "then predict with the job's id", "model") from None
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
        raise UserError("unsupported_task", f"model {ref!r} was trained for {job.task}; predictions support "
                        f"{', '.join(TASKS)}", "model")
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
    return [(c, f) for c, f in [(spec.text_column, "text_column"), (spec.text_pair_column, "text_pair_column"),
                                (spec.id_column, "id_column")] if c is not None]


def prediction_batches(dataset: Dataset, spec: PredictionCreate, problems: Problems) -> Iterator[PredictionBatch]:
    """Read and check the columns a prediction uses, batch by batch (``shared.data.read.read_batches``):
    texts must be non-empty strings (as for training; a list of words, such as a token
    classification dataset's words column, is refused too: ``_text_problem``), ids present scalars.
    Problems go to ``problems`` (the caller raises them); no batch is yielded after the first one."""
    columns = _columns(spec)
    texts = tuple(c for c, param in columns if param != "id_column")  # Parquet lists read, to be named
    for batch in read_batches(objects.dataset_file(dataset), dataset.format, dataset.filename, [c for c, _ in columns],
                              problems, list_columns=texts):
        for column, param in columns:
            check = _id_problem if param == "id_column" else _text_problem
            for i, value in enumerate(batch.values[column]):
                if (message := check(value)) is not None:
                    code = "missing_value" if message in ("is missing", "is empty") else f"invalid_{param[:-7]}"
                    problems.add(batch.start + i + 1, column, value, message, code, param)
        if problems.items:
            continue  # keep reading to report up to MAX_PROBLEMS, but hand out no data
        ids = ([_id_text(v) for v in batch.values[spec.id_column]] if spec.id_column
               else list(range(batch.start, batch.start + batch.size)))
        yield PredictionBatch(batch.start, batch.values[spec.text_column],
                              batch.values[spec.text_pair_column] if spec.text_pair_column else None, ids)


def _text_problem(value) -> str | None:
    """What is wrong with a text cell (``check_text``), a list said to be one (CoNLL's ``tokens``)."""
    if isinstance(value, (list, tuple)):
        return ("holds a list, not text: predictions read raw text, one string a row (for a list of words, "
                "join them with spaces)")
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
            validation report of unusable cells (``missing_value``, ``invalid_text``, ``invalid_id``);
            with a ``label_column``, ``shared.jobs.gold.check_gold_labels``'s.
    """
    model = prediction_model(spec.model, caller)
    if spec.text_pair_column and model.task in ("token_classification", "embedding"):
        raise UserError("invalid_text_pair_column", f"model {spec.model!r} is a {model.task} model: it reads "
                        "one text a row; leave text_pair_column out", "text_pair_column")
    if model.task == "embedding" and spec.precision not in ("auto", "fp32"):
        raise UserError("invalid_precision", f"model {spec.model!r} is an embedding model: embeddings are computed "
                        f"in fp32, not {spec.precision}", "precision")
    check_task(spec, model.task)
    if spec.max_length and model.limit and spec.max_length > model.limit:
        raise UserError("max_length_too_long", f"max_length {spec.max_length} is longer than model {spec.model!r} "
                        f"accepts ({model.limit} tokens)", "max_length")
    with read_session() as s:
        dataset = visible_dataset(s, spec.dataset, "dataset", caller)
    for column, param in _columns(spec) + ([(spec.label_column, "label_column")] if spec.label_column else []):
        if column not in dataset.columns:
            raise UserError("missing_column", f"column {column!r} ({param}) not found in {dataset.filename!r}; "
                            f"its columns are {dataset.columns}", param)
    problems = Problems(dataset.filename)
    for _ in prediction_batches(dataset, spec, problems):
        pass
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
        job = Job(id=new_id("job"), tenant=caller.tenant, kind=KIND, base_model=checked.model.ref,  # an alias resolved
                  task=checked.model.task,
                  training_dataset_id=row.id, spec=stored_spec(checked),
                  label_names=checked.model.label_names, total_steps=row.rows, created_at=received)
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
    (None when there is none)."""
    with TRANSFORMERS_IMPORT:
        from transformers import AutoTokenizer
        from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()  # no warning for texts longer than max_length: we count them
    tokenizer = AutoTokenizer.from_pretrained(checked.model.directory)
    spec, max_length = checked.spec, checked.max_length
    ladder = job_ladder(max_length, None, False, cuda=False)
    rows = truncated = tokens = padded = 0
    batches = prediction_batches(checked.dataset, spec, Problems(checked.dataset.filename))
    for part in parts_of(batches, get_settings().predict_part_rows):
        full = np.concatenate([token_lengths(tokenizer, part.texts[a:a + TOKENIZE_ROWS],
                                             part.pairs[a:a + TOKENIZE_ROWS] if part.pairs else None)
                               for a in range(0, len(part.texts), TOKENIZE_ROWS)])
        lengths = np.minimum(full, max_length)
        rows, tokens = rows + len(full), tokens + int(lengths.sum())
        truncated += int((full > max_length).sum())
        padded += padded_tokens(lengths, max_tokens(spec.batch_size, max_length), ladder)
    return {"rows": rows, "task": checked.model.task, "label_names": checked.model.label_names,
            "max_length": max_length, "tokens": tokens, "truncated": truncated, "padded_tokens": padded,
            "padding_efficiency": tokens / padded if padded else 1.0,
            **estimate_seconds(checked.model.ref, padded, checked.caller, kind=KIND, precision=spec.precision)}


def padded_tokens(lengths: np.ndarray, budget: int, ladder: list[int]) -> int:
    """Tokens computed for texts of ``lengths`` batched as ``shared.inference`` batches them
    (``token_budget_batches``), each batch padded to its longest member's width on ``ladder``."""
    return sum(len(batch) * bucket_width(ladder, int(lengths[batch].max()))
               for batch in token_budget_batches(lengths, budget, ladder))


def token_lengths(tokenizer, texts: list[str], pairs: list[str] | None) -> np.ndarray:
    """Tokens of each text (pair), special tokens included, without truncation."""
    ids = tokenizer(texts, pairs, truncation=False, return_attention_mask=False, return_token_type_ids=False)
    return np.fromiter(map(len, ids["input_ids"]), dtype=np.int64, count=len(texts))


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
        id=job.id, status=job.status, model=job.base_model, task=job.task, dataset=job.training_dataset_id,
        model_alias=spec["model"] if spec["model"] != job.base_model else None,
        text_column=spec["text_column"], text_pair_column=spec.get("text_pair_column"),
        id_column=spec.get("id_column"), label_column=spec.get("label_column"), batch_size=spec["batch_size"], max_length=spec.get("max_length"),
        precision=spec.get("precision", "auto"), label_names=job.label_names, created_at=job.created_at, started_at=job.started_at,
        finished_at=job.finished_at,
        progress=PredictionProgress(rows_done=done, total_rows=total, fraction=min(1.0, done / total) if total else 0.0,
                                    rows_per_second=(result or {}).get("rows_per_second"),
                                    eta_seconds=job.eta_seconds),
        result=PredictionResult(**result) if result else None,
        results_url=f"/predictions/{job.id}/results" if job.status == JobStatus.SUCCEEDED else None,
        evaluation_url=(f"/predictions/{job.id}/evaluation" if job.status == JobStatus.SUCCEEDED
                        and spec.get("label_column") else None),
        device=job.device, attempts=job.attempts, error=job.error, timings=Timings(**(job.timings or {})),
        files_deleted_at=job.files_deleted_at)


# ----------------------------------------------------------------------------- results on disk


def results_dir(job_id: str) -> Path:
    return artifacts.artifacts_dir(job_id) / "predictions"


def written_parts(directory: Path) -> list[str]:
    """The refs (``shared.store.objects``) of the complete parts in ``directory`` (or in the
    bucket), in row order (a temporary file is not a part)."""
    store = objects.store()
    ref = store.ref(directory)
    return [f"{ref}/{name}" for name in store.files(ref) if fnmatch.fnmatch(name, PART_GLOB)]


def part_counts(parts: list[str]) -> dict[str, int]:
    """``PART_COUNTS`` summed over ``parts`` (read from each file's metadata, not its rows)."""
    totals = dict.fromkeys(PART_COUNTS, 0)
    for part in parts:
        counts = json.loads(pq.read_schema(objects.store().local(part)).metadata[b"tunejob"])
        for name in PART_COUNTS:
            totals[name] += counts[name]
    return totals


def write_part(directory: Path, index: int, table: pa.Table, counts: dict[str, int]) -> str:
    """Write part ``index`` atomically: a temporary file, renamed once complete (a reader or a
    resumed attempt sees the whole part or none of it), then published (into the bucket, with
    ``TUNEJOB_STORAGE_URL``). ``counts``: ``PART_COUNTS`` of the part. Returns its ref."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"part-{index:06d}.parquet"
    temporary = directory / f".{path.name}.tmp"
    table = table.replace_schema_metadata({"tunejob": json.dumps({n: int(counts[n]) for n in PART_COUNTS})})
    pq.write_table(table, temporary)
    os.replace(temporary, path)
    return objects.store().publish(path)


def results_table(ids: list, task: str, label_names: list[str] | None, rows: list[dict],
                  id_type: pa.DataType) -> pa.Table:
    """One part's rows as a table: ``id``, then the task's ``result_fields``. ``rows``:
    ``shared.inference.loop.Predictions.rows``."""
    columns = {"id": pa.array(ids, id_type)}
    for name, kind in result_fields(task, label_names):
        columns[name] = pa.array([r[name] for r in rows], kind)
    return pa.table(columns)


def embedding_table(ids: list, vectors: np.ndarray, id_type: pa.DataType) -> pa.Table:
    """One part's rows of an embedding model: ``id``, then ``embedding``, a fixed-size list of
    float32 (``vectors``: ``[rows, dimensions]``), stored without a copy to Python lists."""
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1), pa.float32())
    return pa.table({"id": pa.array(ids, id_type),
                     "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])})


def result_fields(task: str, label_names: list[str] | None) -> list[tuple[str, pa.DataType]]:
    """(column, Arrow type) of a task's results, after ``id``: ``label``, ``score``,
    ``probabilities`` (a struct of the classes, in class order) for classification; ``value`` for
    regression; ``labels`` (a list of names) and ``probabilities`` for multi_label; ``entities``
    (a list of ``ENTITY``) for token_classification."""
    if task == "regression":
        return [("value", pa.float64())]
    if task == "token_classification":
        return [("entities", pa.list_(ENTITY))]
    probabilities = ("probabilities", pa.struct([pa.field(name, pa.float64()) for name in label_names or []]))
    if task == "multi_label":
        return [("labels", pa.list_(pa.string())), probabilities]
    return [("label", pa.string()), ("score", pa.float64()), probabilities]


def id_type(spec: dict) -> pa.DataType:
    """``id`` is the ``id_column`` value as text, or the row index."""
    return pa.string() if spec.get("id_column") else pa.int64()


def results_stream(job_id: str, caller: Caller, fmt: str) -> Iterator[bytes]:
    """A succeeded prediction's results in ``fmt`` (``jsonl``, ``csv`` or ``parquet``), one part
    at a time: memory holds one part. CSV flattens ``probabilities`` into one column per class,
    ``probabilities.<class>``, and writes a list (multi_label's ``labels``, token_classification's
    ``entities``) as JSON text. A prediction deleted while its results are sent ends the stream early.

    Raises:
        NotFound, Deleted: see ``shared.jobs.lifecycle.get_job``. UserError: ``results_not_ready`` (409)
            before the job has succeeded; ``results_deleted`` (409) after its files were removed.
    """
    with read_session() as s:
        job = owned_job(s, job_id, caller, kind=KIND)
    if job.status != JobStatus.SUCCEEDED:
        raise UserError("results_not_ready", f"prediction {job_id!r} is {job.status}; results are served once it "
                        "has succeeded", "prediction_id", 409)
    parts = written_parts(results_dir(job_id))
    if job.files_deleted_at is not None or not parts:
        raise UserError("results_deleted", f"prediction {job_id!r}: its results were deleted "
                        "(TUNEJOB_ARTIFACT_RETENTION_DAYS)", "prediction_id", 409)
    return {"jsonl": _jsonl, "csv": _csv, "parquet": _parquet}[fmt](parts)


def result_tables(parts: list[str]) -> Iterator[pa.Table]:
    """Each part as a table, read (downloaded, from the bucket) when it is its turn: one open file
    at a time, however many parts."""
    for part in parts:
        yield pq.read_table(objects.store().local(part)).replace_schema_metadata(None)


def _jsonl(parts: list[str]) -> Iterator[bytes]:
    for table in result_tables(parts):
        yield "".join(json.dumps(json_safe(row), ensure_ascii=False) + "\n" for row in table.to_pylist()).encode()


def _csv(parts: list[str]) -> Iterator[bytes]:
    for i, table in enumerate(result_tables(parts)):
        out = io.BytesIO()
        pa_csv.write_csv(_lists_as_json(table.flatten()), out, pa_csv.WriteOptions(include_header=i == 0))
        yield out.getvalue()


def _lists_as_json(table: pa.Table) -> pa.Table:
    """``table`` with each list column as JSON text (a CSV cell holds no list)."""
    for index, field in enumerate(table.schema):
        if pa.types.is_list(field.type) or pa.types.is_fixed_size_list(field.type):
            cells = [json.dumps(json_safe(v), ensure_ascii=False) for v in table.column(index).to_pylist()]
            table = table.set_column(index, field.name, pa.array(cells, pa.string()))
    return table


class _Chunks(io.RawIOBase):
    """A write-only file that keeps what is written until ``take`` (a Parquet writer's sink)."""

    def __init__(self):
        super().__init__()
        self.buffer, self.position = [], 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.buffer.append(bytes(data))
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def take(self) -> bytes:
        data, self.buffer = b"".join(self.buffer), []
        return data


def _parquet(parts: list[str]) -> Iterator[bytes]:
    sink, writer = _Chunks(), None
    for table in result_tables(parts):
        writer = writer or pq.ParquetWriter(sink, table.schema)
        writer.write_table(table)
        yield sink.take()
    if writer is not None:
        writer.close()
    yield sink.take()
