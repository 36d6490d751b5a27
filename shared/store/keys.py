"""API keys (``tunejob keys create|list|revoke``) and the local key of ``tunejob serve``.

A key is ``tj_`` + 32 random bytes in base64url (``secrets.token_urlsafe(32)``): 256 bits, so a
single unsalted SHA-256 is enough to store it (a slow password hash protects low-entropy secrets;
OWASP, "Password Storage Cheat Sheet"). The store keeps only that hash and the key's first
characters (``prefix``, to find the row and to name the key in listings); a request's key is
compared with ``hmac.compare_digest`` (constant time). Revoking a key takes effect at the next
request, also with the cache below.

Every API request authenticates, so the callers of keys seen are cached (``key_cache``) as long as
no key may have changed; a hit costs a SHA-256 and a dictionary look-up instead of a read
transaction (about 150 us of CPU on SQLite, a thread hand-off and a network round trip on
PostgreSQL). Only active keys are cached; a miss reads the store. How the cache learns of a change:

- SQLite (``SqliteKeyCache``): ``PRAGMA data_version`` (microseconds) changes on every commit by
  another connection, of any process (``tunejob keys revoke``, the worker, this process's own
  writes), and the cache is emptied then: a key revoked in a committed transaction is refused on
  the next request.
- PostgreSQL (``PostgresKeyCache``): creating or revoking a key sends ``NOTIFY tunejob_keys`` in
  its transaction (``notify_keys_changed``), which PostgreSQL delivers at its commit to every
  session that ``LISTEN``s on the channel; each API process keeps one such connection, in a daemon
  thread, and empties its cache on each notification. While that connection is not open (before
  it is, or once it is lost, until it is open again) the cache is not used: every request reads
  its key. A revoked key is refused in every API process from the moment the notification reaches
  it: the commit plus a local socket hop (well under a millisecond on one host), a window the
  lookup in the store has too (a request that read the key just before the commit).
  A lost connection is seen at once when the server closes it (restart, ``pg_terminate_backend``),
  and within ``LISTEN_KEEPALIVE`` seconds (TCP keepalives) when the network silently drops it.
"""

import hashlib
import hmac
import ipaddress
import os
import re
import logging
import secrets
import threading
import weakref
from functools import lru_cache
from pathlib import Path

import psycopg
from sqlalchemy import bindparam, make_url, select, text
from sqlalchemy.orm import Session

from shared.errors import NotFound, UserError
from shared.settings import get_settings
from shared.store.engine import DataVersion, read_session, session_scope
from shared.store.rows import DEFAULT_TENANT, ApiKey, utcnow
from shared.store.tenancy import Caller

KEY_PREFIX = "tj_"
PREFIX_CHARS = len(KEY_PREFIX) + 8  # stored and shown; 48 of the key's 256 random bits
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LOCAL_KEY_FILE = "api_key"  # under the data directory, mode 0600
LOCAL_KEY_NAME = "local key (tunejob serve)"  # migration 0005 makes existing ones admin keys
CHANNEL = "tunejob_keys"  # PostgreSQL notifications: a key was created or revoked
LISTEN_KEEPALIVE = 10  # seconds: a silently lost listening connection is seen within about this
LISTEN_RETRY_SECONDS = (0.5, 30.0)  # reconnecting: first wait, doubled up to the second
log = logging.getLogger(__name__)


# Built once: this runs on every request.
ACTIVE_KEYS_WITH_PREFIX = select(ApiKey.id, ApiKey.tenant, ApiKey.admin, ApiKey.key_hash).where(
    ApiKey.prefix == bindparam("prefix"), ApiKey.revoked_at.is_(None))


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
        raise UserError("invalid_tenant", f"tenant {tenant!r}: use 1-64 letters, digits, '_', '.' or '-', "
                        "starting with a letter or digit", "tenant")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with session_scope() as s:
        row = ApiKey(tenant=tenant, admin=admin, prefix=key[:PREFIX_CHARS], key_hash=hash_key(key), name=name)
        s.add(row)
        notify_keys_changed(s)
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
        notify_keys_changed(s)
        return row


