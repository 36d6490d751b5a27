"""Reading and validating uploaded datasets (CSV, TSV, JSONL, Parquet, CoNLL), in bounded batches.

Used by the API (to refuse bad input with a 4xx before anything is stored or queued) and by the
worker (to load the same table the API validated, through the same checks).

- **Readers**, one per format, all streaming: CSV and TSV with Python's ``csv`` module (strict
  RFC 4180 quoting; every cell read as text, as written; measured at a third of the memory of
  ``pyarrow.csv``'s streaming reader, which holds several blocks), JSONL line by line with the
  standard ``json`` module, Parquet with ``pyarrow.parquet.ParquetFile.iter_batches`` (text columns read as
  dictionaries, so that a decompression bomb is measured before it is expanded), CoNLL-style text
  (a token and its tag per line, a blank line between sentences) sentence by sentence. Each yields
  ``Batch`` es of at most about ``BATCH_BYTES`` of data, so memory grows with the batch, not the file.
- **Upload checks** (``inspect_dataset``): UTF-8, parses, unique non-nested header, no ragged row,
  JSONL rows are objects without duplicate keys or NaN/Infinity, at least one row, Parquet
  expanded size within ``TUNEJOB_MAX_DATASET_BYTES``.
- **Job checks** (``scan_job_data``, ``job_batches``): the job's text columns hold non-empty
  strings, its labels are scalars (class names: strings, integers, booleans; regression targets:
  finite numbers with |y| <= ``MAX_REGRESSION_TARGET`` unless the spec opts out), for
  ``multi_label`` lists of class names (JSONL or Parquet lists, or text split on
  ``label_separator``), for token_classification non-empty lists of words with as many tags. A rejection
  carries a validation report: up to ``MAX_PROBLEMS`` problems, each {row, column, value, message}.
"""

import codecs
import csv
import functools
import json
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sklearn.model_selection import train_test_split

from shared.errors import UserError, without_paths
from shared.settings import get_settings

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
           ".conll": "conll"}
TEXT_FORMATS = {"csv", "tsv", "jsonl", "conll"}
CONLL_COLUMNS = ("tokens", "tags")  # the columns of a CoNLL file
BATCH_BYTES = 1 << 20  # data per batch; also the longest row (JSONL line, Parquet row) or CSV field accepted
BATCH_ROWS = 65_536  # rows per batch at most (JSONL, Parquet)
MAX_PROBLEMS = 20  # problems listed in one validation report
MAX_CLASS_NAME_CHARS = 1000
MAX_REGRESSION_TARGET = 1e6  # |y| above this is refused unless JobCreate.allow_large_targets
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the worker trains on float32 targets
VALUE_CHARS = 80  # a problem's value is truncated to this many characters


def detect_format(filename: str) -> str:
    """Format from the file name's extension.

    Raises:
        UserError: ``unsupported_format`` for any other extension.
    """
    fmt = FORMATS.get(Path(filename).suffix.lower())
    if fmt is None:
        raise UserError(
            "unsupported_format",
            f"{filename!r}: unsupported file type; use one of {', '.join(sorted(FORMATS))}",
            "file",
        )
    return fmt


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
        self.filename, self.items = filename, []

    @property
    def full(self) -> bool:
        return len(self.items) >= MAX_PROBLEMS

    def add(self, row: int | None, column: str | None, value: Any, message: str, code: str = "invalid_file",
            param: str = "file") -> None:
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
        return UserError(first.code, message, first.param, problems=[
            {"row": p.row, "column": p.column, "value": p.value, "message": p.message} for p in self.items])

    def raise_if_any(self) -> None:
        if (error := self.error()) is not None:
            raise error


def show_value(value: Any) -> str | None:
    """A cell as a problem reports it: text as is, anything else as its Python repr, truncated."""
    if value is None:
        return None
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= VALUE_CHARS else text[:VALUE_CHARS] + "…"


def _invalid_file(filename: str, fmt: str, detail: str) -> UserError:
    return UserError("invalid_file", f"{filename!r} could not be parsed as {fmt}: {detail}", "file")


# ----------------------------------------------------------------------------- readers


class Batch(NamedTuple):
    """Consecutive rows of a file: ``start`` is the 0-based index of the first, ``size`` the
    number of rows, ``values`` the requested columns as Python lists of ``size`` cells (None for a
    row that does not parse); ``keys`` the column names first seen in these rows (CSV: the header,
    with the first batch; JSONL: new keys)."""

    start: int
    size: int
    values: dict[str, list]
    keys: tuple[str, ...] = ()


