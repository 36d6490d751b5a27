"""Pydantic schemas of the REST API: the job spec with its hyperparameters, and the resources returned."""

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, computed_field, model_validator
from pydantic.json_schema import JsonDict

from shared.schemas.hyperparameters import HYPERPARAMETERS_EXAMPLE, TASK_METRICS, TASK_ONLY, Hyperparameters
from shared.schemas.queue import QueuePosition


def metric_text(value: Any) -> str:
    """A job's metric as the CLI and the dashboard print it: a float to 4 decimals (trailing zeros
    dropped: a count stored as 16.0 reads 16), or none from 100 on; an integer with thousands
    separators; a dict of figures (multi_label's f1_per_label) as ``name value, ...``; anything else
    as it is. (token_classification's per_entity, a dict of dicts, has a table of its own.)"""
    if isinstance(value, dict):
        return ", ".join(f"{name} {metric_text(v)}" for name, v in value.items())
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if not isinstance(value, float):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4f}".rstrip("0").rstrip(".")


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, Infinity) replaced by None, for strict JSON
    (and for SQLite, which stores NaN as NULL, and PostgreSQL's json, which has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# A built-in base model's Hugging Face id, as users know it, -> its name in tunejob
# (``shared.jobs.base_models.BUILTIN``): the id names the same weights, which ship in a package.
HUB_IDS = {"sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2"}


def model_name(name: str) -> str:
    """Base model ``name`` as tunejob names it: a built-in model's Hugging Face id (``HUB_IDS``) is
    its name; any other name as it is."""
    return HUB_IDS.get(name, name)


# Metadata caps: OpenAI's, the defaults of TUNEJOB_MAX_METADATA_* (enforced by shared.store.quotas.check_metadata).
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
Metadata = Annotated[
    dict[str, str] | None,
    Field(
        description=f"Your own labels: at most {MAX_METADATA_KEYS} keys of up to {MAX_METADATA_KEY_CHARS} characters, "
        f"string values of up to {MAX_METADATA_VALUE_CHARS} (TUNEJOB_MAX_METADATA_*).",
        json_schema_extra=lambda schema: schema["anyOf"][0].update(
            maxProperties=MAX_METADATA_KEYS,
            propertyNames={"maxLength": MAX_METADATA_KEY_CHARS},
            additionalProperties={"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS},
        ),
    ),
]

# Realistic examples for the OpenAPI schema: a BBC News job as `make demo` runs it.
JOB_CREATE_EXAMPLE: JsonDict = {
    "base_model": "all-MiniLM-L6-v2",
    "task": "classification",
    "training_dataset": "ds_3f9a1c2b7d4e5f60",
    "validation_split": 0.1,
    "text_column": "text",
    "label_column": "label",
    "hyperparameters": HYPERPARAMETERS_EXAMPLE,
    "metadata": {"project": "news-topics"},
}
MULTI_LABEL_EXAMPLE: JsonDict = {
    "base_model": "all-MiniLM-L6-v2",
    "task": "multi_label",
    "training_dataset": "ds_7c1e5a9f0b3d2e48",
    "validation_split": 0.1,
    "text_column": "text",
    "label_column": "genres",
    "label_separator": "|",
    "tune_threshold": True,
    "hyperparameters": {**HYPERPARAMETERS_EXAMPLE, "metric_for_best_model": "f1_micro"},
}
TOKEN_JOB_CREATE_EXAMPLE: JsonDict = {  # named entities from a CoNLL file (columns tokens and tags)
    "base_model": "all-MiniLM-L6-v2",
    "task": "token_classification",
    "training_dataset": "ds_7b2e90c4a1d35f18",
    "validation_dataset": "ds_c5d1e7a9032b4f6e",
    "text_column": "tokens",
    "label_column": "tags",
    "hyperparameters": {**HYPERPARAMETERS_EXAMPLE, "metric_for_best_model": "entity_f1"},
}
# The spec's fields that only one task reads (JobOut shows them for that task)
TASK_FIELDS = {
    "embedding": ("anchor_column", "positive_column", "negative_columns", "score_column"),
    "reranking": ("query_column", "passage_column"),
}


class JobCreate(BaseModel):
    """Body of ``POST /jobs``."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [JOB_CREATE_EXAMPLE, MULTI_LABEL_EXAMPLE, TOKEN_JOB_CREATE_EXAMPLE]},
    )

    base_model: Annotated[str, AfterValidator(model_name)]
    task: Literal["classification", "regression", "multi_label", "token_classification", "embedding", "reranking"] = (
        Field(
            "classification",
            description="multi_label: each row has a list of labels (none, one or several); "
            "sigmoid outputs trained with BCEWithLogitsLoss. token_classification (named entities, IOB/BIO tags): "
            "text_column names a column of word lists (default `tokens`), label_column one of tag lists of the same "
            "length (default `tags`); JSONL, Parquet (list columns) or CoNLL files. embedding (a bi-encoder, saved as a "
            "sentence-transformers model): pairs of anchor_column and positive_column texts, trained with "
            "MultipleNegativesRankingLoss (with negative_columns as hard negatives), or with a score_column in [0, 1], "
            "trained with CoSENT; validated by retrieval (ndcg@10, mrr@10, recall@1, recall@10, map@100). reranking "
            "(a cross-encoder): query_column and passage_column texts with a label_column of 0/1 or a score in [0, 1], "
            "trained with binary cross-entropy; validated by reranking each query's passages (ndcg@10, mrr@10).",
        )
    )
    training_dataset: str
    validation_dataset: str | None = None
    validation_split: float | None = Field(None, ge=0, lt=1, description="Default 0.1 when no validation_dataset.")
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    label_separator: str | None = Field(
        None,
        min_length=1,
        max_length=8,
        description="multi_label: the label column holds text such as "
        "`drama|comedy`, split on this separator (CSV and TSV need it; JSONL and Parquet may hold lists instead). "
        "An empty cell is a row with no label.",
    )
    decision_threshold: float = Field(
        0.5, gt=0, lt=1, description="multi_label: a label is predicted when its sigmoid score is at least this"
    )
    tune_threshold: bool = Field(
        False,
        description="multi_label: instead of decision_threshold, use the threshold (0.05 to 0.95 in steps "
        "of 0.05) with the best micro-F1 on the validation set at each evaluation; the best model's is saved in "
        "its config.json as decision_threshold",
    )
    anchor_column: str = Field("anchor", description="embedding: the query (anchor) texts")
    positive_column: str = Field("positive", description="embedding: the text each anchor should retrieve")
    negative_columns: list[str] | None = Field(
        None,
        min_length=1,
        max_length=16,
        description="embedding: hard negatives, one text per column and row, "
        "ranked below the row's positive along with every other positive of the micro-batch",
    )
    score_column: str | None = Field(
        None,
        description="embedding: a similarity in [0, 1] of each anchor and positive (trained with CoSENT "
        "instead of MultipleNegativesRankingLoss; no negative_columns)",
    )
    query_column: str = Field("query", description="reranking: the queries")
    passage_column: str = Field("passage", description="reranking: the passage scored against each query")
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    allow_large_targets: bool = Field(
        False,
        description="Regression: accept targets with |y| > 1e6 (refused by default: targets that large "
        "usually mean unscaled data or the wrong column, and overflow the loss).",
    )
    label_all_subwords: bool = Field(
        False,
        description="token_classification: train on every subword of a word (its tag, B- as I- after the "
        "first) instead of the first subword only; evaluation always scores the first subword.",
    )
    metadata: Metadata = None
    suffix: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="Added to the trained model's name (``fine_tuned_model`` in /v1).",
    )

    @model_validator(mode="before")
    @classmethod
    def _task_defaults(cls, data: Any) -> Any:
        """token_classification reads word lists and tag lists: their columns default to ``tokens``
        and ``tags`` (the names the CoNLL reader gives them). embedding's best model is the one with
        the best ``ndcg@10`` unless ``metric_for_best_model`` says otherwise, and so is reranking's."""
        if isinstance(data, dict) and data.get("task") == "token_classification":
            return {"text_column": "tokens", "label_column": "tags", **data}
        if isinstance(data, dict) and data.get("task") in ("embedding", "reranking"):  # best by ndcg@10
            hp = data.get("hyperparameters")
            if hp is None or isinstance(hp, dict) and "metric_for_best_model" not in hp:
                return {**data, "hyperparameters": {**(hp or {}), "metric_for_best_model": "ndcg@10"}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "JobCreate":
        if self.label_column in (self.text_column, self.text_pair_column):
            raise ValueError(f"label_column {self.label_column!r} must differ from text_column and text_pair_column")
        if self.validation_dataset and self.validation_split:
            raise ValueError("give validation_dataset or validation_split, not both")
        if self.validation_dataset is None and self.validation_split is None:
            self.validation_split = 0.1
        hp = self.hyperparameters
        if hp.metric_for_best_model not in TASK_METRICS[self.task]:
            raise ValueError(
                f"hyperparameters.metric_for_best_model {hp.metric_for_best_model!r} does not apply to "
                f"{self.task}; use one of {TASK_METRICS[self.task]}"
            )
        multi_label_only = {
            "label_separator": self.label_separator is not None,
            "tune_threshold": self.tune_threshold,
            "decision_threshold": self.decision_threshold != 0.5,
        }
        if self.task != "multi_label" and (given := [name for name, set_ in multi_label_only.items() if set_]):
            raise ValueError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to task 'multi_label' only"
            )
        if self.tune_threshold and not (self.validation_dataset or self.validation_split):
            raise ValueError("tune_threshold needs a validation set")
        if self.task == "token_classification" and self.text_pair_column:
            raise ValueError("token_classification takes one column of words: text_pair_column must be null")
        for name, task in TASK_ONLY.items():
            if getattr(hp, name) is not None and self.task != task:
                raise ValueError(f"hyperparameters.{name} applies to task {task!r} only")
        if self.label_all_subwords and self.task != "token_classification":
            raise ValueError("label_all_subwords applies to token_classification only")
        self._check_retrieval_columns()
        if hp.early_stopping_patience and not (self.validation_dataset or self.validation_split):
            raise ValueError("hyperparameters.early_stopping_patience needs a validation set")
        return self

    def _check_retrieval_columns(self) -> None:
        """embedding's and reranking's columns are distinct and apply to their task only."""
        given = {
            "negative_columns": self.negative_columns is not None,
            "score_column": self.score_column is not None,
            "anchor_column": self.anchor_column != "anchor",
            "positive_column": self.positive_column != "positive",
        }
        reranking = {"query_column": self.query_column != "query", "passage_column": self.passage_column != "passage"}
        for task, fields in (("embedding", given), ("reranking", reranking)):
            if self.task != task and (names := [name for name, set_ in fields.items() if set_]):
                raise ValueError(
                    f"{', '.join(names)} {'applies' if len(names) == 1 else 'apply'} to task {task!r} only"
                )
        if self.task == "reranking" and (
            self.text_pair_column
            or self.query_column == self.passage_column
            or self.label_column in (self.query_column, self.passage_column)
        ):
            raise ValueError(
                "reranking reads query_column, passage_column and label_column: three distinct "
                "columns, and text_pair_column null"
            )
        if self.task != "embedding":
            return
        if self.text_pair_column:
            raise ValueError("embedding reads anchor_column and positive_column: text_pair_column must be null")
        if self.score_column and self.negative_columns:
            raise ValueError("score_column (CoSENT) and negative_columns (MultipleNegativesRankingLoss) do not mix")
        columns = [
            self.anchor_column,
            self.positive_column,
            *(self.negative_columns or []),
            *([self.score_column] if self.score_column else []),
        ]
        if len(set(columns)) < len(columns):
            raise ValueError(
                f"anchor_column, positive_column, negative_columns and score_column must differ: {columns}"
            )


class DatasetOut(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "id": "ds_3f9a1c2b7d4e5f60",
                    "filename": "bbc_news_train.csv",
                    "format": "csv",
                    "rows": 1780,
                    "columns": ["text", "label"],
                    "bytes": 4021377,
                    "sha256": "9c1185a5c5e9fc54612808977ee8f548b2258d31c0f1a5e8b3e2d8e2d9bd5e1a",
                    "created_at": "2026-11-21T09:12:03.512Z",
                }
            ]
        },
    )

    id: str
    filename: str
    format: str
    rows: int
    columns: list[str]
    bytes: int
    sha256: str
    created_at: datetime


