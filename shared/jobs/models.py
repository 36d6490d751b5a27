"""The model a request names: a succeeded training job of the caller's tenant, or a base model;
and the files of a job's model and checkpoints, as the API serves them."""

from pathlib import Path

from sqlalchemy import select

from shared.errors import Conflict, Deleted, NotFound, UserError
from shared.jobs.aliases import owned_model_job
from shared.jobs.base_models import resolve_model
from shared.jobs.lifecycle import get_job
from shared.store import artifacts, objects
from shared.store.engine import read_session
from shared.store.rows import Checkpoint, Job, JobStatus
from shared.store.tenancy import Caller, owned_job


def trained_model(ref: str, caller: Caller) -> tuple[Job, Path]:
    """The succeeded training job ``ref`` (its id, or one of the tenant's aliases:
    ``shared.jobs.aliases.owned_model_job``, one read) of ``caller``'s tenant and its model
    directory. The errors name the job by its id once found, and by ``ref`` before.

    Raises:
        UserError (naming ``model``): ``unknown_model`` (404), ``model_deleted`` (404),
            ``model_not_ready`` (409), ``model_files_deleted`` (409).
    """
    try:
        with read_session() as s:
            job = owned_model_job(s, ref, caller)
    except Deleted as e:
        raise UserError("model_deleted", f"model {e.message}", "model", 404) from None
    except NotFound:
        raise UserError("unknown_model", f"model {ref!r}: {unknown_why(ref)}", "model", 404) from None
    if job.status != JobStatus.SUCCEEDED:
        raise UserError(
            "model_not_ready",
            f"model {job.id!r} is a training job that is {job.status}; only a succeeded job has a model",
            "model",
            409,
        )
    directory = artifacts.local_model(job.id) if job.files_deleted_at is None else None  # from the bucket if set
    if directory is None:
        raise UserError(
            "model_files_deleted",
            f"model {job.id!r}: the job's files were deleted (TUNEJOB_ARTIFACT_RETENTION_DAYS)",
            "model",
            409,
        )
    return job, directory


def unknown_why(ref: str) -> str:
    """Why ``ref`` names no model here: a base model's name (its head, or its retrieval training,
    comes from a job) or nothing at all."""
    try:
        resolve_model(ref)
    except UserError:
        return "no training job or model alias of yours has that name"
    return "a base model, not a fine-tuned one: fine-tune it first (POST /jobs), then use the job's id or an alias"


def embedding_model(ref: str, caller: Caller) -> Path:
    """The directory of the model ``ref`` names for embeddings: a succeeded ``embedding`` job of
    ``caller``'s tenant (its id, or its ``ft:...:job_…`` name in ``/v1``), else a base model (a
    sentence-transformers directory, or an encoder that gets mean pooling).

    Raises:
        UserError (naming ``model``): as ``trained_model``; ``unknown_model`` (404, as for a job id,
            and as OpenAI answers ``model_not_found``) for an unknown base model;
            ``unsupported_task`` (422) for a job of another task.
    """
    ref = ref.rsplit(":", 1)[-1] if ref.startswith("ft:") else ref
    if not ref.startswith("job_"):
        try:
            return resolve_model(ref)
        except UserError as e:
            raise UserError(e.code, e.message.replace("base_model", "model"), "model", 404) from None
    job, directory = trained_model(ref, caller)
    if job.task != "embedding":
        raise UserError(
            "unsupported_task",
            f"model {ref!r} was trained for {job.task}; embeddings come from an "
            "embedding job (task 'embedding') or a base model",
            "model",
        )
    return directory


def get_checkpoint(job_id: str, step: int, caller: Caller) -> dict[str, Path | objects.Remote]:
    """The files of a job's checkpoint at ``step`` by name (local paths, or objects in the bucket).

    Raises:
        NotFound: no such job (or another tenant's), or no checkpoint at that step (never saved,
            or rotated away). Deleted: the job was deleted.
    """
    with read_session() as s:
        owned_job(s, job_id, caller)
        path = s.scalar(select(Checkpoint.path).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
    files = objects.store().files(path) if path is not None else {}
    if not files:
        raise NotFound("checkpoint", f"{job_id} step {step}", "step")
    return files


def model_files(job_id: str, caller: Caller, required: bool = False) -> dict[str, Path | objects.Remote]:
    """A succeeded job's model files by name, local paths or objects in the bucket
    (``shared.store.artifacts.listing`` names what is downloadable). Empty before the job has
    succeeded, and after its files were deleted, unless ``required`` (a download) makes that an error.

    Raises:
        NotFound, Deleted: see ``get_job``. Conflict (409, ``required`` only): ``model_not_ready``
            (the job has not succeeded), ``model_files_deleted``.
    """
    job = get_job(job_id, caller)
    files = objects.store().files(objects.store().ref(artifacts.model_dir(job_id)))
    if required and not files:
        if job.status != JobStatus.SUCCEEDED:
            raise Conflict("model_not_ready", f"job {job_id!r} is {job.status}; only a succeeded job has a model")
        raise Conflict(
            "model_files_deleted", f"job {job_id!r}: its files were deleted (TUNEJOB_ARTIFACT_RETENTION_DAYS)"
        )
    return files