def check_utf8(path: Path, filename: str) -> None:
    """Raise ``UserError(invalid_encoding)`` naming the line and byte offset of the first non-UTF-8 byte
    (the first byte of the invalid or truncated sequence). A UTF-8 byte order mark is allowed."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read so far
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            # The decoder holds back an incomplete sequence from the previous chunk and decodes it
            # together with this one, so e.start counts from the first held-back byte.
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                _raise_encoding_error(path, filename, offset - pending + e.start)
            offset += len(chunk)
    pending = len(decoder.getstate()[0])
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:  # the file ends inside a multi-byte sequence
        _raise_encoding_error(path, filename, offset - pending)


def _raise_encoding_error(path: Path, filename: str, position: int) -> None:
    with open(path, "rb") as f:
        head = f.read(max(position + 1, 2))
    line = head[:position].count(b"\n") + 1
    hint = " (it starts with a UTF-16 byte order mark: save it as UTF-8)" if head[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
    raise UserError(
        "invalid_encoding",
        f"{filename!r} is not valid UTF-8: byte 0x{head[position]:02x} at offset {position} (line {line}){hint}",
        "file",
    )


def read_batches(path: Path, fmt: str, filename: str, columns: list[str] | None,
                 problems: Problems, list_columns: tuple[str, ...] = ()) -> Iterator[Batch]:
    """Stream a stored dataset file in batches of at most about ``BATCH_BYTES``.

    ``columns``: the columns whose values to return (None: none, only count and check the
    structure of every row). Structural problems (ragged rows, bad JSON lines, rows longer than
    ``BATCH_BYTES``) go to ``problems``; reading stops once it is full. ``list_columns``: Parquet
    columns that may hold lists of scalars (multi_label's labels, token_classification's words and
    tags; JSONL cells are whatever the JSON holds); any other nested column a job reads is a problem.

    Raises:
        UserError: ``invalid_file`` when the file cannot be parsed at all (the message names the
            format, never a server path), ``dataset_too_large`` (413) for a Parquet file that
            expands beyond ``TUNEJOB_MAX_DATASET_BYTES``.
    """
    readers = {"csv": _csv_batches, "tsv": _csv_batches, "jsonl": _jsonl_batches, "conll": _conll_batches,
               "parquet": functools.partial(_parquet_batches, list_columns=list_columns)}
    try:
        yield from readers[fmt](path, fmt, filename, columns, problems)
    except UserError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise _invalid_file(filename, fmt, _library_message(e)) from e


def _library_message(e: Exception) -> str:
    """A reader's error, first line, without anything that names a server file."""
    return without_paths(str(e).splitlines()[0] if str(e) else type(e).__name__)


# -- CSV and TSV

csv.field_size_limit(BATCH_BYTES)  # a longer field is a problem of its row, not a MemoryError


def _csv_reader(f, fmt: str, quoted: bool):
    """Python's ``csv`` reader: RFC 4180 quoting, strict (a quote inside an unquoted field, or text
    after a closing quote, is an error, never silently dropped), or no quoting at all."""
    return csv.reader(f, delimiter="\t" if fmt == "tsv" else ",", quotechar='"', doublequote=True,
                      quoting=csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE, strict=quoted)


