"""Webhooks on every stack: a private-range URL refused (at creation and again at delivery), each
delivery signed in the Standard Webhooks format (verified with the ``standardwebhooks`` reference
code), retried with backoff until answered, logged with its status codes, and a test ping. Across
an API restart: test_webhooks_restart.py.

Deliveries go to a local HTTP receiver on 127.0.0.1, so these tests allow private URLs
(``TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS``) except where the refusal is what they check. A job's end
is made by ending a job row that the test writes straight to the store (no broker message, so the
stack's worker leaves it alone) through the lifecycle's own ``request_cancel``."""

import argparse
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from rich.console import Console
from standardwebhooks import WebhookVerificationError
from standardwebhooks.webhooks import Webhook as Verifier

from client import Client, cli
from shared.jobs.lifecycle import request_cancel
from shared.settings import get_settings
from shared.store.engine import session_scope
from shared.store.rows import Dataset, Job, JobStatus, new_id, utcnow
from shared.store.tenancy import Caller
from tests.conftest import BASE_URL, TINY_MODEL, wait_until
from tests.test_api_jobs import labelled_csv


class Receiver:
    """An HTTP endpoint on 127.0.0.1 that records each POST (headers, body) and answers with the
    next of ``statuses`` (the last one repeats)."""

    def __init__(self, statuses: list[int] = (200,)):
        self.statuses, self.requests = list(statuses), []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                status = receiver.statuses.pop(0) if len(receiver.statuses) > 1 else receiver.statuses[0]
                receiver.requests.append(
                    {"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body, "status": status}
                )
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def fast_webhooks(monkeypatch):
    """Private URLs allowed (the receiver is on loopback), retries after 0.2 s, the loop every 0.1 s."""
    settings = get_settings()
    monkeypatch.setattr(settings, "webhooks_allow_private_urls", True)
    monkeypatch.setattr(settings, "webhooks_retry_seconds", [0.2, 0.2, 0.2])
    monkeypatch.setattr(settings, "webhooks_poll_seconds", 0.1)
    return settings


def end_a_job(tenant: str, dataset_id: str | None = None, metadata: dict | None = None) -> str:
    """A queued job of ``tenant`` written to the store and cancelled through the lifecycle: one
    ``job.cancelled`` event. Returns its id."""
    now = utcnow()
    with session_scope() as s:
        if dataset_id is None:
            dataset_id = new_id("ds")
            s.add(
                Dataset(
                    id=dataset_id,
                    tenant=tenant,
                    filename="a.csv",
                    format="csv",
                    path="/nonexistent",
                    rows=1,
                    columns=["text", "label"],
                    bytes=1,
                    sha256="0" * 64,
                )
            )
        job = Job(
            id=new_id("job"),
            tenant=tenant,
            base_model=TINY_MODEL,
            task="classification",
            training_dataset_id=dataset_id,
            spec={"metadata": metadata},
            status=JobStatus.QUEUED,
            created_at=now,
            enqueued_at=now,
        )
        s.add(job)
    request_cancel(job.id, Caller(tenant))
    return job.id


def deliveries(client, webhook_id: str) -> list[dict]:
    answer = client.get(f"/webhooks/{webhook_id}/deliveries")
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


def verified(secret: str, request: dict) -> dict:
    """The payload of a received request, once the reference code checked its signature."""
    return Verifier(secret).verify(request["body"], request["headers"])


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/hook",
        "http://localhost/hook",
        "http://10.1.2.3/hook",
        "http://192.168.0.10/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]:8000/hook",
        "http://0.0.0.0/hook",
        "http://[::ffff:127.0.0.1]/",
    ],
)
def test_a_private_url_is_refused(stack, url):
    answer = stack.client.post("/webhooks", json={"url": url, "events": ["job.succeeded"]})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "private_url" and answer.json()["error"]["param"] == "url"
    assert "TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS" in answer.json()["error"]["message"]


