"""The evaluation report of a job (``GET /jobs/{id}/evaluation``): ``evaluation.json``, which the
worker wrote with the job's model (``worker.evaluation``). No torch here: the API imports this module."""

import json

from shared.errors import Conflict, NotFound
from shared.jobs.lifecycle import get_job
from shared.store import artifacts
from shared.store.tenancy import Caller


def job_evaluation(job_id: str, caller: Caller) -> dict:
    """The report written with a succeeded training job's model, as ``worker.evaluation`` wrote it.

    Raises:
        NotFound, Deleted: see ``shared.jobs.lifecycle.get_job``; ``NotFound`` also for a succeeded
            job without a report (it had no validation rows, or its model was deleted).
        Conflict: ``job_not_succeeded`` (409), the job has not succeeded (yet).
    """
    job = get_job(job_id, caller)
    if job.status != "succeeded":
        raise Conflict("job_not_succeeded", f"job {job_id!r} is {job.status}: its evaluation report is written "
                       "when it succeeds")
    path = artifacts.model_dir(job_id) / artifacts.EVALUATION
    if not path.is_file():
        raise NotFound("evaluation report of job", job_id)
    return json.loads(path.read_text())
