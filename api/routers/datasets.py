import hashlib
import os
import uuid

from fastapi import APIRouter, UploadFile
from sqlalchemy import select

from shared.datasets import detect_format, read_table
from shared.db import session_scope
from shared.errors import NotFound, UserError
from shared.models import Dataset, new_id
from shared.schemas import DatasetOut
from shared.settings import get_settings

router = APIRouter(tags=["datasets"])


@router.post("/datasets", status_code=201)
def upload_dataset(file: UploadFile) -> DatasetOut:
    """Upload a CSV, TSV, JSONL or Parquet file (multipart field ``file``).

    The file is validated (UTF-8, parses, at least one row) before anything is recorded; a
    rejected file leaves no row and no file behind.
    """
    settings = get_settings()
    filename = os.path.basename(file.filename or "upload")
    fmt = detect_format(filename)
    dataset_id = new_id("ds")
    tmp = settings.path("uploads", f".{uuid.uuid4().hex}.tmp")
    final = settings.path("uploads", f"{dataset_id}.{fmt}")
    try:
        size, sha256 = _save(file, tmp, settings.max_upload_bytes, filename)
        table = read_table(tmp, fmt, filename)
        os.replace(tmp, final)
        with session_scope() as s:
            dataset = Dataset(id=dataset_id, filename=filename, format=fmt, path=str(final), rows=len(table),
                              columns=list(table.columns), bytes=size, sha256=sha256)
            s.add(dataset)
    except BaseException:
        tmp.unlink(missing_ok=True)
        final.unlink(missing_ok=True)
        raise
    return DatasetOut.model_validate(dataset)


def _save(file: UploadFile, path, max_bytes: int, filename: str) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as out:
        while chunk := file.file.read(1 << 20):
            size += len(chunk)
            if size > max_bytes:
                raise UserError("file_too_large", f"{filename!r} is larger than {max_bytes} bytes", "file", 413)
            digest.update(chunk)
            out.write(chunk)
    return size, digest.hexdigest()


@router.get("/datasets")
def list_datasets() -> dict[str, list[DatasetOut]]:
    with session_scope() as s:
        rows = s.scalars(select(Dataset).order_by(Dataset.created_at.desc(), Dataset.id.desc())).all()
        return {"data": [DatasetOut.model_validate(d) for d in rows]}


@router.get("/datasets/{dataset_id}")
def get_dataset(dataset_id: str) -> DatasetOut:
    with session_scope() as s:
        dataset = s.get(Dataset, dataset_id)
        if dataset is None:
            raise NotFound("dataset", dataset_id)
        return DatasetOut.model_validate(dataset)