def test_bad_webhook_bodies_name_the_field(stack):
    cases = [
        ({"url": "ftp://example.com/x", "events": ["job.succeeded"]}, "url"),
        ({"url": "http://", "events": ["job.succeeded"]}, "url"),
        ({"url": "http://no-such-host.invalid/x", "events": ["job.succeeded"]}, "url"),
        ({"url": "https://example.com/x", "events": ["job.finished"]}, "events.0"),
        ({"url": "https://example.com/x", "events": []}, "events"),
    ]
    for body, param in cases:
        answer = stack.client.post("/webhooks", json=body)
        assert answer.status_code == 422 and answer.json()["error"]["param"] == param, answer.text


def test_a_job_end_is_delivered_signed_once_and_logged(stack, receiver, fast_webhooks):
    created = stack.client.post("/webhooks", json={"url": receiver.url, "events": ["job.cancelled", "job.failed"]})
    assert created.status_code == 201, created.text
    webhook = created.json()
    assert webhook["secret"].startswith("whsec_")
    assert "secret" not in stack.client.get(f"/webhooks/{webhook['id']}").json()  # shown once
    other = stack.client_for("tenant-b")
    assert other.get(f"/webhooks/{webhook['id']}").status_code == 404
    assert other.get(f"/webhooks/{webhook['id']}/deliveries").status_code == 404

    job_id = end_a_job(stack.tenant, metadata={"team": "nlp"})
    end_a_job("tenant-b")  # another tenant's job: not this endpoint's business
    wait_until(
        lambda: [d["status"] for d in deliveries(stack.client, webhook["id"])] == ["delivered"],
        "the delivery was recorded",
    )
    assert len(receiver.requests) == 1
    request = receiver.requests[0]
    payload = verified(webhook["secret"], request)
    assert payload["type"] == "job.cancelled"
    assert payload["data"] == {
        **payload["data"],
        "id": job_id,
        "object": "job",
        "status": "cancelled",
        "metadata": {"team": "nlp"},
    }
    assert request["headers"]["webhook-id"] == f"evt_{job_id}_cancelled"
    with pytest.raises(WebhookVerificationError):  # another endpoint's secret does not verify it
        Verifier(
            stack.client.post("/webhooks", json={"url": receiver.url, "events": ["job.failed"]}).json()["secret"]
        ).verify(request["body"], request["headers"])
    [logged] = deliveries(stack.client, webhook["id"])
    assert (logged["attempts"], logged["response_status"], logged["error"], logged["event_type"]) == (
        1,
        200,
        None,
        "job.cancelled",
    )
    assert logged["event_id"] == request["headers"]["webhook-id"] and logged["next_attempt_at"] is None


def test_failed_attempts_are_retried_with_backoff_then_given_up(stack, fast_webhooks):
    flaky, down = Receiver([500, 503, 200]), Receiver([500])
    try:
        hooks = [
            stack.client.post("/webhooks", json={"url": r.url, "events": ["job.cancelled"]}).json()
            for r in (flaky, down)
        ]
        end_a_job(stack.tenant)
        wait_until(
            lambda: [deliveries(stack.client, h["id"])[0]["status"] for h in hooks] == ["delivered", "failed"],
            "one delivered after retries, one given up",
            timeout=60,
        )
        [delivered], [failed] = (deliveries(stack.client, h["id"]) for h in hooks)
        assert [r["status"] for r in flaky.requests] == [500, 503, 200] and delivered["attempts"] == 3
        assert len({r["headers"]["webhook-id"] for r in flaky.requests}) == 1  # one event id on every attempt
        for request in flaky.requests:
            verified(hooks[0]["secret"], request)
        # 3 retry delays: 4 attempts, then failed, with the last answer logged
        assert (failed["attempts"], failed["response_status"], failed["error"]) == (4, 500, "answered HTTP 500")
        assert len(down.requests) == 4
        # every attempt is logged (issue 34), not only the last answer
        assert [(a["status_code"], a["error"]) for a in delivered["attempt_log"]] == [
            (500, "answered HTTP 500"),
            (503, "answered HTTP 503"),
            (200, None),
        ]
        assert [a["status_code"] for a in failed["attempt_log"]] == [500] * 4
        assert all(a["duration_ms"] >= 0 and a["at"].endswith("Z") for a in failed["attempt_log"])
    finally:
        flaky.close()
        down.close()


