"""Reading a stored dataset file in bounded batches, whatever its format (``read_batches``), and the
upload check that runs every row through it (``inspect_dataset``)."""

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from shared.data.formats import TEXT_FORMATS
from shared.data.problems import Problems, invalid_file
from shared.data.readers.base import Batch, check_utf8, library_message
from shared.data.readers.conll import conll_batches
from shared.data.readers.delimited import csv_batches
from shared.data.readers.jsonl import jsonl_batches
from shared.data.readers.parquet import parquet_batches
from shared.errors import UserError


def read_batches(
    path: Path,
    fmt: str,
    filename: str,
    columns: list[str] | None,
    problems: Problems,
    list_columns: tuple[str, ...] = (),
) -> Iterator[Batch]:
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
    readers: dict[str, Callable[..., Iterator[Batch]]] = {
        "csv": csv_batches,
        "tsv": csv_batches,
        "jsonl": jsonl_batches,
        "conll": conll_batches,
        "parquet": functools.partial(parquet_batches, list_columns=list_columns),
    }
    try:
        yield from readers[fmt](path, fmt, filename, columns, problems)
    except UserError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        raise invalid_file(filename, fmt, library_message(e)) from e


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
    problems, rows, keys = Problems(filename), 0, list[str]()
    for batch in read_batches(path, fmt, filename, None, problems):
        rows += batch.size
        keys += batch.keys
    problems.raise_if_any()
    columns = pq.ParquetFile(path).schema_arrow.names if fmt == "parquet" else keys
    if rows == 0:
        raise UserError(
            "empty_file",
            f"{filename!r} has a header but no data row" if columns else f"{filename!r} has no data row",
            "file",
        )
    return DatasetInfo(rows, columns)
