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
                receiver.requests.append({"headers": {k.lower(): v for k, v in self.headers.items()},
                                          "body": body, "status": status})
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
            s.add(Dataset(id=dataset_id, tenant=tenant, filename="a.csv", format="csv", path="/nonexistent",
                          rows=1, columns=["text", "label"], bytes=1, sha256="0" * 64))
        job = Job(id=new_id("job"), tenant=tenant, base_model=TINY_MODEL, task="classification",
                  training_dataset_id=dataset_id, spec={"metadata": metadata}, status=JobStatus.QUEUED,
                  created_at=now, enqueued_at=now)
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


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook", "http://localhost/hook", "http://10.1.2.3/hook",
                                 "http://192.168.0.10/hook", "http://169.254.169.254/latest/meta-data",
                                 "http://[::1]:8000/hook", "http://0.0.0.0/hook", "http://[::ffff:127.0.0.1]/"])
def test_a_private_url_is_refused(stack, url):
    answer = stack.client.post("/webhooks", json={"url": url, "events": ["job.succeeded"]})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "private_url" and answer.json()["error"]["param"] == "url"
    assert "TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS" in answer.json()["error"]["message"]


def test_bad_webhook_bodies_name_the_field(stack):
    cases = [({"url": "ftp://example.com/x", "events": ["job.succeeded"]}, "url"),
             ({"url": "http://", "events": ["job.succeeded"]}, "url"),
             ({"url": "http://no-such-host.invalid/x", "events": ["job.succeeded"]}, "url"),
             ({"url": "https://example.com/x", "events": ["job.finished"]}, "events.0"),
             ({"url": "https://example.com/x", "events": []}, "events")]
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
    wait_until(lambda: [d["status"] for d in deliveries(stack.client, webhook["id"])] == ["delivered"],
               "the delivery was recorded")
    assert len(receiver.requests) == 1
    request = receiver.requests[0]
    payload = verified(webhook["secret"], request)
    assert payload["type"] == "job.cancelled"
    assert payload["data"] == {**payload["data"], "id": job_id, "object": "job", "status": "cancelled",
                               "metadata": {"team": "nlp"}}
    assert request["headers"]["webhook-id"] == f"evt_{job_id}_cancelled"
    with pytest.raises(WebhookVerificationError):  # another endpoint's secret does not verify it
        Verifier(stack.client.post("/webhooks", json={"url": receiver.url, "events": ["job.failed"]})
                 .json()["secret"]).verify(request["body"], request["headers"])
    [logged] = deliveries(stack.client, webhook["id"])
    assert (logged["attempts"], logged["response_status"], logged["error"], logged["event_type"]) == \
        (1, 200, None, "job.cancelled")
    assert logged["event_id"] == request["headers"]["webhook-id"] and logged["next_attempt_at"] is None


def test_failed_attempts_are_retried_with_backoff_then_given_up(stack, fast_webhooks):
    flaky, down = Receiver([500, 503, 200]), Receiver([500])
    try:
        hooks = [stack.client.post("/webhooks", json={"url": r.url, "events": ["job.cancelled"]}).json()
                 for r in (flaky, down)]
        end_a_job(stack.tenant)
        wait_until(lambda: [deliveries(stack.client, h["id"])[0]["status"] for h in hooks] == ["delivered", "failed"],
                   "one delivered after retries, one given up", timeout=60)
        [delivered], [failed] = (deliveries(stack.client, h["id"]) for h in hooks)
        assert [r["status"] for r in flaky.requests] == [500, 503, 200] and delivered["attempts"] == 3
        assert len({r["headers"]["webhook-id"] for r in flaky.requests}) == 1  # one event id on every attempt
        for request in flaky.requests:
            verified(hooks[0]["secret"], request)
        # 3 retry delays: 4 attempts, then failed, with the last answer logged
        assert (failed["attempts"], failed["response_status"], failed["error"]) == (4, 500, "answered HTTP 500")
        assert len(down.requests) == 4
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
        answer = self.api.request(request.method, str(request.url), headers=dict(request.headers),
                                  content=request.read())
        return httpx.Response(answer.status_code, headers=answer.headers.multi_items(), content=answer.content)


def test_the_client_and_the_cli(stack, receiver, fast_webhooks):
    key = stack.client.headers["Authorization"].removeprefix("Bearer ")
    screen = io.StringIO()
    out = Console(file=screen, width=200)
    with Client(BASE_URL, api_key=key, transport=ViaTestClient(stack.client)) as client:
        cli.create_webhook(client, argparse.Namespace(url=receiver.url, events=["job.cancelled"], description="ci",
                                                      json=False, quiet=False), out)
        [webhook] = [w for w in client.list_webhooks() if w.description == "ci"]
        assert "whsec_" in screen.getvalue() and "shown only now" in screen.getvalue()
        cli.ping_webhook(client, argparse.Namespace(webhook_id=webhook.id, json=False), out)
        wait_until(lambda: client.webhook_deliveries(webhook.id).data[0].status == "delivered", "the ping arrived")
        screen.truncate(0)
        cli.webhook_deliveries(client, argparse.Namespace(webhook_id=webhook.id, limit=20, cursor=None, json=False), out)
        assert "webhook.ping" in screen.getvalue() and "delivered" in screen.getvalue() and " 200 " in screen.getvalue()
        client.delete_webhook(webhook.id)
        assert webhook.id not in [w.id for w in client.list_webhooks()]


def test_a_cancelled_sweep_is_delivered(stack, receiver, fast_webhooks):
    from tests.test_cancel import LONG
    from tests.test_sweeps import create, sweep_body

    webhook = stack.client.post("/webhooks", json={"url": receiver.url, "events": ["sweep.cancelled"]}).json()
    dataset = stack.client.post("/datasets", files={"file": ("s.csv", io.BytesIO(labelled_csv(rows=48, seed=5)))}).json()
    sweep = create(stack.client, sweep_body(dataset["id"], hyperparameters={"batch_size": 8, "max_length": 32, **LONG}))
    assert stack.client.post(f"/sweeps/{sweep['id']}/cancel").status_code == 200
    wait_until(lambda: [d["status"] for d in deliveries(stack.client, webhook["id"])] == ["delivered"],
               "the sweep's end was delivered")
    [request] = receiver.requests
    payload = verified(webhook["secret"], request)
    assert payload["type"] == "sweep.cancelled"
    assert (payload["data"]["id"], payload["data"]["object"]) == (sweep["id"], "sweep")
