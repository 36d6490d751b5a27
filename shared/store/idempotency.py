"""Idempotency keys on POST requests, with Stripe's semantics
(https://docs.stripe.com/api/idempotent_requests):

- The first request with a key does the work, and its response (status and body) is recorded in
  the same transaction as what it created.
- The same key with the same body within 24 hours gets that response again, and nothing new is made.
- The same key with a different body is refused (422 ``idempotency_key_reused``).
- While the first request is still running, a second one with the key is refused
  (409 ``idempotency_key_in_use``, ``Retry-After: 1``): the unique constraint on
  (tenant, route, key) decides which of two concurrent requests goes first.
- A request that fails records nothing: the key may be used again (``abandon``). A claim left by
  a process that died mid-request is taken over after ``STALE_CLAIM``.

Keys are per tenant and per route. Use: ``begin`` -> ``Claim`` (do the work, and call ``complete``
inside the transaction that writes the result; ``abandon`` on failure) or ``Replay`` (send it);
``once`` does all of that around a function that creates the resource.
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.errors import UserError
from shared.store.engine import read_session, session_scope
from shared.store.rows import IdempotencyRecord, utcnow

TTL = timedelta(hours=24)
STALE_CLAIM = timedelta(minutes=10)  # longer than any request takes (a 2 GiB upload is validated in under that)
HEADER = "Idempotency-Key"
T = TypeVar("T")
HEADER_DESCRIPTION = (
    "Send the same value again (within 24 h, with the same body) to get the first response "
    "back instead of creating a second resource; a different body with the same key is a 422."
)


@dataclass(frozen=True)
class Claim:
    """This request owns the key: do the work, then ``complete`` or ``abandon``."""

    tenant: str
    route: str
    key: str


@dataclass(frozen=True)
class Replay:
    """The recorded first response for the key."""

    status_code: int
    body: dict[str, Any]


def fingerprint(*parts: str) -> str:
    """SHA-256 of a request's identifying parts (e.g. its canonical JSON body)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _same_key(claim: Claim):
    return (
        IdempotencyRecord.tenant == claim.tenant,
        IdempotencyRecord.route == claim.route,
        IdempotencyRecord.key == claim.key,
    )


def begin(tenant: str, route: str, key: str, request_fingerprint: str) -> Claim | Replay:
    """Claim ``key`` for this request, or return the recorded response of its first use.

    Raises:
        UserError: 422 ``idempotency_key_reused`` (the key was used with another body);
            409 ``idempotency_key_in_use`` (the first request with it is still running).
    """
    claim, now = Claim(tenant, route, key), utcnow()
    try:
        with session_scope() as s:
            s.execute(delete(IdempotencyRecord).where(*_same_key(claim), IdempotencyRecord.created_at < now - TTL))
            s.add(
                IdempotencyRecord(tenant=tenant, route=route, key=key, fingerprint=request_fingerprint, created_at=now)
            )
        return claim
    except IntegrityError:  # someone used the key first
        pass
    with read_session() as s:
        record = s.scalars(select(IdempotencyRecord).where(*_same_key(claim))).first()
    if record is not None and record.fingerprint != request_fingerprint:
        raise UserError(
            "idempotency_key_reused",
            f"{HEADER} {key!r} was already used with a different request "
            f"body to {route}; use a new key for a new request",
            HEADER,
        )
    if record is not None and record.status_code is not None:
        return Replay(record.status_code, record.response or {})
    if record is not None and record.created_at < now - STALE_CLAIM and _take_over(claim, record, now):
        return claim
    raise UserError(
        "idempotency_key_in_use",
        f"a request with {HEADER} {key!r} is still in progress; retry shortly to get its response",
        HEADER,
        status=409,
        headers={"Retry-After": "1"},
    )


def _take_over(claim: Claim, record: IdempotencyRecord, now) -> bool:
    with session_scope() as s:
        return (
            s.execute(
                update(IdempotencyRecord)
                .where(
                    IdempotencyRecord.id == record.id,
                    IdempotencyRecord.status_code.is_(None),
                    IdempotencyRecord.created_at == record.created_at,
                )
                .values(created_at=now)
            ).rowcount  # type: ignore[attr-defined]  # DML returns a CursorResult
            == 1
        )


def complete(session: Session, claim: Claim, status_code: int, body: dict[str, Any]) -> None:
    """Record the response, in the transaction (``session``) that writes what the request created."""
    session.execute(update(IdempotencyRecord).where(*_same_key(claim)).values(status_code=status_code, response=body))


def abandon(claim: Claim) -> None:
    """The request failed and created nothing: free the key for a retry."""
    with session_scope() as s:
        s.execute(delete(IdempotencyRecord).where(*_same_key(claim), IdempotencyRecord.status_code.is_(None)))


def once(
    tenant: str, route: str, key: str | None, request_fingerprint: str, create: Callable[[Claim | None], T]
) -> T | Replay:
    """Run ``create(claim)`` once per ``key``: without a key, just run it (``claim`` None); with one,
    ``begin``, then return the recorded response (``Replay``) or run ``create`` with the claim,
    which it must ``complete`` in the transaction that writes its result; if ``create`` raises,
    the key is freed (``abandon``).

    Raises:
        UserError: see ``begin``; and whatever ``create`` raises.
    """
    if key is None:
        return create(None)
    claim = begin(tenant, route, key, request_fingerprint)
    if isinstance(claim, Replay):
        return claim
    try:
        return create(claim)
    except BaseException:
        abandon(claim)
        raise


def purge_expired() -> int:
    """Delete records older than ``TTL`` (run by the recovery loop); returns how many."""
    with session_scope() as s:
        return s.execute(delete(IdempotencyRecord).where(IdempotencyRecord.created_at < utcnow() - TTL)).rowcount  # type: ignore[attr-defined]  # DML returns a CursorResult