def notify_keys_changed(s: Session) -> None:
    """On PostgreSQL, tell every API process's ``PostgresKeyCache`` at the commit of ``s``'s
    transaction that a key changed (nothing if it rolls back)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})


class KeyCache:
    """The callers of active keys, by key hash, valid while the store's key version is unchanged.

    ``get`` reads the version (``version``, None while it cannot be known) and empties the cache
    when it changed. ``put`` stores a caller under the version that ``get`` returned before its
    lookup: if the keys changed since (the key may have been revoked during the lookup), the next
    ``get`` empties the cache, so the caller is never returned. Nothing is cached, or returned,
    under the version None. At most ``max_entries`` keys (then emptied): only active keys are
    stored, so unknown keys cannot fill it.
    """

    def __init__(self, max_entries: int = 10_000):
        self.lock = threading.Lock()  # used from the event loop and the thread pool
        self.max_entries = max_entries
        self.cached_version: int | None = None
        self.callers: dict[str, Caller] = {}

    def version(self) -> int | None:
        """The store's key version now; called under ``lock``."""
        raise NotImplementedError

    def get(self, digest: str) -> tuple[Caller | None, int | None]:
        """The cached caller of the key whose hash is ``digest`` (None if not cached), and the
        store's version now."""
        with self.lock:
            version = self.version()
            if version != self.cached_version or version is None:
                self.callers, self.cached_version = {}, version
            return self.callers.get(digest), version

    def put(self, digest: str, caller: Caller, version: int | None) -> None:
        """Cache ``caller``, looked up in the store at ``version``."""
        with self.lock:
            if version is None or version != self.cached_version:
                return
            if len(self.callers) >= self.max_entries:
                self.callers = {}
            self.callers[digest] = caller


class SqliteKeyCache(KeyCache):
    """The version is the SQLite database's ``PRAGMA data_version`` (``shared.store.engine.DataVersion``)."""

    def __init__(self, path: str, max_entries: int = 10_000):
        super().__init__(max_entries)
        self.store = DataVersion(path)

    def version(self) -> int:
        return self.store.read()


class PostgresKeyCache(KeyCache):
    """The version counts the notifications on ``CHANNEL`` received by a connection of its own to
    the PostgreSQL database at ``conninfo`` (a libpq URL), which a daemon thread keeps listening;
    None while it is not listening."""

    instances: "weakref.WeakSet[PostgresKeyCache]" = weakref.WeakSet()

    def __init__(self, conninfo: str, max_entries: int = 10_000):
        super().__init__(max_entries)
        self.conninfo = conninfo
        self.counter = 0
        self.listening: int | None = None  # the version while listening
        self.listener_pid: int | None = None  # the listening connection's server process (for tests)
        self.closed = threading.Event()
        self.instances.add(self)
        threading.Thread(target=self._listen, name="tunejob-key-cache", daemon=True).start()

    @classmethod
    def close_all(cls) -> None:
        """Stop using every cache; each listener ends once its connection is closed or lost (tests,
        before they drop their databases)."""
        for cache in list(cls.instances):
            cache.closed.set()
            cache._changed(listening=False)

    def version(self) -> int | None:
        return self.listening

    def _changed(self, listening: bool) -> None:
        with self.lock:
            self.counter += 1
            self.listening = self.counter if listening and not self.closed.is_set() else None

    def _listen(self) -> None:
        wait = LISTEN_RETRY_SECONDS[0]
        while not self.closed.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, keepalives=1, keepalives_idle=LISTEN_KEEPALIVE // 2,
                                     keepalives_interval=1, keepalives_count=LISTEN_KEEPALIVE // 2) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.listener_pid = conn.info.backend_pid
                    self._changed(listening=True)  # any change from here on is notified
                    wait = LISTEN_RETRY_SECONDS[0]
                    for _ in conn.notifies():
                        self._changed(listening=True)
            except psycopg.Error as e:
                if self.closed.is_set():
                    return
                log.warning("API key cache: not listening for key changes on PostgreSQL (%s); every request reads "
                            "its key until it listens again, in %.1f s", e, wait)
            self._changed(listening=False)
            self.closed.wait(wait)
            wait = min(2 * wait, LISTEN_RETRY_SECONDS[1])


@lru_cache
def key_cache(url: str) -> KeyCache | None:
    """The cache of the job store at ``url`` (a SQLAlchemy URL): SQLite files and PostgreSQL (see the
    module's docstring); None for an in-memory SQLite database."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return PostgresKeyCache(parsed.set(drivername="postgresql").render_as_string(hide_password=False))
    database = parsed.database if parsed.get_backend_name() == "sqlite" else None
    return SqliteKeyCache(database) if database and database != ":memory:" else None


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
            "TUNEJOB_DATABASE_URL), or listen on 127.0.0.1.")
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
