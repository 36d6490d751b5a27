"""The job store's model alias tables (migration 0013, ``shared.jobs.aliases``): a tenant's names
for its fine-tuned models (``production`` -> ``job_…``), and every move of one (who, when, from, to)."""

from datetime import datetime

from sqlalchemy import ForeignKey, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from shared.store.rows import Base, utcnow


class ModelAlias(Base):
    __tablename__ = "model_aliases"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    alias: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_by: Mapped[str | None] = mapped_column(String(64))  # the API key's id


class ModelAliasChange(Base):
    """One move of an alias: ``from_job_id`` None when it was created, ``to_job_id`` None when it was deleted."""

    __tablename__ = "model_alias_changes"
    __table_args__ = (Index("ix_model_alias_changes_alias", "tenant", "alias", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(64))
    alias: Mapped[str] = mapped_column(String(64))
    from_job_id: Mapped[str | None] = mapped_column(String(32))
    to_job_id: Mapped[str | None] = mapped_column(String(32))
    changed_by: Mapped[str | None] = mapped_column(String(64))
    changed_at: Mapped[datetime] = mapped_column(default=utcnow)
