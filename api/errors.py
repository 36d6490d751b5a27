"""Every error leaves the API as ``{"error": {"code", "message", "param"}}`` (plus ``problems``, a
data validation report, where there is one); never a stack trace, a server path or NaN.

The OpenAPI schema says so too, from one place: ``api.openapi.install_openapi`` makes the app's
schema document ``ErrorBody`` for every 4xx an operation can return. Every operation gets 422 when it
takes parameters or a body, 400 when it takes a body (one that cannot be decoded), and 404 when
its path names a resource (``{...}``); every operation that needs an API key gets 401, 429, 502
and 503; a router or route adds its own with ``responses=error_responses(413, ...)``. Routes added
later inherit this.
"""

import contextlib
import errno
import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from obstore.exceptions import BaseError as ObjectStoreError
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.concurrency import iterate_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from api.request_id import HEADER as REQUEST_ID_HEADER
from api.request_id import current_request_id
from shared.errors import UserError, first_line
from shared.schemas.jobs import json_safe

log = logging.getLogger("tunejob.api")

ERROR_STATUSES = {
    400: "The request is malformed.",
    401: "No valid API key.",
    403: "The API key may not do this (e.g. an admin key is needed), or the request came from a foreign Origin.",
    404: "The id in the path names nothing that exists.",
    405: "The method is not allowed on this path.",
    409: "The request conflicts with the resource's state.",
    413: "The upload, or the dataset once decompressed, is larger than the service accepts, or a request "
    "body other than an upload is larger than TUNEJOB_MAX_REQUEST_BYTES.",
    415: "The body is not in a media type this operation accepts.",
    422: "The request or its data is invalid: `error.param` names the field, `error.problems` lists up to 20 "
    "problems in the data (row, column, value, message).",
    429: "Too many requests for this API key, or too many active jobs: retry after `Retry-After` seconds.",
    502: "The object storage (`TUNEJOB_STORAGE_URL`) failed or did not answer, also when tried again "
    "(`storage_unavailable`).",
    503: "The job store is busy (SQLite's write lock was not free in time): retry after `Retry-After` seconds.",
    507: "The server's disk is full (`insufficient_storage`): nothing was stored; retrying helps once space is freed.",
}
STORE_RETRY_AFTER_S = 1
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # no space left, disk quota exceeded
DISK_FULL_SQLITE = "database or disk is full"  # SQLite's SQLITE_FULL
DISK_FULL_SQLSTATE = "53100"  # PostgreSQL's disk_full (psycopg.errors.DiskFull)


def disk_full(e: Exception) -> bool:
    """Whether the job store refused a write for want of disk space (SQLite's or PostgreSQL's)."""
    return DISK_FULL_SQLITE in str(e) or getattr(getattr(e, "orig", None), "sqlstate", None) == DISK_FULL_SQLSTATE


def service_failure(request: Request, e: Exception) -> UserError | None:
    """What the caller is told when a service the API depends on failed (logged here, one line):
    the job store busy or unreachable (503 ``store_busy``: SQLite's write lock not free within its
    busy timeout, no pooled connection free in time), a full disk, the job store's or the data
    directory's (507 ``insufficient_storage``: retrying will not clear it), the bucket
    (``TUNEJOB_STORAGE_URL``) failed, already tried again for ``TUNEJOB_STORAGE_TIMEOUT_SECONDS``
    (502 ``storage_unavailable``: a gateway's error, which the client does not retry, where a 503
    it would, five times over, each waiting out those retries). None for any other exception (a
    bug: a 500). The API answers it as JSON, the dashboard as a page."""
    where = f"{request.method} {request.url.path}"
    if disk_full(e) or isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
        log.error("%s: the server's disk is full: %s", where, first_line(e))
        return UserError(
            "insufficient_storage",
            "the server's disk is full (no space left on device); nothing was stored. Try again "
            "once its operator has freed space",
            status=507,
        )
    if isinstance(e, OperationalError | PoolTimeout):
        log.warning("%s: job store busy or unreachable: %s", where, first_line(e))
        return UserError(
            "store_busy",
            "the job store is busy or unreachable; retry shortly",
            status=503,
            headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
        )
    if isinstance(e, ObjectStoreError):
        log.warning("%s: object storage unavailable: %s", where, first_line(e))
        return UserError(
            "storage_unavailable",
            "the object storage (TUNEJOB_STORAGE_URL) failed or did not answer, also when tried "
            "again; the API's log says how. Try again once it answers",
            status=502,
        )
    return None


SERVER_LOGGER = "uvicorn.error"  # where uvicorn logs an exception that escapes the app


