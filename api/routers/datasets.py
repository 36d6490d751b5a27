from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api.auth import CallerDep
from api.errors import error_responses
from api.headers import IdempotencyKey
from api.uploads import store_upload, upload_body
from shared.jobs import uploads
from shared.schemas.jobs import DatasetOut
from shared.store import idempotency

router = APIRouter(tags=["datasets"])


@router.post(
    "/datasets",
    status_code=201,
    openapi_extra=upload_body(),
    responses=error_responses(409, 413, 415, 422),
    response_model=DatasetOut,
)
async def upload_dataset(
    request: Request, caller: CallerDep, idempotency_key: IdempotencyKey = None
) -> DatasetOut | JSONResponse:
    """Upload a CSV, TSV, JSONL or Parquet file (multipart field ``file``).

    The body is streamed to disk and refused with 413 as soon as it passes
    ``TUNEJOB_MAX_UPLOAD_BYTES`` (at once when ``Content-Length`` says so). The file is then checked
    in batches (UTF-8, parses, unique header, no ragged row, at least one row, Parquet's expanded
    size) before anything is recorded; a rejected file leaves no row and no file behind, and the
    error lists up to 20 problems (row, column, value, message). With an ``Idempotency-Key``
    header, a retry of the same file under the same name (within 24 h) gets the first response back.
    """
    dataset = await store_upload(request, caller, idempotency_key)
    if isinstance(dataset, idempotency.Replay):
        return JSONResponse(dataset.body, status_code=dataset.status_code)
    return DatasetOut.model_validate(dataset)


@router.get("/datasets")
def list_datasets(caller: CallerDep) -> dict[str, list[DatasetOut]]:
    datasets, _ = uploads.list_datasets(caller)
    return {"data": [DatasetOut.model_validate(d) for d in datasets]}


@router.get("/datasets/{dataset_id}")
def get_dataset(dataset_id: str, caller: CallerDep) -> DatasetOut:
    return DatasetOut.model_validate(uploads.get_dataset(dataset_id, caller))


@router.delete("/datasets/{dataset_id}", status_code=204, responses=error_responses(409))
def delete_dataset(dataset_id: str, caller: CallerDep) -> Response:
    """Delete the uploaded file and its cached tokenizations; the id then answers 404 (code
    ``deleted``). Finished jobs that used it keep their models. 409 while a queued or running job
    uses it."""
    uploads.delete_dataset(dataset_id, caller)
    return Response(status_code=204)
