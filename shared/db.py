"""Engine and sessions for the job store (SQLite by default, PostgreSQL through the same URL).

SQLite gets WAL, a busy timeout and foreign keys, and every transaction starts with
``BEGIN IMMEDIATE`` so that two writers queue on the busy timeout instead of failing with
"database is locked" when a read transaction tries to upgrade to a write
(SQLAlchemy docs, "Serializable isolation / Savepoints / Transactional DDL" for pysqlite).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from shared.settings import get_settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
SQLITE_BUSY_TIMEOUT_S = 30


@lru_cache
def engine_for(url: str) -> Engine:
    """One pooled engine per database URL."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # let the "begin" hook below emit BEGIN itself
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def get_engine() -> Engine:
    settings = get_settings()
    if settings.sqlalchemy_url.startswith("sqlite"):
        settings.data_path.mkdir(parents=True, exist_ok=True)
    return engine_for(settings.sqlalchemy_url)


@lru_cache
def _session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """A short transaction: commits on success, rolls back on any error."""
    with _session_factory(get_engine()).begin() as session:
        yield session


def upgrade_database() -> None:
    """Run ``alembic upgrade head`` against the configured database."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection_engine"] = get_engine()
    command.upgrade(config, "head")
