"""Errors the caller caused. The API turns them into ``{"error": {code, message, param}}`` (plus a
``problems`` list for data validation reports) with their HTTP status; the worker fails the job at
once with them, without retries."""

import re
from datetime import datetime

PATH = re.compile(r"(?<![\w.:/])(?:/[^\s/:'\"]+)+/?")  # an absolute POSIX path (not the path part of a URL)


def first_line(e: BaseException) -> str:
    """An exception's message up to its first line break, for a log line (obstore's and the
    database driver's go on with pages of detail); its type's name if it has none. For an error
    SQLAlchemy wraps (``orig``), the driver's own: SQLAlchemy's first line may be its own remark
    ("(raised as a result of Query-invoked autoflush; ...)") instead of the cause ("No space left")."""
    orig = getattr(e, "orig", None)
    if isinstance(orig, BaseException):
        return first_line(orig)
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def without_paths(text: str) -> str:
    """``text`` (a library's error message) with every absolute file path replaced by ``<path>``:
    no response names a file on the server."""
    return PATH.sub("<path>", text)


class UserError(Exception):
    """A problem with the caller's input: bad data, an unknown model, an impossible spec.

    Args:
        code: a stable machine-readable code, e.g. ``"missing_column"``.
        message: what is wrong, naming the file, row, column or value.
        param: the request field at fault, e.g. ``"label_column"``.
        status: HTTP status for the API (4xx).
        problems: a data validation report, up to 20 ``{"row", "column", "value", "message"}``
            dicts (``shared.data.problems.Problems``); the first is also in ``message``.
        headers: HTTP headers for the API's response, e.g. ``{"Retry-After": "30"}``.
    """

    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        status: int = 422,
        problems: list[dict] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.code, self.message, self.param, self.status, self.problems = code, message, param, status, problems
        self.headers = headers


class NotFound(UserError):
    def __init__(self, what: str, id_: str, param: str | None = None):
        super().__init__("not_found", f"{what} {id_!r} does not exist", param, status=404)


class Deleted(UserError):
    """A job or dataset that was deleted: its id answers 404, saying so and when."""

    def __init__(self, what: str, id_: str, when: datetime):
        super().__init__(
            "deleted",
            f"{what} {id_!r} was deleted at {when:%Y-%m-%d %H:%M:%S} UTC; its files are gone",
            None,
            status=404,
        )


class Conflict(UserError):
    """The request is valid but the resource's state forbids it now (409), e.g. deleting a running job."""

    def __init__(self, code: str, message: str):
        super().__init__(code, message, None, status=409)