def test_a_ping_and_a_url_refused_again_at_delivery(stack, receiver, fast_webhooks, monkeypatch):
    webhook = stack.client.post("/webhooks", json={"url": receiver.url, "events": ["job.succeeded"]}).json()
    pinged = stack.client.post(f"/webhooks/{webhook['id']}/ping")
    assert pinged.status_code == 202 and pinged.json()["event_type"] == "webhook.ping"
    wait_until(lambda: receiver.requests, "the ping arrived")
    assert verified(webhook["secret"], receiver.requests[0])["data"] == {"webhook": webhook["id"]}

    monkeypatch.setattr(get_settings(), "webhooks_allow_private_urls", False)  # the operator changed their mind
    monkeypatch.setattr(get_settings(), "webhooks_retry_seconds", [])
    stack.client.post(f"/webhooks/{webhook['id']}/ping")
    wait_until(lambda: deliveries(stack.client, webhook["id"])[0]["status"] == "failed", "the second ping failed")
    refused = deliveries(stack.client, webhook["id"])[0]
    assert refused["response_status"] is None and "127.0.0.1, a loopback address" in refused["error"]
    assert len(receiver.requests) == 1  # nothing was sent to it

    assert stack.client.delete(f"/webhooks/{webhook['id']}").status_code == 204
    assert stack.client.get(f"/webhooks/{webhook['id']}/deliveries").status_code == 404


class ViaTestClient(httpx.BaseTransport):
    """The Python client's requests, answered by the stack's in-process API (its TestClient)."""

    def __init__(self, api):
        self.api = api

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.api.request(
            request.method, str(request.url), headers=dict(request.headers), content=request.read()
        )
        return httpx.Response(answer.status_code, headers=answer.headers.multi_items(), content=answer.content)


def test_the_client_and_the_cli(stack, receiver, fast_webhooks):
    key = stack.client.headers["Authorization"].removeprefix("Bearer ")
    screen = io.StringIO()
    out = Console(file=screen, width=200)
    with Client(BASE_URL, api_key=key, transport=ViaTestClient(stack.client)) as client:
        cli.create_webhook(
            client,
            argparse.Namespace(
                endpoint=receiver.url, events=["job.cancelled"], description="ci", json=False, quiet=False
            ),
            out,
        )
        [webhook] = [w for w in client.list_webhooks() if w.description == "ci"]
        assert "whsec_" in screen.getvalue() and "shown only now" in screen.getvalue()
        cli.ping_webhook(client, argparse.Namespace(webhook_id=webhook.id, json=False), out)
        wait_until(lambda: client.webhook_deliveries(webhook.id).data[0].status == "delivered", "the ping arrived")
        screen.truncate(0)
        cli.webhook_deliveries(
            client, argparse.Namespace(webhook_id=webhook.id, limit=20, cursor=None, json=False), out
        )
        assert "webhook.ping" in screen.getvalue() and "delivered" in screen.getvalue() and " 200 " in screen.getvalue()
        client.delete_webhook(webhook.id)
        assert webhook.id not in [w.id for w in client.list_webhooks()]


def test_a_cancelled_sweep_is_delivered(stack, receiver, fast_webhooks):
    from tests.test_cancel import LONG
    from tests.test_sweeps import create, sweep_body

    webhook = stack.client.post("/webhooks", json={"url": receiver.url, "events": ["sweep.cancelled"]}).json()
    dataset = stack.client.post(
        "/datasets", files={"file": ("s.csv", io.BytesIO(labelled_csv(rows=48, seed=5)))}
    ).json()
    sweep = create(stack.client, sweep_body(dataset["id"], hyperparameters={"batch_size": 8, "max_length": 32, **LONG}))
    assert stack.client.post(f"/sweeps/{sweep['id']}/cancel").status_code == 200
    wait_until(
        lambda: [d["status"] for d in deliveries(stack.client, webhook["id"])] == ["delivered"],
        "the sweep's end was delivered",
    )
    [request] = receiver.requests
    payload = verified(webhook["secret"], request)
    assert payload["type"] == "sweep.cancelled"
    assert (payload["data"]["id"], payload["data"]["object"]) == (sweep["id"], "sweep")


