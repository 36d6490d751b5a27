"""Stored datasets: save an upload (validated first, stored atomically), get, list, delete.

One service for every API that takes datasets: the native ``/datasets`` routes and the OpenAI
``/v1/files`` facade call these functions, so a file is checked and stored the same way whichever
door it came in by.
"""

import os
from pathlib import Path

from sqlalchemy import or_, select

from shared.data.read import inspect_dataset
from shared.errors import Conflict
from shared.schemas.jobs import DatasetOut
from shared.settings import get_settings
from shared.store import artifacts, idempotency, objects, quotas
from shared.store.engine import keyset_page, read_session, session_scope
from shared.store.rows import Dataset, Job, JobStatus, new_id, utcnow
from shared.store.tenancy import Caller, lock_tenant, owned, scoped


def store_dataset(
    tmp: Path, filename: str, fmt: str, size: int, sha256: str, caller: Caller, claim: idempotency.Claim | None = None
) -> Dataset:
    """Check an uploaded file, received at ``tmp`` (``api.uploads`` streams it there), in batches
    (``shared.data.read.inspect_dataset``: UTF-8, parses, unique header, no ragged row, at least one
    row, Parquet's expanded size) and against the caller's quotas, then move it under a
    server-chosen name (and into the bucket, with ``TUNEJOB_STORAGE_URL``: before the row is
    written) and record it for the caller's tenant. A rejected file leaves no row and no
    file behind (the caller removes ``tmp``). With an idempotency ``claim``, the response
    (``DatasetOut``) is recorded in the same transaction.

    Args:
        tmp: the received file; ``filename``: the uploader's base name (display only); ``fmt``:
            from its extension; ``size`` in bytes and ``sha256`` (hex) of its content.

    Raises:
        UserError: what ``inspect_dataset`` raises, with up to 20 problems (row, column, value);
            422 ``too_many_columns``, 413 ``storage_quota_exceeded`` (``shared.store.quotas``).
    """
    dataset_id = new_id("ds")
    final = get_settings().path("uploads", f"{dataset_id}.{fmt}")
    ref = None
    try:
        info = inspect_dataset(tmp, fmt, filename)
        os.replace(tmp, final)
        ref = objects.store().publish(final)  # in the bucket before the row that points at it
        with session_scope() as s:
            lock_tenant(s, caller.tenant)
            quotas.check_storage(s, caller.tenant, size)
            dataset = Dataset(
                id=dataset_id,
                tenant=caller.tenant,
                filename=filename,
                format=fmt,
                path=ref,
                rows=info.rows,
                columns=info.columns,
                bytes=size,
                sha256=sha256,
            )
            s.add(dataset)
            s.flush()
            if claim is not None:
                idempotency.complete(s, claim, 201, DatasetOut.model_validate(dataset).model_dump(mode="json"))
    except BaseException:
        final.unlink(missing_ok=True)
        if ref is not None:
            objects.store().remove(ref)
        raise
    return dataset


def get_dataset(dataset_id: str, caller: Caller, param: str | None = None) -> Dataset:
    """The dataset, if ``caller`` may see it.

    Raises:
        NotFound: no such dataset, or another tenant's. Deleted: it was deleted (``delete_dataset``).
    """
    with read_session() as s:
        return owned(s, Dataset, dataset_id, caller, param)


def list_datasets(
    caller: Caller, limit: int | None = None, after: str | None = None, newest_first: bool = True
) -> tuple[list[Dataset], bool]:
    """The caller's datasets (an admin's: all) in upload order (newest first by default), ``limit``
    at a time after the dataset ``after``. Returns (datasets, has_more); see ``shared.store.engine.keyset_page``."""
    mine = scoped(select(Dataset), Dataset, caller)
    with read_session() as s:
        return keyset_page(s, mine, Dataset, after, limit, newest_first, within=mine)


def delete_dataset(dataset_id: str, caller: Caller) -> None:
    """Remove an uploaded file and its cached tokenizations, and keep the row as a tombstone
    (finished jobs still name it; its id then answers 404 saying it was deleted).

    Raises:
        NotFound, Deleted: see ``get_dataset``. Conflict: a queued or running job uses it (409).
    """
    with session_scope() as s:
        dataset = owned(s, Dataset, dataset_id, caller, for_update=True)
        users = s.scalars(
            select(Job.id).where(
                Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)),
                or_(Job.training_dataset_id == dataset_id, Job.validation_dataset_id == dataset_id),
            )
        ).all()
        if users:
            raise Conflict(
                "dataset_in_use",
                f"dataset {dataset_id!r} is used by {len(users)} queued or running "
                f"job(s): {', '.join(users[:5])}; wait for them to finish or cancel them",
            )
        dataset.deleted_at = utcnow()
        ref, sha256 = dataset.path, dataset.sha256
        shared_content = s.scalar(select(Dataset.id).where(Dataset.sha256 == sha256, Dataset.deleted_at.is_(None)))
    objects.store().remove(ref)
    if shared_content is None:  # no other dataset has the same content (and so the same cache)
        artifacts.remove_tree(artifacts.tokenized_cache_dir(sha256))
