"""Alembic environment: runs against the engine from ``shared.db`` (the configured job store)."""

from alembic import context

from shared.db import get_engine
from shared.models import Base

target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = context.config.attributes.get("connection_engine") or get_engine()
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


run_migrations_online()
