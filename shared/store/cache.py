"""In-process caches of job-store reads that stay correct across processes: what was read is kept
while the store's version of it is unchanged, and dropped when any process commits a change.

Used for the callers of API keys (``shared.store.keys``) and for the rows the polling routes read
(``GET /jobs/{id}`` and its metrics: ``api.db.cached``). A hit costs a dictionary look-up
instead of a read (a thread hand-off, a network round trip and the server's CPU on PostgreSQL).
How a cache learns of a change:

- SQLite (``SqliteCache``): ``PRAGMA data_version`` (microseconds) changes on every commit by
  another connection, of any process (the worker, ``tunejob keys``, this process's own writes
  through the engine); the cache is emptied then.
- PostgreSQL (``PostgresCache``): a notification on a channel (``LISTEN``/``NOTIFY``), which
  PostgreSQL delivers at the commit of the transaction that sent it to every session listening on
  the channel. Each cache keeps one such connection, in a daemon thread, and is emptied on each
  notification; this process's own commits empty it at once too (``after_commit``), so a request
  reads what the one before it wrote. While the connection is not open (before it is, or once it
  is lost, until it is open again) nothing is cached: every request reads the store. Another
  process's change is seen from the moment its notification arrives: the commit plus a local
  socket hop (well under a millisecond on one host), a window a read in the store has too (one that
  began just before the commit). A lost connection is seen at once when the server closes it
  (restart, ``pg_terminate_backend``), and within ``LISTEN_KEEPALIVE`` seconds (TCP keepalives)
  when the network silently drops it.

Who notifies: triggers on the tables (migration 0011), so that no writer can forget: the API keys
notify ``tunejob_keys`` (``KEYS``), the jobs and their metrics ``tunejob_jobs`` (``JOBS``).
"""

import logging
import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import psycopg
from sqlalchemy import event, make_url
from sqlalchemy.orm import Session

from shared.store.engine import DataVersion

LISTEN_KEEPALIVE = 10  # seconds: a silently lost listening connection is seen within about this
LISTEN_RETRY_SECONDS = (0.5, 30.0)  # reconnecting: first wait, doubled up to the second
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Channel:
    """What a cache holds reads of: the PostgreSQL notification channel that the triggers on
    ``tables`` notify (migration 0011), and at most how many values it keeps."""

    name: str
    tables: frozenset[str]
    max_entries: int


KEYS = Channel("tunejob_keys", frozenset({"api_keys"}), 10_000)  # the callers of active keys
JOBS = Channel("tunejob_jobs", frozenset({"jobs", "job_metrics"}), 1_000)  # job rows, short metric reads
CHANGED_TABLES = "tunejob_changed_tables"  # in Session.info: the tables its transaction wrote


class VersionedCache:
    """Values read from the store, by key, valid while the store's version is unchanged.

    ``get`` reads the version (``version``, None while it cannot be known) and empties the cache
    when it changed. ``put`` stores a value under the version that ``get`` returned before its
    read: if the store changed since (a commit during the read), the next ``get`` empties the
    cache, so the value is never returned. Nothing is cached, or returned, under the version None.
    At most ``max_entries`` values (then emptied): a bound on memory, not an eviction policy.
    """

    def __init__(self, max_entries: int):
        self.lock = threading.Lock()  # used from the event loop and the thread pool
        self.max_entries = max_entries
        self.cached_version: int | None = None
        self.values: dict[Hashable, Any] = {}

    def version(self) -> int | None:
        """The store's version now; called under ``lock``."""
        raise NotImplementedError

    def get(self, key: Hashable) -> tuple[Any, int | None]:
        """The cached value of ``key`` (None if not cached), and the store's version now."""
        with self.lock:
            version = self.version()
            if version != self.cached_version or version is None:
                self.values, self.cached_version = {}, version
            return self.values.get(key), version

    def put(self, key: Hashable, value: Any, version: int | None) -> None:
        """Cache ``value``, read from the store at ``version`` (as ``get`` returned it)."""
        with self.lock:
            if version is None or version != self.cached_version:
                return
            if len(self.values) >= self.max_entries:
                self.values = {}
            self.values[key] = value


class SqliteCache(VersionedCache):
    """The version is the SQLite database's ``PRAGMA data_version`` (``shared.store.engine.DataVersion``)."""

    def __init__(self, path: str, max_entries: int):
        super().__init__(max_entries)
        self.store = DataVersion(path)

    def version(self) -> int:
        return self.store.read()


