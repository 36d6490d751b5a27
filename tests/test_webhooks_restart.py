"""Webhooks across an API restart, on every stack: an event whose delivery failed before a deploy,
and one stored while no API ran, are each delivered exactly once by the restarted ``tunejob api``
(a process of its own on a store of its own), signed (Standard Webhooks reference code)."""

import os
import sys

import httpx
import pytest
from sqlalchemy import select

from shared.store.engine import read_session, upgrade_database
from shared.store.webhook_rows import WebhookDelivery
from tests.conftest import auth_header, configure_stack
from tests.faults_support import Process, free_port, wait_for
from tests.test_webhooks import Receiver, end_a_job, verified


@pytest.fixture(params=["embedded", "postgres+redis"])
def api_process_env(request, tmp_path):
    """A store of its own (no in-process API sends from it) and the environment of ``tunejob api``."""
    drop = configure_stack(
        request.param,
        {
            "TUNEJOB_DATA_DIR": str(tmp_path / "data"),
            "TUNEJOB_WEBHOOKS_ALLOW_PRIVATE_URLS": "true",
            "TUNEJOB_WEBHOOKS_RETRY_SECONDS": "1,1,1,1,1,1",
            "TUNEJOB_WEBHOOKS_POLL_SECONDS": "0.2",
            "TUNEJOB_WEBHOOKS_TIMEOUT_SECONDS": "5",
        },
    )
    upgrade_database()
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TUNEJOB_PORT": str(port)}
    yield env, port, tmp_path
    drop()


def test_no_delivery_is_lost_or_sent_twice_across_an_api_restart(api_process_env):
    env, port, work = api_process_env
    url = f"http://127.0.0.1:{port}"
    headers = auth_header("tenant-a")
    receiver = Receiver([503])  # the receiver is down at first

    def start() -> Process:
        api = Process("api", [sys.executable, "-m", "tunejob", "api", "--port", str(port)], env, work / "api.log")
        wait_for("tunejob api", lambda: _up(url), timeout=120, diagnostics=api.tail)
        return api

    api = start()
    try:
        webhook = httpx.post(
            f"{url}/webhooks", headers=headers, json={"url": receiver.url, "events": ["job.cancelled"]}
        ).json()
        first = end_a_job("tenant-a")
        wait_for("a failed attempt", lambda: receiver.requests, timeout=60, diagnostics=api.tail)
        api.stop(timeout=30)  # a deploy: SIGTERM
        second = end_a_job("tenant-a")  # while no API runs
        receiver.statuses = [200]
        api = start()

        def log() -> list[dict]:
            return httpx.get(f"{url}/webhooks/{webhook['id']}/deliveries", headers=headers).json()["data"]

        wait_for(
            "both delivered",
            lambda: [d["status"] for d in log()] == ["delivered"] * 2,
            timeout=60,
            diagnostics=api.tail,
        )
    finally:
        api.stop(timeout=30)
        receiver.close()
    answered = [r for r in receiver.requests if r["status"] == 200]
    ids = sorted(r["headers"]["webhook-id"] for r in answered)
    assert ids == sorted([f"evt_{first}_cancelled", f"evt_{second}_cancelled"])  # each once
    assert {verified(webhook["secret"], r)["data"]["id"] for r in answered} == {first, second}
    with read_session() as s:  # the API has stopped: the log from the store
        attempts = dict(
            s.execute(
                select(WebhookDelivery.event_id, WebhookDelivery.attempts).where(
                    WebhookDelivery.webhook_id == webhook["id"]
                )
            ).all()
        )
    assert attempts[f"evt_{first}_cancelled"] >= 2 and attempts[f"evt_{second}_cancelled"] >= 1


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
