"""Sending webhook deliveries (``shared.jobs.webhooks`` stores them): ``deliver_due`` takes the due
ones with a compare-and-set lease and ``Senders`` posts them side by side, each attempt bounded in
time and in the answer read, then records it."""

import asyncio
import json
import logging
import threading
import time
from datetime import datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import func, or_, select, update

from shared.errors import UserError
from shared.jobs.webhooks import DELIVERED, FAILED, PENDING, resolve, signatures
from shared.settings import get_settings
from shared.store.engine import read_session, session_scope
from shared.store.rows import utcnow
from shared.store.webhook_rows import Webhook, WebhookDelivery

log = logging.getLogger(__name__)

DELIVERIES_PER_TURN = 100
SENDS_PER_ENDPOINT = 4  # of one endpoint's due deliveries in one turn
MAX_ANSWER_BYTES = 64 * 1024  # of an endpoint's answer read (its status is what counts)
LEASE_MARGIN_SECONDS = 30.0  # a delivery's lease outlasts its attempt's deadline by this


def deliver_due() -> int:
    """Start sending the due deliveries, oldest due first (up to ``DELIVERIES_PER_TURN``), on this
    process's ``SENDERS``: at most ``SENDS_PER_ENDPOINT`` of one endpoint's in flight at once, so that
    a slow or backlogged endpoint cannot take the senders from the others. Returns how many were started."""
    now = utcnow()
    rank = (
        func.row_number()
        .over(partition_by=WebhookDelivery.webhook_id, order_by=(WebhookDelivery.next_attempt_at, WebhookDelivery.id))
        .label("rank")
    )
    due = (
        select(WebhookDelivery.id, WebhookDelivery.webhook_id, WebhookDelivery.next_attempt_at, rank)
        .where(
            WebhookDelivery.status == PENDING,
            WebhookDelivery.next_attempt_at <= now,
            or_(WebhookDelivery.lease_expires_at.is_(None), WebhookDelivery.lease_expires_at < now),
        )
        .subquery()
    )
    with read_session() as s:
        rows = s.execute(
            select(due.c.id, due.c.webhook_id)
            .where(due.c.rank <= SENDS_PER_ENDPOINT)
            .order_by(due.c.next_attempt_at, due.c.id)
            .limit(DELIVERIES_PER_TURN)
        ).all()
    return SENDERS.start([(delivery_id, webhook_id) for delivery_id, webhook_id in rows])


class Senders:
    """A process's bounded pool of webhook senders: one event loop, in a daemon thread of its own
    (started on first use), running at most ``TUNEJOB_WEBHOOKS_SENDERS`` attempts at once and at most
    ``SENDS_PER_ENDPOINT`` per endpoint. Each attempt takes its delivery's lease when a sender is free
    (``_take``), so a delivery waiting here is not leased and any process may send it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_flight: dict[int, str] = {}  # delivery id -> its endpoint, from start to recorded

    def start(self, due: list[tuple[int, str]]) -> int:
        """Start an attempt of each ``(delivery id, endpoint id)`` not in flight here, within the per-endpoint share."""
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                self.senders = asyncio.Semaphore(get_settings().webhooks_senders)
                threading.Thread(target=self.loop.run_forever, name="tunejob-webhook-senders", daemon=True).start()
            started = []
            for delivery_id, webhook_id in due:
                busy = sum(1 for w in self.in_flight.values() if w == webhook_id)
                if delivery_id not in self.in_flight and busy < SENDS_PER_ENDPOINT:
                    self.in_flight[delivery_id] = webhook_id
                    started.append(delivery_id)
        for delivery_id in started:
            asyncio.run_coroutine_threadsafe(self._send(delivery_id), self.loop)
        return len(started)

    async def _send(self, delivery_id: int) -> None:
        try:
            async with self.senders:
                taken = await asyncio.to_thread(_take, delivery_id)
                if taken is None:
                    return
                started = time.monotonic()
                status_code, error = await attempt(*taken)
                await asyncio.to_thread(_record, delivery_id, taken[2], status_code, error, time.monotonic() - started)
        except Exception:  # a sender must outlive any one delivery: the lease expires, it is sent again
            log.exception("webhook delivery %s: the attempt failed unexpectedly", delivery_id)
        finally:
            with self.lock:
                self.in_flight.pop(delivery_id, None)


SENDERS = Senders()


def _take(delivery_id: int) -> tuple[WebhookDelivery, Webhook, datetime] | None:
    """Lease a due delivery for this process (compare-and-set) for one attempt's deadline and a
    margin; None if another process has it. Returns the delivery, its endpoint and the lease's end."""
    now = utcnow()
    lease = now + timedelta(seconds=get_settings().webhooks_timeout_seconds + LEASE_MARGIN_SECONDS)
    with session_scope() as s:
        result = s.execute(
            update(WebhookDelivery)
            .where(
                WebhookDelivery.id == delivery_id,
                WebhookDelivery.status == PENDING,
                or_(WebhookDelivery.lease_expires_at.is_(None), WebhookDelivery.lease_expires_at < now),
            )
            .values(lease_expires_at=lease)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]  # DML returns a CursorResult
            return None
        delivery = s.get(WebhookDelivery, delivery_id, populate_existing=True)
        webhook = s.get(Webhook, delivery.webhook_id) if delivery is not None else None
        return (delivery, webhook, lease) if delivery is not None and webhook is not None else None