class Endpoint:
    """An HTTP endpoint on 127.0.0.1 whose every POST is answered by ``answer(handler)`` (which writes
    the whole response); counts the requests that arrived."""

    def __init__(self, answer):
        self.arrived = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                endpoint.arrived.append(time.monotonic())
                try:
                    answer(self)
                except OSError:  # the sender hung up, as it should
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def trickle(handler) -> None:
    """A 200 whose body comes a byte a second, for ever (each read well within httpx's read timeout)."""
    handler.send_response(200)
    handler.end_headers()
    while True:
        handler.wfile.write(b"x")
        handler.wfile.flush()
        time.sleep(1)


def flood(handler) -> None:
    """A 200 with an endless body, as fast as the socket takes it."""
    handler.send_response(200)
    handler.end_headers()
    chunk = b"x" * 65536
    while True:
        handler.wfile.write(chunk)


def late(handler) -> None:
    """A 200 after 5.5 s: past httpx's default timeout of 5 s, within the attempt's."""
    time.sleep(5.5)
    handler.send_response(200)
    handler.send_header("content-length", "0")
    handler.end_headers()


def test_an_attempt_has_a_whole_deadline_and_reads_at_most_64_kib(stack, fast_webhooks, monkeypatch):
    """httpx's timeout is per read: an endpoint answering a byte a second held an attempt open for
    ever, and an endless answer was read whole (issue 34). An attempt now ends at
    TUNEJOB_WEBHOOKS_TIMEOUT_SECONDS in all, and stops reading an answer after 64 KiB. An answer
    within that time is taken, however late (httpx's own 5 s default cut every attempt at 5 s)."""
    monkeypatch.setattr(get_settings(), "webhooks_retry_seconds", [])
    # the endless answer and the late one: a deadline they do not reach
    for answer, timeout in ((trickle, 2.0), (flood, 15.0), (late, 8.0)):
        monkeypatch.setattr(get_settings(), "webhooks_timeout_seconds", timeout)
        endpoint = Endpoint(answer)
        try:
            client = stack.client_for(f"tenant-{answer.__name__}")
            hook = client.post("/webhooks", json={"url": endpoint.url, "events": ["job.cancelled"]}).json()
            end_a_job(f"tenant-{answer.__name__}")
            wait_until(
                lambda c=client, h=hook: deliveries(c, h["id"])[0]["status"] != "pending",
                "the attempt ended",
                timeout=40,
            )
            [logged] = deliveries(client, hook["id"])
            if answer is trickle:
                assert (logged["status"], logged["response_status"]) == ("failed", None), logged
                assert "no complete answer within 2 s" in logged["error"], logged
                assert logged["attempt_log"][0]["duration_ms"] < 10_000, logged
            else:
                assert (logged["status"], logged["response_status"], logged["error"]) == ("delivered", 200, None), (
                    logged
                )
        finally:
            endpoint.close()


