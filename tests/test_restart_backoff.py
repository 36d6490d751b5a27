"""A job that fails unexpectedly is re-sent after an exponential countdown (Celery's ``countdown``),
not at once, until its ``max_restarts`` are used up; on every stack."""

from datetime import datetime

import worker.tasks
from shared.settings import get_settings
from tests.conftest import TINY_MODEL, wait_for_status
from tests.test_api_jobs import labelled_csv, upload


def test_an_unexpected_failure_is_retried_after_a_growing_countdown(stack, monkeypatch):
    monkeypatch.setattr(get_settings(), "restart_backoff_seconds", 0.4)
    sent: list[float | None] = []
    real_send = worker.tasks.send

    def recording_send(job_id: str, countdown: float | None = None) -> None:
        sent.append(countdown)
        real_send(job_id, countdown=countdown)

    def broken_recipe(kind: str):
        def run(job, device, reporter):
            raise OSError("No space left on device")

        return run

    monkeypatch.setattr(worker.tasks, "send", recording_send)
    monkeypatch.setattr(worker.tasks, "recipe", broken_recipe)
    dataset = upload(stack.client, labelled_csv())
    job = stack.client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "training_dataset": dataset["id"],
            "text_column": "text",
            "label_column": "label",
        },
    ).json()
    ended = wait_for_status(stack.client, job["id"], {"failed", "succeeded"}, timeout=60)
    assert ended["status"] == "failed" and ended["error"]["code"] == "too_many_restarts"
    assert sent == [0.4, 0.8, 1.6]  # restart_backoff_seconds x 2^restarts, for max_restarts = 3
    events = stack.client.get(f"/jobs/{job['id']}/events").json()["data"]
    restarted = [datetime.fromisoformat(e["time"]) for e in events if e["code"] == "job_restarted"]
    started = [datetime.fromisoformat(e["time"]) for e in events if e["code"] == "started"]
    assert len(started) == 4 and len(restarted) == 3
    for countdown, failed_at, next_start in zip(sent, restarted, started[1:]):
        # the message's ETA is set after the event was written: the next attempt cannot start earlier
        assert (next_start - failed_at).total_seconds() >= countdown, (failed_at, next_start)
    said = [e["message"] for e in events if e["code"] == "job_restarted"][0]
    assert said.endswith("OSError: No space left on device; retrying in 0.4 s"), said
    # the job's end says it gave up, not that it was retrying (it read "...; last: unexpected error, retrying in 240 s")
    assert (
        ended["error"]["message"]
        == "gave up after 3 restarts; last: unexpected error: OSError: No space left on device"
    )


def test_an_object_storage_failure_reaches_the_event_without_the_buckets_address(stack, monkeypatch):
    """obstore's message is a page of Rust debug output that names the bucket's internal address: the
    tenant's event says the storage failed, the worker's log keeps the rest."""
    from obstore.exceptions import GenericError

    monkeypatch.setattr(get_settings(), "restart_backoff_seconds", 0.1)
    monkeypatch.setattr(get_settings(), "max_restarts", 0)

    def broken_recipe(kind: str):
        def run(job, device, reporter):
            raise GenericError(
                "Generic S3 error: Error performing GET http://10.0.0.7:9000/bucket/uploads/ds_1.csv in 30s"
                '\n\nDebug source:\nGeneric {\n    store: "S3",\n}'
            )

        return run

    monkeypatch.setattr(worker.tasks, "recipe", broken_recipe)
    dataset = upload(stack.client, labelled_csv())
    spec = {"base_model": TINY_MODEL, "training_dataset": dataset["id"], "text_column": "text", "label_column": "label"}
    job = stack.client.post("/jobs", json=spec).json()
    ended = wait_for_status(stack.client, job["id"], {"failed", "succeeded"}, timeout=60)
    events = stack.client.get(f"/jobs/{job['id']}/events").json()["data"]
    said = " ".join([e["message"] for e in events] + [ended["error"]["message"]])
    assert worker.tasks.STORAGE_FAILED in said
    assert "10.0.0.7" not in said and "Debug source" not in said, said


def test_a_job_whose_reporter_cannot_be_made_is_restarted_at_once_and_says_why(stack, monkeypatch):
    """The job's ``Reporter`` was made outside the error handling: when it raised (a worker upgraded
    under its feet: a ``NameError``), the job stayed claimed, its error unsaid, until its lease
    expired (minutes, three times over). It is restarted as any unexpected error now."""
    import worker.reporter

    monkeypatch.setattr(get_settings(), "restart_backoff_seconds", 0.1)
    monkeypatch.setattr(get_settings(), "max_restarts", 1)

    def broken(*args, **kwargs):
        raise NameError("name 'Outage' is not defined")

    monkeypatch.setattr(worker.reporter.Reporter, "__init__", broken)
    dataset = upload(stack.client, labelled_csv())
    spec = {"base_model": TINY_MODEL, "training_dataset": dataset["id"], "text_column": "text", "label_column": "label"}
    job = stack.client.post("/jobs", json=spec).json()
    ended = wait_for_status(stack.client, job["id"], {"failed", "succeeded"}, timeout=30)
    assert ended["error"]["message"].endswith("NameError: name 'Outage' is not defined"), ended["error"]
    events = stack.client.get(f"/jobs/{job['id']}/events").json()["data"]
    restarted = [e["message"] for e in events if e["code"] == "job_restarted"]
    assert len(restarted) == 1 and "NameError" in restarted[0], events  # restarted once, then out of restarts
