"""Batch prediction jobs: ``/predictions``, the same lifecycle, events and stream as ``/jobs``
(``shared.jobs.predictions``). A training job's id answers 404 here, and a prediction's on ``/jobs``."""

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from sse_starlette import EventSourceResponse

from api import db
from api.auth import CallerDep
from api.errors import SafeJSONResponse, error_responses, stream_body
from api.feeds import Cursor
from api.headers import IdempotencyKey, respond
from shared.jobs import evaluation, lifecycle, predictions
from shared.jobs.positions import with_positions
from shared.jobs.prediction_results import MEDIA_TYPES, results_stream
from shared.jobs.predictions import KIND
from shared.queue import submit_once
from shared.schemas.jobs import EventOut
from shared.schemas.predictions import (
    PredictionCreate,
    PredictionDryRunOut,
    PredictionList,
    PredictionOut,
)
from shared.settings import get_settings

router = APIRouter(prefix="/predictions", tags=["predictions"])
Status = Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled)$")]


@router.post(
    "",
    status_code=201,
    response_model=PredictionOut,
    responses={
        200: {"model": PredictionDryRunOut, "description": "dry_run=true: the plan; nothing is stored or queued"},
        **error_responses(404, 409, 413),
    },
)
def create_prediction(
    spec: PredictionCreate, caller: CallerDep, dry_run: bool = False, idempotency_key: IdempotencyKey = None
):
    """Check the request against its model and data, store the prediction job, then queue its id.

    ``model`` is a succeeded training job of yours (``job_…``) or a base model with a
    sequence- or token-classification head. With ``dry_run=true`` nothing is stored or queued: the response (200) is
    the plan (rows, tokens, texts truncated at ``max_length``, padding efficiency, estimated time).
    With an ``Idempotency-Key`` header, a retry with the same key and body (within 24 h) gets the
    first response back and queues nothing.
    """
    if dry_run:
        plan = PredictionDryRunOut(
            dry_run=True, plan=predictions.plan_prediction(predictions.check_prediction(spec, caller))
        )
        return SafeJSONResponse(plan.model_dump(mode="json"))
    return respond(submit_once("POST /predictions", spec, caller, idempotency_key, predictions.to_out))


@router.get("")
def list_predictions(
    caller: CallerDep, status: Status = None, limit: Annotated[int, Query(ge=1, le=100)] = 20, cursor: str | None = None
) -> PredictionList:
    """Prediction jobs, newest first. Pass ``next_cursor`` back as ``cursor`` for the next page."""
    page, has_more = lifecycle.list_jobs(caller, limit, cursor, status, param="cursor", kind=KIND)
    return PredictionList(
        data=with_positions([predictions.to_out(j) for j in page]), next_cursor=page[-1].id if has_more else None
    )


@router.get("/{prediction_id}")
async def get_prediction(prediction_id: str, caller: CallerDep) -> PredictionOut:
    prediction = predictions.to_out(await db.read(lifecycle.get_job, prediction_id, caller, KIND))
    return (await db.read(with_positions, [prediction]))[0] if prediction.status == "queued" else prediction


@router.delete("/{prediction_id}", status_code=204, responses=error_responses(409))
def delete_prediction(prediction_id: str, caller: CallerDep) -> Response:
    """Delete a finished prediction's results and events. Its id then answers 404 (code
    ``deleted``). A queued or running one answers 409: cancel it first."""
    lifecycle.delete_job(prediction_id, caller, kind=KIND)
    return Response(status_code=204)


@router.post("/{prediction_id}/cancel")
def cancel_prediction(prediction_id: str, caller: CallerDep) -> PredictionOut:
    """A queued prediction never starts; a running one stops after the part it is scoring (the
    parts written so far are kept until it is deleted)."""
    return predictions.to_out(lifecycle.request_cancel(prediction_id, caller, kind=KIND))


@router.get("/{prediction_id}/events")
def prediction_events(prediction_id: str, caller: CallerDep) -> dict[str, list[EventOut]]:
    return {"data": [EventOut.model_validate(e) for e in lifecycle.list_events(prediction_id, caller, kind=KIND)]}


@router.get(
    "/{prediction_id}/results",
    response_class=StreamingResponse,
    responses={
        200: {"content": {t: {} for t in MEDIA_TYPES.values()}, "description": "one row per input row, in input order"},
        **error_responses(409),
    },
)
def prediction_results(
    prediction_id: str, caller: CallerDep, format: Literal["jsonl", "csv", "parquet"] = "jsonl"
) -> StreamingResponse:
    """A succeeded prediction's results, streamed: one row per input row, in input order, with
    ``id`` (the ``id_column`` value, as text, or the 0-based row index), then ``label``, ``score``
    and ``probabilities`` (every class's) for classification; ``value`` for regression;
    ``labels`` (those at or above the model's decision threshold) and ``probabilities`` (every
    label's sigmoid score) for multi_label; ``entities`` (``entity_group``, ``score``, ``word``,
    ``start``, ``end``: character offsets into the text) for token_classification. CSV has one
    ``probabilities.<class>`` column per class, and ``labels`` and ``entities`` as JSON text. 409
    before it has succeeded."""
    chunks = results_stream(prediction_id, caller, format)
    return StreamingResponse(
        stream_body(chunks, f"prediction {prediction_id} results.{format}"),
        media_type=MEDIA_TYPES[format],
        headers={"Content-Disposition": f'attachment; filename="{prediction_id}.{format}"'},
    )


@router.get("/{prediction_id}/evaluation", responses=error_responses(409))
def prediction_evaluation(prediction_id: str, caller: CallerDep) -> dict:
    """The evaluation report of a prediction made with a ``label_column`` (a labelled test set):
    the same report, with the same metric definitions, as a training job's on its validation rows
    (``GET /jobs/{id}/evaluation``), computed from this prediction's results. ``unknown_labels``
    names the labels the model does not know (``count_unknown_labels``), whose rows count as
    errors. 404 for a prediction without a ``label_column``; 409 before it has succeeded."""
    return evaluation.prediction_evaluation(prediction_id, caller)


@router.get(
    "/{prediction_id}/evaluation/{figure}",
    response_class=FileResponse,
    responses={
        200: {"content": {"image/png": {}}, "description": "a picture the report names in its ``figures``"},
        **error_responses(409),
    },
)
def prediction_evaluation_figure(
    prediction_id: str, caller: CallerDep, figure: Annotated[str, Path(pattern=r"^[a-z_]{1,40}\.png$")]
) -> FileResponse:
    """A picture of the prediction's evaluation report (``confusion_matrix.png``,
    ``reliability_diagram.png``, ``residuals.png``: as the report's ``figures`` lists them)."""
    return FileResponse(evaluation.prediction_report_file(prediction_id, caller, figure), media_type="image/png")


@router.get(
    "/{prediction_id}/stream",
    response_class=EventSourceResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "progress, events, then end (see api/feeds.py)"}
    },
)
def stream_prediction(
    prediction_id: str,
    request: Request,
    caller: CallerDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventSourceResponse:
    """Server-sent events, as ``GET /jobs/{id}/stream``: ``progress`` (the prediction, as
    ``GET /predictions/{id}``) whenever it changes, ``events`` as they are written, and ``end``
    (the prediction) after it finished; resumable with ``Last-Event-ID``."""
    lifecycle.get_job(prediction_id, caller, kind=KIND)
    return EventSourceResponse(
        request.app.state.feeds.stream(prediction_id, Cursor.parse(last_event_id)),
        ping=get_settings().stream_heartbeat_seconds,
    )
