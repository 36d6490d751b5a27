"""A request id for every API request: the client's ``X-Request-ID`` when it sends a sane one (at
most 64 letters, digits, ``.``, ``_``, ``-``; e.g. from a proxy), else a new one. It is echoed in
the response's ``X-Request-ID`` header and is the ``[req …]`` of every log line logged while the
request is handled (``shared.logs.log_context``), so a user's report of a failed request leads to
its log lines."""

import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.logs import log_context

HEADER = "X-Request-ID"
SANE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def current_request_id() -> str | None:
    """The id of the request being handled, or None outside a request."""
    context = log_context.get()
    return context.removeprefix("req ") if context.startswith("req ") else None


class RequestId:
    """Pure ASGI middleware (no ``BaseHTTPMiddleware``: it would buffer the SSE streams). The id is
    set in the request's context and not reset: each request is its own task, and the app's
    last-resort error handler, which runs outside every middleware, still logs under it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = Headers(scope=scope).get(HEADER, "")
        request_id = sent if SANE.fullmatch(sent) else uuid.uuid4().hex
        log_context.set(f"req {request_id}")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
