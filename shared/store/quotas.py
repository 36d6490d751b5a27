"""Caps on what one request may carry, and quotas on what one tenant may hold. Every limit is a
setting (``shared.settings``; docs/production/security.md, "Limits"), and every refusal is a 4xx
naming the limit, the value and the setting:

- ``metadata``: at most ``max_metadata_keys`` keys of at most ``max_metadata_key_chars`` characters,
  string values of at most ``max_metadata_value_chars`` (the OpenAI limits): 422.
- columns per uploaded dataset (``max_columns``) and classes per classification job
  (``max_classes``): 422, checked as the data is read (``shared.datasets``).
- queued + running jobs per tenant (``max_active_jobs_per_tenant``): 429 with ``Retry-After``.
- storage per tenant (``max_storage_bytes_per_tenant``): uploaded datasets plus the checkpoints and
  artifacts of its jobs, checked when a dataset is uploaded or a job submitted: 413. A running job
  may take a tenant past it; nothing new is accepted until space is freed.

The request rate per API key is limited in ``api.auth``.
"""

import logging

from obstore.exceptions import BaseError as ObjectStoreError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.errors import UserError
from shared.settings import get_settings
from shared.store import objects
from shared.store.rows import Checkpoint, Dataset, Job, JobStatus

log = logging.getLogger(__name__)

ACTIVE_JOBS_RETRY_AFTER_S = 60  # a guess at how soon a slot frees: jobs take minutes to hours


def check_metadata(metadata: dict[str, str] | None) -> None:
    """Raises: UserError 422 ``invalid_request`` (``param`` ``metadata``) if ``metadata`` breaks the
    caps or holds a NUL character."""
    if not metadata:
        return
    settings = get_settings()
    if len(metadata) > settings.max_metadata_keys:
        raise _metadata_error(f"{len(metadata)} keys; at most {settings.max_metadata_keys} (TUNEJOB_MAX_METADATA_KEYS)")
    for key, value in metadata.items():
        if "\x00" in key + value:  # PostgreSQL's jsonb cannot keep one: refused on every store alike
            raise _metadata_error(f"the entry {key!r} holds a NUL character (0x00)")
        if len(key) > settings.max_metadata_key_chars:
            raise _metadata_error(
                f"key {key[:80]!r} has {len(key)} characters; at most "
                f"{settings.max_metadata_key_chars} (TUNEJOB_MAX_METADATA_KEY_CHARS)"
            )
        if len(value) > settings.max_metadata_value_chars:
            raise _metadata_error(
                f"value of {key!r} has {len(value)} characters; at most "
                f"{settings.max_metadata_value_chars} (TUNEJOB_MAX_METADATA_VALUE_CHARS)"
            )


def _metadata_error(detail: str) -> UserError:
    return UserError("invalid_request", f"metadata: {detail}", "metadata")


def check_active_jobs(session: Session, tenant: str) -> None:
    """Raises: UserError 429 ``too_many_active_jobs`` when ``tenant`` has its maximum of queued +
    running jobs. Call in the transaction that inserts the job, after ``shared.store.tenancy.lock_tenant``."""
    limit = get_settings().max_active_jobs_per_tenant
    active = (
        session.scalar(
            select(func.count())
            .select_from(Job)
            .where(Job.tenant == tenant, Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
        )
        or 0
    )
    if active >= limit:
        raise UserError(
            "too_many_active_jobs",
            f"tenant {tenant!r} has {active} queued or running jobs, its maximum "
            f"(TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT={limit}); submit again when one has finished, or "
            "cancel one",
            status=429,
            headers={"Retry-After": str(ACTIVE_JOBS_RETRY_AFTER_S)},
        )


def job_files_bytes(session: Session, tenant: str) -> int:
    """Bytes of the checkpoints and artifacts of ``tenant``'s jobs whose files are kept, as recorded
    when they were written (``Checkpoint.bytes``, ``Job.files_bytes``): two sums over its rows, so
    that a check costs the same however many objects the bucket holds (it listed every tenant's
    checkpoints and artifacts on each upload and job). A running prediction's results count as
    its parts are written (``worker.predict``), a training job's artifacts once it has ended
    (both then as listed, ``artifacts_bytes``); rows written before revision 0015 count 0."""
    kept = (Job.tenant == tenant, Job.deleted_at.is_(None), Job.files_deleted_at.is_(None))
    checkpoints = session.scalar(
        select(func.coalesce(func.sum(Checkpoint.bytes), 0)).join(Job, Checkpoint.job_id == Job.id).where(*kept)
    )
    artifacts = session.scalar(select(func.coalesce(func.sum(Job.files_bytes), 0)).where(*kept))
    return int(checkpoints or 0) + int(artifacts or 0)


def artifacts_bytes(job_id: str) -> int | None:
    """Bytes under the job's ``artifacts/<id>`` (its model, or its prediction's results), recorded
    as ``Job.files_bytes`` when it ends (one listing of its own objects); None, logged, when the
    store cannot say (a bucket that fails must not keep a job from ending: it may be why it failed)."""
    try:
        return objects.store().folder_bytes(f"artifacts/{job_id}")
    except (OSError, ObjectStoreError) as e:
        log.warning("the size of job %s's files is unknown (they count 0 towards its quota): %s", job_id, e)
        return None


def check_storage(session: Session, tenant: str, adding: int = 0) -> None:
    """Raises: UserError 413 ``storage_quota_exceeded`` when ``tenant`` would hold more than its
    quota with ``adding`` more bytes (a job adds its checkpoints and artifacts later: 0).

    Summed in ``session``, so that two uploads checked in transactions serialized by
    ``shared.store.tenancy.lock_tenant`` cannot both pass on the same free space.
    """
    limit = get_settings().max_storage_bytes_per_tenant
    uploads = (
        session.scalar(
            select(func.coalesce(func.sum(Dataset.bytes), 0)).where(
                Dataset.tenant == tenant, Dataset.deleted_at.is_(None)
            )
        )
        or 0
    )  # a deleted dataset's file is gone
    used = int(uploads) + job_files_bytes(session, tenant)
    if used + adding > limit:
        what = f"; this upload adds {adding:,}" if adding else ""
        raise UserError(
            "storage_quota_exceeded",
            f"tenant {tenant!r} stores {used:,} bytes of its {limit:,}-byte quota "
            f"(TUNEJOB_MAX_STORAGE_BYTES_PER_TENANT){what}; delete datasets or jobs to free space",
            "file" if adding else None,
            status=413,
        )