def _csv_rows(path: Path, fmt: str, quoted: bool) -> Iterator[tuple[int, list[str] | csv.Error]]:
    """(line number, fields) of each non-blank record after the header, the header first; a record
    the reader refuses comes as its ``csv.Error`` (the reader goes on with the next line)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = _csv_reader(f, fmt, quoted)
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


def _csv_header(path: Path, fmt: str, quoted: bool, filename: str) -> list[str]:
    for _, header in _csv_rows(path, fmt, quoted):
        if isinstance(header, csv.Error):
            raise _invalid_file(filename, fmt, f"the header (line 1) {header}")
        _check_names(header, filename)
        return header
    raise _invalid_file(filename, fmt, "it has no header row")


def too_many_columns(filename: str, columns: str) -> UserError:
    """422 ``too_many_columns``: ``columns`` says how many (e.g. "257 columns")."""
    limit = get_settings().max_columns
    return UserError("too_many_columns", f"{filename!r} has {columns}; at most {limit} (TUNEJOB_MAX_COLUMNS)", "file")


def _check_names(names: list[str], filename: str) -> None:
    if len(names) > get_settings().max_columns:
        raise too_many_columns(filename, f"{len(names)} columns")
    problems = Problems(filename)
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            problems.add(None, name, None, f"is a duplicate column name (columns {seen[name] + 1} and {i + 1})")
        seen.setdefault(name, i)
    problems.raise_if_any()


def _parses_cleanly(path: Path, fmt: str, quoted: bool) -> bool:
    """Every record parses and has as many fields as the header."""
    width = None
    for _, fields in _csv_rows(path, fmt, quoted):
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
    return _parses_cleanly(path, "tsv", True) or not _parses_cleanly(path, "tsv", False)


def _csv_batches(path: Path, fmt: str, filename: str, columns: list[str] | None,
                 problems: Problems) -> Iterator[Batch]:
    quoted = fmt == "csv" or tsv_is_quoted(path)
    header = _csv_header(path, fmt, quoted, filename)
    picks = [(name, header.index(name)) for name in columns or []]
    values: dict[str, list] = {name: [] for name, _ in picks}
    start = size = nbytes = 0
    keys = tuple(header)  # handed out with the first batch
    rows = _csv_rows(path, fmt, quoted)
    next(rows)  # the header
    for line, fields in rows:
        row = start + size + 1
        if isinstance(fields, csv.Error):
            hint = {"expected after": " (a quote inside a field must be doubled, and the field quoted)",
                    "end of data": " (a quoted field that never ends?)"}
            problems.add(row, None, None, f"(line {line}) does not parse: {fields}"
                         + "".join(h for key, h in hint.items() if key in str(fields)))
        elif len(fields) != len(header):
            delimiter = "\t" if fmt == "tsv" else ","
            problems.add(row, None, delimiter.join(fields), f"has {len(fields)} field(s) where the header has "
                         f"{len(header)}")
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


# -- JSONL

class _JsonRowError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    row = dict(pairs)
    if len(row) != len(pairs):
        seen = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _JsonRowError(f"has the key {duplicate!r} twice")
    return row


def _no_constant(name: str) -> None:
    raise _JsonRowError(f"holds {name}, which is not valid JSON (use null, or a number)")


_JSON = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def _jsonl_batches(path: Path, fmt: str, filename: str, columns: list[str] | None,
                   problems: Problems) -> Iterator[Batch]:
    """One JSON object per line; blank lines are skipped. Each batch names the keys it saw first."""
    keys: dict[str, None] = {}
    known = 0  # keys already handed out
    values: dict[str, list] = {name: [] for name in columns or []}
    start = size = nbytes = 0
    line_number = 0
    with open(path, "rb") as f:
        while line := f.readline(BATCH_BYTES + 1):
            line_number += 1
            if len(line) > BATCH_BYTES and not line.endswith(b"\n"):
                problems.add(start + size + 1, None, None, f"(line {line_number}) is longer than "
                             f"{BATCH_BYTES >> 20} MiB, the longest row accepted")
                while (rest := f.readline(BATCH_BYTES)) and not rest.endswith(b"\n"):
                    pass
                size += 1
                continue
            text = line.decode("utf-8-sig" if line_number == 1 else "utf-8").strip()
            if not text:
                continue
            try:
                row = _JSON.decode(text)
                if not isinstance(row, dict):
                    raise _JsonRowError(f"is a JSON {type(row).__name__}, not an object "
                                        '(each line must be one {"column": value, ...} object)')
            except _JsonRowError as e:
                problems.add(start + size + 1, None, text, f"(line {line_number}) {e}")
                row = {}
            except json.JSONDecodeError as e:
                problems.add(start + size + 1, None, text, f"(line {line_number}) is not valid JSON: {e.msg} "
                             f"at character {e.pos + 1}")
                row = {}
            for key in row:
                keys.setdefault(key, None)
            if len(keys) > get_settings().max_columns:
                raise too_many_columns(filename, f"{len(keys)} distinct keys (columns) by row {start + size + 1}")
            for name, cells in values.items():
                cells.append(row.get(name))
            size += 1
            nbytes += len(line)
            if problems.full:
                return
            if size >= BATCH_ROWS or nbytes >= BATCH_BYTES:
                yield Batch(start, size, values, tuple(keys)[known:])
                values = {name: [] for name in columns or []}
                start, size, nbytes, known = start + size, 0, 0, len(keys)
    if size:
        yield Batch(start, size, values, tuple(keys)[known:])


# -- CoNLL


def _conll_batches(path: Path, fmt: str, filename: str, columns: list[str] | None,
                   problems: Problems) -> Iterator[Batch]:
    """CoNLL-style text (CoNLL-2003, WNUT): one token per line with its tag in the last
    whitespace-separated field (fields between, such as POS and chunk tags, are ignored), a blank
    line between sentences, ``-DOCSTART-`` lines skipped; tags as written (IOB/BIO). Each sentence
    is a row with the columns ``tokens`` and ``tags`` (``CONLL_COLUMNS``)."""
    values: dict[str, list] = {name: [] for name in columns or []}
    start = size = nbytes = 0
    keys = CONLL_COLUMNS  # handed out with the first batch
    for sentence in _conll_sentences(path, problems, lambda: start + size + 1):
        for name, cells in values.items():
            cells.append(sentence[CONLL_COLUMNS.index(name)] if name in CONLL_COLUMNS else None)
        size += 1
        nbytes += sum(map(len, sentence[0]))
        if problems.full:
            return
        if size >= BATCH_ROWS or nbytes >= BATCH_BYTES:
            yield Batch(start, size, values, keys)
            values, keys = {name: [] for name in columns or []}, ()
            start, size, nbytes = start + size, 0, 0
    if size or keys:
        yield Batch(start, size, values, keys)


def _conll_sentences(path: Path, problems: Problems, row) -> Iterator[tuple[list[str], list[str]]]:
    """(tokens, tags) of each sentence of a CoNLL file; a line without a tag, or longer than
    ``BATCH_BYTES``, is a problem of its sentence (``row()``: its 1-based number)."""
    tokens, tags, line_number = [], [], 0
    with open(path, encoding="utf-8-sig") as f:
        while line := f.readline(BATCH_BYTES + 1):
            line_number += 1
            fields = line.split()
            if len(line) > BATCH_BYTES:
                problems.add(row(), None, None, f"(line {line_number}) is longer than {BATCH_BYTES >> 20} MiB")
                return
            if fields and fields[0] != "-DOCSTART-":
                if len(fields) < 2:
                    problems.add(row(), CONLL_COLUMNS[1], line.strip(), f"(line {line_number}) has a token but no "
                                 "tag: each line is a token and its tag, separated by whitespace", "missing_value")
                tokens.append(fields[0])
                tags.append(fields[-1])
            elif tokens:  # a blank or -DOCSTART- line ends the sentence
                yield tokens, tags
                tokens, tags = [], []
    if tokens:
        yield tokens, tags


# -- Parquet

def _is_nested(t: pa.DataType) -> bool:
    return pa.types.is_nested(t) or pa.types.is_dictionary(t) and pa.types.is_nested(t.value_type)


def _is_scalar_list(t: pa.DataType) -> bool:
    """A list (any list type) of non-nested values."""
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return lists and not _is_nested(t.value_type)


def _is_variable_width(t: pa.DataType) -> bool:
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_string_view(t) or pa.types.is_binary_view(t))


def _check_expansion(pf: pq.ParquetFile, path: Path, filename: str) -> None:
    """Refuse a file whose pages declare more decompressed bytes than the dataset limit, or more
    than 100x the file (and over 64 MiB): a compression bomb, refused before reading any page."""
    meta, limit = pf.metadata, get_settings().max_dataset_bytes
    declared = sum(meta.row_group(i).column(j).total_uncompressed_size
                   for i in range(meta.num_row_groups) for j in range(meta.num_columns))
    if declared > limit or declared > max(64 << 20, 100 * path.stat().st_size):
        raise _too_large(filename, f"its pages decompress to {declared:,} bytes")


def _too_large(filename: str, detail: str) -> UserError:
    limit = get_settings().max_dataset_bytes
    return UserError("dataset_too_large", f"{filename!r} expands to more data than this service accepts ({detail}; "
                     f"the limit is {limit:,} bytes, TUNEJOB_MAX_DATASET_BYTES)", "file", 413)


def _parquet_batches(path: Path, fmt: str, filename: str, columns: list[str] | None,
                     problems: Problems, list_columns: tuple[str, ...] = ()) -> Iterator[Batch]:
    """Column chunks are read as dictionaries where they are text, so each batch's expanded size
    is known before it is expanded: the running total must stay within ``max_dataset_bytes``, a
    row within ``BATCH_BYTES``, and each batch is expanded ``BATCH_BYTES`` at a time."""
    schema = pq.ParquetFile(path).schema_arrow
    _check_names(schema.names, filename)
    wanted = schema.names if columns is None else columns
    nested = [n for n in wanted if _is_nested(schema.field(n).type)
              and not (n in list_columns and _is_scalar_list(schema.field(n).type))]
    for name in nested:
        if columns is not None:  # a job uses it: it must hold scalars
            problems.add(None, name, None, f"holds nested values ({schema.field(name).type}), not single values",
                         "invalid_column", "file")
    read = [n for n in wanted if n not in nested]
    pf = pq.ParquetFile(path, read_dictionary=[n for n in read if _is_variable_width(schema.field(n).type)] or None)
    _check_expansion(pf, path, filename)
    if nested and columns is not None:
        return
    limit, total, start = get_settings().max_dataset_bytes, 0, 0
    for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=read, use_threads=False):
        row_bytes = np.zeros(batch.num_rows, dtype=np.int64)
        for column in batch.columns:
            row_bytes += _cell_bytes(column)
        total += int(row_bytes.sum())
        if total > limit:
            raise _too_large(filename, f"more than {limit:,} bytes once decompressed, at row {start + batch.num_rows:,}")
        for i in np.flatnonzero(row_bytes > BATCH_BYTES)[:MAX_PROBLEMS]:
            problems.add(start + int(i) + 1, None, None, f"holds {int(row_bytes[i]):,} bytes; the longest row "
                         f"accepted is {BATCH_BYTES >> 20} MiB")
        if problems.full:
            return
        for a, b in _slices(row_bytes):
            values = {name: _decoded(batch.column(name).slice(a, b - a)).to_pylist() for name in columns or []}
            yield Batch(start + a, b - a, values)
        start += batch.num_rows


def _decoded(column: pa.Array) -> pa.Array:
    """A dictionary-encoded column as plain values (``to_pylist`` on the dictionary form is slow)."""
    return column.dictionary_decode() if pa.types.is_dictionary(column.type) else column


def _cell_bytes(column: pa.Array) -> np.ndarray:
    """Bytes each cell takes once expanded (dictionary-encoded text: its value's length; a list:
    its values' bytes)."""
    if _is_scalar_list(column.type):
        values = _cell_bytes(pc.list_flatten(column))
        return np.bincount(pc.list_parent_indices(column).to_numpy(), weights=values,
                           minlength=len(column)).astype(np.int64)
    if pa.types.is_dictionary(column.type):
        lengths = pc.binary_length(column.dictionary) if _is_variable_width(column.type.value_type) else None
        if lengths is None:
            return _cell_bytes(_decoded(column))
        return pc.take(lengths, column.indices).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if _is_variable_width(column.type):
        return pc.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    try:
        width = column.type.bit_width // 8
    except ValueError:  # not fixed-width
        width = 8
    return np.full(len(column), max(1, width), dtype=np.int64)


def _slices(row_bytes: np.ndarray) -> Iterator[tuple[int, int]]:
    """Cut rows into runs of about ``BATCH_BYTES`` (at least one row each)."""
    ends = np.cumsum(row_bytes)
    a = 0
    while a < len(row_bytes):
        base = ends[a - 1] if a else 0
        b = max(a + 1, int(np.searchsorted(ends, base + BATCH_BYTES, side="right")))
        yield a, b
        a = b


# ----------------------------------------------------------------------------- upload


@dataclass
class DatasetInfo:
    rows: int
    columns: list[str]


def inspect_dataset(path: Path, fmt: str, filename: str) -> DatasetInfo:
    """Check a stored upload end to end, in batches: encoding, parse, header, every row.

    Raises:
        UserError: ``empty_file``, ``invalid_encoding``, ``invalid_file`` (with a validation report
            of up to 20 problems), ``dataset_too_large``.
    """
    if path.stat().st_size == 0:
        raise UserError("empty_file", f"{filename!r} is empty", "file")
    if fmt in TEXT_FORMATS:
        check_utf8(path, filename)
    problems, rows, keys = Problems(filename), 0, []
    for batch in read_batches(path, fmt, filename, None, problems):
        rows += batch.size
        keys += batch.keys
    problems.raise_if_any()
    columns = pq.ParquetFile(path).schema_arrow.names if fmt == "parquet" else keys
    if rows == 0:
        raise UserError("empty_file", f"{filename!r} has a header but no data row" if columns else
                        f"{filename!r} has no data row", "file")
    return DatasetInfo(rows, columns)


# ----------------------------------------------------------------------------- job data


@dataclass(frozen=True)
class JobColumns:
    """The columns a job reads and how its labels are checked (from a ``JobCreate`` or its stored
    ``spec`` dict)."""

    task: str
    text: str
    text_pair: str | None
    label: str
    allow_large_targets: bool = False
    label_separator: str | None = None  # multi_label: splits a text label cell

    @classmethod
    def of(cls, spec) -> "JobColumns":
        get = spec.get if isinstance(spec, dict) else lambda k, default=None: getattr(spec, k, default)
        return cls(get("task", "classification"), get("text_column", "text"), get("text_pair_column"),
                   get("label_column", "label"), bool(get("allow_large_targets", False)), get("label_separator"))

    @property
    def has_classes(self) -> bool:
        """The labels are class names (one per row, or a list of them)."""
        return self.task in ("classification", "multi_label")

    def label_of(self, value: Any) -> str | float | list[str]:
        """A label cell as the task reads it (``class_name``, ``regression_target``, ``label_list``).

        Raises:
            ValueError: the message says what is wrong with the cell.
        """
        if self.task == "regression":
            return regression_target(value, self.allow_large_targets)
        if self.task == "multi_label":
            return label_list(value, self.label_separator)
        return class_name(value)

    @property
    def texts(self) -> list[tuple[str, str]]:
        """(column, spec field) of each text input."""
        return [(self.text, "text_column")] + ([(self.text_pair, "text_pair_column")] if self.text_pair else [])

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([c for c, _ in self.texts] + [self.label]))

    @property
    def list_columns(self) -> tuple[str, ...]:
        """Columns of lists: multi_label's labels, token_classification's words and tags."""
        return {"multi_label": (self.label,), "token_classification": (self.text, self.label)}.get(self.task, ())