def test_a_slow_endpoint_does_not_hold_up_another(stack, fast_webhooks, monkeypatch):
    """Attempts run side by side (``TUNEJOB_WEBHOOKS_SENDERS``), at most 4 to one endpoint: another
    tenant's delivery arrives while one endpoint takes 4 s to answer each of its six (before issue
    34, one at a time: after all of them, 24 s later)."""
    monkeypatch.setattr(get_settings(), "webhooks_timeout_seconds", 10.0)

    def slowly(handler) -> None:
        time.sleep(4)
        handler.send_response(200)
        handler.send_header("content-length", "0")
        handler.end_headers()

    slow, fast = Endpoint(slowly), Receiver()
    try:
        slow_hook = stack.client.post("/webhooks", json={"url": slow.url, "events": ["job.cancelled"]}).json()
        for _ in range(6):
            end_a_job(stack.tenant)
        wait_until(lambda: slow.arrived, "the slow endpoint is busy", timeout=20)
        other = stack.client_for("tenant-fair")
        other.post("/webhooks", json={"url": fast.url, "events": ["job.cancelled"]})
        end_a_job("tenant-fair")
        wait_until(lambda: fast.requests, "the other tenant's delivery arrived", timeout=30)
        # the slow endpoint's six take two rounds of 4 s (4 at once): far from all answered yet
        assert sum(d["status"] == "delivered" for d in deliveries(stack.client, slow_hook["id"])) < 6
        wait_until(
            lambda: all(d["status"] == "delivered" for d in deliveries(stack.client, slow_hook["id"])),
            "the slow endpoint's deliveries all arrived",
            timeout=60,
        )
    finally:
        slow.close()
        fast.close()


def test_endpoints_per_tenant_are_capped_and_pings_do_not_pile_up(stack, fast_webhooks, monkeypatch):
    """Issue 34: endpoints per tenant are capped (``TUNEJOB_MAX_WEBHOOKS_PER_TENANT``, 409), and an
    endpoint takes a ping only once its last one was delivered (429 ``ping_pending``)."""

    def slowly(handler) -> None:
        time.sleep(3)
        handler.send_response(200)
        handler.send_header("content-length", "0")
        handler.end_headers()

    endpoint = Endpoint(slowly)
    try:
        client = stack.client_for("tenant-capped")
        monkeypatch.setattr(get_settings(), "max_webhooks_per_tenant", 2)
        hooks = [client.post("/webhooks", json={"url": endpoint.url, "events": ["job.failed"]}) for _ in range(3)]
        assert [h.status_code for h in hooks] == [201, 201, 409], [h.text for h in hooks]
        assert hooks[2].json()["error"]["code"] == "too_many_webhooks"
        assert (
            stack.client_for("tenant-other")
            .post("/webhooks", json={"url": endpoint.url, "events": ["job.failed"]})
            .status_code
            == 201
        )
        hook = hooks[0].json()["id"]
        assert client.post(f"/webhooks/{hook}/ping").status_code == 202
        again = client.post(f"/webhooks/{hook}/ping")
        assert again.status_code == 429 and again.json()["error"]["code"] == "ping_pending", again.text
        wait_until(lambda: deliveries(client, hook)[0]["status"] == "delivered", "the ping arrived", timeout=20)
        assert client.post(f"/webhooks/{hook}/ping").status_code == 202
    finally:
        endpoint.close()


def test_the_delivery_log_keeps_30_days(stack):
    """Issue 34: ended deliveries stored over TUNEJOB_WEBHOOKS_LOG_RETENTION_DAYS (30) ago are
    deleted by the recovery loop's ``purge_deliveries``; pending ones and recent ones stay."""
    from datetime import timedelta

    from shared.jobs import webhooks
    from shared.queue import RecoveryThread
    from shared.store.webhook_rows import WebhookDelivery

    client = stack.client_for("tenant-log")
    hook = client.post("/webhooks", json={"url": "https://93.184.216.34/hook", "events": ["job.failed"]}).json()["id"]
    old, recent = utcnow() - timedelta(days=31), utcnow() - timedelta(days=29)
    with session_scope() as s:
        for n, (status, created) in enumerate(
            [("delivered", old), ("failed", old), ("pending", old), ("delivered", recent)]
        ):
            s.add(
                WebhookDelivery(
                    webhook_id=hook,
                    event_id=f"evt_{n}",
                    event_type="job.failed",
                    payload={},
                    status=status,
                    attempts=1,
                    next_attempt_at=utcnow() + timedelta(days=1),
                    created_at=created,
                )
            )
    assert webhooks.purge_deliveries() >= 2
    assert sorted(d["event_id"] for d in deliveries(client, hook)) == ["evt_2", "evt_3"]
    assert webhooks.purge_deliveries in RecoveryThread().thread._args[1]  # the API's and workers' loop runs it


