"""Request headers that several routers read (``Idempotency-Key``), and the answer to a request
that carried one: on a retry, the first request's response again (``shared.queue.submit_once``)."""

from typing import Annotated

from fastapi import Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from shared.store import idempotency

IdempotencyKey = Annotated[str | None, Header(alias=idempotency.HEADER, min_length=1, max_length=255,
                                              description=idempotency.HEADER_DESCRIPTION)]


def respond(answer: BaseModel | idempotency.Replay) -> BaseModel | JSONResponse:
    """The response to an idempotent creation: the new resource's view, or a retry's replay of the
    first response (its status and body, as stored)."""
    if isinstance(answer, idempotency.Replay):
        return JSONResponse(answer.body, status_code=answer.status_code)
    return answer