def _kind(value: Any) -> str:
    """What a cell holds, in words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "a nested value (an object)"
    if isinstance(value, (list, tuple)):
        return "a nested value (a list)"
    if isinstance(value, bytes):
        return "bytes (binary)"
    return f"a {type(value).__name__} value"


def check_text(value: Any) -> str | None:
    """What is wrong with a text cell, or None when it is a non-empty string."""
    if value is None:
        return "is missing"
    if isinstance(value, bytes):
        return "holds bytes (binary), not text: store text as a UTF-8 string column"
    if not isinstance(value, str):
        return f"holds {_kind(value)}, not text"
    if not value.strip():
        return "is empty"
    return None


def class_name(value: Any) -> str:
    """A classification label as its class name: text as written, integers in decimal, booleans
    as ``true``/``false`` (so a JSONL ``1`` and ``"1"`` are the same class, as in a CSV).

    Raises:
        ValueError: the message says what is wrong (missing, float, nested, ...).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is empty")
        if len(value) > MAX_CLASS_NAME_CHARS:
            raise ValueError(f"is {len(value):,} characters long; class names are at most {MAX_CLASS_NAME_CHARS:,} "
                             "(is it the right column?)")
        return value
    if value is None:
        raise ValueError("is missing")
    if isinstance(value, float):
        raise ValueError("is a float; classification labels are class names (strings, integers or booleans): "
                         "use task 'regression' for numeric targets")
    raise ValueError(f"holds {_kind(value)}; labels are strings, integers or booleans")


