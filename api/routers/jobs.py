from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import FileResponse, RedirectResponse, StreamingResponse
from sqlalchemy import bindparam, select

from api import db
from api.auth import CallerDep
from api.errors import SafeJSONResponse, error_responses, stream_body
from api.headers import IdempotencyKey, respond
from shared.errors import NotFound
from shared.jobs import lifecycle, models
from shared.jobs.evaluation import job_evaluation
from shared.jobs.planning import check_spec, plan_job
from shared.jobs.positions import with_positions
from shared.queue import submit_once
from shared.schemas.jobs import ArtifactOut, CheckpointOut, EventOut, JobCreate, JobList, JobOut, MetricOut
from shared.schemas.plans import DryRunOut
from shared.store import artifacts, objects
from shared.store.engine import read_session
from shared.store.rows import JobMetric

router = APIRouter(prefix="/jobs", tags=["jobs"])
Status = Annotated[str | None, Query(pattern="^(queued|running|succeeded|failed|cancelled|pruned)$")]
MAX_STEP = 2**31 - 1  # steps are stored as 32-bit integers (PostgreSQL INTEGER)
# Built once: polling clients ask for a job's new metrics all the time.
METRICS_AFTER_STEP = (
    select(JobMetric)
    .where(JobMetric.job_id == bindparam("job_id"), JobMetric.step > bindparam("after_step"))
    .order_by(JobMetric.step, JobMetric.id)
    .limit(bindparam("limit"))
)


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    responses={200: {"model": DryRunOut, "description": "dry_run=true: the job's plan; nothing is stored or queued"}},
)
def create_job(spec: JobCreate, caller: CallerDep, dry_run: bool = False, idempotency_key: IdempotencyKey = None):
    """Validate the spec against its model and data, store the job, then queue its id.

    With ``dry_run=true`` nothing is stored or queued: the response (200) is the job's plan:
    token-length histogram, padding efficiency of each batching strategy, steps per epoch, the
    fraction of examples truncated at ``max_length``, and an estimated duration where a past job
    on the same base model gives the throughput.

    With an ``Idempotency-Key`` header, a retry with the same key and body (within 24 h) gets the
    first response back and queues nothing (a dry run ignores the header: it stores nothing).
    """
    if dry_run:
        plan = DryRunOut(dry_run=True, plan=plan_job(check_spec(spec, caller)))
        return SafeJSONResponse(plan.model_dump(mode="json"))
    return respond(submit_once("POST /jobs", spec, caller, idempotency_key, lifecycle.to_out))


@router.get("")
def list_jobs(
    caller: CallerDep, status: Status = None, limit: Annotated[int, Query(ge=1, le=100)] = 20, cursor: str | None = None
) -> JobList:
    """Jobs, newest first. Pass ``next_cursor`` back as ``cursor`` for the next page."""
    page, has_more = lifecycle.list_jobs(caller, limit, cursor, status, param="cursor")
    return JobList(
        data=with_positions([lifecycle.to_out(j) for j in page]), next_cursor=page[-1].id if has_more else None
    )


@router.get("/{job_id}")
async def get_job(job_id: str, caller: CallerDep) -> JobOut:
    """The job; a queued one with its place in the queue and estimated start (``queue``)."""
    job = lifecycle.to_out(await db.job(job_id, caller))
    return (await db.read(with_positions, [job]))[0] if job.status == "queued" else job


@router.delete("/{job_id}", status_code=204, responses=error_responses(409))
def delete_job(job_id: str, caller: CallerDep) -> Response:
    """Delete a finished job's checkpoints, artifacts, metrics and events. Its id then answers 404
    (code ``deleted``). A queued or running job answers 409 (cancel it first), and so does one that a running prediction or a model alias uses."""
    lifecycle.delete_job(job_id, caller)
    return Response(status_code=204)


@router.post("/{job_id}/cancel")
def cancel_job(job_id: str, caller: CallerDep) -> JobOut:
    """A queued job never starts; a running one stops within about a second, after an optimizer step."""
    return lifecycle.to_out(lifecycle.request_cancel(job_id, caller))


