"""Request headers that several routers read, and the idempotent submission of a job."""

import re
from collections.abc import Callable
from typing import Annotated

from fastapi import Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.errors import UserError
from shared.queue import submit
from shared.store import idempotency
from shared.store.rows import Job
from shared.store.tenancy import Caller

IdempotencyKey = Annotated[str | None, Header(alias=idempotency.HEADER, min_length=1, max_length=255,
                                              description=idempotency.HEADER_DESCRIPTION)]

EVENT_ID = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit passes "²", which int() refuses), < 2**63


def after_event_id(last_event_id: str | None) -> int:
    """The job event id in a ``Last-Event-ID`` header (``GET /sweeps/{id}/stream``); 0 without one.

    Raises:
        UserError: ``invalid_last_event_id`` (422) for anything but an event id (1 to 18 ASCII digits).
    """
    if not last_event_id or not last_event_id.strip():
        return 0
    if not EVENT_ID.fullmatch(last_event_id.strip()):
        raise UserError("invalid_last_event_id", f"Last-Event-ID {last_event_id!r} is not an event id of this stream "
                        "(an integer)", "Last-Event-ID")
    return int(last_event_id)


def submit_once(route: str, spec: BaseModel, caller: Caller, key: str | None,
                view: Callable[[Job], BaseModel]) -> BaseModel | JSONResponse:
    """Store and queue a job of either kind (``shared.queue.submit``) once per ``Idempotency-Key``
    ``key`` and body: the new job's API view (``view(job)``), or on a retry the first answer again.

    Raises:
        UserError: see ``shared.queue.submit``; 422 ``idempotency_key_reused`` (another body), 409
            ``idempotency_key_in_use`` (the first request with the key is still running).
    """
    job = idempotency.once(caller.tenant, route, key, idempotency.fingerprint(spec.model_dump_json()),
                           lambda claim: submit(spec, caller, claim))
    if isinstance(job, idempotency.Replay):
        return JSONResponse(job.body, status_code=job.status_code)
    return view(job)
