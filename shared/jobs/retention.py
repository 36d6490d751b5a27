"""Retention and clean-up of job and dataset files (a chore of the recovery loop, ``shared.queue``):
the files of jobs past ``artifact_retention_days``, and whatever a process that died between a row's
change and its files' removal left behind."""

import time
from datetime import timedelta

from sqlalchemy import delete, or_, select

from shared.jobs import trials
from shared.settings import get_settings
from shared.store import artifacts, objects
from shared.store.alias_rows import ModelAlias
from shared.store.engine import read_session, session_scope
from shared.store.rows import Checkpoint, Dataset, Job, JobEvent, JobStatus, utcnow

# An upload's temporary file (``api.uploads``: ``uploads/.<uuid>.tmp``) is written as the body
# arrives and removed when the request ends; one untouched for this long is a killed API's.
DEAD_UPLOAD_SECONDS = 3600


def clean_up_files() -> None:
    """Retention and clean-up of files, safe to run from any number of processes at once.

    Marks the files of jobs that finished more than ``artifact_retention_days`` ago (but for the
    models that model aliases name) as deleted
    (with a ``files_deleted`` event; the job itself stays listed), then removes every file the
    store says should be gone: checkpoints and artifacts of jobs whose files were deleted, step
    checkpoints of succeeded jobs, uploads and tokenization caches of deleted datasets. Those are
    normally removed at once; this catches what a process that died in between left behind, and
    the temporary file of an upload whose API process was killed (``remove_dead_uploads``). What
    is removed is looked for among the files there are (a listing of the store, and of this host's
    caches), so each is removed once, not again at every turn.
    """
    remove_dead_uploads()
    settings, now = get_settings(), utcnow()
    if settings.artifact_retention_days is not None:
        cutoff = now - timedelta(days=settings.artifact_retention_days)
        with session_scope() as s:
            expired = s.scalars(
                select(Job)
                .where(Job.status.in_(JobStatus.FINISHED), Job.finished_at < cutoff, Job.files_deleted_at.is_(None))
                .where(Job.id.not_in(select(ModelAlias.job_id)))  # a model an alias names is in use, however old
                .with_for_update(skip_locked=True)
            ).all()
            for job in expired:
                job.files_deleted_at = now
                s.execute(delete(Checkpoint).where(Checkpoint.job_id == job.id))
                s.add(
                    JobEvent(
                        job_id=job.id,
                        code="files_deleted",
                        level="info",
                        message=f"checkpoints and artifacts removed: finished over "
                        f"{settings.artifact_retention_days:g} days ago (TUNEJOB_ARTIFACT_RETENTION_DAYS)",
                    )
                )
    for folder, gone in [
        ("checkpoints", or_(Job.status.in_(trials.NO_CHECKPOINTS), Job.files_deleted_at.isnot(None))),
        ("artifacts", or_(Job.status == JobStatus.PRUNED, Job.files_deleted_at.isnot(None))),
    ]:
        for job_id in _jobs_on_disk(folder, gone):
            objects.remove_job_files(job_id, folder)
    store = objects.store()
    for ref in _deleted_datasets(Dataset.path, store.upload_refs()):
        store.remove(ref)
    cached = artifacts.tokenized_cache_root()
    shas = [p.name for p in cached.iterdir() if not p.name.startswith(".")] if cached.is_dir() else []
    for sha256 in _deleted_datasets(Dataset.sha256, shas):
        artifacts.remove_tree(artifacts.tokenized_cache_dir(sha256))


def _deleted_datasets(column, present: list[str]) -> set[str]:
    """Of the ``present`` values of ``column`` (``Dataset.path``: the uploads there are;
    ``Dataset.sha256``: the tokenization caches on this host), those of deleted datasets and of no
    live one: files to remove. Only what is there is asked for, so a dataset whose files are gone is
    not found again (a tombstone stays for good)."""
    deleted: set[str] = set()
    live: set[str] = set()
    with read_session() as s:
        for i in range(0, len(present), 500):
            rows = s.execute(select(column, Dataset.deleted_at).where(column.in_(present[i : i + 500])))
            for value, deleted_at in rows:
                (live if deleted_at is None else deleted).add(value)
    return deleted - live


def _jobs_on_disk(folder: str, condition) -> list[str]:
    """Ids of the jobs that have files under ``<data>/<folder>`` (or in the bucket) and match ``condition``."""
    names = objects.store().job_ids(folder)
    found: list[str] = []
    with session_scope() as s:
        for i in range(0, len(names), 500):
            found += s.scalars(select(Job.id).where(Job.id.in_(names[i : i + 500]), condition)).all()
    return found


def remove_dead_uploads() -> None:
    """Remove this host's upload temporary files not written for ``DEAD_UPLOAD_SECONDS``: an API
    process killed mid-upload (``kill -9``, a supervisor's SIGKILL after its grace period) left
    them for good (52 MB each in a walk)."""
    folder = get_settings().data_path / "uploads"
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else []:
        try:
            if time.time() - tmp.stat().st_mtime > DEAD_UPLOAD_SECONDS:
                tmp.unlink()
        except FileNotFoundError:  # its request ended meanwhile, or another process removed it
            continue