@pytest.mark.parametrize(
    "address",
    ["2002:a00:1::1", "2002:c0a8:101::1", "2001:0:4136:e378:8000:63bf:f5ff:fffe", "64:ff9b::a00:1", "::ffff:127.0.0.1"],
    ids=["6to4-10.0.0.1", "6to4-192.168.1.1", "teredo-client-10.0.0.1", "nat64-10.0.0.1", "mapped"],
)
def test_ipv6_addresses_that_embed_a_private_one_are_refused(address):
    """Issue 34: a 6to4, Teredo or NAT64 address reaches the IPv4 address inside it, which is checked
    on every Python (which of them ``is_private`` counts has changed between versions)."""
    from shared.jobs.webhooks import refused_address

    assert refused_address(address) is not None
    assert refused_address("2002:808:808::1") is None  # 6to4 of a public address (8.8.8.8)


def test_the_guide_lists_every_event_type_and_no_other():
    """docs/guide/webhooks.md's ``events`` list (the ``POST /webhooks`` row) is ``EventType``, both
    ways: a type added to the schema and not to the guide fails, and so does one the guide keeps
    after the schema dropped it."""
    import re
    import typing
    from pathlib import Path

    from shared.schemas.webhooks import EventType

    guide = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "webhooks.md").read_text()
    (row,) = [line for line in guide.splitlines() if line.startswith("| `POST /webhooks` |")]
    listed = re.findall(r"`([a-z_]+\.[a-z_]+)`", row.partition("`events` from ")[2])
    schema = typing.get_args(EventType)
    assert len(listed) == len(set(listed)), listed
    assert set(schema) - set(listed) == set(), "in EventType, not in the guide"
    assert set(listed) - set(schema) == set(), "in the guide, not in EventType"


