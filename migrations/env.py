"""Alembic environment: runs against the engine from ``shared.store.engine`` (the configured job store)."""

from alembic import context
from sqlalchemy import text

from shared.store.engine import get_engine
from shared.store.rows import Base

target_metadata = Base.metadata
MIGRATIONS_LOCK = int.from_bytes(b"tunejob")  # the PostgreSQL advisory lock id of `alembic upgrade`


def run_migrations_online() -> None:
    engine = context.config.attributes.get("connection_engine") or get_engine()
    with engine.connect() as connection:
        # Batch mode recreates a table that others reference (e.g. datasets), so SQLite's foreign keys
        # are off meanwhile (alembic docs, "Batch Migrations for SQLite"). The PRAGMA is a no-op
        # inside a transaction, so it goes to the driver's connection before BEGIN.
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
        try:
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
            with context.begin_transaction():
                if connection.dialect.name == "postgresql":
                    # Two processes starting at once (API processes, workers) migrate one after the other:
                    # the second waits here, then finds the store at head (SQLite: IMMEDIATE does this).
                    # The lock ends with this transaction, which also holds every migration (transactional DDL).
                    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATIONS_LOCK})
                context.run_migrations()
            connection.commit()
        finally:
            if sqlite:
                connection.rollback()
                connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


run_migrations_online()
