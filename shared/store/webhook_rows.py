"""The job store's webhook tables (migration 0009): a tenant's endpoints and the deliveries of
events to them (``shared.jobs.webhooks``). A delivery row is written in the same transaction as the
change it reports (a transactional outbox), so no event is lost when a process stops."""

from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from shared.store.rows import DEFAULT_TENANT, Base, new_id, utcnow
from shared.store.sealed import Sealed


class Webhook(Base):
    __tablename__ = "webhooks"
    __table_args__ = (Index("ix_webhooks_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("wh"))
    tenant: Mapped[str] = mapped_column(String(64), default=DEFAULT_TENANT)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[Any]]  # event types, e.g. ["job.succeeded", "job.failed"]
    # whsec_<base64>: signs every delivery; stored encrypted (shared.store.sealed, migration 0014)
    secret: Mapped[str] = mapped_column(Sealed)
    # after a rotation (migration 0012), the old secret also signs deliveries until then
    previous_secret: Mapped[str | None] = mapped_column(Sealed)
    previous_secret_expires_at: Mapped[datetime | None]
    description: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One event for one endpoint, delivered until it is answered 2xx or its attempts run out.
    ``(webhook_id, event_id)`` is unique: one event is stored, so sent, once per endpoint."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("webhook_id", "event_id", name="uq_webhook_deliveries_event"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_webhook", "webhook_id", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    event_id: Mapped[str] = mapped_column(String(64))  # the webhook-id header: receivers de-duplicate on it
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]]  # {"type", "timestamp", "data"}, sent as its JSON
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    lease_expires_at: Mapped[datetime | None]  # a process is sending it until then
    response_status: Mapped[int | None]  # HTTP status of the last attempt
    error: Mapped[str | None] = mapped_column(Text)  # why the last attempt failed
    # every attempt, oldest first (migration 0012): {"at", "status_code", "error", "duration_ms"}; at most
    # len(TUNEJOB_WEBHOOKS_RETRY_SECONDS) + 1 of them
    attempt_log: Mapped[list[Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]
