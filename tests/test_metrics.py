"""``GET /metrics`` scraped while a job trains and another waits, parsed with
``prometheus_client.parser``: the job-store gauges and the HTTP request metrics are there with
values that match what the API says; on every stack."""

import time

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY_MODEL, wait_for_status
from tests.test_api_jobs import labelled_csv, submit, upload

MIB = 2**20


def scrape(client) -> dict[str, list]:
    """Metric family name -> samples."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(r.text)}


def value(metrics: dict, family: str, sample: str | None = None, **labels) -> float:
    """The value of the one sample of ``family`` (named ``sample``, default the family's name)
    whose labels include ``labels``."""
    found = [
        s.value
        for s in metrics[family]
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (family, sample, labels, metrics[family])
    return found[0]


def requests_counted(
    metrics: dict, handler: str, method: str, status: str, sample: str = "http_requests_total", **labels
) -> float:
    """An HTTP request counter (or histogram sample) by route template, method and status; 0 before
    the first such request."""
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_bucket").removesuffix("_sum")
    return sum(
        s.value
        for s in metrics.get(family, [])
        if s.name == sample
        and s.labels.get("handler") == handler
        and s.labels.get("method") == method
        and s.labels.get("status") == status
        and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_while_a_job_trains(stack):
    client = stack.client_for("ops", admin=True)  # /metrics covers every tenant: admin keys only
    before = scrape(client)  # the HTTP counters below are deltas from here
    dataset = upload(client, labelled_csv(48))
    submitted = [submit(client, dataset["id"], epochs=500, batch_size=2, max_length=32)["id"]]  # until cancelled
    try:
        scrape_while_training(client, before, submitted)
    finally:
        # the queued one first: cancelled after the running one, it could start and end (a few
        # steps) before its cancel came
        for job_id in reversed(submitted):
            client.post(f"/jobs/{job_id}/cancel")
        for job_id in submitted:
            assert wait_for_status(client, job_id, {"succeeded", "failed", "cancelled"})["status"] == "cancelled"
    client.get("/jobs/job_0000000000000000")

    after = scrape(client)
    assert value(after, "tunejob_jobs", status="cancelled") == 2
    assert value(after, "tunejob_jobs", status="running") == 0 == value(after, "tunejob_queue_depth")
    assert value(after, "tunejob_queue_oldest_age_seconds") == 0
    assert after["tunejob_job_step"] == [] and after["tunejob_job_info"] == []
    missing = ("/jobs/{job_id}", "GET", "404")
    assert requests_counted(after, *missing) - requests_counted(before, *missing) == 1
    assert requests_counted(after, "/metrics", "GET", "200") - requests_counted(before, "/metrics", "GET", "200") == 2


def scrape_while_training(client, before: dict, submitted: list[str]) -> None:
    """Once the first of ``submitted`` has reported a few steps, queue a second job behind it, then
    scrape and check the gauges against the API's view of the jobs."""
    job_id, polls = submitted[0], 0

    def reported() -> dict | None:
        nonlocal polls
        polls += 1
        job = client.get(f"/jobs/{job_id}").json()
        assert job["status"] in {"queued", "running"}, job
        return job if job["progress"]["step"] >= 3 and job["train_metrics"] else None

    deadline = time.monotonic() + 120
    while not (job := reported()):
        assert time.monotonic() < deadline, "the job reported no step in 120 s"
        time.sleep(0.1)
    submitted.append(submit(client, job["training_dataset"])["id"])  # one worker: it waits behind the first
    time.sleep(0.5)

    metrics = scrape(client)
    assert value(metrics, "tunejob_store_up") == 1
    assert value(metrics, "tunejob_jobs", status="running") == 1
    assert value(metrics, "tunejob_jobs", status="queued") == 1 == value(metrics, "tunejob_queue_depth")
    assert value(metrics, "tunejob_jobs", status="succeeded") == 0
    assert 0.5 <= value(metrics, "tunejob_queue_oldest_age_seconds") < 60

    assert value(metrics, "tunejob_job_step", job_id=job_id) >= job["progress"]["step"]
    assert value(metrics, "tunejob_job_total_steps", job_id=job_id) == job["progress"]["total_steps"]
    assert value(metrics, "tunejob_job_tokens_per_second", job_id=job_id) > 0
    assert 0 < value(metrics, "tunejob_job_padding_efficiency", job_id=job_id) <= 1
    assert value(metrics, "tunejob_job_memory_bytes", job_id=job_id) > 10 * MIB  # CPU: the worker's RSS
    assert value(metrics, "tunejob_job_peak_memory_bytes", job_id=job_id) > 10 * MIB
    assert 0 <= value(metrics, "tunejob_job_heartbeat_age_seconds", job_id=job_id) < 120  # TUNEJOB_LEASE_SECONDS
    info = [s.labels for s in metrics["tunejob_job_info"]]
    assert len(info) == 1 and info[0]["job_id"] == job_id and info[0]["base_model"] == TINY_MODEL
    assert info[0]["device"] and info[0]["worker"]

    # HTTP metrics, by route template and status: every poll of this job counted once.
    poll = ("/jobs/{job_id}", "GET", "200")
    for sample in ("http_requests_total", "http_request_duration_seconds_count"):
        assert requests_counted(metrics, *poll, sample) - requests_counted(before, *poll, sample) == polls
    assert requests_counted(metrics, *poll, "http_request_duration_seconds_bucket", le="+Inf") == requests_counted(
        metrics, *poll, "http_request_duration_seconds_count"
    )
    assert requests_counted(metrics, *poll, "http_request_duration_seconds_sum") > 0
    assert requests_counted(metrics, "/jobs", "POST", "201") - requests_counted(before, "/jobs", "POST", "201") == 2


def test_a_store_that_does_not_answer_is_a_metric_not_a_failed_scrape(stack, monkeypatch):
    from sqlalchemy.exc import OperationalError

    def down(*_):
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr("api.metrics.snapshot", down)
    metrics = scrape(stack.client_for("ops", admin=True))
    assert value(metrics, "tunejob_store_up") == 0
    assert "tunejob_jobs" not in metrics and "http_requests" in metrics
