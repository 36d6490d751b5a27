"""Errors the caller caused. The API turns them into ``{"error": {code, message, param}}`` with
their HTTP status; the worker fails the job at once with them, without retries."""


class UserError(Exception):
    """A problem with the caller's input: bad data, an unknown model, an impossible spec.

    Args:
        code: a stable machine-readable code, e.g. ``"missing_column"``.
        message: what is wrong, naming the file, row, column or value.
        param: the request field at fault, e.g. ``"label_column"``.
        status: HTTP status for the API (4xx).
    """

    def __init__(self, code: str, message: str, param: str | None = None, status: int = 422):
        super().__init__(message)
        self.code, self.message, self.param, self.status = code, message, param, status


class NotFound(UserError):
    def __init__(self, what: str, id_: str, param: str | None = None):
        super().__init__("not_found", f"{what} {id_!r} does not exist", param, status=404)
