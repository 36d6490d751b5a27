"""Webhooks: a tenant's endpoints hear when its jobs, predictions, sweeps and trials end, instead of
polling. The deliveries follow the Standard Webhooks specification
(https://www.standardwebhooks.com, "Signature scheme"): each is an HTTP POST of
``{"type", "timestamp", "data"}`` with the headers ``webhook-id`` (the event id: receivers
de-duplicate on it), ``webhook-timestamp`` (Unix seconds) and ``webhook-signature``
(``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``, keyed with the base64-decoded part of
the endpoint's ``whsec_…`` secret), so a receiver verifies them with the ``standardwebhooks``
library (or Svix's) as it is.

Where deliveries come from and go:

- **Written with the change they report.** ``job_ended`` runs inside the transaction that ends a
  job (``shared.jobs.lifecycle``), and inserts one ``WebhookDelivery`` row per subscribed endpoint (a
  transactional outbox): an event is stored exactly when its job's end is, and no process stop
  loses it. ``(webhook_id, event_id)`` is unique and the event id is the job's id and status, so
  one end is one delivery per endpoint.
- **Sent by the API**, from its own loop (``DeliveryLoop`` in ``api.main``, every
  ``TUNEJOB_WEBHOOKS_POLL_SECONDS``), not by the workers: a worker's one Celery slot trains for
  hours (a delivery task would wait behind the job), GPU boxes often have no way out to the
  internet, and the API is what every deployment runs. Any number of API processes may run the
  loop: a process takes a due delivery with a compare-and-set lease (as workers claim jobs), so two
  never send it at once, and one that dies while sending leaves it to be sent again after the
  lease (the same ``webhook-id``: at least once, never concurrently).
- **Retried with backoff for a day**: after a failed attempt (no 2xx answer in
  ``TUNEJOB_WEBHOOKS_TIMEOUT_SECONDS``) it is due again after the next of
  ``TUNEJOB_WEBHOOKS_RETRY_SECONDS`` (Svix's schedule: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h,
  about 27.6 h in all), then it is ``failed``. Redirects are not followed.
- **SSRF.** A URL whose host is, or resolves to, a loopback, link-local, private, multicast,
  reserved or unspecified address is refused (422 ``private_url``) unless
  ``TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS=true``; at delivery the name is resolved again, every
  address checked, and the connection made to the checked address (``Host`` and TLS SNI still
  name the host), so a name re-pointed after the check (DNS rebinding) reaches nothing private.
"""

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from shared.errors import NotFound, UserError
from shared.settings import get_settings
from shared.store.engine import keyset_page, read_session, session_scope
from shared.store.rows import Job, utcnow
from shared.store.tenancy import Caller
from shared.store.webhook_rows import Webhook, WebhookDelivery

log = logging.getLogger(__name__)

EVENT_TYPES = ("job.succeeded", "job.failed", "job.cancelled",
               "prediction.succeeded", "prediction.failed", "prediction.cancelled",
               "sweep.succeeded", "sweep.failed", "sweep.cancelled", "trial.pruned")
PING = "webhook.ping"  # POST /webhooks/{id}/ping: sent whatever the endpoint subscribed to
SECRET_PREFIX = "whsec_"
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
DELIVERIES_PER_TURN = 20


def new_secret() -> str:
    """``whsec_`` + base64 of 24 random bytes (the Standard Webhooks secret format)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: ``v1,`` + base64 HMAC-SHA256, keyed with the secret's
    base64-decoded bytes, of ``"{event_id}.{timestamp}.{body}"`` (Standard Webhooks)."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


# ----------------------------------------------------------------------------- SSRF


def refused_address(address: str) -> str | None:
    """Why the webhook may not reach IP ``address`` (e.g. ``"private"``), or None when it is public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    for reason in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{reason}"):
            return reason.replace("_", "-")
    return None if ip.is_global else "not globally routable"


