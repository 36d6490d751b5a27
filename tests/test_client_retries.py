"""The client retries an answer 429 or 503 after ``Retry-After`` (httpx-retries), the stream of
``jobs watch`` included, and sends an ``Idempotency-Key`` with every create so that a retried POST
makes one job: against a mock transport, and against the real API on every stack."""

import httpx
import pytest
from httpx_retries import retry as retry_module

from client import Client
from client.api import IDEMPOTENCY_HEADER
from tests.conftest import BASE_URL, TINY_MODEL
from tests.test_api_jobs import labelled_csv, upload

JOB = {
    "id": "job_1",
    "status": "queued",
    "base_model": TINY_MODEL,
    "task": "classification",
    "training_dataset": "ds_1",
    "text_column": "text",
    "label_column": "label",
    "hyperparameters": {"epochs": 1},
    "created_at": "2026-01-01T00:00:00Z",
    "progress": {"step": 0, "total_steps": None, "epoch": 0.0, "fraction": 0.0, "eta_seconds": None},
    "attempts": 0,
    "timings": {},
    **dict.fromkeys(
        [
            "validation_dataset",
            "validation_split",
            "text_pair_column",
            "label_names",
            "metadata",
            "suffix",
            "started_at",
            "finished_at",
            "train_metrics",
            "validation_metrics",
            "device",
            "error",
        ]
    ),
}
DATASET = {
    "id": "ds_1",
    "filename": "a.csv",
    "format": "csv",
    "rows": 1,
    "columns": ["text"],
    "bytes": 11,
    "sha256": "0" * 64,
    "created_at": "2026-01-01T00:00:00Z",
}


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """The seconds httpx-retries waits before each retry (recorded, not slept)."""
    waits: list[float] = []
    monkeypatch.setattr(retry_module.time, "sleep", waits.append)
    return waits


def test_a_429_is_retried_after_its_retry_after_and_a_503_with_jittered_backoff(slept):
    answers = iter(
        [
            httpx.Response(
                429, headers={"Retry-After": "7"}, json={"error": {"code": "rate_limited", "message": "slow down"}}
            ),
            httpx.Response(503, json={"error": {"code": "store_busy", "message": "busy"}}),
            httpx.Response(200, json={"status": "ok"}),
        ]
    )
    with Client("http://tunejob.test", transport=httpx.MockTransport(lambda request: next(answers))) as client:
        assert client.health() == {"status": "ok"}
    assert slept[0] == 7.0  # the server's Retry-After
    assert 0.0 <= slept[1] <= 2.0  # no Retry-After: 0.5 s x 2^2 (the second retry), full jitter


def test_retries_give_up_with_the_api_error(slept):
    busy = httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {"code": "rate_limited", "message": "x"}})
    with Client("http://tunejob.test", transport=httpx.MockTransport(lambda request: busy), retries=2) as client:
        with pytest.raises(Exception) as raised:
            client.health()
    assert (raised.value.status, raised.value.code) == (429, "rate_limited")
    assert slept == [1.0, 1.0]


def test_every_create_sends_its_own_idempotency_key_and_a_retry_the_same_one(slept, tmp_path):
    seen: list[tuple[str, str | None, bytes]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get(IDEMPOTENCY_HEADER), request.read()))
        if len(seen) % 2:  # every first try is refused
            return httpx.Response(
                503, headers={"Retry-After": "1"}, json={"error": {"code": "store_busy", "message": "busy"}}
            )
        if request.url.path == "/datasets":
            return httpx.Response(201, json=DATASET)
        return httpx.Response(201, json=JOB)

    path = tmp_path / "a.csv"
    path.write_text("text\nhello\n")
    spec = {"base_model": TINY_MODEL, "training_dataset": "ds_1", "text_column": "text", "label_column": "label"}
    with Client("http://tunejob.test", transport=httpx.MockTransport(answer)) as client:
        client.create_job(spec)
        client.create_job(spec)
        client.upload_dataset(path)
    keys = [key for _, key, _ in seen]
    assert all(keys) and keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2] and keys[4] == keys[5]
    assert seen[4][2] == seen[5][2] and b"hello" in seen[5][2]  # the retried upload sent the whole file again


def test_the_stream_of_watch_is_retried_instead_of_falling_back_to_polling(slept):
    paths: list[str] = []
    end = {**JOB, "status": "succeeded"}

    def answer(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if paths.count("/jobs/job_1/stream") == 1:
            return httpx.Response(
                429, headers={"Retry-After": "2"}, json={"error": {"code": "rate_limited", "message": "x"}}
            )
        import json

        body = f"event: end\nid: 1\ndata: {json.dumps(end)}\n\n"
        return httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=body.encode())

    with Client("http://tunejob.test", transport=httpx.MockTransport(answer)) as client:
        messages = list(client.follow("job_1"))
    assert [m.event for m in messages] == ["end"] and messages[0].data.status == "succeeded"
    assert paths == ["/jobs/job_1/stream", "/jobs/job_1/stream"]  # no GET /jobs/job_1: it never polled
    assert slept == [2.0]


class LosesTheFirstAnswer(httpx.BaseTransport):
    """Passes each request to the API in-process (through the stack's TestClient, which is built on
    another httpx), but the first POST's answer is lost on the way back (a proxy answers 503
    instead): the API did create the job."""

    def __init__(self, api):
        self.api, self.lost = api, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.api.request(
            request.method, str(request.url), headers=dict(request.headers), content=request.read()
        )
        if request.method == "POST" and not self.lost:
            self.lost += 1
            return httpx.Response(503, headers={"Retry-After": "1"}, text="upstream connect error")
        return httpx.Response(answer.status_code, headers=answer.headers.multi_items(), content=answer.content)


def test_a_retried_create_makes_one_job(stack, slept):
    dataset = upload(stack.client, labelled_csv())
    key = stack.client.headers["Authorization"].removeprefix("Bearer ")
    spec = {
        "base_model": TINY_MODEL,
        "task": "classification",
        "training_dataset": dataset["id"],
        "text_column": "text",
        "label_column": "label",
        "hyperparameters": {"epochs": 1, "max_length": 32},
        "metadata": {"test": "retried-create"},
    }
    transport = LosesTheFirstAnswer(stack.client)
    with Client(BASE_URL, api_key=key, transport=transport) as client:
        job = client.create_job(spec)
        client.cancel_job(job.id)
    assert transport.lost == 1 and slept == [1.0]
    mine = [
        j
        for j in stack.client.get("/jobs", params={"limit": 100}).json()["data"]
        if (j.get("metadata") or {}).get("test") == "retried-create"
    ]
    assert [j["id"] for j in mine] == [job.id]


def test_a_download_cut_short_says_so_and_keeps_no_partial_file(tmp_path):
    """The API cuts a download short on purpose when a stored file does not match its manifest (and
    a bucket or a proxy may drop it): the client said "cannot reach tunejob" and left the part it had
    as the file. It names the cut now, and removes the part."""

    class CutShort(httpx.SyncByteStream):
        def __iter__(self):
            yield b"x" * 1000
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Length": "5000"}, stream=CutShort())

    dest = tmp_path / "results.jsonl"
    with Client("http://tunejob.test", transport=httpx.MockTransport(answer)) as client:
        with pytest.raises(Exception) as raised:
            client.download_predictions("pred_1", dest)
    assert raised.value.code == "download_incomplete", raised.value
    assert "cut short after 1,000 bytes of 5,000" in str(raised.value)
    assert not dest.exists()