@router.get("/{job_id}/metrics")
async def job_metrics(
    job_id: str,
    caller: CallerDep,
    after_step: Annotated[int, Query(ge=-1, le=MAX_STEP)] = -1,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> dict[str, list[MetricOut]]:
    """The metric series (step, epoch, name, value, time), ordered by step. A value that was not
    finite (NaN, Infinity) is null, with ``nonfinite`` true."""
    await db.job(job_id, caller)
    return {"data": await db.cached(("metrics", job_id, after_step, limit), _metrics, job_id, after_step, limit=limit)}


def _metrics(job_id: str, after_step: int, limit: int) -> list[MetricOut]:
    with read_session() as s:
        rows = s.scalars(METRICS_AFTER_STEP, {"job_id": job_id, "after_step": after_step, "limit": limit}).all()
        return [MetricOut.model_validate(m) for m in rows]


@router.get("/{job_id}/events")
def job_events(job_id: str, caller: CallerDep) -> dict[str, list[EventOut]]:
    return {"data": [EventOut.model_validate(e) for e in lifecycle.list_events(job_id, caller)]}


@router.get("/{job_id}/evaluation", responses=error_responses(409))
def get_evaluation(job_id: str, caller: CallerDep) -> dict:
    """The evaluation report of the model on the validation rows (``evaluation.json`` in the
    artifact, with its pictures as ``model/<name>`` artifacts): per-class figures, the confusion
    matrix, calibration and the most confident mistakes (classification); per-label figures
    (multi_label); errors and correlations (regression); per-entity figures and the worst sentences
    (token_classification). 409 before the job succeeded; 404 for a job without validation rows."""
    return job_evaluation(job_id, caller)


@router.get("/{job_id}/checkpoints")
def job_checkpoints(job_id: str, caller: CallerDep) -> dict[str, list[CheckpointOut]]:
    return {"data": [CheckpointOut.model_validate(c) for c in lifecycle.list_checkpoints(job_id, caller)]}


@router.get("/{job_id}/checkpoints/{step}/model.tar")
def download_checkpoint(
    job_id: str, step: Annotated[int, Path(ge=0, le=MAX_STEP)], caller: CallerDep
) -> StreamingResponse:
    """A checkpoint's model (weights, config, tokenizer; not the optimizer state) as an uncompressed
    tar, e.g. of a running job. Checkpoints beyond ``save_total_limit`` are rotated away, and a
    succeeded job's are deleted (its model is in the artifacts)."""
    files = {n: f for n, f in models.get_checkpoint(job_id, step, caller).items() if n != artifacts.TRAINING_STATE}
    return _tar_response(artifacts.TarStream(files), f"{job_id}-step-{step}.tar", f"job {job_id} checkpoint {step}")


@router.get("/{job_id}/artifacts")
def list_artifacts(job_id: str, caller: CallerDep) -> dict[str, list[ArtifactOut]]:
    """The job's downloadable files once it succeeded: ``model.tar`` (the model directory, ready
    for ``transformers``), ``metrics.json``, and each file of the model as ``model/<name>``."""
    return {
        "data": [
            ArtifactOut(name=name, bytes=size, url=f"/jobs/{job_id}/artifacts/{name}")
            for name, size in artifacts.listing(models.model_files(job_id, caller)).items()
        ]
    }


@router.get("/{job_id}/artifacts/model/{filename:path}", responses=error_responses(409))
def download_model_file(job_id: str, filename: str, caller: CallerDep) -> Response:
    """One file of the model, by its name in the listing (never a path on the server)."""
    return _file(job_id, models.model_files(job_id, caller, required=True), filename, f"model/{filename}")


@router.get("/{job_id}/artifacts/{name}", responses=error_responses(409))
def download_artifact(job_id: str, name: str, caller: CallerDep):
    """Download an artifact by its name in the job's artifact list (never by path). ``model.tar``
    is streamed from the model directory; ``model.tar.gz`` (unlisted, for older clients) is the
    same tar gzipped on the fly at level 1: no second copy on disk. A job without its files (not
    succeeded, or deleted by retention) answers 409 saying which."""
    files = models.model_files(job_id, caller, required=True)
    if files and name == "model.tar":
        return _tar_response(artifacts.TarStream(files), f"{job_id}-model.tar", f"job {job_id} model.tar")
    if files and name == "model.tar.gz":
        return StreamingResponse(
            stream_body(artifacts.gzip_stream(iter(artifacts.TarStream(files))), f"job {job_id} model.tar.gz"),
            media_type="application/gzip",
            headers={"Content-Disposition": f'attachment; filename="{job_id}-model.tar.gz"'},
        )
    return _file(job_id, files, name if name == artifacts.METRICS else "", name)


def _file(job_id: str, files: dict, filename: str, name: str) -> Response:
    """One file: from disk, or from the bucket, streamed or (``TUNEJOB_STORAGE_PRESIGNED_SECONDS``)
    a redirect to a presigned URL."""
    if filename not in files:
        raise NotFound("artifact", name)
    source, basename = files[filename], filename.rsplit("/", 1)[-1]
    if not isinstance(source, objects.Remote):
        return FileResponse(source, filename=basename, media_type="application/octet-stream")
    if url := objects.store().presigned_url(source):
        return RedirectResponse(url, status_code=307)
    return StreamingResponse(
        stream_body(source.achunks(), f"job {job_id} {name}"),
        media_type="application/octet-stream",
        headers={"Content-Length": str(source.size), "Content-Disposition": f'attachment; filename="{basename}"'},
    )


def _tar_response(tar: artifacts.TarStream, filename: str, what: str) -> StreamingResponse:
    return StreamingResponse(
        stream_body(tar, what),
        media_type="application/x-tar",
        headers={"Content-Length": str(tar.size), "Content-Disposition": f'attachment; filename="{filename}"'},
    )
