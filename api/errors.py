"""Every error leaves the API as ``{"error": {"code", "message", "param"}}``; never a stack trace."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shared.errors import UserError

log = logging.getLogger("tunejob.api")


def error_response(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "param": param}}, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(UserError)
    async def _user_error(_: Request, e: UserError):
        return error_response(e.status, e.code, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        value = f" (got {first['input']!r})" if "input" in first and not isinstance(first["input"], dict) else ""
        message = f"{param}: {first['msg']}{value}" if param else first["msg"]
        return error_response(422, "invalid_request", message, param)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(e.status_code, code, str(e.detail))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal_error", "internal server error; see the service log")