def resolve(url: str) -> list[str]:
    """The IP addresses ``url``'s host is or resolves to, each one checked (unless
    ``TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS``).

    Raises:
        UserError: 422 ``invalid_url`` (not http(s), no host, a name that does not resolve),
            ``private_url`` (an address in a refused range).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError("invalid_url", f"webhook url {url!r} must be an http:// or https:// URL with a host", "url")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        raise UserError("invalid_url", f"webhook url host {parts.hostname!r} does not resolve ({e})", "url") from e
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not get_settings().webhooks_allow_private_urls:
        for address in addresses:
            if (reason := refused_address(address)) is not None:
                raise UserError("private_url", f"webhook url host {parts.hostname!r} is {address}, a {reason} "
                                "address; webhooks reach only public addresses unless the operator sets "
                                "TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS=true", "url")
    return addresses


# ----------------------------------------------------------------------------- endpoints


def create_webhook(caller: Caller, url: str, events: list[str], description: str | None = None) -> Webhook:
    """Store an endpoint for ``caller``'s tenant; its ``secret`` is in the returned row (shown once).

    Raises:
        UserError: see ``resolve``.
    """
    resolve(url)
    with session_scope() as s:
        webhook = Webhook(tenant=caller.tenant, url=url, events=list(dict.fromkeys(events)), secret=new_secret(),
                          description=description, created_at=utcnow())
        s.add(webhook)
    return webhook


def _owned(s: Session, webhook_id: str, caller: Caller) -> Webhook:
    webhook = s.get(Webhook, webhook_id)
    if webhook is None or not caller.sees(webhook.tenant):
        raise NotFound("webhook", webhook_id)
    return webhook


def get_webhook(webhook_id: str, caller: Caller) -> Webhook:
    """Raises: NotFound (no such endpoint, or another tenant's)."""
    with read_session() as s:
        return _owned(s, webhook_id, caller)


def list_webhooks(caller: Caller) -> list[Webhook]:
    """The caller's endpoints (an admin's: all), newest first."""
    query = select(Webhook).order_by(Webhook.created_at.desc(), Webhook.id.desc())
    with read_session() as s:
        return list(s.scalars(query if caller.admin else query.where(Webhook.tenant == caller.tenant)))


def delete_webhook(webhook_id: str, caller: Caller) -> None:
    """Delete an endpoint and its delivery log; pending deliveries are not sent.

    Raises: NotFound."""
    with session_scope() as s:
        s.delete(_owned(s, webhook_id, caller))


def list_deliveries(webhook_id: str, caller: Caller, limit: int, after: int | None = None
                    ) -> tuple[list[WebhookDelivery], bool]:
    """The endpoint's deliveries, newest first, ``limit`` at a time after delivery ``after``.

    Returns: (deliveries, has_more). Raises: NotFound; UserError ``invalid_cursor``."""
    with read_session() as s:
        _owned(s, webhook_id, caller)
        query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
        return keyset_page(s, query, WebhookDelivery, after, limit, param="cursor")


def ping(webhook_id: str, caller: Caller) -> WebhookDelivery:
    """Queue a ``webhook.ping`` event to the endpoint (sent by the delivery loop like any other).

    Raises: NotFound."""
    with session_scope() as s:
        webhook = _owned(s, webhook_id, caller)
        delivery = _delivery(webhook.id, f"evt_ping_{secrets.token_hex(8)}", PING, {"webhook": webhook.id})
        s.add(delivery)
    return delivery


# ----------------------------------------------------------------------------- events


def _delivery(webhook_id: str, event_id: str, event_type: str, data: dict[str, Any]) -> WebhookDelivery:
    now = utcnow()
    payload = {"type": event_type, "timestamp": now.isoformat().replace("+00:00", "Z"), "data": data}
    return WebhookDelivery(webhook_id=webhook_id, event_id=event_id, event_type=event_type, payload=payload,
                           status=PENDING, attempts=0, next_attempt_at=now, created_at=now)


def emit(s: Session, tenant: str, event_type: str, event_id: str, data: dict[str, Any]) -> int:
    """In session ``s`` (the transaction of the change the event reports), add a delivery of the
    event to each of ``tenant``'s endpoints subscribed to ``event_type``; one already stored for
    ``event_id`` is not added again. Returns how many were added."""
    webhooks = [w for w in s.scalars(select(Webhook).where(Webhook.tenant == tenant)) if event_type in w.events]
    if not webhooks:
        return 0
    stored = set(s.scalars(select(WebhookDelivery.webhook_id).where(WebhookDelivery.event_id == event_id)))
    added = [_delivery(w.id, event_id, event_type, data) for w in webhooks if w.id not in stored]
    s.add_all(added)
    return len(added)


def job_ended(s: Session, job: Job) -> None:
    """``job.<status>`` (a prediction: ``prediction.<status>``; a sweep's trial stopped by its
    pruner: ``trial.pruned``) for a job that just ended, in the transaction that ends it. ``data``: the job's id, kind, status, error and metadata; fetch the
    rest from the API."""
    noun = "prediction" if job.kind == "predict" else "trial" if job.status == "pruned" else "job"
    data = {"id": job.id, "object": noun, "status": job.status, "error": job.error,
            **({"sweep_id": job.sweep_id, "trial_number": job.trial_number} if job.sweep_id else {}),
            "metadata": (job.spec or {}).get("metadata"),
            "finished_at": job.finished_at.isoformat().replace("+00:00", "Z") if job.finished_at else None}
    emit(s, job.tenant, f"{noun}.{job.status}", f"evt_{job.id}_{job.status}", data)


# ----------------------------------------------------------------------------- delivery


def deliver_due() -> int:
    """Send up to DELIVERIES_PER_TURN due deliveries, oldest due first, each taken with a lease so
    that no other process sends it meanwhile, and record each attempt. Returns how many were sent."""
    now = utcnow()
    with read_session() as s:
        due = list(s.scalars(select(WebhookDelivery.id).where(
            WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now,
            or_(WebhookDelivery.lease_expires_at.is_(None), WebhookDelivery.lease_expires_at < now))
            .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id).limit(DELIVERIES_PER_TURN)))
    sent = 0
    for delivery_id in due:
        taken = _take(delivery_id)
        if taken is not None:
            _record(delivery_id, *attempt(*taken))
            sent += 1
    return sent