class PostgresCache(VersionedCache):
    """The version counts the notifications on ``channel`` received by a connection of its own to
    the PostgreSQL database at ``conninfo`` (a libpq URL), which a daemon thread keeps listening,
    and this process's commits that wrote the channel's tables; None while it is not listening."""

    instances: "weakref.WeakSet[PostgresCache]" = weakref.WeakSet()

    def __init__(self, conninfo: str, channel: Channel):
        super().__init__(channel.max_entries)
        self.conninfo, self.channel = conninfo, channel
        self.counter = 0
        self.listening: int | None = None  # the version while listening
        self.listener_pid: int | None = None  # the listening connection's server process (for tests)
        self.closed = threading.Event()
        self.instances.add(self)
        threading.Thread(target=self._listen, name=f"tunejob-cache-{channel.name}", daemon=True).start()

    @classmethod
    def close_all(cls) -> None:
        """Stop using every cache; each listener ends once its connection is closed or lost (tests,
        before they drop their databases)."""
        for cache in list(cls.instances):
            cache.closed.set()
            cache.changed(listening=False)

    def version(self) -> int | None:
        return self.listening

    def changed(self, listening: bool = True) -> None:
        """Something may have changed: what is cached is dropped at the next ``get``."""
        with self.lock:
            self.counter += 1
            self.listening = (
                self.counter if listening and self.listening is not None and not self.closed.is_set() else None
            )

    def _listen(self) -> None:
        wait = LISTEN_RETRY_SECONDS[0]
        while not self.closed.is_set():
            try:
                with psycopg.connect(
                    self.conninfo,
                    autocommit=True,
                    keepalives=1,
                    keepalives_idle=LISTEN_KEEPALIVE // 2,
                    keepalives_interval=1,
                    keepalives_count=LISTEN_KEEPALIVE // 2,
                ) as conn:
                    conn.execute(f"LISTEN {self.channel.name}")
                    self.listener_pid = conn.info.backend_pid
                    with self.lock:  # any change from here on is notified
                        self.counter += 1
                        self.listening = None if self.closed.is_set() else self.counter
                    wait = LISTEN_RETRY_SECONDS[0]
                    for _ in conn.notifies():
                        self.changed()
            except psycopg.Error as e:
                if self.closed.is_set():
                    return
                log.warning(
                    "cache of %s: not listening for changes on PostgreSQL (%s); every request reads the "
                    "store until it listens again, in %.1f s",
                    self.channel.name,
                    e,
                    wait,
                )
            self.changed(listening=False)
            self.closed.wait(wait)
            wait = min(2 * wait, LISTEN_RETRY_SECONDS[1])


def _wrote(session: Session, tables: set[str]) -> None:
    session.info.setdefault(CHANGED_TABLES, set()).update(tables)


@event.listens_for(Session, "after_flush")
def _flushed(session: Session, _context) -> None:
    """Note the tables of the rows a flush wrote (``new``, ``dirty``, ``deleted`` still hold them)."""
    _wrote(session, {row.__table__.name for row in (*session.new, *session.dirty, *session.deleted)})


@event.listens_for(Session, "do_orm_execute")
def _executed(state) -> None:
    """Note the table of an ``insert``, ``update`` or ``delete`` statement run by a session."""
    if state.is_insert or state.is_update or state.is_delete:
        _wrote(state.session, {state.statement.table.name})


@event.listens_for(Session, "after_rollback")
def _rolled_back(session: Session) -> None:
    session.info.pop(CHANGED_TABLES, None)


@event.listens_for(Session, "after_commit")
def _committed(session: Session) -> None:
    """This process's own commit: its caches of the tables it wrote drop what they hold now, before
    the notification comes back (so a request reads what the one before it wrote)."""
    tables = session.info.pop(CHANGED_TABLES, None)
    if tables:
        for cache in list(PostgresCache.instances):
            if cache.channel.tables & tables:
                cache.changed()


@lru_cache
def cache_for(url: str, channel: Channel) -> VersionedCache | None:
    """This process's cache of the reads of ``channel``'s tables in the job store at ``url`` (a
    SQLAlchemy URL; on SQLite a commit to any table empties it); None for an in-memory SQLite
    database."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        return PostgresCache(parsed.set(drivername="postgresql").render_as_string(hide_password=False), channel)
    database = parsed.database if parsed.get_backend_name() == "sqlite" else None
    return SqliteCache(database, channel.max_entries) if database and database != ":memory:" else None
