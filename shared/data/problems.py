"""Validation reports: up to ``MAX_PROBLEMS`` problems, each {row, column, value, message}, in row
order, raised as one ``UserError`` (a 4xx naming the file, row, column and value)."""

import bisect
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

    @property
    def position(self) -> tuple[bool, int]:
        """Where the problem sorts in a report: problems without a row (the header, a whole column)
        first, then by row."""
        return (self.row is not None, self.row or 0)


class Problems:
    """Collects the first ``MAX_PROBLEMS`` problems of one file in row order; ``full`` tells readers
    to stop early.

    The checks run column by column over a batch of rows, but users fix a file top to bottom, so the
    report is kept sorted by row (``Problem.position``), and within a row in the order the problems
    were found: the row's structure (as the reader parses it), then the job's columns in the job's
    order (text columns, then the label). Sorting here, as problems arrive, orders every report the
    same way, whichever check found its problems.

    The cap keeps the first rows' problems, not the first found: once full, a problem in an earlier
    row than the last one kept takes its place (a comparison per problem, an insertion into at most
    ``MAX_PROBLEMS`` items when it wins). Otherwise a batch's text problems in rows 1-20 would crowd
    out a label problem in row 1, and the report would skip a row the user has to fix first.
    Readers stop at the batch that fills the report and later batches hold later rows, so the report
    is the file's first ``MAX_PROBLEMS`` problems in row order; the exception is a batch whose rows'
    structure alone (ragged rows, bad JSON lines) fills it, whose columns are then never checked.
    """

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
        """Record a problem in its row's place (``Problem.position``); once the report is full, only
        one in an earlier row than the last one kept, which it replaces."""
        problem = Problem(row, column, None, message, code, param)
        if self.full:
            if problem.position >= self.items[-1].position:
                return
            self.items.pop()
        problem.value = show_value(value)
        bisect.insort(self.items, problem, key=lambda p: p.position)

    def error(self, summary: str | None = None) -> UserError | None:
        """The report as a ``UserError`` (None without problems): code and param are the first
        problem's (the earliest row's), and so is the message unless a ``summary`` replaces it."""
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
