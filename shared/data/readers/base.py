"""What every format reader shares: the ``Batch`` it yields, the UTF-8 check, and its errors."""

import codecs
from pathlib import Path
from typing import NamedTuple

from shared.data.problems import Problems
from shared.errors import UserError, without_paths
from shared.settings import get_settings

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
    hint = (
        " (it starts with a UTF-16 byte order mark: save it as UTF-8)" if head[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
    )
    raise UserError(
        "invalid_encoding",
        f"{filename!r} is not valid UTF-8: byte 0x{head[position]:02x} at offset {position} (line {line}){hint}",
        "file",
    )


def library_message(e: Exception) -> str:
    """A reader's error, first line, without anything that names a server file."""
    return without_paths(str(e).splitlines()[0] if str(e) else type(e).__name__)


def too_many_columns(filename: str, columns: str) -> UserError:
    """422 ``too_many_columns``: ``columns`` says how many (e.g. "257 columns")."""
    limit = get_settings().max_columns
    return UserError("too_many_columns", f"{filename!r} has {columns}; at most {limit} (TUNEJOB_MAX_COLUMNS)", "file")


def check_names(names: list[str], filename: str) -> None:
    if len(names) > get_settings().max_columns:
        raise too_many_columns(filename, f"{len(names)} columns")
    problems = Problems(filename)
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            problems.add(None, name, None, f"is a duplicate column name (columns {seen[name] + 1} and {i + 1})")
        seen.setdefault(name, i)
    problems.raise_if_any()
