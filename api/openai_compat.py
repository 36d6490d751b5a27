"""The OpenAI fine-tuning API's objects, and their mapping to and from tunejob's (the ``/v1`` facade).

Shapes follow the openai-python SDK's types (``types/file_object.py``, ``file_deleted.py``,
``model.py``, ``fine_tuning/fine_tuning_job.py``, ``fine_tuning_job_event.py``,
``fine_tuning/jobs/fine_tuning_job_checkpoint.py``, ``job_create_params.py``) and its cursor pages
(``pagination.py``: ``data`` + ``has_more``, the next page ``after`` the last item's ``id``). A
file is a tunejob dataset and a fine-tuning job is a tunejob job, with the same ids; nothing here
validates or stores anything itself: requests become a ``shared.schemas.jobs.JobCreate`` and go
through the same checks as ``POST /jobs``.

Errors keep tunejob's body, ``{"error": {"code", "message", "param"}}``, plus OpenAI's ``type``;
an invalid request is 400 (OpenAI's status for it, which the SDK raises as ``BadRequestError``)
instead of 422, and ``param`` uses the OpenAI names (``training_file``, ``hyperparameters.n_epochs``).
"""

import inspect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails
from starlette.exceptions import HTTPException

from shared.errors import NotFound, UserError
from shared.jobs import uploads
from shared.jobs.trials import stored_hyperparameters
from shared.schemas.hyperparameters import Hyperparameters
from shared.schemas.jobs import JobCreate, Metadata
from shared.store.rows import Checkpoint, Dataset, Job, JobEvent, JobStatus
from shared.store.tenancy import Caller

DEFAULT_LEARNING_RATE = Hyperparameters.model_fields["learning_rate"].default
# OpenAI hyperparameter -> tunejob hyperparameter; learning_rate = learning_rate_multiplier * the default.
OPENAI_HYPERPARAMETERS = {"n_epochs": "epochs", "batch_size": "batch_size", "learning_rate_multiplier": "learning_rate"}
# tunejob spec field -> OpenAI request field, for error params.
OPENAI_FIELDS = {"base_model": "model", "training_dataset": "training_file", "validation_dataset": "validation_file"}
EVENT_LEVELS = {"info": "info", "warning": "warn", "error": "error"}
OWNERS = {"builtin": "system", "models_dir": "local"}
OPENAI_STATUS = {JobStatus.PRUNED: "cancelled"}  # statuses OpenAI lacks: a pruned trial was stopped by its sweep


# ----------------------------------------------------------------------------- errors


class OpenAIError(BaseModel):
    code: str = Field(examples=["unknown_dataset"])
    message: str = Field(
        examples=["training_dataset 'ds_0123456789abcdef' does not exist; upload it with POST /datasets"]
    )
    param: str | None = Field(examples=["training_file"])
    type: Literal["invalid_request_error"] = "invalid_request_error"


class OpenAIErrorResponse(BaseModel):
    error: OpenAIError


