"""Validation reports: up to ``MAX_PROBLEMS`` problems, each {row, column, value, message}, raised
as one ``UserError`` (a 4xx naming the file, row, column and value)."""

from dataclasses import dataclass
from typing import Any

from shared.data.formats import MAX_PROBLEMS, VALUE_CHARS
from shared.errors import UserError

# ----------------------------------------------------------------------------- validation reports


@dataclass
class Problem:
    """One thing wrong with the data. ``row`` is the 1-based data row (the CSV header is not a
    row; None for the header or a whole column); ``value`` the cell, truncated."""

    row: int | None
    column: str | None
    value: str | None
    message: str
    code: str
    param: str

    def describe(self, filename: str) -> str:
        where = f"{filename!r}" + (f" row {self.row}" if self.row is not None else "")
        what = f"column {self.column!r} {self.message}" if self.column is not None else self.message
        return f"{where}: {what}" + (f": {self.value!r}" if self.value is not None else "")


class Problems:
    """Collects up to ``MAX_PROBLEMS`` problems in one file; ``full`` tells readers to stop early."""

    def __init__(self, filename: str):
        self.filename = filename
        self.items: list[Problem] = []

    @property
    def full(self) -> bool:
        return len(self.items) >= MAX_PROBLEMS

    def add(
        self,
        row: int | None,
        column: str | None,
        value: Any,
        message: str,
        code: str = "invalid_file",
        param: str = "file",
    ) -> None:
        if not self.full:
            self.items.append(Problem(row, column, show_value(value), message, code, param))

    def error(self, summary: str | None = None) -> UserError | None:
        """The report as a ``UserError`` (None without problems): code and param are the first
        problem's, and so is the message unless a ``summary`` replaces it."""
        if not self.items:
            return None
        first = self.items[0]
        message = summary or first.describe(self.filename)
        if len(self.items) > 1:
            more = f"{len(self.items) - 1}{'+' if self.full else ''}"
            message += f" (and {more} more problem(s), listed in error.problems)"
        return UserError(
            first.code,
            message,
            first.param,
            problems=[{"row": p.row, "column": p.column, "value": p.value, "message": p.message} for p in self.items],
        )

    def raise_if_any(self) -> None:
        if (error := self.error()) is not None:
            raise error


def show_value(value: Any) -> str | None:
    """A cell as a problem reports it: text as is, anything else as its Python repr, truncated."""
    if value is None:
        return None
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + "…"


def invalid_file(filename: str, fmt: str, detail: str) -> UserError:
    return UserError("invalid_file", f"{filename!r} could not be parsed as {fmt}: {detail}", "file")