def test_a_url_with_a_user_and_password_is_refused(stack):
    r = stack.client.post("/webhooks", json={"url": "https://user:secret@93.184.216.34/hook", "events": ["job.failed"]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_url", r.text
    assert "secret" not in r.text


def test_a_rotated_secret_signs_beside_the_old_one_for_a_day(stack, receiver, fast_webhooks):
    """Issue 34: ``POST /webhooks/{id}/rotate-secret`` gives a new secret; for 24 h deliveries carry
    both signatures (Standard Webhooks: space-separated), so either secret verifies them; after that
    only the new one."""
    from shared.store.webhook_rows import Webhook

    old = stack.client.post("/webhooks", json={"url": receiver.url, "events": ["job.failed"]}).json()
    rotated = stack.client.post(f"/webhooks/{old['id']}/rotate-secret")
    assert rotated.status_code == 200 and rotated.json()["secret"] != old["secret"], rotated.text
    new = rotated.json()["secret"]
    assert stack.client.post(f"/webhooks/{old['id']}/ping").status_code == 202
    wait_until(lambda: receiver.requests, "the ping arrived")
    for secret in (old["secret"], new):
        verified(secret, receiver.requests[0])
    with session_scope() as s:
        s.get(Webhook, old["id"]).previous_secret_expires_at = utcnow()
    assert stack.client.post(f"/webhooks/{old['id']}/ping").status_code == 202
    wait_until(lambda: len(receiver.requests) == 2, "the second ping arrived")
    verified(new, receiver.requests[1])
    from standardwebhooks.webhooks import WebhookVerificationError

    with pytest.raises(WebhookVerificationError):
        verified(old["secret"], receiver.requests[1])


def stored_secrets(webhook_id: str) -> tuple[str, str | None]:
    """An endpoint's ``secret`` and ``previous_secret`` as the job store holds them (no decryption)."""
    from sqlalchemy import text

    with session_scope() as s:
        return tuple(
            s.execute(text("SELECT secret, previous_secret FROM webhooks WHERE id = :id"), {"id": webhook_id}).one()
        )


def test_secrets_are_stored_encrypted_and_the_key_rotates(stack, receiver, fast_webhooks, monkeypatch):
    """Issue 34 Low 10: a copy of the job store does not hold the signing secrets. They are Fernet
    tokens under ``TUNEJOB_SECRET_KEY`` (on the embedded stack, unset: the data directory's key, made
    with mode 0600); with ``TUNEJOB_SECRET_KEY=new,old`` they are read with either key,
    ``reseal_secrets`` writes them with the new one, and after that the old key is no longer needed;
    a key that opens none of them is a clear error."""
    from cryptography.fernet import Fernet

    from shared.jobs.webhooks import reseal_secrets
    from shared.store.webhook_rows import Webhook

    webhook = stack.client.post("/webhooks", json={"url": receiver.url, "events": ["job.failed"]}).json()
    rotated = stack.client.post(f"/webhooks/{webhook['id']}/rotate-secret").json()["secret"]
    stored, previous = stored_secrets(webhook["id"])
    assert "whsec_" not in stored + previous
    key_file = get_settings().data_path / "secret_key"
    if stack.name == "embedded":
        assert key_file.stat().st_mode & 0o777 == 0o600
    old = get_settings().secret_key.encode() if stack.name != "embedded" else key_file.read_bytes()
    assert Fernet(old).decrypt(stored.encode()).decode() == rotated
    assert Fernet(old).decrypt(previous.encode()).decode() == webhook["secret"]

    new = Fernet.generate_key()
    monkeypatch.setattr(get_settings(), "secret_key", f"{new.decode()},{old.decode()}")
    try:
        assert reseal_secrets() >= 1
        stored, previous = stored_secrets(webhook["id"])
        assert Fernet(new).decrypt(stored.encode()).decode() == rotated
        assert Fernet(new).decrypt(previous.encode()).decode() == webhook["secret"]
        monkeypatch.setattr(get_settings(), "secret_key", new.decode())  # the old key dropped
        assert stack.client.post(f"/webhooks/{webhook['id']}/ping").status_code == 202
        wait_until(lambda: receiver.requests, "the ping arrived")
        verified(rotated, receiver.requests[0])
        monkeypatch.setattr(get_settings(), "secret_key", Fernet.generate_key().decode())
        with pytest.raises(ValueError, match="cannot be decrypted"), session_scope() as s:
            s.get(Webhook, webhook["id"])
    finally:  # the stack's other tests read these rows with the stack's key
        monkeypatch.setattr(get_settings(), "secret_key", f"{old.decode()},{new.decode()}")
        reseal_secrets()
        monkeypatch.undo()


def test_postgresql_needs_the_secret_key(stack, monkeypatch):
    """Where each process has a data directory of its own (PostgreSQL), a key made in one would not
    be the others' nor outlive it: without ``TUNEJOB_SECRET_KEY`` a secret is not stored (503)."""
    if stack.name == "embedded":
        pytest.skip("the embedded default makes its key in the data directory")
    monkeypatch.setattr(get_settings(), "secret_key", None)
    answer = stack.client.post("/webhooks", json={"url": "https://example.com/hook", "events": ["job.failed"]})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "secret_key_missing", answer.text
    assert answer.json()["error"]["param"] == "TUNEJOB_SECRET_KEY"


def test_the_migration_encrypts_the_secrets_stored_in_the_clear(stack, receiver, fast_webhooks):
    """Migration 0014 encrypts the secrets written before it, and its downgrade decrypts them."""
    from alembic import command
    from alembic.config import Config

    from shared.store.engine import MIGRATIONS_DIR, WRITE, get_engine

    webhook = stack.client.post("/webhooks", json={"url": receiver.url, "events": ["job.failed"]}).json()
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection_engine"] = get_engine().execution_options(**{WRITE: True})
    command.downgrade(config, "0013")
    try:
        assert stored_secrets(webhook["id"]) == (webhook["secret"], None)
    finally:
        command.upgrade(config, "head")
    stored, _ = stored_secrets(webhook["id"])
    assert stored != webhook["secret"] and "whsec_" not in stored
    stack.client.post(f"/webhooks/{webhook['id']}/ping")
    wait_until(lambda: receiver.requests, "the ping arrived")
    verified(webhook["secret"], receiver.requests[0])
