"""JSONL, line by line with the standard ``json`` module: every row an object, without duplicate
keys or NaN/Infinity."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared.data.formats import BATCH_BYTES, BATCH_ROWS
from shared.data.problems import Problems, invalid_file
from shared.data.readers.base import Batch, too_many_columns
from shared.settings import get_settings

# -- JSONL


class _JsonRowError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    row = dict(pairs)
    if len(row) != len(pairs):
        duplicate = next(k for i, (k, _) in enumerate(pairs) if k in (earlier for earlier, _ in pairs[:i]))
        raise _JsonRowError(f"has the key {duplicate!r} twice")
    return row


def _no_constant(name: str) -> None:
    raise _JsonRowError(f"holds {name}, which is not valid JSON (use null, or a number)")


_JSON = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def jsonl_batches(
    path: Path, fmt: str, filename: str, columns: list[str] | None, problems: Problems
) -> Iterator[Batch]:
    """One JSON object per line; blank lines are skipped. Each batch names the keys it saw first."""
    keys: dict[str, None] = {}
    known = 0  # keys already handed out
    values: dict[str, list] = {name: [] for name in columns or []}
    start = size = nbytes = 0
    line_number = 0
    with open(path, "rb") as f:
        while line := f.readline(BATCH_BYTES + 1):
            line_number += 1
            if line_number == 1 and line.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
                raise invalid_file(
                    filename,
                    fmt,
                    "it is one JSON array, not JSON Lines: write one object per line "
                    "(pandas: to_json(path, orient='records', lines=True))",
                )
            if len(line) > BATCH_BYTES and not line.endswith(b"\n"):
                problems.add(
                    start + size + 1,
                    None,
                    None,
                    f"(line {line_number}) is longer than {BATCH_BYTES >> 20} MiB, the longest row accepted",
                )
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
                    raise _JsonRowError(
                        f"is a JSON {type(row).__name__}, not an object "
                        '(each line must be one {"column": value, ...} object)'
                    )
            except _JsonRowError as e:
                problems.add(start + size + 1, None, text, f"(line {line_number}) {e}")
                row = {}
            except json.JSONDecodeError as e:
                problems.add(
                    start + size + 1,
                    None,
                    text,
                    f"(line {line_number}) is not valid JSON: {e.msg} at character {e.pos + 1}",
                )
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
