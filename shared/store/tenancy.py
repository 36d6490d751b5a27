"""Who may see what: the caller of a request, and the query helpers that keep each tenant to its own
rows. Every API route that reads or changes a dataset or a job goes through these helpers (the
API resolves the caller from its key in ``api.auth``); another tenant's row is reported as absent
(404, never 403), so ids do not leak whether they exist.

- ``scoped(query, Model, caller)``: a ``select`` limited to the caller's tenant (admins: every tenant),
  without deleted rows (tombstones).
- ``owned(session, Model, id_, caller)``: one row of the caller's, or ``NotFound`` (``Deleted`` for a
  tombstone of the caller's).
- ``owned_job(session, job_id, caller, kind=…)``: the same for a job of one kind (``train`` or
  ``predict``); metrics, events, checkpoints, artifacts and results are reached through their job,
  so checking the job is checking them.
- ``lock_tenant(session, tenant)``: serializes a tenant's quota checks with its inserts.
"""

from dataclasses import dataclass
from typing import TypeVar, cast

from sqlalchemy import Select, bindparam, select, text
from sqlalchemy.orm import Session

from shared.errors import Deleted, NotFound
from shared.store.rows import Dataset, Job

Row = TypeVar("Row", Dataset, Job)
# Built once: building a statement costs more than reading the row from SQLite, and the polling
# routes (GET /jobs/{id}, its metrics) read a job on every request.
ROW_BY_ID = {model: select(model).where(model.id == bindparam("id")) for model in (Dataset, Job)}


@dataclass(frozen=True)
class Caller:
    """The tenant an API key belongs to, and whether it is an admin key (sees every tenant).

    ``key_id`` names the key (``key_…``), for rate limits and logs; None for internal callers.
    """

    tenant: str
    admin: bool = False
    key_id: str | None = None

    def sees(self, tenant: str) -> bool:
        return self.admin or tenant == self.tenant


def scoped(query: Select, model: type[Row], caller: Caller) -> Select:
    """``query`` restricted to rows of ``model`` (Dataset or Job) that ``caller`` may see and that
    were not deleted."""
    query = query.where(model.deleted_at.is_(None))
    return query if caller.admin else query.where(model.tenant == caller.tenant)


def by_id(session: Session, model: type[Row], id_: str, **options) -> Row | None:
    """``session.get(model, id_, **options)``, or None for an id holding a NUL character: no id
    holds one, and PostgreSQL text cannot (it would raise ``DataError``, a 500, not a 404)."""
    return None if "\x00" in id_ else session.get(model, id_, **options)


def find(session: Session, model: type[Row], id_: str, for_update: bool = False) -> Row | None:
    """The ``model`` row ``id_``, whoever's it is, or None; ``for_update`` locks it on PostgreSQL
    (``SELECT … FOR UPDATE``) before a change that depends on what it holds."""
    if for_update or "\x00" in id_:
        return by_id(session, model, id_, with_for_update=for_update or None)
    return cast(Row | None, session.scalars(ROW_BY_ID[model], {"id": id_}).first())


def visible(row: Row | None, model: type[Row], id_: str, caller: Caller, param: str | None = None) -> Row:
    """``row`` (the ``model`` row ``id_``, as ``find`` returned it) if ``caller`` may see it.

    Raises:
        NotFound: (404) no such row, or it belongs to another tenant: the two are not told apart.
        Deleted: (404) the caller's row was deleted (a tombstone), saying so and when.
    """
    if row is None or not caller.sees(row.tenant):
        raise NotFound(model.__name__.lower(), id_, param)
    if row.deleted_at is not None:
        raise Deleted(model.__name__.lower(), id_, row.deleted_at)
    return row


def owned(
    session: Session, model: type[Row], id_: str, caller: Caller, param: str | None = None, for_update: bool = False
) -> Row:
    """The ``model`` row ``id_`` if ``caller`` may see it: ``visible(find(...))``.

    Raises:
        NotFound, Deleted: see ``visible``.
    """
    return visible(find(session, model, id_, for_update), model, id_, caller, param)


def of_kind(job: Job, kind: str) -> Job:
    """``job`` if it is of ``kind``: the one place jobs are told apart by ``kind``; a job of another
    kind (a prediction on ``/jobs/…``, a training job on ``/predictions/…``) is absent.

    Raises:
        NotFound: the job is of another kind.
    """
    if job.kind != kind:
        raise NotFound("job" if kind == "train" else "prediction", job.id)
    return job


def owned_job(session: Session, job_id: str, caller: Caller, for_update: bool = False, kind: str = "train") -> Job:
    """``owned(session, Job, job_id, caller)`` of ``kind``: check this before reading a job's
    metrics, events, checkpoints or artifacts, or changing it.

    Raises:
        NotFound, Deleted: see ``visible`` and ``of_kind``.
    """
    return of_kind(owned(session, Job, job_id, caller, for_update=for_update), kind)


def lock_tenant(session: Session, tenant: str) -> None:
    """Hold, until the transaction ends, a lock that other transactions of ``tenant`` also take, so
    that a quota check and the insert it allows are not interleaved with another's.

    PostgreSQL: a transaction-level advisory lock on the tenant's name. SQLite: nothing to do, the
    caller's ``session_scope`` transaction already holds the database's single write lock.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:tenant))"), {"tenant": tenant})


def try_lock_tenant(session: Session, tenant: str) -> bool:
    """``lock_tenant`` if the lock is free (or already this transaction's) now; False if another
    transaction holds it. For a transaction that already holds other locks (a sweep's row, when a
    trial ends), which must not wait for the tenant's: ``cancel_sweep`` takes the tenant's lock
    first, then the sweep's, and waiting the other way round could deadlock."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(
        session.execute(text("SELECT pg_try_advisory_xact_lock(hashtext(:tenant))"), {"tenant": tenant}).scalar()
    )
