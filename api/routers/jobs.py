import logging
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy import select, tuple_

from shared import jobs
from shared.db import session_scope
from shared.errors import NotFound, UserError
from shared.models import Checkpoint, Job, JobEvent, JobMetric
from shared.planning import check_spec, plan_job
from shared.schemas import ArtifactOut, CheckpointOut, EventOut, JobCreate, JobList, JobOut, MetricOut
from shared.settings import get_settings
from worker.celery_app import send

router = APIRouter(prefix="/jobs", tags=["jobs"])
log = logging.getLogger("tunejob.api")
Status = Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled)$")]


@router.post("", status_code=201, response_model=JobOut,
             responses={200: {"description": "dry_run=true: the job's plan; nothing is stored or queued"}})
def create_job(spec: JobCreate, dry_run: bool = False):
    """Validate the spec against its model and data, store the job, then queue its id.

    With ``dry_run=true`` nothing is stored or queued: the response (200) is the job's plan:
    token-length histogram, padding efficiency of each batching strategy, steps per epoch, the
    fraction of examples truncated at ``max_length``, and an estimated duration where a past job
    on the same base model gives the throughput.
    """
    if dry_run:
        return JSONResponse({"dry_run": True, "plan": plan_job(check_spec(spec))})
    job = jobs.create_job(spec)
    try:
        send(job.id)
    except Exception:  # the broker is down: the job stays queued and the sweeper re-sends it
        log.exception("job %s stored but not yet sent to the broker", job.id)
    return jobs.to_out(jobs.get_job(job.id))


@router.get("")
def list_jobs(status: Status = None, limit: Annotated[int, Query(ge=1, le=100)] = 20,
              cursor: str | None = None) -> JobList:
    """Jobs, newest first. Pass ``next_cursor`` back as ``cursor`` for the next page."""
    with session_scope() as s:
        query = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
        if status:
            query = query.where(Job.status == status)
        if cursor:
            after = s.get(Job, cursor)
            if after is None:
                raise UserError("invalid_cursor", f"cursor {cursor!r} is not a job id", "cursor")
            query = query.where(tuple_(Job.created_at, Job.id) < tuple_(after.created_at, after.id))
        rows = s.scalars(query).all()
    page = rows[:limit]
    return JobList(data=[jobs.to_out(j) for j in page], next_cursor=page[-1].id if len(rows) > limit else None)


@router.get("/{job_id}")
def get_job(job_id: str) -> JobOut:
    return jobs.to_out(jobs.get_job(job_id))


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str) -> JobOut:
    """A queued job never starts; a running one stops at its next optimizer step."""
    return jobs.to_out(jobs.request_cancel(job_id))


@router.get("/{job_id}/metrics")
def job_metrics(job_id: str, after_step: int = -1,
                limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000) -> dict[str, list[MetricOut]]:
    """The metric series (step, epoch, name, value, time), ordered by step."""
    jobs.get_job(job_id)
    with session_scope() as s:
        rows = s.scalars(select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.step > after_step)
                         .order_by(JobMetric.step, JobMetric.id).limit(limit)).all()
        return {"data": [MetricOut.model_validate(m) for m in rows]}


@router.get("/{job_id}/events")
def job_events(job_id: str) -> dict[str, list[EventOut]]:
    jobs.get_job(job_id)
    with session_scope() as s:
        rows = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.time, JobEvent.id)).all()
        return {"data": [EventOut.model_validate(e) for e in rows]}


@router.get("/{job_id}/checkpoints")
def job_checkpoints(job_id: str) -> dict[str, list[CheckpointOut]]:
    jobs.get_job(job_id)
    with session_scope() as s:
        rows = s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)).all()
        return {"data": [CheckpointOut.model_validate(c) for c in rows]}


def _artifacts(job_id: str) -> dict:
    jobs.get_job(job_id)
    folder = get_settings().data_path / "artifacts" / job_id
    return {f.name: f for f in sorted(folder.glob("*")) if f.is_file() and not f.name.startswith(".")}


@router.get("/{job_id}/artifacts")
def list_artifacts(job_id: str) -> dict[str, list[ArtifactOut]]:
    """The job's downloadable files; the trained model is ``model.tar.gz``."""
    return {"data": [ArtifactOut(name=name, bytes=f.stat().st_size, url=f"/jobs/{job_id}/artifacts/{name}")
                     for name, f in _artifacts(job_id).items()]}


@router.get("/{job_id}/artifacts/{name}")
def download_artifact(job_id: str, name: str) -> FileResponse:
    """Download an artifact by its name in the job's artifact list (never by path)."""
    files = _artifacts(job_id)
    if name not in files:
        raise NotFound("artifact", name)
    return FileResponse(files[name], filename=name, media_type="application/octet-stream")
