"""``/webhooks``: a tenant's endpoints for job, prediction, sweep and trial events, their delivery
log, and a test ping (``shared.jobs.webhooks``)."""

from typing import Annotated, TypeVar

from fastapi import APIRouter, Query, Response

from api.auth import CallerDep
from api.errors import error_responses
from shared.jobs import webhooks
from shared.schemas.webhooks import DeliveryList, DeliveryOut, WebhookCreate, WebhookCreated, WebhookList, WebhookOut
from shared.store.webhook_rows import Webhook, WebhookDelivery

Out = TypeVar("Out", bound=WebhookOut)

router = APIRouter(prefix="/webhooks", tags=["webhooks"])


def _out(webhook: Webhook, model: type[Out]) -> Out:
    return model.model_validate(webhook, from_attributes=True)


def _delivery(d: WebhookDelivery) -> DeliveryOut:
    return DeliveryOut.model_validate(
        {
            **{c: getattr(d, c) for c in DeliveryOut.model_fields if hasattr(d, c)},
            "next_attempt_at": d.next_attempt_at if d.status == webhooks.PENDING else None,
            "attempt_log": d.attempt_log or [],
        }
    )


@router.post("", status_code=201, responses=error_responses(409))
def create_webhook(body: WebhookCreate, caller: CallerDep) -> WebhookCreated:
    """Register an endpoint for the caller's tenant. The answer carries its ``secret`` (``whsec_…``),
    shown only here: verify each delivery's ``webhook-signature`` with it (Standard Webhooks). A URL
    whose host is or resolves to a loopback, link-local or private address is refused (422
    ``private_url``) unless the operator allows it; 409 ``too_many_webhooks`` at
    ``TUNEJOB_MAX_WEBHOOKS_PER_TENANT`` (20) endpoints."""
    return _out(webhooks.create_webhook(caller, body.url, list(body.events), body.description), WebhookCreated)


@router.get("")
def list_webhooks(caller: CallerDep) -> WebhookList:
    return WebhookList(data=[_out(w, WebhookOut) for w in webhooks.list_webhooks(caller)])


@router.get("/{webhook_id}")
def get_webhook(webhook_id: str, caller: CallerDep) -> WebhookOut:
    return _out(webhooks.get_webhook(webhook_id, caller), WebhookOut)


@router.delete("/{webhook_id}", status_code=204)
def delete_webhook(webhook_id: str, caller: CallerDep) -> Response:
    """Delete the endpoint and its delivery log; pending deliveries are not sent."""
    webhooks.delete_webhook(webhook_id, caller)
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries")
def list_deliveries(
    webhook_id: str,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[int | None, Query(ge=1)] = None,
) -> DeliveryList:
    """The delivery log, newest first: each event's status (``pending``, ``delivered``,
    ``failed``), attempts, the status code of the last answer and why it failed, and every attempt
    (``attempt_log``: its time, status code, error and duration). Pass
    ``next_cursor`` back as ``cursor`` for the next page."""
    page, has_more = webhooks.list_deliveries(webhook_id, caller, limit, cursor)
    return DeliveryList(data=[_delivery(d) for d in page], next_cursor=page[-1].id if has_more else None)


@router.post("/{webhook_id}/rotate-secret", responses=error_responses(404))
def rotate_secret(webhook_id: str, caller: CallerDep) -> WebhookCreated:
    """Give the endpoint a new ``secret`` (in this answer only). For 24 hours deliveries carry the
    old secret's signature too, so the receiver can switch to the new one without losing any."""
    return _out(webhooks.rotate_secret(webhook_id, caller), WebhookCreated)


@router.post("/{webhook_id}/ping", status_code=202, responses=error_responses(404, 429))
def ping_webhook(webhook_id: str, caller: CallerDep) -> DeliveryOut:
    """Send a ``webhook.ping`` event to the endpoint now (signed like any delivery); follow it in
    the delivery log. One at a time: 429 ``ping_pending`` while the last ping is not yet delivered."""
    return _delivery(webhooks.ping(webhook_id, caller))
