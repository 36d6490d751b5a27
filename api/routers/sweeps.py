"""Hyperparameter sweeps (``shared.jobs.sweeps``): many trials of one job spec, each an ordinary job."""

import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from api import db
from api.auth import CallerDep
from api.errors import SafeJSONResponse, error_responses
from api.headers import IdempotencyKey, after_event_id, respond
from shared.jobs import sweep_report, sweeps
from shared.queue import send_trials
from shared.schemas.sweeps import SweepCreate, SweepList, SweepOut, SweepPlan, TrialOut
from shared.settings import get_settings
from shared.store import idempotency
from shared.store.tenancy import Caller

router = APIRouter(prefix="/sweeps", tags=["sweeps"])
TRIAL_EVENTS = {
    "started": "trial_started",
    "succeeded": "trial_ended",
    "failed": "trial_ended",
    "cancelled": "trial_ended",
    "pruned": "trial_pruned",
    "job_restarted": "trial_restarted",
}


@router.post(
    "",
    status_code=201,
    response_model=SweepOut,
    responses={200: {"model": SweepPlan, "description": "dry_run=true: the plan; nothing is stored or queued"}},
)
def create_sweep(spec: SweepCreate, caller: CallerDep, dry_run: bool = False, idempotency_key: IdempotencyKey = None):
    """Check the sweep against its model, data and the search space, store it and queue its first
    trials (``max_parallel_trials`` of them); each later trial is asked for when one ends.

    With ``dry_run=true`` nothing is stored: the response (200) is the search space as understood,
    the first trials' parameters and one trial's plan (as ``POST /jobs?dry_run=true``). With an
    ``Idempotency-Key``, a retry with the same key and body gets the first answer and queues nothing.
    """
    if dry_run:
        return SafeJSONResponse(sweeps.plan_sweep(spec, caller).model_dump(mode="json"))
    created = idempotency.once(
        caller.tenant,
        "POST /sweeps",
        idempotency_key,
        idempotency.fingerprint(spec.model_dump_json()),
        lambda claim: sweeps.create_sweep(spec, caller, claim),
    )
    if isinstance(created, idempotency.Replay):
        return respond(created)
    send_trials(created.id)
    return sweeps.get_sweep(created.id, caller)


@router.get("")
def list_sweeps(
    caller: CallerDep, limit: Annotated[int, Query(ge=1, le=100)] = 20, cursor: str | None = None
) -> SweepList:
    """Sweeps, newest first. Pass ``next_cursor`` back as ``cursor`` for the next page."""
    page, more = sweeps.list_sweeps(caller, limit, cursor)
    return SweepList(data=page, next_cursor=page[-1].id if more else None)


@router.get("/{sweep_id}")
def get_sweep(sweep_id: str, caller: CallerDep) -> SweepOut:
    return sweeps.get_sweep(sweep_id, caller)


@router.get("/{sweep_id}/trials")
def list_trials(sweep_id: str, caller: CallerDep) -> dict[str, list[TrialOut]]:
    """Every trial by number: its job (``GET /jobs/{job_id}``), parameters, status, value, steps run."""
    return {"data": sweeps.list_trials(sweep_id, caller)}


@router.post("/{sweep_id}/cancel")
def cancel_sweep(sweep_id: str, caller: CallerDep) -> SweepOut:
    """End the sweep: queued trials never start, running ones stop after their next optimizer step."""
    return sweeps.cancel_sweep(sweep_id, caller)


@router.delete("/{sweep_id}", status_code=204, responses=error_responses(409))
def delete_sweep(sweep_id: str, caller: CallerDep) -> Response:
    """Delete an ended sweep and all its trials (their models too). 409 while it runs: cancel it first."""
    sweeps.delete_sweep(sweep_id, caller)
    return Response(status_code=204)


@router.get(
    "/{sweep_id}/report/{report}",
    response_class=Response,
    responses={
        200: {"content": {"text/csv": {}, "image/png": {}}, "description": "the report file"},
        **error_responses(409),
    },
)
def sweep_report_file(sweep_id: str, report: str, caller: CallerDep) -> Response:
    """The sweep's report, drawn from its trials now: ``trials.csv`` (number, job, parameters,
    status, value, steps), and Optuna's ``optimization_history.png`` and ``param_importances.png``
    (409 ``not_enough_trials`` until enough trials completed)."""
    content, media_type = sweep_report.report_file(sweep_id, report, caller)
    return Response(
        content, media_type=media_type, headers={"Content-Disposition": f'attachment; filename="{sweep_id}-{report}"'}
    )


@router.get(
    "/{sweep_id}/stream",
    response_class=EventSourceResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "trial_started, trial_ended, trial_pruned, best, end",
        }
    },
)
def stream_sweep(
    sweep_id: str, caller: CallerDep, last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None
) -> EventSourceResponse:
    """Server-sent events: ``trial_started``, ``trial_ended``, ``trial_pruned`` and
    ``trial_restarted`` (``{"trial_number", "job_id", "code", "message"}``), ``best`` (the sweep,
    whenever its best trial changes) and ``end`` (the sweep, once it ended). Message ids are job
    event ids: reconnect with ``Last-Event-ID`` to resume (anything but such an id: 422)."""
    after = after_event_id(last_event_id)
    sweeps.get_sweep(sweep_id, caller)
    return EventSourceResponse(_feed(sweep_id, caller, after), ping=get_settings().stream_heartbeat_seconds)


async def _feed(sweep_id: str, caller: Caller, after: int):
    best = None
    while True:
        sweep = await db.in_thread(sweeps.get_sweep, sweep_id, caller)  # first: the events read next are all
        for event_id, job_id, event, number in await db.in_thread(sweeps.events_since, sweep_id, caller, after):
            after = event_id
            if event.code in TRIAL_EVENTS:
                yield ServerSentEvent(
                    event=TRIAL_EVENTS[event.code],
                    id=str(event_id),
                    data=json.dumps(
                        {"trial_number": number, "job_id": job_id, "code": event.code, "message": event.message}
                    ),
                )
        if sweep.best_trial is not None and sweep.best_trial != best:
            best = sweep.best_trial
            yield ServerSentEvent(event="best", data=sweep.model_dump_json())
        if sweep.finished_at is not None:
            yield ServerSentEvent(event="end", data=sweep.model_dump_json())
            return
        await asyncio.sleep(get_settings().stream_poll_seconds)
