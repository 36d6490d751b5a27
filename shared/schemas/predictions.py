"""Pydantic schemas of prediction jobs (``POST /predictions``) and of the sync endpoint
(``POST /models/{job_id}/predict``)."""

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

from shared.schemas.jobs import Timings
from shared.schemas.queue import QueuePosition

PREDICTION_CREATE_EXAMPLE: JsonDict = {
    "model": "job_8e2d4c1a9b7f3e05",
    "dataset": "ds_5b0e7d21c9a84f13",
    "text_column": "text",
    "id_column": "article_id",
    "batch_size": 64,
    "max_length": 128,
}


class PredictionCreate(BaseModel):
    """Body of ``POST /predictions``: score every row of a dataset with a model."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [PREDICTION_CREATE_EXAMPLE]})

    model: str = Field(
        description="A succeeded training job of yours (``job_…``), or the name of a base model "
        "(``GET /models``) that has a sequence- or token-classification head. An "
        "``embedding`` job's results are vectors (column ``embedding``)."
    )
    dataset: str = Field(description="The dataset to score (``ds_…``).")
    text_column: str = "text"
    text_pair_column: str | None = None
    id_column: str | None = Field(
        None,
        description="A column whose value (as text) names each row in the results (each row its own: a repeated id is refused, duplicate_id); default: the row's 0-based index.",
    )
    label_column: str | None = Field(
        None,
        description="A column of gold labels (a labelled test set): the "
        "prediction then writes an evaluation report, ``GET /predictions/{id}/evaluation``, "
        "with the validation report's metrics. Labels read as the model's training job "
        "read them; not for token_classification models.",
    )
    count_unknown_labels: bool = Field(
        False,
        description="With ``label_column``: score a test set whose labels "
        "include some the model does not know, counting their rows as errors (as "
        "``trainer.evaluate`` would); without it such a request is refused (422 "
        "``unknown_labels``, naming them).",
    )
    batch_size: int = Field(64, ge=1, le=4096, description="Texts per forward pass at most.")
    max_length: int | None = Field(
        None,
        ge=8,
        le=8192,
        description="Tokens per text (pair) at most; longer "
        "texts are truncated and counted. Default: the model's limit.",
    )
    precision: Literal["auto", "fp32", "bf16", "int8"] = Field(
        "auto",
        description=(
            "``auto``: bf16 on a GPU and on a CPU with AMX, fp32 on other CPUs; ``int8``: CPU workers only, the model's Linear layers "
            "dynamically quantized to int8 (compiled on CPUs with AMX, else PyTorch ``quantize_dynamic``): faster, "
            "labels may differ slightly."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        """JSON Schema counts 64.0 as an integer; pydantic's strict mode would refuse it."""
        if not isinstance(data, dict):
            return data
        return {
            k: int(v) if k in ("batch_size", "max_length") and isinstance(v, float) and v.is_integer() else v
            for k, v in data.items()
        }

    @model_validator(mode="after")
    def _distinct_columns(self) -> "PredictionCreate":
        if self.id_column is not None and self.id_column in (self.text_column, self.text_pair_column):
            raise ValueError(f"id_column {self.id_column!r} must differ from text_column and text_pair_column")
        if self.label_column is not None and self.label_column in (self.text_column, self.text_pair_column):
            raise ValueError(f"label_column {self.label_column!r} must differ from text_column and text_pair_column")
        if self.count_unknown_labels and self.label_column is None:
            raise ValueError("count_unknown_labels needs a label_column")
        return self


class PredictionProgress(BaseModel):
    rows_done: int = Field(description="input rows scored and written so far")
    total_rows: int
    fraction: float
    rows_per_second: float | None = Field(description="of the current attempt")
    eta_seconds: float | None


class PredictionResult(BaseModel):
    """What a prediction job computed (so far, while it runs)."""

    model_config = ConfigDict(extra="allow")

    rows: int = Field(description="rows scored")
    truncated: int = Field(description="texts (pairs) longer than max_length, cut to it")
    max_length: int = Field(description="tokens per text (pair) at most")
    tokens: int = Field(description="real (non-pad) tokens")
    padded_tokens: int = Field(description="tokens computed, padding included")
    padding_efficiency: float | None = Field(description="tokens / padded_tokens")
    tokens_per_second: float | None = Field(description="real tokens per second of scoring (current attempt)")
    rows_per_second: float | None = Field(description="rows per second of scoring (current attempt)")


class PredictionOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "job_1c7e9a40d2b35f86",
                    "status": "succeeded",
                    **PREDICTION_CREATE_EXAMPLE,
                    "text_pair_column": None,
                    "task": "classification",
                    "label_names": ["business", "entertainment", "politics", "sport", "tech"],
                    "created_at": "2026-11-21T09:20:00.118Z",
                    "started_at": "2026-11-21T09:20:01.402Z",
                    "finished_at": "2026-11-21T09:20:09.771Z",
                    "progress": {
                        "rows_done": 445,
                        "total_rows": 445,
                        "fraction": 1.0,
                        "rows_per_second": 61.3,
                        "eta_seconds": 0.0,
                    },
                    "result": {
                        "rows": 445,
                        "truncated": 203,
                        "max_length": 128,
                        "tokens": 50874,
                        "padded_tokens": 51622,
                        "padding_efficiency": 0.986,
                        "tokens_per_second": 7011.4,
                        "rows_per_second": 61.3,
                    },
                    "results_url": "/predictions/job_1c7e9a40d2b35f86/results",
                    "device": "cpu (2 threads)",
                    "attempts": 1,
                    "error": None,
                    "timings": {"queued": 0.21, "load": 1.05, "total": 9.65},
                }
            ]
        }
    )

    id: str
    status: str
    model: str
    model_alias: str | None = Field(
        None,
        description="the alias ``model`` was given as; ``model`` is the job it named when the prediction was submitted",
    )
    task: str
    dataset: str
    text_column: str
    text_pair_column: str | None
    id_column: str | None
    label_column: str | None = None
    batch_size: int
    max_length: int = Field(description="tokens per text (pair) at most: as requested, else the model's limit")
    precision: str = "auto"
    label_names: list[Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: PredictionProgress
    result: PredictionResult | None
    results_url: str | None = Field(description="``GET`` it with ``?format=jsonl|csv|parquet`` once succeeded")
    evaluation_url: str | None = Field(
        None, description="the evaluation report, once a prediction with a ``label_column`` has succeeded"
    )
    device: str | None
    attempts: int
    error: dict[str, Any] | None
    timings: Timings
    files_deleted_at: datetime | None = None
    queue: QueuePosition | None = Field(
        None, description="a queued job's place in the queue and estimated start; null once it runs"
    )


class PredictionList(BaseModel):
    data: list[PredictionOut]
    next_cursor: str | None


class PredictionPlan(BaseModel):
    """What a prediction job will do (``shared.jobs.predictions.plan_prediction``). Other fields may be added."""

    model_config = ConfigDict(extra="allow")

    rows: int
    task: str
    label_names: list[Any] | None
    max_length: int
    tokens: int = Field(description="real tokens after truncation at max_length")
    truncated: int = Field(description="texts (pairs) longer than max_length")
    padded_tokens: int = Field(description="tokens computed with texts of similar length batched together")
    padding_efficiency: float = Field(description="tokens / padded_tokens")
    estimated_seconds: float | None = Field(
        description="from the newest succeeded prediction on the same model; null when there is none"
    )
    estimate_basis: str
    sampled_rows: int | None = Field(
        None,
        description="rows tokenized for this plan, where the file has more than TUNEJOB_DRY_RUN_ROWS: "
        "a random sample, the counts scaled to the whole; null when all were",
    )
    notes: list[str] = Field([], description="what a user should know about the plan")


class PredictionDryRunOut(BaseModel):
    """Response of ``POST /predictions?dry_run=true``: nothing is stored or queued."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "dry_run": True,
                    "plan": {
                        "rows": 445,
                        "task": "classification",
                        "label_names": ["business", "entertainment", "politics", "sport", "tech"],
                        "max_length": 128,
                        "tokens": 50874,
                        "truncated": 203,
                        "padded_tokens": 51622,
                        "padding_efficiency": 0.986,
                        "estimated_seconds": 7.4,
                        "estimate_basis": "job job_1c7e9a40d2b35f86: 6980 padded tokens/s on cpu",
                    },
                }
            ]
        }
    )

    dry_run: Literal[True]
    plan: PredictionPlan


class PredictIn(BaseModel):
    """``POST /models/{job_id}/predict``: texts, or [text, pair] pairs for a model trained on pairs."""

    model_config = ConfigDict(extra="forbid")

    # min_length on each branch: on the union itself it is lost from the OpenAPI schema
    inputs: Annotated[list[str], Field(min_length=1)] | Annotated[list[tuple[str, str]], Field(min_length=1)] = Field(
        ...,
        description="texts, or [text, text_pair] pairs; at most max_sync_inputs (default 64)",
        examples=[["Shares fell sharply", "A late goal won the match"]],
    )
    max_length: int | None = Field(
        None,
        ge=2,
        description="tokens per input (default: the model's max_length); longer inputs are truncated and counted",
    )


class PredictOut(BaseModel):
    model: str = Field(description="the job whose model answered")
    predictions: list[dict] = Field(
        description='in input order: {"label", "score", "probabilities"} for '
        'classification, {"value"} for regression, {"labels", '
        '"probabilities"} for multi_label, {"entities": [{"entity_group", '
        '"score", "word", "start", "end"}]} for token_classification '
        "(start, end: character offsets into the input)"
    )
    truncated: int = Field(description="inputs cut at max_length")
    max_length: int = Field(description="tokens per input the model read")


class EmbedIn(BaseModel):
    """``POST /models/{job_id}/embed``: texts to embed."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[Annotated[str, Field(min_length=1)]] = Field(
        ...,
        min_length=1,
        description="non-empty texts (an empty one has no meaning to embed); at most max_sync_inputs (default 64)",
        examples=[["How do volcanoes form?", "Shares fell sharply"]],
    )
    normalize: bool = Field(True, description="unit-length vectors (their dot product is the cosine similarity)")


class EmbedOut(BaseModel):
    model: str = Field(description="the job (or base model) whose model answered")
    embeddings: list[list[float]] = Field(description="one vector per input, in input order")
    dimensions: int
    tokens: int = Field(description="tokens of the inputs, special tokens included, before truncation")
    truncated: int = Field(description="inputs cut at max_length")
    max_length: int = Field(description="tokens per input the model read")


class RerankIn(BaseModel):
    """``POST /models/{job_id}/rerank``: documents to order by their relevance to a query."""

    model_config = ConfigDict(extra="forbid")

    query: str = Field(..., min_length=1)
    documents: list[str] = Field(..., min_length=1, description="at most max_sync_inputs (default 64)")
    top_n: int | None = Field(None, ge=1, description="return only the best top_n (default: all)")


class RerankResult(BaseModel):
    index: int = Field(description="the document's position in documents")
    relevance_score: float = Field(description="the cross-encoder's sigmoid score in [0, 1]")


class RerankOut(BaseModel):
    model: str
    results: list[RerankResult] = Field(description="best first")
