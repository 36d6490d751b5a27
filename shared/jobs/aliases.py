"""Model aliases (issue 37, after MLflow's registered model aliases): a tenant's stable names for
its fine-tuned models, e.g. ``production`` -> ``job_…``. Every route that takes a fine-tuned model's
job id takes an alias too (``resolve``, once per request; sync predict and rerank read the alias
with its job in one statement, ``owned_model_job``), so promoting a model is one
``PUT /models/aliases/{alias}`` and no client changes. A move is recorded (who, when, from, to) and
sends a ``model.alias_updated`` webhook in the same transaction (``shared.jobs.webhooks.emit``).
The sync predict cache is keyed by the job id an alias resolves to, so the next request after a
move loads the new model."""

import re

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.errors import Conflict, NotFound, UserError
from shared.jobs.base_models import available_models
from shared.jobs.webhooks import emit
from shared.store.alias_rows import ModelAlias, ModelAliasChange
from shared.store.engine import read_session, session_scope
from shared.store.rows import Job, JobStatus, utcnow
from shared.store.tenancy import Caller, of_kind, owned_job, visible

ALIAS = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")  # a slug: never a job id (job_…), which has an underscore
EVENT = "model.alias_updated"


def checked_alias(alias: str) -> str:
    """Raises: UserError (422 ``invalid_alias``, naming ``alias``) unless ``alias`` is a slug of
    ``ALIAS`` that is not also a base model's name (which it would hide)."""
    if not ALIAS.match(alias):
        raise UserError(
            "invalid_alias",
            f"alias {alias!r} is not a slug: 1 to 64 lowercase letters, digits and "
            "hyphens, starting with a letter or digit",
            "alias",
        )
    if alias in available_models():
        raise UserError("invalid_alias", f"alias {alias!r} is the name of a base model (GET /models)", "alias")
    return alias


def set_alias(alias: str, job_id: str, caller: Caller) -> ModelAlias:
    """Point ``caller``'s tenant's ``alias`` at ``job_id``, creating it or moving it; a move to the
    job it already names changes nothing. Records the change and emits ``model.alias_updated``.

    Raises:
        UserError: 422 ``invalid_alias``; NotFound, Deleted (404): no such training job of the
            caller's tenant (another tenant's job too, even for an admin key); Conflict (409
            ``job_not_succeeded``): the job has not succeeded.
    """
    checked_alias(alias)
    with session_scope() as s:
        job = owned_job(s, job_id, Caller(caller.tenant))
        if job.status != JobStatus.SUCCEEDED:
            raise Conflict("job_not_succeeded", f"job {job_id!r} is {job.status}: an alias names a succeeded job")
        row = s.get(ModelAlias, (caller.tenant, alias), with_for_update=True)
        if row is not None and row.job_id == job_id:
            return row
        previous = row.job_id if row is not None else None
        if row is None:
            row = ModelAlias(tenant=caller.tenant, alias=alias)
            s.add(row)
        row.job_id, row.updated_at, row.updated_by = job_id, utcnow(), caller.key_id
        _record(s, caller, alias, previous, job_id)
        return row


def delete_alias(alias: str, caller: Caller) -> None:
    """Remove ``alias``; recorded, with a ``model.alias_updated`` event whose ``job_id`` is None.

    Raises: NotFound (404): no such alias of the caller's tenant."""
    with session_scope() as s:
        row = s.get(ModelAlias, (caller.tenant, alias), with_for_update=True)
        if row is None:
            raise NotFound("alias", alias)
        s.delete(row)
        _record(s, caller, alias, row.job_id, None)


def _record(s, caller: Caller, alias: str, previous: str | None, job_id: str | None) -> None:
    change = ModelAliasChange(
        tenant=caller.tenant,
        alias=alias,
        from_job_id=previous,
        to_job_id=job_id,
        changed_by=caller.key_id,
        changed_at=utcnow(),
    )
    s.add(change)
    s.flush()  # its id names the event
    emit(
        s,
        caller.tenant,
        EVENT,
        f"evt_alias_{change.id}",
        {
            "alias": alias,
            "object": "model_alias",
            "job_id": job_id,
            "previous_job_id": previous,
            "changed_by": caller.key_id,
            "changed_at": change.changed_at.isoformat().replace("+00:00", "Z"),
        },
    )


def get_alias(alias: str, caller: Caller) -> tuple[ModelAlias, list[ModelAliasChange]]:
    """The alias and its history, newest first. Raises: NotFound (404)."""
    with read_session() as s:
        row = s.get(ModelAlias, (caller.tenant, alias)) if ALIAS.match(alias) else None
        if row is None:
            raise NotFound("alias", alias)
        history = s.scalars(
            select(ModelAliasChange)
            .where(ModelAliasChange.tenant == caller.tenant, ModelAliasChange.alias == alias)
            .order_by(ModelAliasChange.id.desc())
        ).all()
        return row, list(history)


def list_aliases(caller: Caller) -> list[ModelAlias]:
    """The caller's tenant's aliases, by name."""
    with read_session() as s:
        return list(s.scalars(select(ModelAlias).where(ModelAlias.tenant == caller.tenant).order_by(ModelAlias.alias)))


def resolve(ref: str, caller: Caller) -> str:
    """The job id that ``ref`` names when it is one of the caller's tenant's aliases, else ``ref``
    as it is (a job id, or a base model's name). One primary-key read per request."""
    if not ALIAS.match(ref):
        return ref
    with read_session() as s:
        job_id = s.scalar(select(ModelAlias.job_id).where(ModelAlias.tenant == caller.tenant, ModelAlias.alias == ref))
    return job_id or ref


def owned_model_job(s: Session, ref: str, caller: Caller) -> Job:
    """``owned_job`` of the training job ``ref`` names: a job id, or one of the caller's tenant's
    aliases, read with the job it names in one statement (``resolve`` and then ``owned_job`` would
    read twice).

    Raises:
        NotFound: (404) no such job, or alias, naming ``ref``; another tenant's job, or one of
            another kind. Deleted: (404) the job (by its id) was deleted.
    """
    if not ALIAS.match(ref):
        return owned_job(s, ref, caller)
    job = s.scalar(
        select(Job)
        .join(ModelAlias, ModelAlias.job_id == Job.id)
        .where(ModelAlias.tenant == caller.tenant, ModelAlias.alias == ref)
    )
    return of_kind(visible(job, Job, job.id if job else ref, caller), "train")
