"""``/v1``: the OpenAI fine-tuning API over tunejob, so that the official ``openai`` SDK
(``OpenAI(base_url="http://host:8000/v1")``) uploads files and runs fine-tuning jobs.

A thin adapter: every route calls the same services as the native API (``shared.jobs.uploads``,
``shared.jobs``, ``shared.queue.submit``, ``shared.jobs.base_models``) and only reshapes their
results (``api.openai_compat``). A file is a tunejob dataset, a fine-tuning job a tunejob job,
with the same ids in both APIs.
"""

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request

from api.auth import CallerDep
from api.headers import IdempotencyKey
from api.openai_compat import (
    FileDeleted,
    FileList,
    FileObject,
    FineTuningJob,
    FineTuningJobCheckpointList,
    FineTuningJobCreate,
    FineTuningJobEventList,
    FineTuningJobList,
    ModelList,
    OpenAIRoute,
    checkpoint_id,
    error_responses,
    event_id,
    file_object,
    fine_tuning_job,
    job_checkpoint,
    job_event,
    job_spec,
    model_object,
    page_after,
)
from api.openai_embeddings import EmbeddingCreate, EmbeddingList, embedding_list
from api.routers.inference import embed_texts_with
from api.uploads import store_upload, upload_body
from shared.errors import UserError
from shared.jobs import lifecycle, uploads
from shared.jobs.base_models import available_models
from shared.queue import submit_once
from shared.store.idempotency import Replay

router = APIRouter(prefix="/v1", tags=["openai-compatible"], route_class=OpenAIRoute)
Limit = Annotated[int, Query(ge=1, le=100)]


@router.post(
    "/files",
    responses=error_responses(400, 413, 415),
    openapi_extra=upload_body(purpose={"type": "string", "enum": ["fine-tune"]}),
)
async def create_file(request: Request, caller: CallerDep) -> FileObject:
    """Upload a training or validation file (multipart fields ``file`` and ``purpose``, which must
    be ``fine-tune``): JSONL rows ``{"text": ..., "label": ...}`` (and ``"text_pair"``), or CSV, TSV,
    Parquet as in ``POST /datasets``, streamed and checked the same way. It is validated before it
    is stored, so it is ``processed`` at once."""
    dataset = await store_upload(request, caller, None, ("purpose",), check_purpose)
    assert not isinstance(dataset, Replay)  # no idempotency key: nothing to replay
    return file_object(dataset)


def check_purpose(fields: dict[str, str]) -> None:
    if fields["purpose"] != "fine-tune":
        raise UserError(
            "invalid_request", f"purpose {fields['purpose']!r} is not supported; use 'fine-tune'", "purpose"
        )


