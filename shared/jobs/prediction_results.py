r"""The results of a batch prediction job (``shared.jobs.predictions``): the layout of its parts on
disk (or in the bucket), and streaming them back in the format asked for.

Results are Parquet parts under ``artifacts/<job>/predictions/part-<n>.parquet``, each holding
``predict_part_rows`` consecutive input rows (the last may hold fewer), written once, atomically
(a temporary file renamed), with its counts in the file's metadata. A resumed attempt skips the
rows of the parts already written, so no row is scored twice. Columns: ``id`` (the ``id_column``
value as text, or the 0-based row index), then per task (``result_fields``): ``label``, ``score``
and ``probabilities`` (a struct with one field per class, in class order) for classification;
``value`` for regression; ``labels`` (a list) and ``probabilities`` for multi_label; ``entities``
(a list of structs ``ENTITY``) for token_classification; ``embedding`` (a fixed-size list of float32,
the model's vector size, unit length) for an embedding model (``embedding_table``).

No torch here: the API imports this module.
"""

import fnmatch
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from shared.errors import UserError
from shared.jobs.predictions import KIND
from shared.schemas.jobs import json_safe
from shared.store import artifacts, objects
from shared.store.engine import read_session
from shared.store.rows import JobStatus
from shared.store.tenancy import Caller, owned_job

PART_GLOB = "part-*.parquet"
MEDIA_TYPES = {"jsonl": "application/x-ndjson", "csv": "text/csv", "parquet": "application/vnd.apache.parquet"}
# Written in each part's Parquet metadata, summed over the parts for the job's result.
PART_COUNTS = ("rows", "truncated", "tokens", "padded_tokens")
# One entity of a token_classification row (``shared.inference.loop.entity_rows``).
ENTITY = pa.struct(
    [
        ("entity_group", pa.string()),
        ("score", pa.float64()),
        ("word", pa.string()),
        ("start", pa.int64()),
        ("end", pa.int64()),
    ]
)


# ----------------------------------------------------------------------------- results on disk


def results_dir(job_id: str) -> Path:
    return artifacts.artifacts_dir(job_id) / "predictions"


def written_parts(directory: Path) -> list[str]:
    """The refs (``shared.store.objects``) of the complete parts in ``directory`` (or in the
    bucket), in row order (a temporary file is not a part)."""
    store = objects.store()
    ref = store.ref(directory)
    return [f"{ref}/{name}" for name in store.files(ref) if fnmatch.fnmatch(name, PART_GLOB)]


def part_counts(parts: list[str]) -> dict[str, int]:
    """``PART_COUNTS`` summed over ``parts`` (read from each file's metadata, not its rows)."""
    totals = dict.fromkeys(PART_COUNTS, 0)
    for part in parts:
        counts = json.loads(pq.read_schema(objects.store().local(part)).metadata[b"tunejob"])
        for name in PART_COUNTS:
            totals[name] += counts[name]
    return totals