class SafeJSONResponse(JSONResponse):
    """A JSON response that never contains NaN or Infinity (they become null)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(json_safe(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class ProblemOut(BaseModel):
    row: int | None = Field(
        description="1-based data row (a CSV header is not a row); null for the header or a whole column"
    )
    column: str | None
    value: str | None = Field(description="the cell, truncated to 80 characters")
    message: str


class ErrorDetail(BaseModel):
    code: str = Field(description="stable machine-readable code, e.g. `missing_value`")
    message: str = Field(description="what is wrong, naming the file, row, column or value")
    param: str | None = Field(description="the request field at fault")
    problems: list[ProblemOut] | None = Field(
        None, description="data validation report: up to 20 problems, the first of which is also `message`"
    )


class ErrorBody(BaseModel):
    """The body of every 4xx response."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": {
                        "code": "missing_value",
                        "param": "text_column",
                        "message": "'reviews.csv' row 3: column 'text' is empty (and 1 more problem(s), listed in error.problems)",
                        "problems": [
                            {"row": 3, "column": "text", "value": "", "message": "is empty"},
                            {
                                "row": 7,
                                "column": "label",
                                "value": "inf",
                                "message": "is not a finite number (float32)",
                            },
                        ],
                    }
                }
            ]
        }
    )

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """OpenAPI ``responses`` for these 4xx statuses, each with the ``ErrorBody`` schema."""
    return {status: {"model": ErrorBody, "description": ERROR_STATUSES[status]} for status in statuses}


def openai_type(path: str) -> str | None:
    """OpenAI's error ``type`` for an error outside a ``/v1`` route's own handling (no such route
    or method, a refused Host or Origin): the facade's errors all carry one (``api.openai_compat``)."""
    return "invalid_request_error" if path.startswith("/v1/") else None


def error_response(
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    problems: list[dict] | None = None,
    headers: Mapping[str, str] | None = None,
    error_type: str | None = None,
) -> JSONResponse:
    """The API's error body, ``{"error": {"code", "message", "param"[, "problems"][, "type"]}}``;
    ``error_type``: OpenAI's ``type`` (the ``/v1`` facade's errors, ``api.openai_compat``)."""
    error = {"code": code, "message": message, "param": param, **({"problems": problems} if problems else {})}
    error |= {"type": error_type} if error_type else {}
    return SafeJSONResponse({"error": error}, status_code=status, headers=headers)


LOGGED = "_tunejob_logged"  # set (True) on an exception the app has logged: the server need not again


class StreamCut(Exception):
    """A streamed body failed after its response started, and ``stream_body`` has logged why.

    Raised in place of the failure, so that it still escapes the app and the server closes the
    connection (the client sees an incomplete body: ASGI has no other way to abort a response);
    ``install_error_handlers`` keeps it out of the log, where it would be a second traceback."""

    _tunejob_logged = True


async def stream_body(chunks: Iterable | AsyncIterable, what: str) -> AsyncIterator[Any]:
    """The body of a streamed download (``what``: "job <id> model.tar"): ``chunks`` (a sync
    iterator runs in the thread pool, as ``StreamingResponse`` runs it).

    Once the headers are sent, a failure can no longer be an error response. It is logged here,
    once, with the bytes sent so far: a WARNING line for a failure of the storage (the bucket
    failed, an object no longer matches its manifest: ``OSError``), a traceback for anything else.
    Then ``StreamCut`` cuts the connection, which the client reports as an incomplete download.
    """
    body = chunks if isinstance(chunks, AsyncIterable) else iterate_in_threadpool(chunks)
    sent = 0
    try:
        async for chunk in body:
            yield chunk
            sent += len(chunk)
    except (ObjectStoreError, OSError) as e:
        cause = f"storage unavailable: {first_line(e)}" if isinstance(e, ObjectStoreError) else first_line(e)
        log.warning("download of %s cut after %s bytes: %s", what, f"{sent:,}", cause)
        raise StreamCut(what) from e
    except Exception as e:
        log.exception("download of %s failed after %s bytes: %s: %s", what, f"{sent:,}", type(e).__name__, e)
        raise StreamCut(what) from e


def not_logged_already(record: logging.LogRecord) -> bool:
    """A logging filter for the server's records: drops "Exception in ASGI application" and its
    traceback for an exception the app has logged already (``LOGGED``: an unhandled error, logged by
    the handler that answered 500, which Starlette then raises again to the server; a
    ``StreamCut``), so that one failure is one record."""
    return not (record.exc_info and getattr(record.exc_info[1], LOGGED, False))


