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
- **Side by side, each bounded** (issue 34; ``shared.jobs.webhook_delivery``): a process's ``Senders`` run ``TUNEJOB_WEBHOOKS_SENDERS``
  attempts at once, at most ``SENDS_PER_ENDPOINT`` to one endpoint; an attempt ends after
  ``TUNEJOB_WEBHOOKS_TIMEOUT_SECONDS`` in all (``asyncio.timeout`` around the whole request: httpx's
  timeouts are per operation) and before its lease, and reads at most ``MAX_ANSWER_BYTES`` of the answer.
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
import logging
import secrets
import socket
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import flag_modified

from shared.errors import NotFound, UserError
from shared.settings import get_settings
from shared.store.engine import keyset_page, read_session, session_scope
from shared.store.rows import Job, utcnow
from shared.store.sealed import fernet
from shared.store.tenancy import Caller, lock_tenant
from shared.store.webhook_rows import Webhook, WebhookDelivery

log = logging.getLogger(__name__)

PING = "webhook.ping"  # POST /webhooks/{id}/ping: sent whatever the endpoint subscribed to
SECRET_PREFIX = "whsec_"
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
ROTATION_OVERLAP = timedelta(hours=24)  # the old secret keeps signing this long after a rotation (as Svix)
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the last 32 bits are an IPv4 address


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
    if isinstance(ip, ipaddress.IPv6Address):
        # An IPv4 address inside an IPv6 one reaches that IPv4 host: mapped (::ffff:a.b.c.d), 6to4
        # (2002::/16), Teredo (2001::/32: server and client) and NAT64 (64:ff9b::/96). Checked here on
        # every Python: which of them is_private or is_global counts has changed between versions.
        embedded = [
            ip.ipv4_mapped,
            ip.sixtofour,
            *(ip.teredo or ()),
            ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in NAT64 else None,
        ]
        for inner in filter(None, embedded):
            if (reason := refused_address(str(inner))) is not None:
                return f"{reason} (inside {ip})"
        if ip.ipv4_mapped:
            return None
    for reason in ("loopback", "link_local", "private", "multicast", "reserved", "unspecified"):
        if getattr(ip, f"is_{reason}"):
            return reason.replace("_", "-")
    return None if ip.is_global else "not globally routable"


def resolve(url: str) -> list[str]:
    """The IP addresses ``url``'s host is or resolves to, each one checked (unless
    ``TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS``).

    Raises:
        UserError: 422 ``invalid_url`` (not http(s), no host, user:password@, a name that does not resolve),
            ``private_url`` (an address in a refused range).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError("invalid_url", f"webhook url {url!r} must be an http:// or https:// URL with a host", "url")
    if parts.username is not None or parts.password is not None:
        raise UserError(
            "invalid_url",
            "webhook url must not carry a user name or password (user:password@); "
            "verify deliveries with the webhook-signature header instead",
            "url",
        )
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        raise UserError("invalid_url", f"webhook url host {parts.hostname!r} does not resolve ({e})", "url") from e
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not get_settings().webhooks_allow_private_urls:
        for address in addresses:
            if (reason := refused_address(address)) is not None:
                raise UserError(
                    "private_url",
                    f"webhook url host {parts.hostname!r} is {address}, a {reason} "
                    "address; webhooks reach only public addresses unless the operator sets "
                    "TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS=true",
                    "url",
                )
    return addresses


# ----------------------------------------------------------------------------- endpoints


def create_webhook(caller: Caller, url: str, events: list[str], description: str | None = None) -> Webhook:
    """Store an endpoint for ``caller``'s tenant; its ``secret`` is in the returned row (shown once).

    Raises:
        UserError: see ``resolve``; 409 ``too_many_webhooks`` at ``max_webhooks_per_tenant`` endpoints;
            503 ``secret_key_missing`` (``shared.store.sealed.fernet``).
    """
    fernet()  # the key its secret is stored encrypted with
    resolve(url)
    with session_scope() as s:
        lock_tenant(s, caller.tenant)  # two creations at once count each other
        limit = get_settings().max_webhooks_per_tenant
        count = s.scalar(select(func.count()).select_from(Webhook).where(Webhook.tenant == caller.tenant)) or 0
        if count >= limit:
            raise UserError(
                "too_many_webhooks",
                f"tenant {caller.tenant!r} has {count} webhook endpoints, this "
                f"server's maximum (TUNEJOB_MAX_WEBHOOKS_PER_TENANT={limit}); delete one first",
                "url",
                status=409,
            )
        webhook = Webhook(
            tenant=caller.tenant,
            url=url,
            events=list(dict.fromkeys(events)),
            secret=new_secret(),
            description=description,
            created_at=utcnow(),
        )
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


def list_deliveries(
    webhook_id: str, caller: Caller, limit: int, after: int | None = None
) -> tuple[list[WebhookDelivery], bool]:
    """The endpoint's deliveries, newest first, ``limit`` at a time after delivery ``after``.

    Returns: (deliveries, has_more). Raises: NotFound; UserError ``invalid_cursor``."""
    with read_session() as s:
        _owned(s, webhook_id, caller)
        query = select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
        return keyset_page(s, query, WebhookDelivery, after, limit, param="cursor")


def rotate_secret(webhook_id: str, caller: Caller) -> Webhook:
    """Give the endpoint a new secret (in the returned row, shown once). For ``ROTATION_OVERLAP`` the
    old one signs deliveries too (``webhook-signature`` then holds both signatures, space-separated,
    as Standard Webhooks allows), so the receiver can switch without rejecting any delivery.

    Raises: NotFound; UserError 503 ``secret_key_missing`` (``shared.store.sealed.fernet``)."""
    fernet()
    with session_scope() as s:
        webhook = _owned(s, webhook_id, caller)
        webhook.previous_secret, webhook.previous_secret_expires_at = webhook.secret, utcnow() + ROTATION_OVERLAP
        webhook.secret = new_secret()
    return webhook


def reseal_secrets() -> int:
    """Store every endpoint's secrets encrypted again with the first of ``TUNEJOB_SECRET_KEY``'s keys
    (read with any of them: ``shared.store.sealed``), so that the keys after it can be dropped.
    Returns how many endpoints were written."""
    with session_scope() as s:
        hooks = s.scalars(select(Webhook)).all()
        for webhook in hooks:
            flag_modified(webhook, "secret")
            if webhook.previous_secret is not None:
                flag_modified(webhook, "previous_secret")
    return len(hooks)


def signatures(webhook: Webhook, event_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: the current secret's signature, and the previous one's
    while a rotation's overlap lasts."""
    secrets_ = [webhook.secret]
    if webhook.previous_secret and webhook.previous_secret_expires_at and webhook.previous_secret_expires_at > utcnow():
        secrets_.append(webhook.previous_secret)
    return " ".join(sign(secret, event_id, timestamp, body) for secret in secrets_)