class Progress(BaseModel):
    step: int
    total_steps: int | None
    epoch: float
    fraction: float
    eta_seconds: float | None


class Timings(BaseModel):
    """Where a job's wall time went, in seconds; null until the phase has run.

    ``queued``: POST to a worker taking the job. ``load``: reading the dataset and loading the model
    (and, on a resumed attempt, the optimizer state). ``tokenize``: loading the tokenizer and
    tokenizing (near 0 on a tokenization-cache hit). ``warmup``: capture/compile before the first
    step, if any. ``train``: optimizer steps, without the evaluations and checkpoints in between.
    ``evaluate``: every validation pass. ``save``: checkpoints, the best model and the artifact.
    ``total``: POST to the job's end. A restarted job's phases are those of its last attempt, so
    ``total`` also holds the earlier attempts; the rest of the gap is bookkeeping between phases.
    """

    queued: float | None = None
    load: float | None = None
    tokenize: float | None = None
    warmup: float | None = None
    train: float | None = None
    evaluate: float | None = None
    save: float | None = None
    total: float | None = None


PHASES = tuple(name for name in Timings.model_fields if name not in ("queued", "total"))  # timed by the worker


class JobOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "job_8e2d4c1a9b7f3e05",
                    "status": "succeeded",
                    "base_model": "all-MiniLM-L6-v2",
                    "task": "classification",
                    "training_dataset": "ds_3f9a1c2b7d4e5f60",
                    "validation_dataset": None,
                    "validation_split": 0.1,
                    "text_column": "text",
                    "text_pair_column": None,
                    "label_column": "label",
                    "label_names": ["business", "entertainment", "politics", "sport", "tech"],
                    "hyperparameters": {**Hyperparameters().model_dump(), **HYPERPARAMETERS_EXAMPLE},
                    "metadata": {"project": "news-topics"},
                    "suffix": None,
                    "created_at": "2026-11-21T09:12:10.118Z",
                    "started_at": "2026-11-21T09:12:11.402Z",
                    "finished_at": "2026-11-21T09:15:02.771Z",
                    "progress": {"step": 101, "total_steps": 101, "epoch": 1.0, "fraction": 1.0, "eta_seconds": 0.0},
                    "train_metrics": {
                        "loss": 0.412,
                        "learning_rate": 0.0,
                        "tokens_per_second": 1893.4,
                        "padding_efficiency": 0.993,
                        "skipped_steps": 0,
                    },
                    "validation_metrics": {"loss": 0.288, "accuracy": 0.955, "f1_macro": 0.953},
                    "device": "cpu (2 threads)",
                    "attempts": 1,
                    "error": None,
                    "timings": {
                        "queued": 0.4,
                        "load": 0.3,
                        "tokenize": 1.2,
                        "warmup": 0.0,
                        "train": 165.2,
                        "evaluate": 3.1,
                        "save": 1.4,
                        "total": 172.3,
                    },
                }
            ]
        }
    )

    id: str
    status: str
    base_model: str
    task: str
    training_dataset: str
    validation_dataset: str | None
    validation_split: float | None
    text_column: str
    text_pair_column: str | None
    label_column: str
    label_separator: str | None = None
    decision_threshold: float = 0.5
    tune_threshold: bool = False
    anchor_column: str | None = Field(None, description="embedding only, as the spec's fields below")
    positive_column: str | None = None
    negative_columns: list[str] | None = None
    score_column: str | None = None
    query_column: str | None = Field(None, description="reranking only")
    passage_column: str | None = None
    label_names: list[Any] | None
    hyperparameters: Hyperparameters
    metadata: dict[str, Any] | None
    suffix: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: Progress
    train_metrics: dict[str, Any] | None
    validation_metrics: dict[str, Any] | None
    device: str | None
    attempts: int
    error: dict[str, Any] | None
    timings: Timings
    files_deleted_at: datetime | None = Field(
        None, description="When the job's checkpoints and artifacts were removed (TUNEJOB_ARTIFACT_RETENTION_DAYS)."
    )
    sweep_id: str | None = Field(None, description="The sweep this job is a trial of (``POST /sweeps``), if any.")
    trial_number: int | None = Field(None, description="Its trial number in that sweep, from 0.")
    queue: QueuePosition | None = Field(
        None, description="a queued job's place in the queue and estimated start; null once it runs"
    )

    def column_fields(self) -> dict[str, str | list[str]]:
        """The spec fields naming the columns this job's task reads, with their columns (what the
        CLI and the dashboard show): ``TASK_FIELDS`` and the label for embedding and reranking,
        else the text, pair and label columns."""
        names = {
            "embedding": TASK_FIELDS["embedding"],
            "reranking": (*TASK_FIELDS["reranking"], "label_column"),
        }.get(self.task, ("text_column", "text_pair_column", "label_column"))
        return {name: value for name in names if (value := getattr(self, name)) is not None}