def install_error_handlers(app: FastAPI) -> None:
    """Error handlers for every exception (``api.openapi`` documents them in the app's schema)."""
    logging.getLogger(SERVER_LOGGER).addFilter(not_logged_already)  # added once however many apps

    @app.exception_handler(UserError)
    async def _user_error(_: Request, e: UserError):
        return error_response(e.status, e.code, e.message, e.param, e.problems, e.headers)

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeout)
    @app.exception_handler(ObjectStoreError)
    @app.exception_handler(OSError)
    async def _service_failed(request: Request, e: Exception):
        if (failure := service_failure(request, e)) is None:  # anything else: a 500, logged whole
            return await _internal_error(request, e)
        return error_response(failure.status, failure.code, failure.message, headers=failure.headers)

    # The client closed its connection while its request's body was read (an upload cut short):
    # nothing of ours failed, and no one reads the answer. Status 499, as nginx logs it ("client
    # closed request"), so that GET /metrics counts no 5xx for it; it was a 500 with a traceback.
    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, _: ClientDisconnect):
        log.info(
            "%s %s: the client closed the connection before its whole request came", request.method, request.url.path
        )
        return error_response(
            499, "client_closed_request", "the client closed the connection before its whole request came"
        )

    @app.exception_handler(DataError)
    async def _data_error(request: Request, e: DataError):
        if "NUL" not in str(e.orig):  # anything else PostgreSQL refuses is a bug of ours: a 500
            return await _internal_error(request, e)
        return error_response(
            422,
            "invalid_request",
            "a text in the request holds a NUL character (0x00), which "
            "the job store (PostgreSQL) cannot keep; nothing was written",
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        media = request.headers.get("content-type", "").split(";")[0].strip()
        if tuple(first.get("loc", ())) == ("body",) and first["type"] != "missing" and not media.endswith("json"):
            # curl -d sends a form (a missing body is "Field required", whatever its type)
            message = (
                f"the body must be JSON, sent with Content-Type: application/json (it came as {media or 'no type'})"
            )
            return error_response(422, "invalid_request", message, "Content-Type")
        # a union's members each report an error on the same field: a wrong type from the members
        # the value is not, and the one it is says what is wrong with it ([] for ``str | list[str]``
        # with at least one item: "at least 1 item", not "a valid string"); a literal's member least
        # of all (n_epochs -1 of ``"auto" | float > 0`` read "Input should be 'auto'")
        # (and the member's own error may be deeper: ``input.1`` of ``str | list[str]``)
        path = field_path(first, e.body)
        same = [x for x in e.errors() if field_path(x, e.body)[: len(path)] == path]
        said = [x for x in same if not x["type"].endswith("_type")]
        deepest = max(same, key=lambda x: len(field_path(x, e.body)))  # all wrong types: the member that got furthest
        first = next((x for x in said if x["type"] != "literal_error"), next(iter(said), deepest))
        param = ".".join(field_path(first, e.body)) or None
        value = f" (got {show(first['input'])})" if "input" in first and not isinstance(first["input"], dict) else ""
        # a rule across fields (param null: the message names them) without pydantic's "Value error, "
        message = f"{param}: {first['msg']}{value}" if param else first["msg"].removeprefix("Value error, ")
        return error_response(422, "invalid_request", message, param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            e.status_code, "http_error"
        )  # 413: api.body_limit's (tunejob's other 413s are UserErrors)
        headers = {"Allow": ", ".join(allowed_methods(request))} if e.status_code == 405 else e.headers
        return error_response(
            e.status_code, code, str(e.detail), headers=headers, error_type=openai_type(request.url.path)
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        if not getattr(e, LOGGED, False):  # a StreamCut is (and comes too late for a response)
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            with contextlib.suppress(AttributeError):  # an exception with __slots__ keeps no mark
                setattr(e, LOGGED, True)
        request_id = current_request_id()
        return error_response(
            500,
            "internal_error",
            "internal server error; see the service log" + (f" (request id {request_id})" if request_id else ""),
            headers={REQUEST_ID_HEADER: request_id} if request_id else None,
        )


def field_path(error: dict, body: Any) -> list[str]:
    """The request field a pydantic error is about, as path parts (``["hyperparameters",
    "n_epochs"]``). Pydantic adds the member's tag to the location of an error in a union
    (``n_epochs.literal['auto']``, ``input.list[str].1``): such a tag is skipped where parts of the
    value follow it, else the path stops at the first part that is not in the request's body (a
    missing field's own name is kept)."""
    source, *loc = error.get("loc", ()) or ("",)
    if source not in ("body", "query", "path", "header", "cookie"):
        loc = [source, *loc]
    if source != "body":
        return [str(p) for p in loc]
    path, current = [], body
    for i, part in enumerate(loc):
        if (
            isinstance(current, dict)
            and part in current
            or isinstance(current, list)
            and isinstance(part, int)
            and -len(current) <= part < len(current)
        ):
            current = current[part]
        elif isinstance(part, str) and not isinstance(current, dict) and i < len(loc) - 1:
            continue  # a union member's tag before a part of the value (``input.list[str].1``)
        elif not (i == len(loc) - 1 and error.get("type") == "missing"):
            break
        path.append(str(part))
    return path


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's own 405 names only the first route's)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def show(value: Any) -> str:
    """A rejected input as an error message quotes it: its repr, truncated."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"