def _take(delivery_id: int) -> tuple[WebhookDelivery, Webhook] | None:
    """Lease a due delivery for this process (compare-and-set); None if another process has it."""
    now = utcnow()
    lease = now + timedelta(seconds=4 * get_settings().webhooks_timeout_seconds + 30)
    with session_scope() as s:
        result = s.execute(update(WebhookDelivery).where(
            WebhookDelivery.id == delivery_id, WebhookDelivery.status == PENDING,
            or_(WebhookDelivery.lease_expires_at.is_(None), WebhookDelivery.lease_expires_at < now))
            .values(lease_expires_at=lease))
        if result.rowcount != 1:  # type: ignore[attr-defined]  # DML returns a CursorResult
            return None
        delivery = s.get(WebhookDelivery, delivery_id, populate_existing=True)
        webhook = s.get(Webhook, delivery.webhook_id) if delivery is not None else None
        return (delivery, webhook) if delivery is not None and webhook is not None else None


def attempt(delivery: WebhookDelivery, webhook: Webhook) -> tuple[int | None, str | None]:
    """POST the delivery to its endpoint once, signed. Returns (HTTP status or None, error or None)."""
    body = json.dumps(delivery.payload, separators=(",", ":"), ensure_ascii=False).encode()
    timestamp = int(time.time())
    headers = {"content-type": "application/json", "user-agent": "tunejob-webhooks",
               "webhook-id": delivery.event_id, "webhook-timestamp": str(timestamp),
               "webhook-signature": sign(webhook.secret, delivery.event_id, timestamp, body)}
    try:
        address = resolve(webhook.url)[0]
    except UserError as e:
        return None, e.message
    parts = urlsplit(webhook.url)
    pinned = f"[{address}]" if ":" in address else address  # connect to the address that was checked
    target = urlunsplit(parts._replace(netloc=f"{pinned}:{parts.port}" if parts.port else pinned))
    headers["host"] = parts.netloc.rsplit("@", 1)[-1]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    try:
        with httpx.Client(timeout=get_settings().webhooks_timeout_seconds, follow_redirects=False) as client:
            answer = client.post(target, content=body, headers=headers, extensions=extensions)
    except httpx.HTTPError as e:
        return None, f"{type(e).__name__}: {e}"[:500]
    return answer.status_code, None if answer.is_success else f"answered HTTP {answer.status_code}"


def _record(delivery_id: int, status_code: int | None, error: str | None) -> None:
    """Record an attempt: ``delivered`` on a 2xx, else due again after the next retry delay, or
    ``failed`` once ``TUNEJOB_WEBHOOKS_RETRY_SECONDS`` is used up."""
    delays = get_settings().webhooks_retry_seconds
    now = utcnow()
    with session_scope() as s:
        delivery = s.get(WebhookDelivery, delivery_id, with_for_update=True, populate_existing=True)
        if delivery is None:  # its endpoint was deleted meanwhile
            return
        delivery.attempts += 1
        delivery.response_status, delivery.error, delivery.lease_expires_at = status_code, error, None
        if error is None:
            delivery.status, delivery.delivered_at = DELIVERED, now
        elif delivery.attempts > len(delays):
            delivery.status = FAILED
        else:
            delivery.next_attempt_at = now + timedelta(seconds=delays[delivery.attempts - 1])
    if error is not None:
        log.warning("webhook delivery %s failed (attempt %s): %s", delivery_id, delivery.attempts, error)

