"""Browser sessions of the dashboard (``/ui``): an opaque random token in a cookie, never the key.

Signing in with an API key (``/ui/login``) stores a session row that names the key; the cookie
holds ``secrets.token_urlsafe(32)`` (256 bits) and the store keeps only its SHA-256, as for API
keys (``shared.store.keys``). Each request resolves the cookie to the key's ``Caller`` (tenant, admin)
again, so the browser goes through the same tenant checks as the API, and revoking the key ends
its sessions at the next request. A session expires ``TUNEJOB_UI_SESSION_HOURS`` after sign-in,
and signing out deletes it.

Each session also has a CSRF token (OWASP "Cross-Site Request Forgery Prevention Cheat Sheet",
synchronizer token pattern): pages put it in their forms and the dashboard's scripts send it as
``X-CSRF-Token``; a state-changing request authenticated by the cookie without it is refused
(``api.auth``). The cookie is also ``SameSite=Strict``.

A sign-in link (``tunejob serve`` prints one for its local key) is a row of kind ``link``: it
works once, within ``LINK_MINUTES``, and is exchanged for a session.
"""

import hashlib
import hmac
import secrets
from datetime import datetime, timedelta

from sqlalchemy import ForeignKey, String, delete, select
from sqlalchemy.orm import Mapped, mapped_column

from shared.settings import get_settings
from shared.store.engine import read_session, session_scope
from shared.store.rows import ApiKey, Base, utcnow
from shared.store.tenancy import Caller

COOKIE = "tunejob_session"
CSRF_HEADER = "X-CSRF-Token"
SESSION, LINK = "session", "link"
LINK_MINUTES = 15


class UiSession(Base):
    """A dashboard session (``kind='session'``) or an unused sign-in link (``kind='link'``)."""

    __tablename__ = "ui_sessions"

    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)  # hex SHA-256 of the cookie's token
    key_id: Mapped[str] = mapped_column(String(32), ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _insert(key_id: str, kind: str, lifetime: timedelta) -> str:
    token = secrets.token_urlsafe(32)
    with session_scope() as s:
        now = utcnow()
        s.execute(delete(UiSession).where(UiSession.expires_at < now))  # expired rows go as new ones come
        s.add(
            UiSession(
                token_hash=_hash(token),
                key_id=key_id,
                kind=kind,
                csrf_token=secrets.token_urlsafe(32),
                created_at=now,
                expires_at=now + lifetime,
            )
        )
    return token


def start(caller: Caller) -> str:
    """A new session for the key behind ``caller`` (an authenticated key); returns the cookie's token."""
    assert caller.key_id is not None, "an internal caller has no key to sign in with"
    return _insert(caller.key_id, SESSION, timedelta(hours=get_settings().ui_session_hours))


def signin_link(key_id: str) -> str:
    """A one-time sign-in token for key ``key_id``, valid ``LINK_MINUTES``."""
    return _insert(key_id, LINK, timedelta(minutes=LINK_MINUTES))


def redeem(link_token: str) -> str | None:
    """Exchange a sign-in link's token for a new session's token; None when the link is unknown,
    used, expired or its key revoked. The link is deleted either way, and redeemed once even when
    several requests bring it at once."""
    with session_scope() as s:
        # One DELETE ... RETURNING: of two redeems at once, only the one whose DELETE took the row gets it
        # (a read then a delete let both through on PostgreSQL).
        row = s.execute(
            delete(UiSession)
            .where(UiSession.token_hash == _hash(link_token), UiSession.kind == LINK)
            .returning(UiSession.key_id, UiSession.expires_at)
        ).first()
        if row is None:
            return None
        key = s.get(ApiKey, row.key_id)
        if row.expires_at < utcnow() or key is None or key.revoked_at is not None:
            return None
        key_id = row.key_id
    return _insert(key_id, SESSION, timedelta(hours=get_settings().ui_session_hours))


def resolve(token: str) -> tuple[Caller, str] | None:
    """The caller and CSRF token of the live session whose cookie holds ``token``; None when the
    token is unknown or expired, or its key was revoked."""
    if not token or len(token) > 128:
        return None
    with read_session() as s:
        row = s.execute(
            select(UiSession.csrf_token, ApiKey.id, ApiKey.tenant, ApiKey.admin)
            .join(ApiKey, ApiKey.id == UiSession.key_id)
            .where(
                UiSession.token_hash == _hash(token),
                UiSession.kind == SESSION,
                UiSession.expires_at > utcnow(),
                ApiKey.revoked_at.is_(None),
            )
        ).first()
    return None if row is None else (Caller(row.tenant, row.admin, row.id), row.csrf_token)


def csrf_matches(expected: str, given: str | None) -> bool:
    """Whether ``given`` (a form field or header) is the session's CSRF token (constant time)."""
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def end(token: str) -> None:
    """Sign out: the session ``token`` stops working at once."""
    with session_scope() as s:
        s.execute(delete(UiSession).where(UiSession.token_hash == _hash(token)))
