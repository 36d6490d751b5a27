"""Alembic environment: runs against the engine from ``shared.store.engine`` (the configured job store)."""

from alembic import context

from shared.store.engine import get_engine
from shared.store.rows import Base

target_metadata = Base.metadata


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
                context.run_migrations()
            connection.commit()
        finally:
            if sqlite:
                connection.rollback()
                connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")


run_migrations_online()