async def attempt(delivery: WebhookDelivery, webhook: Webhook, lease: datetime) -> tuple[int | None, str | None]:
    """POST the delivery to its endpoint once, signed, within ``TUNEJOB_WEBHOOKS_TIMEOUT_SECONDS``
    in all (resolving, connecting, sending, and reading the answer: httpx's own timeouts are per
    operation, so an endpoint answering a byte a second would hold it for ever), and ended before
    ``lease`` (so that no other process can send it meanwhile). Of the answer, only its status and
    at most ``MAX_ANSWER_BYTES`` are read, as they stream in. Returns (HTTP status or None, error or None).
    """
    timeout = get_settings().webhooks_timeout_seconds
    deadline = min(timeout, (lease - utcnow()).total_seconds() - LEASE_MARGIN_SECONDS / 2)
    try:
        # httpx's own per-operation timeouts at the same bound: its default of 5 s cut every attempt
        # at 5 s, whatever TUNEJOB_WEBHOOKS_TIMEOUT_SECONDS said
        async with asyncio.timeout(deadline), httpx.AsyncClient(follow_redirects=False, timeout=deadline) as client:
            return await _post(client, delivery, webhook)
    except TimeoutError:
        return None, f"no complete answer within {timeout:g} s (TUNEJOB_WEBHOOKS_TIMEOUT_SECONDS)"


async def _post(
    client: httpx.AsyncClient, delivery: WebhookDelivery, webhook: Webhook
) -> tuple[int | None, str | None]:
    body = json.dumps(delivery.payload, separators=(",", ":"), ensure_ascii=False).encode()
    timestamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": "tunejob-webhooks",
        "webhook-id": delivery.event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signatures(webhook, delivery.event_id, timestamp, body),
    }
    try:
        address = (await asyncio.to_thread(resolve, webhook.url))[0]
    except UserError as e:
        return None, e.message
    parts = urlsplit(webhook.url)
    pinned = f"[{address}]" if ":" in address else address  # connect to the address that was checked
    target = urlunsplit(parts._replace(netloc=f"{pinned}:{parts.port}" if parts.port else pinned))
    headers["host"] = parts.netloc.rsplit("@", 1)[-1]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    try:
        async with client.stream("POST", target, content=body, headers=headers, extensions=extensions) as answer:
            read = 0
            async for chunk in answer.aiter_raw():  # the body is not kept: read to let a short answer finish
                read += len(chunk)
                if read >= MAX_ANSWER_BYTES:
                    break
    except httpx.HTTPError as e:
        return None, (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:500]
    return answer.status_code, None if answer.is_success else f"answered HTTP {answer.status_code}"


def _record(delivery_id: int, lease: datetime, status_code: int | None, error: str | None, seconds: float) -> None:
    """Record an attempt (taking ``seconds``) of the delivery leased until ``lease``: ``delivered``
    on a 2xx, else due again after the next retry delay, or ``failed`` once
    ``TUNEJOB_WEBHOOKS_RETRY_SECONDS`` is used up. Nothing is recorded once the lease is another's."""
    delays = get_settings().webhooks_retry_seconds
    now = utcnow()
    with session_scope() as s:
        delivery = s.get(WebhookDelivery, delivery_id, with_for_update=True, populate_existing=True)
        if delivery is None:  # its endpoint was deleted meanwhile
            return
        if delivery.lease_expires_at is None or abs((delivery.lease_expires_at - lease).total_seconds()) > 1e-3:
            log.error("webhook delivery %s: its lease passed to another process during an attempt", delivery_id)
            return
        delivery.attempts += 1
        delivery.response_status, delivery.error, delivery.lease_expires_at = status_code, error, None
        delivery.attempt_log = [
            *(delivery.attempt_log or []),
            {
                "at": now.isoformat().replace("+00:00", "Z"),
                "status_code": status_code,
                "error": error,
                "duration_ms": round(seconds * 1000),
            },
        ]
        if error is None:
            delivery.status, delivery.delivered_at = DELIVERED, now
        elif delivery.attempts > len(delays):
            delivery.status = FAILED
        else:
            delivery.next_attempt_at = now + timedelta(seconds=delays[delivery.attempts - 1])
    if error is not None:
        log.warning(
            "webhook delivery %s failed (attempt %s, %.1f s): %s", delivery_id, delivery.attempts, seconds, error
        )
