"""Request headers that several routers read (``Idempotency-Key``, ``Last-Event-ID``), and the
answer to a request that carried an ``Idempotency-Key``: on a retry, the first request's response
again (``shared.queue.submit_once``)."""

import re
from typing import Annotated

from fastapi import Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.errors import UserError
from shared.store import idempotency

IdempotencyKey = Annotated[
    str | None,
    Header(alias=idempotency.HEADER, min_length=1, max_length=255, description=idempotency.HEADER_DESCRIPTION),
]

EVENT_ID = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit passes "²", which int() refuses), < 2**63


def after_event_id(last_event_id: str | None) -> int:
    """The job event id in a ``Last-Event-ID`` header (``GET /sweeps/{id}/stream``); 0 without one.

    Raises:
        UserError: ``invalid_last_event_id`` (422) for anything but an event id (1 to 18 ASCII digits).
    """
    if not last_event_id or not last_event_id.strip():
        return 0
    if not EVENT_ID.fullmatch(last_event_id.strip()):
        raise UserError(
            "invalid_last_event_id",
            f"Last-Event-ID {last_event_id!r} is not an event id of this stream (an integer)",
            "Last-Event-ID",
        )
    return int(last_event_id)


def respond(answer: BaseModel | idempotency.Replay) -> BaseModel | JSONResponse:
    """The response to an idempotent creation: the new resource's view, or a retry's replay of the
    first response (its status and body, as stored)."""
    if isinstance(answer, idempotency.Replay):
        return JSONResponse(answer.body, status_code=answer.status_code)
    return answer