class JobList(BaseModel):
    data: list[JobOut]
    next_cursor: str | None


class MetricOut(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "step": 40,
                    "epoch": 0.4,
                    "name": "train_loss",
                    "value": 0.731,
                    "time": "2026-11-21T09:13:05.004Z",
                    "nonfinite": False,
                }
            ]
        },
    )

    step: int
    epoch: float
    name: str
    value: float | None = Field(description="null when the value was not finite (NaN or Infinity)")
    time: datetime

    @computed_field(  # type: ignore[prop-decorator]  # pydantic's documented form, which mypy does not model
        description="the value was NaN or Infinity (a step with a non-finite loss is skipped)"
    )
    @property
    def nonfinite(self) -> bool:
        return self.value is None or not math.isfinite(self.value)


class EventOut(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "time": "2026-11-21T09:12:11.402Z",
                    "level": "info",
                    "code": "started",
                    "message": "attempt 1 started on worker gpu-box-1:4242:1a2b3c4d",
                }
            ]
        },
    )

    time: datetime
    level: str
    code: str
    message: str


class CheckpointOut(BaseModel):
    model_config = ConfigDict(
        from_attributes=True,
        json_schema_extra={
            "examples": [
                {
                    "step": 101,
                    "metrics": {"loss": 0.288, "accuracy": 0.955, "f1_macro": 0.953},
                    "created_at": "2026-11-21T09:14:58.310Z",
                }
            ]
        },
    )

    step: int
    metrics: dict[str, Any] | None
    created_at: datetime


class ArtifactOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"name": "model.tar.gz", "bytes": 84213760, "url": "/jobs/job_8e2d4c1a9b7f3e05/artifacts/model.tar.gz"}
            ]
        }
    )

    name: str
    bytes: int
    url: str


class BaseModelOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={"examples": [{"name": "all-MiniLM-L6-v2", "source": "builtin", "model_type": "bert"}]}
    )

    name: str
    source: Literal["builtin", "models_dir"]
    model_type: str | None