def label_list(value: Any, separator: str | None) -> list[str]:
    """A multi_label cell as its class names (``class_name`` each), duplicates dropped, first
    occurrence first: a list (JSONL, Parquet), or text split on ``separator`` (each part
    stripped). An empty list, or empty text with a separator, is a row with no label.

    Raises:
        ValueError: missing, text without a separator, not a list, or an item that is not a
            class name (empty, a float, nested).
    """
    if isinstance(value, str) and separator is not None:
        value = [part.strip() for part in value.split(separator)] if value.strip() else []
    if value is None:
        raise ValueError("is missing")
    if isinstance(value, str):
        raise ValueError("holds text, not a list of labels: give label_separator (e.g. \",\") to split it")
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"holds {_kind(value)}; multi_label labels are lists of class names, or text split on "
                         "label_separator")
    names = []
    for item in value:
        try:
            names.append(class_name(item))
        except ValueError as e:
            raise ValueError(f"holds a label that {e}") from None
    return list(dict.fromkeys(names))


def regression_target(value: Any, allow_large: bool = False) -> float:
    """A regression label as a float: a number, or text that spells one (CSV cells are text).

    Raises:
        ValueError: missing, not a number (booleans are not), not finite, beyond float32, or
            |y| > ``MAX_REGRESSION_TARGET`` unless ``allow_large``.
    """
    if value is None or isinstance(value, str) and not value.strip():
        raise ValueError("is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"holds {_kind(value)}, not a number")
    try:
        if isinstance(value, str) and "_" in value:
            raise ValueError
        y = float(value)
    except (ValueError, OverflowError):
        raise ValueError("is not a number" if isinstance(value, str) else "is not a finite number") from None
    if not math.isfinite(y) or abs(y) > FLOAT32_MAX:
        raise ValueError("is not a finite number (float32)")
    if abs(y) > MAX_REGRESSION_TARGET and not allow_large:
        raise ValueError(f"is larger than {MAX_REGRESSION_TARGET:g} in absolute value; scale the targets, or set "
                         "allow_large_targets to true in the job spec")
    return y


@dataclass
class JobBatch:
    """Validated rows of a job's file: ``texts`` (and ``pairs``) are non-empty strings, ``labels``
    class names, float targets or (multi_label) lists of class names (token_classification:
    ``texts`` are lists of words, ``labels`` lists of tag names as long); ``start`` is the 0-based
    index of the first row."""

    start: int
    texts: list[str]
    pairs: list[str] | None
    labels: list


def job_batches(path: Path, fmt: str, filename: str, cols: JobColumns, problems: Problems) -> Iterator[JobBatch]:
    """Read and check a job's columns batch by batch. Problems go to ``problems`` (the caller
    raises them once the file is read); no batch is yielded after the first problem."""
    for batch in read_batches(path, fmt, filename, cols.names, problems, cols.list_columns):
        if cols.task == "token_classification":
            yield from _tagged_batch(batch, cols, problems)
            continue
        labels = []
        for column, param in cols.texts:
            for i, value in enumerate(batch.values[column]):
                if (message := check_text(value)) is not None:
                    code = "missing_value" if message in ("is missing", "is empty") else "invalid_text"
                    problems.add(batch.start + i + 1, column, value, message, code, param)
        for i, value in enumerate(batch.values[cols.label]):
            try:
                labels.append(cols.label_of(value))
            except ValueError as e:
                code = "missing_value" if str(e) in ("is missing", "is empty") else "invalid_label"
                problems.add(batch.start + i + 1, cols.label, value, str(e), code, "label_column")
        if problems.items:
            continue  # keep reading to report up to MAX_PROBLEMS, but hand out no data
        yield JobBatch(batch.start, batch.values[cols.text],
                       batch.values[cols.text_pair] if cols.text_pair else None, labels)
    # Text problems first (as a job reads its columns), then labels, each in row order.
    rank = {param: i for i, param in enumerate(["file", "text_column", "text_pair_column", "label_column"])}
    problems.items.sort(key=lambda p: (rank.get(p.param, 0), p.row or 0))


# -- token_classification: a list of words and a list of tags per row


def check_words(value: Any) -> str | None:
    """What is wrong with a cell of words, or None when it is a non-empty list of non-empty strings."""
    if value is None:
        return "is missing"
    if isinstance(value, str):
        return ("holds text, not a list of words: token_classification reads a JSON list per row (JSONL), a list "
                "column (Parquet) or a CoNLL file")
    if not isinstance(value, (list, tuple)):
        return f"holds {_kind(value)}, not a list of words"
    if not value:
        return "is an empty sentence (no words)"
    for i, word in enumerate(value):
        if (message := check_text(word)) is not None:
            return f"word {i + 1} {message}"
    return None


def tag_names(value: Any, words: Any) -> list[str]:
    """A cell of tags as class names (``class_name``), one per word of ``words``.

    Raises:
        ValueError: missing, not a list, a tag that is not a class name, or not as many tags as words.
    """
    if value is None:
        raise ValueError("is missing")
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"holds {'text' if isinstance(value, str) else _kind(value)}, not a list of tags")
    names = []
    for i, tag in enumerate(value):
        try:
            names.append(class_name(tag))
        except ValueError as e:
            raise ValueError(f"tag {i + 1} {e}") from None
    if isinstance(words, (list, tuple)) and len(names) != len(words):
        raise ValueError(f"has {len(names)} tag(s) for {len(words)} word(s); give one tag per word")
    return names


