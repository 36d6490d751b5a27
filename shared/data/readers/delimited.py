"""CSV and TSV, streamed with Python's ``csv`` module (strict RFC 4180 quoting; every cell read as
text, as written; a third of the memory of ``pyarrow.csv``'s streaming reader, which holds several
blocks). A CSV file may be separated by semicolons, as Excel writes it where the decimal
separator is a comma (``delimiter``)."""

import csv
from collections.abc import Iterator
from pathlib import Path

from shared.data.formats import BATCH_BYTES, BATCH_ROWS
from shared.data.problems import Problems, invalid_file
from shared.data.readers.base import Batch, check_names

# -- CSV and TSV

csv.field_size_limit(BATCH_BYTES)  # a longer field is a problem of its row, not a MemoryError


def delimiter(path: Path, fmt: str) -> str:
    """A TSV file's tab; a CSV file's comma, or its semicolon when its header is one field
    holding a semicolon and no tab (``text;label``: Excel's CSV where a comma is the decimal
    separator, which a comma read as one column and then failed on every quoted text)."""
    if fmt == "tsv":
        return "\t"
    with open(path, newline="", encoding="utf-8-sig") as f:
        first = f.readline(1 << 20)
    try:
        header = next(csv.reader([first]), [])
    except csv.Error:  # a header in quotes that spans lines: comma-separated or broken, not Excel's
        return ","
    return ";" if len(header) == 1 and ";" in header[0] and "\t" not in header[0] else ","


def _csv_reader(f, quoted: bool, sep: str):
    """Python's ``csv`` reader: RFC 4180 quoting, strict (a quote inside an unquoted field, or text
    after a closing quote, is an error, never silently dropped), or no quoting at all."""
    return csv.reader(
        f,
        delimiter=sep,
        quotechar='"',
        doublequote=True,
        quoting=csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE,
        strict=quoted,
    )


def _csv_rows(path: Path, quoted: bool, sep: str) -> Iterator[tuple[int, list[str] | csv.Error]]:
    """(line number, fields) of each non-blank record after the header, the header first; a record
    the reader refuses comes as its ``csv.Error`` (the reader goes on with the next line)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = _csv_reader(f, quoted, sep)
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                yield reader.line_num, e
                continue
            if fields:
                yield reader.line_num, fields


def _csv_header(path: Path, fmt: str, quoted: bool, sep: str, filename: str) -> list[str]:
    for _, header in _csv_rows(path, quoted, sep):
        if isinstance(header, csv.Error):
            raise invalid_file(filename, fmt, f"the header (line 1) {header}")
        check_names(header, filename)
        return header
    raise invalid_file(filename, fmt, "it has no header row")


def _parses_cleanly(path: Path, quoted: bool) -> bool:
    """Every record of a TSV file parses and has as many fields as the header."""
    width = None
    for _, fields in _csv_rows(path, quoted, "\t"):
        if isinstance(fields, csv.Error) or len(fields) != (width := width or len(fields)):
            return False
    return True


def tsv_is_quoted(path: Path) -> bool:
    """Whether a TSV file uses RFC 4180 quoting (as Python's ``csv`` module and pandas write it)
    rather than none (quotes are literal text, as in PostgreSQL's text COPY format).

    Quoted unless that is impossible: a file without any double quote reads the same either way;
    otherwise it is unquoted only when it does not parse as strict RFC 4180 (``"Great" film``)
    but does, without a ragged row, with quotes as text.
    """
    with open(path, "rb") as f:
        if not any(b'"' in chunk for chunk in iter(lambda: f.read(1 << 20), b"")):
            return True
    return _parses_cleanly(path, True) or not _parses_cleanly(path, False)


def csv_batches(path: Path, fmt: str, filename: str, columns: list[str] | None, problems: Problems) -> Iterator[Batch]:
    quoted, sep = fmt == "csv" or tsv_is_quoted(path), delimiter(path, fmt)
    header = _csv_header(path, fmt, quoted, sep, filename)
    picks = [(name, header.index(name)) for name in columns or []]
    values: dict[str, list] = {name: [] for name, _ in picks}
    start = size = nbytes = 0
    keys = tuple(header)  # handed out with the first batch
    rows = _csv_rows(path, quoted, sep)
    next(rows)  # the header
    for line, fields in rows:
        row = start + size + 1
        if isinstance(fields, csv.Error):
            hint = {
                "expected after": " (a quote inside a field must be doubled, and the field quoted)",
                "end of data": " (a quoted field that never ends?)",
            }
            problems.add(
                row,
                None,
                None,
                f"(line {line}) does not parse: {fields}" + "".join(h for key, h in hint.items() if key in str(fields)),
            )
        elif len(fields) != len(header):
            problems.add(row, None, sep.join(fields), f"has {len(fields)} field(s) where the header has {len(header)}")
        for name, i in picks:
            cell = fields[i] if isinstance(fields, list) and len(fields) == len(header) else None
            values[name].append(cell)
            nbytes += len(cell or "")
        if problems.full:
            return
        size += 1
        if size >= BATCH_ROWS or nbytes >= BATCH_BYTES:
            yield Batch(start, size, values, keys)
            values, keys = {name: [] for name, _ in picks}, ()
            start, size, nbytes = start + size, 0, 0
    if size or keys:
        yield Batch(start, size, values, keys)
