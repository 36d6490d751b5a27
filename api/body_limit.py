"""A limit on request bodies: every body but an upload's is read whole into memory (FastAPI parses
JSON bodies before it checks the key or runs the route), so each is refused past
``TUNEJOB_MAX_REQUEST_BYTES`` with 413 ``request_too_large``: at once when ``Content-Length``
says so, else as soon as the bytes received pass it. The upload routes (``UPLOADS``) stream their
body to disk under their own limit, ``TUNEJOB_MAX_UPLOAD_BYTES`` (``api.uploads``).

FastAPI's own ``max_body_size`` answers a ``Content-Length`` over the limit with Starlette's plain
text ``Content Too Large`` whatever the app's error handlers say (it replaces the response), not
with the API's error envelope; hence this middleware.
"""

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_response
from shared.settings import get_settings

UPLOADS = frozenset({("POST", "/datasets"), ("POST", "/v1/files")})  # (method, path) of the streamed uploads
OPENAI = "/v1/"  # the OpenAI facade's paths: its errors carry OpenAI's ``type`` (``api.openai_compat``)


def too_large(limit: int) -> str:
    """The 413's message for a body past ``limit`` bytes."""
    return f"the request body is larger than {limit:,} bytes (TUNEJOB_MAX_REQUEST_BYTES); upload datasets with POST /datasets"


class BodyLimit:
    """Refuse a request body of more than ``TUNEJOB_MAX_REQUEST_BYTES`` (see the module), other than an upload's.

    Raises:
        HTTPException: 413, from ``receive`` once a body without ``Content-Length`` passes the
            limit (inside the route's body read: the app's handler answers it, ``api.errors``).
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or (scope["method"], path) in UPLOADS:
            await self.app(scope, receive, send)
            return
        limit = get_settings().max_request_bytes
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            error_type = "invalid_request_error" if path.startswith(OPENAI) else None
            await error_response(413, "request_too_large", too_large(limit), error_type=error_type)(
                scope, receive, send
            )
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, too_large(limit))
            return message

        await self.app(scope, counted, send)
