"""Engine and sessions for the job store (SQLite by default, PostgreSQL through the same URL).

Two kinds of transaction:

- ``read_session()``: reads only. On SQLite a plain (deferred) ``BEGIN``: in WAL mode readers see
  the last committed state and never wait for, nor block, a writer. On PostgreSQL, autocommit:
  no BEGIN and ROLLBACK round trips (READ COMMITTED snapshots each statement anyway).
- ``session_scope()``: any transaction that writes. On SQLite it starts with ``BEGIN IMMEDIATE``,
  taking the single write lock at once, so that a transaction that reads and then writes queues
  on the busy timeout instead of failing with "database is locked" when it tries to upgrade a
  read to a write (SQLAlchemy docs, pysqlite "Serializable isolation / Savepoints / Transactional
  DDL"). A transaction that only writes takes the lock at its first statement either way, and the
  ORM sends BEGIN just before that statement, so IMMEDIATE costs it nothing. Keep these short.

A write lock that cannot be had within ``TUNEJOB_SQLITE_BUSY_TIMEOUT_SECONDS`` raises
``sqlalchemy.exc.OperationalError``, which the API answers with 503 and ``Retry-After``.
PostgreSQL is left as it is (READ COMMITTED; the row locks taken with ``with_for_update``). A
worker pings a pooled connection before each transaction (``pool_pre_ping``), so that a server
restart while it trains costs it nothing once the server is back (and ``worker.reporter`` trains on
through the restart itself). The API does not (``PING_CONNECTIONS``, turned off by
``api.main``): under polling load that round trip is a third of a request's store work. There,
when the server has closed a connection (a restart), the first transaction to use it fails with
``OperationalError`` (503 with ``Retry-After``), and SQLAlchemy, seeing a disconnect, drops every
connection of the pool made before it, so the next ones connect afresh (SQLAlchemy docs, "Dealing
with Disconnects", optimistic handling).

``data_version()`` tells whether a SQLite store changed since it was last asked, for what caches
reads (``shared.store.cache.SqliteCache``) or polls the store (``api.feeds``).
"""

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, Select, create_engine, event, make_url, select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from shared.errors import UserError
from shared.settings import get_settings

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
WRITE = "tunejob_write"  # execution option of the engine that begins IMMEDIATE transactions
PING_CONNECTIONS = True  # PostgreSQL: ping a pooled connection before each transaction (see above)


@lru_cache
def engine_for(url: str, sqlite_busy_timeout: float = 5.0, pool_size: int = 20, ping: bool = True) -> Engine:
    """One pooled engine per database URL (and SQLite busy timeout, in seconds; PostgreSQL pool
    size, and whether to ping connections)."""
    if not url.startswith("sqlite"):
        # A fixed pool (no overflow): under load a connection opened and closed per request costs
        # more than the request (PostgreSQL starts a process for each).
        return create_engine(url, pool_pre_ping=ping, pool_size=pool_size, max_overflow=0)
    Path(make_url(url).database or ".").parent.mkdir(parents=True, exist_ok=True)
    # Enough pooled connections for the API's thread pool (40 threads) to read at once.
    engine = create_engine(
        url, pool_size=20, max_overflow=30, connect_args={"timeout": sqlite_busy_timeout, "check_same_thread": False}
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let the "begin" hook below emit BEGIN itself
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(sqlite_busy_timeout * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE) else "BEGIN")

    return engine


def get_engine() -> Engine:
    settings = get_settings()
    return engine_for(
        settings.sqlalchemy_url, settings.sqlite_busy_timeout_seconds, settings.database_pool_size, PING_CONNECTIONS
    )


@lru_cache
def _session_factory(engine: Engine, write: bool) -> sessionmaker[Session]:
    bind: Engine
    if write:
        bind = engine.execution_options(**{WRITE: True})
    elif engine.dialect.name == "postgresql":
        # READ COMMITTED gives each statement its own snapshot anyway; AUTOCOMMIT saves the BEGIN
        # and ROLLBACK round trips, two of a polled request's four (psycopg sends neither when idle)
        bind = engine.execution_options(isolation_level="AUTOCOMMIT")
    else:
        bind = engine
    return sessionmaker(bind, expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """A short write transaction (``BEGIN IMMEDIATE`` on SQLite): commits on success, rolls back on
    any error."""
    with _session_factory(get_engine(), True).begin() as session:
        yield session


@contextmanager
def read_session() -> Iterator[Session]:
    """Reads only: a deferred ``BEGIN`` on SQLite (one snapshot, never blocks a writer), rolled back
    at the end; on PostgreSQL no transaction at all (``AUTOCOMMIT``: each statement reads what was
    committed before it began, as READ COMMITTED would). Never write in one."""
    with _session_factory(get_engine(), False)() as session:  # closing rolls back
        yield session


class DataVersion:
    """SQLite's ``PRAGMA data_version`` of the database file at ``path``, read on a connection of
    its own: SQLite changes it on every commit by another connection, of any process (the worker,
    ``tunejob keys``, this process's own writes through the engine), and on nothing else. Reading
    it costs microseconds; a read transaction about a millisecond of CPU."""

    def __init__(self, path: str):
        self.connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.lock = threading.Lock()  # one sqlite3 connection, used from the event loop and threads

    def read(self) -> int:
        with self.lock:
            return self.connection.execute("PRAGMA data_version").fetchone()[0]


@lru_cache
def data_version(url: str) -> DataVersion | None:
    """The ``DataVersion`` of the job store at ``url``: SQLite files only (PostgreSQL has no such counter)."""
    database = make_url(url).database if url.startswith("sqlite") else None
    return DataVersion(database) if database and database != ":memory:" else None


def upgrade_database() -> None:
    """Run ``alembic upgrade head`` against the configured database."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # IMMEDIATE on SQLite: the API and a worker starting together migrate one after the other.
    config.attributes["connection_engine"] = get_engine().execution_options(**{WRITE: True})
    command.upgrade(config, "head")


def database_revision() -> str | None:
    """The configured database's Alembic revision (``0014_sealed_webhook_secrets``); None before
    the first migration."""
    from alembic.runtime.migration import MigrationContext

    with get_engine().connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def keyset_page(
    s: Session,
    query: Select,
    model,
    after: str | int | None,
    limit: int | None,
    newest_first: bool = True,
    param: str = "after",
    within: Select | None = None,
) -> tuple[list, bool]:
    """One page of ``query`` (rows of ``model``, which has ``id`` and ``created_at``) in
    ``(created_at, id)`` order, starting after the row whose id is ``after`` (keyset pagination).
    ``after`` must be a row of ``within`` (default: any row of ``model``; e.g. the caller's tenant's).

    Returns:
        (rows, has_more): at most ``limit`` rows (all when ``limit`` is None), and whether more follow.

    Raises:
        UserError: ``invalid_cursor`` when ``after`` is not the id of a row of ``within``.
    """
    key = tuple_(model.created_at, model.id)
    order = (model.created_at.desc(), model.id.desc()) if newest_first else (model.created_at, model.id)
    query = query.order_by(*order)
    if after:
        row = s.scalars((within if within is not None else select(model)).where(model.id == after)).first()
        if row is None:
            raise UserError("invalid_cursor", f"{param} {after!r} is not the id of a listed object", param)
        cursor = tuple_(row.created_at, row.id)
        query = query.where(key < cursor if newest_first else key > cursor)
    if limit is None:
        return list(s.scalars(query)), False
    rows = s.scalars(query.limit(limit + 1)).all()
    return list(rows[:limit]), len(rows) > limit