@router.get("/files", responses=error_responses(400))
def list_files(
    caller: CallerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> FileList:
    """Files by upload time, ``limit`` at a time after file ``after``. Every file has purpose
    ``fine-tune``: any other ``purpose`` lists nothing."""
    if purpose not in (None, "fine-tune"):
        return FileList(data=[], has_more=False)
    datasets, has_more = uploads.list_datasets(caller, limit, after, newest_first=order == "desc")
    return FileList(data=[file_object(d) for d in datasets], has_more=has_more)


@router.get("/files/{file_id}", responses=error_responses(404))
def retrieve_file(file_id: str, caller: CallerDep) -> FileObject:
    return file_object(uploads.get_dataset(file_id, caller))


@router.delete("/files/{file_id}", responses=error_responses(404, 409))
def delete_file(file_id: str, caller: CallerDep) -> FileDeleted:
    """Delete a file that no job uses (409 otherwise)."""
    uploads.delete_dataset(file_id, caller)
    return FileDeleted(id=file_id, deleted=True)


@router.get("/models", responses=error_responses())
def list_models() -> ModelList:
    """The base models that can be fine-tuned."""
    return ModelList(data=[model_object(name, path, source) for name, (path, source) in available_models().items()])


@router.post("/embeddings", responses=error_responses(400, 404, 409))
def create_embeddings(body: EmbeddingCreate, caller: CallerDep) -> EmbeddingList:
    """Embed ``input`` with ``model`` (an embedding job's id or fine-tuned name, or a base model's
    name), as ``POST /models/{job_id}/embed`` does; ``usage`` counts the inputs' tokens."""
    result, loaded = embed_texts_with(body.model, body.texts, True, caller, "input")
    if body.dimensions is not None and body.dimensions != loaded.dimensions:
        raise UserError(
            "unsupported_dimensions",
            f"dimensions {body.dimensions}: model {body.model!r} gives {loaded.dimensions}-dimensional vectors",
            "dimensions",
        )
    return embedding_list(body.model, result.vectors, result.tokens, body.encoding_format)


@router.post("/fine_tuning/jobs", responses=error_responses(400))
def create_fine_tuning_job(
    body: FineTuningJobCreate, caller: CallerDep, idempotency_key: IdempotencyKey = None
) -> FineTuningJob:
    """Check the job against its model and files exactly as ``POST /jobs`` does, store it and
    queue it. ``hyperparameters``: ``n_epochs``, ``batch_size``, ``learning_rate_multiplier``
    ("auto" = tunejob's default) and any of tunejob's own (``max_length``, ...). With an
    ``Idempotency-Key``, a retry with the same key and body (within 24 h) gets the same job back
    and queues nothing (the ``openai`` SDK retries a create that timed out: it made a second job)."""
    spec, names = job_spec(body, caller)
    try:
        answer = submit_once("POST /v1/fine_tuning/jobs", spec, caller, idempotency_key, lifecycle.to_out)
    except UserError as e:
        e.param = names(e.param)
        raise
    job_id = answer.body["id"] if isinstance(answer, Replay) else answer.id  # type: ignore[attr-defined]
    return fine_tuning_job(lifecycle.get_job(job_id, caller))


@router.get("/fine_tuning/jobs", responses=error_responses(400))
def list_fine_tuning_jobs(
    request: Request, caller: CallerDep, after: str | None = None, limit: Limit = 20
) -> FineTuningJobList:
    """Jobs, newest first, ``limit`` at a time after job ``after``; with ``metadata[key]=value``
    query parameters (OpenAI's filter, which the ``openai`` SDK sends for ``metadata={...}``), only
    those whose metadata holds each (it was ignored: every job came back)."""
    metadata = {
        key[len("metadata[") : -1]: value
        for key, value in request.query_params.items()
        if key.startswith("metadata[") and key.endswith("]")
    }
    page, has_more = lifecycle.list_jobs(caller, limit, after, metadata=metadata)
    return FineTuningJobList(data=[fine_tuning_job(j) for j in page], has_more=has_more)


@router.get("/fine_tuning/jobs/{job_id}", responses=error_responses(404))
def retrieve_fine_tuning_job(job_id: str, caller: CallerDep) -> FineTuningJob:
    return fine_tuning_job(lifecycle.get_job(job_id, caller))


@router.post("/fine_tuning/jobs/{job_id}/cancel", responses=error_responses(404))
def cancel_fine_tuning_job(job_id: str, caller: CallerDep) -> FineTuningJob:
    """A queued job is cancelled at once; a running one stops at its next optimizer step."""
    return fine_tuning_job(lifecycle.request_cancel(job_id, caller))


@router.get("/fine_tuning/jobs/{job_id}/events", responses=error_responses(400, 404))
def list_fine_tuning_events(
    job_id: str, caller: CallerDep, after: str | None = None, limit: Limit = 20
) -> FineTuningJobEventList:
    """The job's events, newest first."""
    events, has_more = page_after(lifecycle.list_events(job_id, caller)[::-1], event_id, after, limit)
    return FineTuningJobEventList(data=[job_event(e) for e in events], has_more=has_more)


@router.get("/fine_tuning/jobs/{job_id}/checkpoints", responses=error_responses(400, 404))
def list_fine_tuning_checkpoints(
    job_id: str, caller: CallerDep, after: str | None = None, limit: Limit = 10
) -> FineTuningJobCheckpointList:
    """The job's kept checkpoints (the newest ``save_total_limit``), newest first."""
    job = lifecycle.get_job(job_id, caller)
    checkpoints, has_more = page_after(lifecycle.list_checkpoints(job_id, caller)[::-1], checkpoint_id, after, limit)
    return FineTuningJobCheckpointList(data=[job_checkpoint(c, job) for c in checkpoints], has_more=has_more)
