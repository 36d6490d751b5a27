"""``/models/aliases``: a tenant's names for its fine-tuned models (``shared.jobs.aliases``)."""

from fastapi import APIRouter, Response

from api.auth import CallerDep
from api.errors import error_responses
from shared.jobs import aliases
from shared.schemas.aliases import AliasChangeOut, AliasIn, AliasOut

router = APIRouter(prefix="/models/aliases", tags=["models"])


def _out(alias: str, caller) -> AliasOut:
    row, history = aliases.get_alias(alias, caller)
    return AliasOut(
        alias=row.alias,
        job_id=row.job_id,
        updated_at=row.updated_at,
        updated_by=row.updated_by,
        history=[AliasChangeOut.model_validate(c) for c in history],
    )


@router.get("")
def list_aliases(caller: CallerDep) -> dict[str, list[dict]]:
    """Your tenant's aliases and the jobs they name."""
    return {
        "data": [
            {"alias": a.alias, "job_id": a.job_id, "updated_at": a.updated_at, "updated_by": a.updated_by}
            for a in aliases.list_aliases(caller)
        ]
    }


@router.put("/{alias}", responses=error_responses(404, 409, 422))
def set_alias(alias: str, body: AliasIn, caller: CallerDep) -> AliasOut:
    """Point ``alias`` (a slug) at a succeeded training job of your tenant, creating or moving it.
    Sync predict (``POST /models/{alias}/predict``) and prediction jobs (``"model": alias``) then use
    that job's model. A move is recorded in the alias's ``history`` and sends ``model.alias_updated``
    to subscribed webhooks. 422 ``invalid_alias``; 404 for another tenant's or an unknown job; 409
    ``job_not_succeeded``."""
    aliases.set_alias(alias, body.job_id, caller)
    return _out(alias, caller)


@router.get("/{alias}", responses=error_responses(404))
def get_alias(alias: str, caller: CallerDep) -> AliasOut:
    """The job ``alias`` names, and its history (who moved it, when, from and to which job)."""
    return _out(alias, caller)


@router.delete("/{alias}", status_code=204, responses=error_responses(404))
def delete_alias(alias: str, caller: CallerDep) -> Response:
    """Remove ``alias`` (recorded, and sent as ``model.alias_updated`` with ``job_id`` null)."""
    aliases.delete_alias(alias, caller)
    return Response(status_code=204)
