"""Objects in the bucket that no row points at: what a process that died between writing an
object and writing its row (``shared.store.objects``: always in that order) left behind, or
between deleting a row and its objects. The recovery loop (``shared.queue.RecoveryThread``)
deletes them once they are older than ``GRACE``, the most a process may take from its upload to
its row; a row never points at nothing, because it is written last.

What is an orphan:

- ``uploads/<dataset>.<format>`` without the ``Dataset`` row that names it (a deleted dataset's
  row remains as a tombstone: ``shared.jobs.retention.clean_up_files`` removes its file);
- ``checkpoints/<job>/step-<n>/…`` without its ``Checkpoint`` row (published, never recorded, or
  rotated away and not deleted);
- ``checkpoints/<job>/…`` and ``artifacts/<job>/…`` of a job id that has no row.

With files in the data directory (no ``TUNEJOB_STORAGE_URL``) there is nothing to do here.
"""

import logging
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from shared.store import objects
from shared.store.engine import read_session
from shared.store.rows import Checkpoint, Dataset, Job

GRACE = timedelta(hours=1)
EVERY_SECONDS = 300.0  # a bucket listing per process at most this often, whatever TUNEJOB_RECOVERY_SECONDS is
log = logging.getLogger(__name__)
_next_run = 0.0


def collect_orphans(grace: timedelta = GRACE, force: bool = False) -> list[str]:
    """Delete the bucket's orphans (module docstring) last modified over ``grace`` ago; at most
    once every ``EVERY_SECONDS`` in a process unless ``force``. Returns the refs deleted.

    Raises:
        OSError (obstore's errors): the bucket cannot be listed or an object deleted (the
            recovery loop logs it and tries again at its next turn).
    """
    global _next_run
    store = objects.store()
    if not isinstance(store, objects.Bucket) or (not force and time.monotonic() < _next_run):
        return []
    _next_run = time.monotonic() + EVERY_SECONDS
    cutoff = datetime.now(UTC) - grace
    candidates: dict[str, datetime] = {}  # ref -> the newest object's time under it
    for folder, depth in (("uploads", 2), ("checkpoints", 3), ("artifacts", 2)):
        for key, _, modified in store.listing(folder):
            ref = "/".join(key.split("/")[:depth])
            candidates[ref] = max(modified, candidates.get(ref, modified))
    old = [ref for ref, modified in candidates.items() if modified < cutoff]
    with read_session() as s:
        uploads = [r for r in old if r.startswith("uploads/")]
        datasets = set(s.scalars(select(Dataset.path).where(Dataset.path.in_(uploads))))
        checkpoints = set(s.scalars(select(Checkpoint.path).where(Checkpoint.path.in_(old))))
        job_ids = {r.split("/")[1] for r in old if not r.startswith("uploads/")}
        jobs = set(s.scalars(select(Job.id).where(Job.id.in_(job_ids))))
    orphans = [ref for ref in old if _orphan(ref, datasets, checkpoints, jobs)]
    for ref in orphans:
        log.info("deleting orphaned object(s) %s: no row points at them", ref)
        store.remove(ref)
    return orphans


def _orphan(ref: str, datasets: set[str], checkpoints: set[str], jobs: set[str]) -> bool:
    folder, job_or_file, *rest = ref.split("/")
    if folder == "uploads":
        return ref not in datasets
    if job_or_file not in jobs:
        return True
    return folder == "checkpoints" and bool(rest) and rest[0].startswith("step-") and ref not in checkpoints