def write_part(directory: Path, index: int, table: pa.Table, counts: dict[str, int]) -> int:
    """Write part ``index`` atomically: a temporary file, renamed once complete (a reader or a
    resumed attempt sees the whole part or none of it), then published (into the bucket, with
    ``TUNEJOB_STORAGE_URL``). ``counts``: ``PART_COUNTS`` of the part. Returns its bytes (the
    tenant's storage quota counts a running prediction's parts: ``shared.store.quotas``)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"part-{index:06d}.parquet"
    temporary = directory / f".{path.name}.tmp"
    table = table.replace_schema_metadata({"tunejob": json.dumps({n: int(counts[n]) for n in PART_COUNTS})})
    pq.write_table(table, temporary)
    os.replace(temporary, path)
    size = path.stat().st_size
    try:
        objects.store().publish(path)
    except BaseException:  # not in the bucket: the attempt that resumes writes it again; no copy is left here
        path.unlink(missing_ok=True)
        raise
    return size


def results_table(
    ids: list, task: str, label_names: list[str] | None, rows: list[dict], id_type: pa.DataType
) -> pa.Table:
    """One part's rows as a table: ``id``, then the task's ``result_fields``. ``rows``:
    ``shared.inference.loop.Predictions.rows``."""
    columns = {"id": pa.array(ids, id_type)}
    for name, kind in result_fields(task, label_names):
        columns[name] = pa.array([r[name] for r in rows], kind)
    return pa.table(columns)


def embedding_table(ids: list, vectors: np.ndarray, id_type: pa.DataType) -> pa.Table:
    """One part's rows of an embedding model: ``id``, then ``embedding``, a fixed-size list of
    float32 (``vectors``: ``[rows, dimensions]``), stored without a copy to Python lists."""
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1), pa.float32())
    return pa.table(
        {"id": pa.array(ids, id_type), "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])}
    )


def result_fields(task: str, label_names: list[str] | None) -> list[tuple[str, pa.DataType]]:
    """(column, Arrow type) of a task's results, after ``id``: ``label``, ``score``,
    ``probabilities`` (a struct of the classes, in class order) for classification; ``value`` for
    regression; ``labels`` (a list of names) and ``probabilities`` for multi_label; ``entities``
    (a list of ``ENTITY``) for token_classification."""
    if task == "regression":
        return [("value", pa.float64())]
    if task == "token_classification":
        return [("entities", pa.list_(ENTITY))]
    probabilities = ("probabilities", pa.struct([pa.field(name, pa.float64()) for name in label_names or []]))
    if task == "multi_label":
        return [("labels", pa.list_(pa.string())), probabilities]
    return [("label", pa.string()), ("score", pa.float64()), probabilities]


def id_type(spec: dict) -> pa.DataType:
    """``id`` is the ``id_column`` value as text, or the row index."""
    return pa.string() if spec.get("id_column") else pa.int64()


def results_stream(job_id: str, caller: Caller, fmt: str) -> Iterator[bytes]:
    """A succeeded prediction's results in ``fmt`` (``jsonl``, ``csv`` or ``parquet``), one part
    at a time: memory holds one part. CSV flattens ``probabilities`` into one column per class,
    ``probabilities.<class>``, and writes a list (multi_label's ``labels``, token_classification's
    ``entities``) as JSON text. A prediction deleted while its results are sent ends the stream early.

    Raises:
        NotFound, Deleted: see ``shared.jobs.lifecycle.get_job``. UserError: ``results_not_ready`` (409)
            before the job has succeeded; ``results_deleted`` (409) after its files were removed.
    """
    with read_session() as s:
        job = owned_job(s, job_id, caller, kind=KIND)
    if job.status != JobStatus.SUCCEEDED:
        raise UserError(
            "results_not_ready",
            f"prediction {job_id!r} is {job.status}; results are served once it has succeeded",
            "prediction_id",
            409,
        )
    parts = written_parts(results_dir(job_id))
    if job.files_deleted_at is not None or not parts:
        raise UserError(
            "results_deleted",
            f"prediction {job_id!r}: its results were deleted (TUNEJOB_ARTIFACT_RETENTION_DAYS)",
            "prediction_id",
            409,
        )
    return {"jsonl": _jsonl, "csv": _csv, "parquet": _parquet}[fmt](parts)


def result_tables(parts: list[str]) -> Iterator[pa.Table]:
    """Each part as a table, read (downloaded, from the bucket) when it is its turn: one open file
    at a time, however many parts."""
    for part in parts:
        yield pq.read_table(objects.store().local(part)).replace_schema_metadata(None)


def _jsonl(parts: list[str]) -> Iterator[bytes]:
    for table in result_tables(parts):
        yield "".join(json.dumps(json_safe(row), ensure_ascii=False) + "\n" for row in table.to_pylist()).encode()


def _csv(parts: list[str]) -> Iterator[bytes]:
    for i, table in enumerate(result_tables(parts)):
        out = io.BytesIO()
        pa_csv.write_csv(_lists_as_json(table.flatten()), out, pa_csv.WriteOptions(include_header=i == 0))
        yield out.getvalue()


def _lists_as_json(table: pa.Table) -> pa.Table:
    """``table`` with each list column as JSON text (a CSV cell holds no list)."""
    for index, field in enumerate(table.schema):
        if pa.types.is_list(field.type) or pa.types.is_fixed_size_list(field.type):
            cells = [json.dumps(json_safe(v), ensure_ascii=False) for v in table.column(index).to_pylist()]
            table = table.set_column(index, field.name, pa.array(cells, pa.string()))
    return table


class _Chunks(io.RawIOBase):
    """A write-only file that keeps what is written until ``take`` (a Parquet writer's sink)."""

    def __init__(self):
        super().__init__()
        self.buffer, self.position = [], 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.buffer.append(bytes(data))
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def take(self) -> bytes:
        data, self.buffer = b"".join(self.buffer), []
        return data


def _parquet(parts: list[str]) -> Iterator[bytes]:
    sink, writer = _Chunks(), None
    for table in result_tables(parts):
        writer = writer or pq.ParquetWriter(sink, table.schema)
        writer.write_table(table)
        yield sink.take()
    if writer is not None:
        writer.close()
    yield sink.take()