def ping(webhook_id: str, caller: Caller) -> WebhookDelivery:
    """Queue a ``webhook.ping`` event to the endpoint (sent by the delivery loop like any other),
    one at a time: pings cannot pile up on an endpoint.

    Raises: NotFound; UserError 429 ``ping_pending`` while the endpoint's last ping is unsent."""
    with session_scope() as s:
        s.get(Webhook, webhook_id, with_for_update=True)  # one ping check at a time per endpoint
        webhook = _owned(s, webhook_id, caller)
        if (
            s.scalar(
                select(WebhookDelivery.id)
                .where(
                    WebhookDelivery.webhook_id == webhook_id,
                    WebhookDelivery.event_type == PING,
                    WebhookDelivery.status == PENDING,
                )
                .limit(1)
            )
            is not None
        ):
            raise UserError(
                "ping_pending",
                f"webhook {webhook_id!r} has a ping not yet delivered; follow it in "
                "its deliveries (GET /webhooks/{id}/deliveries), then ping again",
                "webhook_id",
                status=429,
                headers={"Retry-After": "5"},
            )
        delivery = _delivery(webhook.id, f"evt_ping_{secrets.token_hex(8)}", PING, {"webhook": webhook.id})
        s.add(delivery)
    return delivery


def purge_deliveries() -> int:
    """For the recovery loop: delete deliveries that ended (delivered or failed) over
    ``webhooks_log_retention_days`` ago, so that the log does not grow for ever. Returns how many."""
    cutoff = utcnow() - timedelta(days=get_settings().webhooks_log_retention_days)
    with session_scope() as s:
        result = s.execute(
            delete(WebhookDelivery).where(WebhookDelivery.status != PENDING, WebhookDelivery.created_at < cutoff)
        )
        return result.rowcount  # type: ignore[attr-defined]  # DML returns a CursorResult


# ----------------------------------------------------------------------------- events


def _delivery(webhook_id: str, event_id: str, event_type: str, data: dict[str, Any]) -> WebhookDelivery:
    now = utcnow()
    payload = {"type": event_type, "timestamp": now.isoformat().replace("+00:00", "Z"), "data": data}
    return WebhookDelivery(
        webhook_id=webhook_id,
        event_id=event_id,
        event_type=event_type,
        payload=payload,
        status=PENDING,
        attempts=0,
        next_attempt_at=now,
        created_at=now,
    )


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
    data = {
        "id": job.id,
        "object": noun,
        "status": job.status,
        "error": job.error,
        **({"sweep_id": job.sweep_id, "trial_number": job.trial_number} if job.sweep_id else {}),
        "metadata": (job.spec or {}).get("metadata"),
        "finished_at": job.finished_at.isoformat().replace("+00:00", "Z") if job.finished_at else None,
    }
    emit(s, job.tenant, f"{noun}.{job.status}", f"evt_{job.id}_{job.status}", data)