ERROR_DESCRIPTIONS = {
    400: "Invalid request: a bad parameter, file or job spec (`param` names it)",
    404: "No such file or fine-tuning job",
    409: "The file is used by a job",
    413: "The file is larger than TUNEJOB_MAX_UPLOAD_BYTES",
    415: "The body is not multipart/form-data",
}


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` for a /v1 route: its error statuses, and "4XX" (any other client
    error, e.g. authentication) with the same body."""
    return {
        **{s: {"model": OpenAIErrorResponse, "description": ERROR_DESCRIPTIONS[s]} for s in statuses},
        "4XX": {"model": OpenAIErrorResponse, "description": "Any other client error"},
    }


class OpenAIRoute(APIRoute):
    """A route whose client errors are answered in OpenAI's shape: the app's own error handler
    (``api.errors``) writes the body, then this adds ``type`` and turns 422 into 400 (the pattern
    of FastAPI's "Custom Request and APIRoute class" guide)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route_handler(request: Request):
            try:
                return await handler(request)
            except (UserError, RequestValidationError, HTTPException) as e:  # HTTPException: api.body_limit's 413
                return await openai_error(request, e)

        return route_handler


async def openai_error(request: Request, error: Exception) -> JSONResponse:
    handlers = request.app.exception_handlers
    handler = next(handlers[cls] for cls in type(error).__mro__ if cls in handlers)
    response = handler(request, error)
    if inspect.isawaitable(response):
        response = await response
    body = json.loads(response.body)
    body["error"]["type"] = "invalid_request_error"
    headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
    return JSONResponse(
        body, status_code=400 if response.status_code == 422 else response.status_code, headers=headers
    )  # Retry-After, WWW-Authenticate


# ----------------------------------------------------------------------------- files and models


class FileObject(BaseModel):
    """A stored tunejob dataset as an OpenAI file (``purpose`` fine-tune, ``status`` processed:
    it was validated before it was stored)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["fine-tune"] = "fine-tune"
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool


class ModelObject(BaseModel):
    """A base model that can be fine-tuned. ``owned_by``: ``system`` (built in) or ``local``
    (a directory in TUNEJOB_MODELS_DIR); ``created``: its config.json's modification time."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def unix(moment) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def file_object(dataset: Dataset) -> FileObject:
    return FileObject(
        id=dataset.id, bytes=dataset.bytes, created_at=unix(dataset.created_at), filename=dataset.filename
    )


def model_object(name: str, path: Path, source: str) -> ModelObject:
    return ModelObject(id=name, created=int((path / "config.json").stat().st_mtime), owned_by=OWNERS[source])


# ----------------------------------------------------------------------------- fine-tuning jobs: requests


class OpenAIHyperparameters(Hyperparameters):
    """OpenAI's three hyperparameters ("auto" = tunejob's default), and any of tunejob's own
    (``max_length``, ``learning_rate``, ``batching``, ...: ``Hyperparameters``, with the same
    checks); only the ones given are used."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"n_epochs": 2, "batch_size": 16, "learning_rate_multiplier": 2, "max_length": 128}]
        }
    )

    # left_to_right: "auto" first, then the number, each validated as the rest of the spec is (an
    # integral 5.0 is a batch size of 5)
    n_epochs: Literal["auto"] | Annotated[float, Field(gt=0, le=1000)] | None = Field(
        None, union_mode="left_to_right", description="tunejob's `epochs`; may be fractional"
    )
    batch_size: Literal["auto"] | Annotated[int, Field(ge=1, le=4096)] = Field(  # type: ignore[assignment]
        "auto", union_mode="left_to_right", description="tunejob's `batch_size` (the micro-batch)"
    )
    learning_rate_multiplier: Literal["auto"] | Annotated[float, Field(gt=0, le=1000)] | None = Field(
        None, union_mode="left_to_right", description=f"`learning_rate` = this x {DEFAULT_LEARNING_RATE}"
    )


class SupervisedMethod(BaseModel):
    hyperparameters: OpenAIHyperparameters | None = None


class Method(BaseModel):
    type: str = Field(description="Only `supervised`; `dpo` and `reinforcement` are refused with 400")
    supervised: SupervisedMethod | None = None
    dpo: dict[str, Any] | None = None
    reinforcement: dict[str, Any] | None = None


class FineTuningJobCreate(BaseModel):
    """Body of ``POST /v1/fine_tuning/jobs``: OpenAI's fields, plus tunejob's own spec fields
    (``task``, ``text_column``, ``text_pair_column``, ``label_column``, ``validation_split``, and
    for multi_label ``label_separator``, ``decision_threshold``, ``tune_threshold``; the SDK sends
    them with ``extra_body``). The training file's ``text_pair`` column, if it has one,
    is the text pair unless ``text_pair_column`` says otherwise."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(examples=["all-MiniLM-L6-v2"])
    training_file: str = Field(examples=["ds_0123456789abcdef"])
    validation_file: str | None = None
    hyperparameters: OpenAIHyperparameters | None = None
    method: Method | None = None
    suffix: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] | None = None
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
    metadata: Metadata = None
    integrations: list[dict[str, Any]] | None = Field(None, description="Not supported: must be empty")
    task: Literal["classification", "regression", "multi_label", "token_classification"] | None = Field(
        None,
        description="tunejob: classification (default), regression, multi_label or token_classification (a "
        "CoNLL, JSONL or Parquet file of word lists and tag lists; columns default to `tokens` and "
        "`tags`)",
    )
    text_column: str | None = Field(None, description="tunejob: default `text` (`tokens` for token_classification)")
    text_pair_column: str | None = Field(None, description="tunejob: default `text_pair` when the file has it")
    label_column: str | None = Field(None, description="tunejob: default `label` (`tags` for token_classification)")
    label_separator: str | None = Field(None, description="tunejob, multi_label: splits text labels")
    decision_threshold: float | None = Field(None, description="tunejob, multi_label: default 0.5")
    tune_threshold: bool | None = Field(None, description="tunejob, multi_label: tune it on the validation set")
    validation_split: Annotated[float, Field(ge=0, lt=1)] | None = Field(
        None, description="tunejob: default 0.1 without a validation_file"
    )


@dataclass
class ParamNames:
    """Maps a tunejob spec parameter (``hyperparameters.epochs``) to the name the OpenAI request
    used for it (``hyperparameters.n_epochs``, or under ``method.supervised.hyperparameters``)."""

    hyperparameters: str = "hyperparameters"  # where the request's hyperparameters were
    renamed: dict[str, str] = field(default_factory=dict)  # tunejob hyperparameter -> request param

    def __call__(self, param: str | None) -> str | None:
        head, _, name = (param or "").partition(".")
        if head == "hyperparameters" and name:
            return self.renamed.get(name, f"{self.hyperparameters}.{name}")
        return OPENAI_FIELDS.get(param, param) if param is not None else None


def bad_request(code: str, message: str, param: str) -> UserError:
    return UserError(code, message, param, status=400)


def job_spec(body: FineTuningJobCreate, caller: Caller) -> tuple[JobCreate, ParamNames]:
    """The tunejob spec of an OpenAI create request, and how its parameters were named.

    Raises:
        UserError: ``unsupported_method`` (a ``method`` other than supervised),
            ``unsupported_parameter`` (integrations), ``conflicting_parameters`` (one value given
            twice, e.g. ``n_epochs`` and ``epochs``).
        RequestValidationError: the spec is invalid (``JobCreate``'s checks), with OpenAI names.
    """
    if body.method and body.method.type != "supervised":
        raise bad_request(
            "unsupported_method",
            f"method.type {body.method.type!r} is not supported: tunejob "
            "fine-tunes encoders for classification (single- and multi-label), regression and token "
            "classification, method 'supervised' only",
            "method.type",
        )
    if body.integrations:
        raise bad_request("unsupported_parameter", "integrations are not supported", "integrations")
    names = ParamNames()
    hyperparameters = native_hyperparameters(body, names)
    tunejob_fields = body.model_dump(
        include={
            "task",
            "text_column",
            "text_pair_column",
            "label_column",
            "validation_split",
            "label_separator",
            "decision_threshold",
            "tune_threshold",
        },
        exclude_none=True,
    )
    if (
        "text_pair_column" not in tunejob_fields
        and body.task != "token_classification"
        and "text_pair" in _columns(body.training_file, caller)
    ):
        tunejob_fields["text_pair_column"] = "text_pair"
    try:
        spec = JobCreate.model_validate(
            {
                "base_model": body.model,
                "training_dataset": body.training_file,
                "validation_dataset": body.validation_file,
                "hyperparameters": hyperparameters,
                "metadata": body.metadata,
                "suffix": body.suffix,
                **tunejob_fields,
            }
        )
    except ValidationError as e:
        raise RequestValidationError([_renamed(error, names) for error in e.errors()]) from e
    return spec, names


def _renamed(error: ErrorDetails, names: ParamNames) -> dict:
    """A pydantic error about a ``JobCreate`` field, located at the request's name for it."""
    if not error["loc"]:
        return dict(error)
    return {**error, "loc": ("body", *(names(".".join(map(str, error["loc"]))) or "").split("."))}


def native_hyperparameters(body: FineTuningJobCreate, names: ParamNames) -> dict[str, Any]:
    """tunejob's hyperparameters from the request's ``hyperparameters`` (or
    ``method.supervised.hyperparameters``) and ``seed``; records the request's names in ``names``.

    Raises:
        UserError: ``conflicting_parameters`` when one value is given twice.
    """
    hp = body.hyperparameters or OpenAIHyperparameters()
    supervised = body.method.supervised if body.method else None
    if supervised and supervised.hyperparameters:
        if body.hyperparameters:
            raise bad_request(
                "conflicting_parameters",
                "give hyperparameters or method.supervised.hyperparameters, not both",
                "method.supervised.hyperparameters",
            )
        names.hyperparameters, hp = "method.supervised.hyperparameters", supervised.hyperparameters
    given = hp.model_fields_set
    hyperparameters = {name: getattr(hp, name) for name in given - OPENAI_HYPERPARAMETERS.keys()}
    for openai_name, name in OPENAI_HYPERPARAMETERS.items():
        value = getattr(hp, openai_name)
        if openai_name not in given or value is None or value == "auto":
            continue
        if openai_name != name and name in hyperparameters:
            raise bad_request(
                "conflicting_parameters",
                f"give {openai_name} or {name}, not both",
                f"{names.hyperparameters}.{openai_name}",
            )
        hyperparameters[name] = value * DEFAULT_LEARNING_RATE if name == "learning_rate" else value
        names.renamed[name] = f"{names.hyperparameters}.{openai_name}"
    if body.seed is not None:
        if "seed" in hyperparameters:
            raise bad_request("conflicting_parameters", "give seed or hyperparameters.seed, not both", "seed")
        hyperparameters["seed"], names.renamed["seed"] = body.seed, "seed"
    return hyperparameters


def _columns(dataset_id: str, caller: Caller) -> list[str]:
    try:
        return uploads.get_dataset(dataset_id, caller).columns
    except NotFound:
        return []  # check_spec names the missing file


# ----------------------------------------------------------------------------- fine-tuning jobs: objects


class JobHyperparameters(BaseModel):
    n_epochs: int | float
    batch_size: int
    learning_rate_multiplier: float


class SupervisedMethodOut(BaseModel):
    hyperparameters: JobHyperparameters


class MethodOut(BaseModel):
    type: Literal["supervised"] = "supervised"
    supervised: SupervisedMethodOut


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(BaseModel):
    """A tunejob job as OpenAI's ``fine_tuning.job``. ``fine_tuned_model`` names the trained model
    (``ft:<base model>[:<suffix>]:<job id>``; download it from ``/jobs/{id}/artifacts``);
    ``trained_tokens`` counts the real (non-padding) tokens trained, over all epochs;
    ``result_files`` is always empty (the results are the job's artifacts); tunejob never reports
    ``validating_files``: files are validated before the job exists."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None
    fine_tuned_model: str | None
    finished_at: int | None
    hyperparameters: JobHyperparameters
    model: str
    organization_id: str
    result_files: list[str]
    seed: int
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
    trained_tokens: int | None
    training_file: str
    validation_file: str | None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    method: MethodOut


class FineTuningJobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


class FineTuningJobEvent(BaseModel):
    """A job event; ``data.code`` is tunejob's event code (``created``, ``started``, ``requeued``, ...)."""

    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"


class FineTuningJobEventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobEvent]
    has_more: bool


class CheckpointMetrics(BaseModel):
    """The validation metrics at the checkpoint: ``valid_loss``, and tunejob's other validation
    metrics as ``valid_<name>`` (``valid_accuracy``, ``valid_f1_macro``, ``valid_mse``, ``valid_entity_f1``, ...)."""

    model_config = ConfigDict(extra="allow")

    step: float
    valid_loss: float | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


class FineTuningJobCheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobCheckpoint]
    has_more: bool


def fine_tuned_model_name(job: Job) -> str:
    suffix = job.spec.get("suffix")
    return ":".join(["ft", job.base_model, *([suffix] if suffix else []), job.id])


def fine_tuning_job(job: Job) -> FineTuningJob:
    """Job ``job`` as OpenAI's object (a sweep's pruned trial ``cancelled``: ``OPENAI_STATUS``)."""
    hp, error = stored_hyperparameters(job)
    hyperparameters = JobHyperparameters(
        n_epochs=int(hp.epochs) if float(hp.epochs).is_integer() else hp.epochs,
        batch_size=hp.batch_size,
        learning_rate_multiplier=float(f"{hp.learning_rate / DEFAULT_LEARNING_RATE:.12g}"),
    )
    finished = job.status in JobStatus.FINISHED
    running_eta = job.status == JobStatus.RUNNING and job.eta_seconds is not None
    return FineTuningJob(
        id=job.id,
        created_at=unix(job.created_at),
        finished_at=unix(job.finished_at),
        error=JobError(code=error["code"], message=error["message"]) if error else None,
        fine_tuned_model=fine_tuned_model_name(job) if job.status == JobStatus.SUCCEEDED else None,
        hyperparameters=hyperparameters,
        model=job.base_model,
        organization_id="tunejob",
        result_files=[],
        seed=hp.seed,
        status=OPENAI_STATUS.get(job.status, job.status),
        trained_tokens=(job.train_metrics or {}).get("real_tokens") if finished else None,
        training_file=job.training_dataset_id,
        validation_file=job.validation_dataset_id,
        estimated_finish=int(time.time() + job.eta_seconds) if running_eta and job.eta_seconds is not None else None,
        metadata=job.spec.get("metadata"),
        method=MethodOut(supervised=SupervisedMethodOut(hyperparameters=hyperparameters)),
    )


def event_id(event: JobEvent) -> str:
    return f"ftevent_{event.id}"


def job_event(event: JobEvent) -> FineTuningJobEvent:
    return FineTuningJobEvent(
        id=event_id(event),
        created_at=unix(event.time),
        level=EVENT_LEVELS.get(event.level, "info"),
        message=event.message,
        data={"code": event.code},
    )


def checkpoint_id(checkpoint: Checkpoint) -> str:
    return f"ftckpt_{checkpoint.id}"


def job_checkpoint(checkpoint: Checkpoint, job: Job) -> FineTuningJobCheckpoint:
    validation = checkpoint.metrics or {}
    metrics = CheckpointMetrics(
        step=checkpoint.step,
        valid_loss=validation.get("loss"),
        **{f"valid_{k}": v for k, v in validation.items() if k != "loss" and not isinstance(v, dict)},
    )  # per_entity stays in tunejob's API
    return FineTuningJobCheckpoint(
        id=checkpoint_id(checkpoint),
        created_at=unix(checkpoint.created_at),
        fine_tuned_model_checkpoint=f"{fine_tuned_model_name(job)}:ckpt-step-{checkpoint.step}",
        fine_tuning_job_id=job.id,
        metrics=metrics,
        step_number=checkpoint.step,
    )


T = TypeVar("T")


def page_after(items: Sequence[T], ids: Callable[[T], str], after: str | None, limit: int) -> tuple[list[T], bool]:
    """The ``limit`` items that follow the one whose id is ``after`` (cursor pagination of a short
    list read whole: a job's events or checkpoints). Returns (items, has_more).

    Raises:
        UserError: ``invalid_cursor`` (400) when no item has the id ``after``.
    """
    start = 0
    if after is not None:
        position = next((i for i, item in enumerate(items) if ids(item) == after), None)
        if position is None:
            raise bad_request("invalid_cursor", f"after {after!r} is not the id of a listed object", "after")
        start = position + 1
    return list(items[start : start + limit]), len(items) > start + limit
