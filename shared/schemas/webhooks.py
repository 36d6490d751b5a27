"""Webhook request and response bodies (``api.routers.webhooks``, ``shared.jobs.webhooks``)."""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

EventType = Literal[
    "job.succeeded",
    "job.failed",
    "job.cancelled",
    "prediction.succeeded",
    "prediction.failed",
    "prediction.cancelled",
    "sweep.succeeded",
    "sweep.failed",
    "sweep.cancelled",
    "trial.pruned",
    "model.alias_updated",
]


class WebhookCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"url": "https://hooks.example.com/tunejob", "events": ["job.succeeded", "job.failed"]}]
        },
    )

    # A string checked by shared.jobs.webhooks.resolve (422 invalid_url or private_url, naming the host),
    # not pydantic's URL type, which would re-write it (a trailing slash) and refuse other schemes as a
    # schema error the JSON Schema does not document.
    url: str = Field(
        pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\x00-\x20\x7f]+$",
        max_length=2048,
        description="http(s) URL that receives each event as a signed POST; loopback, link-local and "
        "private addresses are refused unless the operator sets "
        "TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS=true",
    )
    events: list[EventType] = Field(min_length=1, description="event types to receive")
    description: str | None = Field(None, max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")


class WebhookOut(BaseModel):
    id: str
    url: str
    events: list[str]
    description: str | None
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(
        description="`whsec_…`: verifies each delivery's `webhook-signature` (Standard Webhooks). "
        "Shown only in this response"
    )


class WebhookList(BaseModel):
    data: list[WebhookOut]


class AttemptOut(BaseModel):
    at: datetime = Field(description="when the attempt ended")
    status_code: int | None = Field(description="the endpoint's HTTP status; null when it gave none")
    error: str | None = Field(description="why the attempt failed; null when it was answered 2xx")
    duration_ms: int = Field(description="from resolving the endpoint's name to the end of its answer")


class DeliveryOut(BaseModel):
    id: int
    event_id: str = Field(description="the `webhook-id` header: the same for every attempt of this event")
    event_type: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    response_status: int | None = Field(description="HTTP status the endpoint answered the last attempt with")
    error: str | None = Field(description="why the last attempt failed")
    created_at: datetime
    next_attempt_at: datetime | None = Field(description="when a pending delivery is tried next")
    delivered_at: datetime | None
    payload: dict[str, Any] = Field(description="the body sent: `{type, timestamp, data}`")
    attempt_log: list[AttemptOut] = Field([], description="every attempt, oldest first (as Stripe and Svix list them)")


class DeliveryList(BaseModel):
    data: list[DeliveryOut]
    next_cursor: int | None