def _tagged_batch(batch: Batch, cols: JobColumns, problems: Problems) -> Iterator[JobBatch]:
    """A token_classification batch checked (``check_words``, ``tag_names``): a ``JobBatch`` of
    word lists and tag-name lists, or nothing once ``problems`` has any."""
    words, tags = batch.values[cols.text], []
    for i, (value, label) in enumerate(zip(words, batch.values[cols.label])):
        if (message := check_words(value)) is not None:
            code = "missing_value" if message.startswith(("is missing", "is an empty")) else "invalid_text"
            problems.add(batch.start + i + 1, cols.text, value, message, code, "text_column")
        try:
            tags.append(tag_names(label, value))
        except ValueError as e:
            code = "missing_value" if str(e) == "is missing" else "invalid_label"
            problems.add(batch.start + i + 1, cols.label, label, str(e), code, "label_column")
    if not problems.items:
        yield JobBatch(batch.start, [list(w) for w in words], None, tags)


@dataclass
class LabelSummary:
    """What checking a job's file keeps: its row count and, for classification, the class of
    each row (``codes``, indices into ``names``), each class's row count and first row;
    multi_label: each label's row count and first row, and the rows without a label (``empty_rows``)."""

    rows: int = 0
    names: list[str] | None = None
    codes: np.ndarray | None = None
    counts: dict[str, int] = field(default_factory=dict)
    first_row: dict[str, int] = field(default_factory=dict)
    empty_rows: int = 0


