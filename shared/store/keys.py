"""API keys (``tunejob keys create|list|revoke``) and the local key of ``tunejob serve``.

A key is ``tj_`` + 32 random bytes in base64url (``secrets.token_urlsafe(32)``): 256 bits, so a
single unsalted SHA-256 is enough to store it (a slow password hash protects low-entropy secrets;
OWASP, "Password Storage Cheat Sheet"). The store keeps only that hash and the key's first
characters (``prefix``, to find the row and to name the key in listings); a request's key is
compared with ``hmac.compare_digest`` (constant time). Revoking a key takes effect at the next
request, also with the cache below.

Every API request authenticates, so the callers of active keys seen are cached (``key_cache``,
a ``shared.store.cache.VersionedCache``) as long as no key may have changed; a hit costs a SHA-256
and a dictionary look-up instead of a read transaction (about 150 us of CPU on SQLite, a thread
hand-off and a network round trip on PostgreSQL). Only active keys are cached; a miss reads the
store. On SQLite any commit empties the cache; on PostgreSQL a trigger on the keys' table sends
``NOTIFY tunejob_keys`` at the commit of a key's creation or revocation, and every API process's
cache is emptied when it arrives: a key revoked in a committed transaction is refused at once in
every API process (see ``shared.store.cache`` for the window and a lost listening connection).
"""

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from pathlib import Path

from sqlalchemy import bindparam, select

from shared.errors import NotFound, UserError
from shared.settings import get_settings
from shared.store.cache import KEYS, VersionedCache, cache_for
from shared.store.engine import read_session, session_scope
from shared.store.rows import DEFAULT_TENANT, ApiKey, utcnow
from shared.store.tenancy import Caller

KEY_PREFIX = "tj_"
PREFIX_CHARS = len(KEY_PREFIX) + 8  # stored and shown; 48 of the key's 256 random bits
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LOCAL_KEY_FILE = "api_key"  # under the data directory, mode 0600
LOCAL_KEY_NAME = "local key (tunejob serve)"  # migration 0005 makes existing ones admin keys


# Built once: this runs on every request.
ACTIVE_KEYS_WITH_PREFIX = select(ApiKey.id, ApiKey.tenant, ApiKey.admin, ApiKey.key_hash).where(
    ApiKey.prefix == bindparam("prefix"), ApiKey.revoked_at.is_(None)
)


class NoKeyError(RuntimeError):
    """The server would listen beyond loopback and no API key exists."""


def hash_key(key: str) -> str:
    """Hex SHA-256 of the whole key."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(tenant: str, admin: bool = False, name: str | None = None) -> tuple[str, ApiKey]:
    """Make a key for ``tenant``; returns (the key, its row). The key is not stored: show it once.

    Raises:
        UserError: ``invalid_tenant`` for a name that is not 1-64 of ``A-Za-z0-9_.-``.
    """
    if not TENANT_PATTERN.fullmatch(tenant):
        raise UserError(
            "invalid_tenant",
            f"tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit",
            "tenant",
        )
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with session_scope() as s:
        row = ApiKey(tenant=tenant, admin=admin, prefix=key[:PREFIX_CHARS], key_hash=hash_key(key), name=name)
        s.add(row)
    return key, row


def list_keys() -> list[ApiKey]:
    with read_session() as s:
        return list(s.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))


def revoke_key(key_id: str) -> ApiKey:
    """Revoke key ``key_id`` (``key_…``, or its prefix ``tj_…`` as listed); requests with it fail
    with 401 from now on. Revoking a revoked key changes nothing.

    Raises:
        NotFound: no key has that id or prefix.
    """
    with session_scope() as s:
        row = s.get(ApiKey, key_id) or s.scalars(select(ApiKey).where(ApiKey.prefix == key_id)).first()
        if row is None:
            raise NotFound("API key", key_id)
        row.revoked_at = row.revoked_at or utcnow()
        return row


def key_cache(url: str) -> VersionedCache | None:
    """The callers of API keys of the job store at ``url`` (a SQLAlchemy URL) cached in this process."""
    return cache_for(url, KEYS)


def cached_caller(key: str) -> Caller | None:
    """The caller of ``key`` if the cache holds it (no I/O on PostgreSQL: for the event loop); None
    means look it up (``authenticate``)."""
    cache = key_cache(get_settings().sqlalchemy_url)
    return cache.get(hash_key(key))[0] if cache is not None and key.startswith(KEY_PREFIX) else None


def authenticate(key: str) -> Caller | None:
    """The caller that ``key`` stands for, or None if it is not an active key."""
    if not key.startswith(KEY_PREFIX) or len(key) > 128:
        return None
    digest = hash_key(key)
    cache = key_cache(get_settings().sqlalchemy_url)
    if cache is not None:
        caller, version = cache.get(digest)
        if caller is not None:
            return caller
    with read_session() as s:
        rows = s.execute(ACTIVE_KEYS_WITH_PREFIX, {"prefix": key[:PREFIX_CHARS]}).all()
    for row in rows:
        if hmac.compare_digest(row.key_hash, digest):
            caller = Caller(row.tenant, row.admin, row.id)
            if cache is not None:
                cache.put(digest, caller, version)
            return caller
    return None


def has_active_key() -> bool:
    with read_session() as s:
        return s.scalar(select(ApiKey.id).where(ApiKey.revoked_at.is_(None)).limit(1)) is not None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listening address) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def local_key_path() -> Path:
    return get_settings().data_path / LOCAL_KEY_FILE


def ensure_key_for(host: str) -> Path | None:
    """Secure by default without hurting the first run, before the API listens on ``host``.

    With an active key already in the store, nothing changes. Without one: on a loopback address,
    create an admin key for the tenant ``default`` (the machine's own user: it also reads
    ``/metrics`` and every tenant's jobs) and write it to ``<data dir>/api_key`` (mode 0600), where
    the CLI, the demo and other local clients read it; returns that path. Keys for other users
    (``create_key``) are not admin keys unless asked.

    Raises:
        NoKeyError: ``host`` is not a loopback address and no key exists.
    """
    if has_active_key():
        return None
    if not is_loopback(host):
        raise NoKeyError(
            f"refusing to listen on {host} without an API key: anyone who reaches the port could use it. "
            "Create one first with `tunejob keys create --tenant NAME [--admin]` (same TUNEJOB_DATA_DIR / "
            "TUNEJOB_DATABASE_URL), or listen on 127.0.0.1."
        )
    key, _ = create_key(DEFAULT_TENANT, admin=True, name=LOCAL_KEY_NAME)
    path = local_key_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.chmod(tmp, 0o600)  # an existing file keeps its mode through os.open
    os.replace(tmp, path)
    return path
