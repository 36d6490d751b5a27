"""Parquet, with ``pyarrow.parquet.ParquetFile.iter_batches``: text columns read as dictionaries,
so that a decompression bomb is measured before it is expanded."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shared.data.formats import BATCH_BYTES, BATCH_ROWS, MAX_PROBLEMS
from shared.data.problems import Problems
from shared.data.readers.base import Batch, check_names
from shared.errors import UserError
from shared.settings import get_settings

# -- Parquet


def _is_nested(t: pa.DataType) -> bool:
    return pa.types.is_nested(t) or pa.types.is_dictionary(t) and pa.types.is_nested(t.value_type)


def _is_scalar_list(t: pa.DataType) -> bool:
    """A list (any list type) of non-nested values."""
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    return lists and not _is_nested(t.value_type)


def _is_variable_width(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_string_view(t)
        or pa.types.is_binary_view(t)
    )


def _check_expansion(pf: pq.ParquetFile, path: Path, filename: str) -> None:
    """Refuse a file whose pages declare more decompressed bytes than the dataset limit, or more
    than 100x the file (and over 64 MiB): a compression bomb, refused before reading any page."""
    meta, limit = pf.metadata, get_settings().max_dataset_bytes
    declared = sum(
        meta.row_group(i).column(j).total_uncompressed_size
        for i in range(meta.num_row_groups)
        for j in range(meta.num_columns)
    )
    if declared > limit or declared > max(64 << 20, 100 * path.stat().st_size):
        raise _too_large(filename, f"its pages decompress to {declared:,} bytes")


def _too_large(filename: str, detail: str) -> UserError:
    limit = get_settings().max_dataset_bytes
    return UserError(
        "dataset_too_large",
        f"{filename!r} expands to more data than this service accepts ({detail}; "
        f"the limit is {limit:,} bytes, TUNEJOB_MAX_DATASET_BYTES)",
        "file",
        413,
    )


def parquet_batches(
    path: Path,
    fmt: str,
    filename: str,
    columns: list[str] | None,
    problems: Problems,
    list_columns: tuple[str, ...] = (),
) -> Iterator[Batch]:
    """Column chunks are read as dictionaries where they are text, so each batch's expanded size
    is known before it is expanded: the running total must stay within ``max_dataset_bytes``, a
    row within ``BATCH_BYTES``, and each batch is expanded ``BATCH_BYTES`` at a time."""
    schema = pq.ParquetFile(path).schema_arrow
    check_names(schema.names, filename)
    wanted = schema.names if columns is None else columns
    nested = [
        n
        for n in wanted
        if _is_nested(schema.field(n).type) and not (n in list_columns and _is_scalar_list(schema.field(n).type))
    ]
    for name in nested:
        if columns is not None:  # a job uses it: it must hold scalars
            problems.add(
                None,
                name,
                None,
                f"holds nested values ({schema.field(name).type}), not single values",
                "invalid_column",
                "file",
            )
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
            raise _too_large(
                filename, f"more than {limit:,} bytes once decompressed, at row {start + batch.num_rows:,}"
            )
        for i in np.flatnonzero(row_bytes > BATCH_BYTES)[:MAX_PROBLEMS]:
            problems.add(
                start + int(i) + 1,
                None,
                None,
                f"holds {int(row_bytes[i]):,} bytes; the longest row accepted is {BATCH_BYTES >> 20} MiB",
            )
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
        return np.bincount(pc.list_parent_indices(column).to_numpy(), weights=values, minlength=len(column)).astype(
            np.int64
        )
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