def sort_class_names(names) -> list[str]:
    """Class names sorted numerically when every one spells a finite number, else as text."""
    def number(name: str) -> float | None:
        try:
            x = float(name)
        except ValueError:
            return None
        return x if math.isfinite(x) else None

    numbers = [number(n) for n in names]
    if all(x is not None for x in numbers):
        return [n for _, n in sorted(zip(numbers, names))]
    return sorted(names)


class ClassIndex:
    """Numbers a file's class names as they stream past (one per row, or a list per row for
    multi_label): each class's row count and first row, the rows without a label, and
    (``keep_codes``, single-label only) one int32 per row; ``summary`` sorts the classes
    (``sort_class_names``) and renumbers."""

    def __init__(self, filename: str, column: str, keep_codes: bool = True):
        self.filename, self.column = filename, column
        self.index: dict[str, int] = {}
        self.first_row: dict[str, int] = {}
        self.counts: list[int] = []
        self.rows = self.empty_rows = 0
        self.codes = array("i") if keep_codes else None

    @staticmethod
    def of(filename: str, cols: JobColumns, keep_codes: bool = True) -> "ClassIndex | None":
        """The index for a job's labels: a ``TagIndex`` for token_classification's tags, None when
        they are not class names (regression). Per-row codes are kept for single-label
        classification only (they stratify the split)."""
        if cols.task == "token_classification":
            return TagIndex(filename, cols.label)
        if not cols.has_classes:
            return None
        return ClassIndex(filename, cols.label, keep_codes and cols.task == "classification")

    def add(self, batch: JobBatch) -> None:
        for i, label in enumerate(batch.labels):
            names = label if isinstance(label, list) else (label,)
            self.rows += 1
            self.empty_rows += not names
            for name in names:
                code = self._code(name, batch.start + i + 1)
                self.counts[code] += 1
            if self.codes is not None:
                self.codes.append(code)

    def _code(self, name: str, row: int) -> int:
        """The index of class ``name``, numbering it if new (first seen at 1-based ``row``).

        Raises:
            UserError: ``too_many_classes``.
        """
        code = self.index.get(name)
        if code is None:
            limit = get_settings().max_classes
            if len(self.index) == limit:
                raise UserError("too_many_classes", f"{self.filename!r}: label column {self.column!r} has "
                                f"{limit + 1} classes by row {row}; at most {limit} "
                                "(TUNEJOB_MAX_CLASSES): is it the right column, or is this a regression task?",
                                "label_column")
            code = self.index[name] = len(self.index)
            self.first_row[name] = row
            self.counts.append(0)
        return code

    def summary(self) -> LabelSummary:
        names = sort_class_names(self.index)
        counts = {name: self.counts[self.index[name]] for name in names}
        codes = None
        if self.codes is not None:
            position = {name: i for i, name in enumerate(names)}
            order = np.array([position[n] for n in self.index] or [0], dtype=np.int32)
            codes = order[np.frombuffer(self.codes, dtype=np.int32)] if len(self.codes) else np.zeros(0, np.int32)
        return LabelSummary(self.rows, names, codes, counts, self.first_row, self.empty_rows)


