"""A running job, live: its server-sent event stream and its training curves as a PNG."""

from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse

from api.auth import CallerDep
from api.feeds import Cursor
from shared.errors import UserError
from shared.jobs import curves, lifecycle
from shared.settings import get_settings

router = APIRouter(prefix="/jobs", tags=["jobs"])


@router.get(
    "/{job_id}/stream",
    response_class=EventSourceResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "progress, metrics, events, then end (see api/feeds.py)",
        }
    },
)
def stream_job(
    job_id: str,
    request: Request,
    caller: CallerDep,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventSourceResponse:
    """Server-sent events: ``progress`` (the job, as ``GET /jobs/{id}``) whenever it changes,
    ``metrics`` and ``events`` (``{"data": [...]}``, each row once) as they are written, and
    ``end`` (the job) after it finished. Each message's id is the position to resume from with
    ``Last-Event-ID``; a comment line every ``TUNEJOB_STREAM_HEARTBEAT_SECONDS`` keeps the
    connection open. Every open stream of a job shares one reader of the job store."""
    lifecycle.get_job(job_id, caller)
    cursor = Cursor.parse(last_event_id)
    return EventSourceResponse(
        request.app.state.feeds.stream(job_id, cursor), ping=get_settings().stream_heartbeat_seconds
    )


@router.get(
    "/{job_id}/plot.png",
    response_class=Response,
    responses={200: {"content": {"image/png": {}}, "description": "the training curves"}},
)
def plot_job(job_id: str, caller: CallerDep) -> Response:
    """Train loss and learning rate, evaluation metrics, tokens/s and padding efficiency by step,
    drawn from the metric rows written so far (the artifact's ``training_curves.png`` is the
    same picture at the end of the job).

    409 ``no_metrics`` while the job has written none."""
    job = lifecycle.get_job(job_id, caller)
    series = curves.series_of(curves.metric_rows(job_id))
    if not series:
        raise UserError("no_metrics", f"job {job_id!r} has written no metrics yet (it is {job.status})", "job_id", 409)
    return Response(curves.render_png(series, f"{job_id} · {job.base_model}"), media_type="image/png")
