"""Request headers that several routers read."""

from typing import Annotated

from fastapi import Header

from shared import idempotency

IdempotencyKey = Annotated[str | None, Header(alias=idempotency.HEADER, min_length=1, max_length=255,
                                              description=idempotency.HEADER_DESCRIPTION)]