class TagIndex(ClassIndex):
    """``ClassIndex`` over the tags of a token_classification file: each tag's count (in words)
    and first row (sentence), and the rows (sentences); no per-row codes (the validation split is
    not stratified)."""

    def __init__(self, filename: str, column: str):
        super().__init__(filename, column, keep_codes=False)

    def add(self, batch: JobBatch) -> None:
        for i, tags in enumerate(batch.labels):
            self.rows += 1
            for name in tags:
                self.counts[self._code(name, batch.start + i + 1)] += 1


def scan_job_data(path: Path, fmt: str, filename: str, cols: JobColumns) -> LabelSummary:
    """Check a job's columns in one file, batch by batch, keeping only the row count and, for
    classification, each class's row count and first row: never the texts, nothing per row.

    Raises:
        UserError: the validation report (``missing_value``, ``invalid_text``, ``invalid_label``,
            ``invalid_column``, ...), ``too_many_classes``, or a reader error (see ``read_batches``).
    """
    problems, rows = Problems(filename), 0
    classes = ClassIndex.of(filename, cols, keep_codes=False)
    for batch in job_batches(path, fmt, filename, cols, problems):
        rows += len(batch.texts)
        if classes is not None:
            classes.add(batch)
    problems.raise_if_any()
    return classes.summary() if classes is not None else LabelSummary(rows)


def read_job_table(path: Path, fmt: str, filename: str, cols: JobColumns) -> tuple[pd.DataFrame, LabelSummary]:
    """The worker's view of one file: a DataFrame with only the job's columns, checked as the API
    checked them, texts as ``str``, labels as class names (``str``) or float32 targets
    (multi_label: lists of class names; token_classification: lists of words and of tag names);
    and the same ``LabelSummary`` as ``scan_job_data`` (classes and per-row codes, to split alike).

    Raises:
        UserError: as ``scan_job_data``; the worker fails the job at once with it.
    """
    problems, texts, pairs, labels = Problems(filename), [], [], []
    classes = ClassIndex.of(filename, cols)
    for batch in job_batches(path, fmt, filename, cols, problems):
        texts += batch.texts
        pairs += batch.pairs or []
        labels += batch.labels
        if classes is not None:
            classes.add(batch)
    problems.raise_if_any()
    frame = {cols.text: texts, **({cols.text_pair: pairs} if cols.text_pair else {}),
             cols.label: labels if classes is not None else np.array(labels, dtype=np.float32)}
    return pd.DataFrame(frame), classes.summary() if classes is not None else LabelSummary(len(texts))


def validation_size(n: int, fraction: float) -> int:
    """Rows ``validation_split`` holds out of ``n``, as scikit-learn sizes it.

    Raises:
        UserError: ``too_few_rows`` when that leaves no row for training.
    """
    n_val = math.ceil(n * fraction)
    if fraction and n_val >= n:
        raise UserError(
            "too_few_rows",
            f"validation_split {fraction} of {n} row(s) leaves no row for training; upload more rows, "
            "lower validation_split (0 for none) or give a validation_dataset",
            "validation_split",
        )
    return n_val


def split_train_validation(
    n: int, codes: np.ndarray | None, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Hold out ``fraction`` of ``n`` rows for validation: row indices (sorted) of each part.

    Stratified by ``codes`` (classification: the class of each row) when every class has at
    least two rows and both parts can hold every class (scikit-learn ``train_test_split``);
    seeded by ``seed``, so the API's dry run and the worker split alike.

    Raises:
        UserError: ``too_few_rows`` when the held-out part would leave no row for training.
    """
    rows = np.arange(n, dtype=np.int32)
    if not fraction:
        return rows, None
    n_val = validation_size(n, fraction)
    stratify = None
    if codes is not None:
        counts = np.bincount(codes)
        classes = int((counts > 0).sum())
        if counts[counts > 0].min() >= 2 and round(n * fraction) >= classes and n - n_val >= classes:
            stratify = codes
    train, val = train_test_split(rows, test_size=fraction, random_state=seed, stratify=stratify)
    return np.sort(train), np.sort(val)
