"""A queued job shows its place in the queue and an estimated start, from the running jobs' ETAs
and the queued jobs' dry-run plan estimates: in ``GET /jobs/{id}``, the list, the stream and the
CLI; on every stack.

The jobs are written to the store directly (no broker message), so that the stack's worker leaves
them where the test puts them."""

import json
from datetime import timedelta

from client.display import queue_line
from shared.jobs.positions import estimate_queued
from shared.schemas.jobs import JobOut
from shared.store.engine import session_scope
from shared.store.rows import Job, JobStatus, new_id, utcnow
from tests.conftest import TINY_MODEL
from tests.test_api_jobs import labelled_csv, upload


def add_job(stack, dataset_id: str, status: str, **columns) -> str:
    spec = {
        "base_model": TINY_MODEL,
        "task": "classification",
        "training_dataset": dataset_id,
        "text_column": "text",
        "label_column": "label",
        "hyperparameters": {"epochs": 2, "batch_size": 8, "max_length": 64},
    }
    now = utcnow()
    job = Job(
        id=new_id("job"),
        tenant=stack.tenant,
        base_model=TINY_MODEL,
        task="classification",
        training_dataset_id=dataset_id,
        spec=spec,
        status=status,
        created_at=now,
        enqueued_at=now,
        **columns,
    )
    with session_scope() as s:
        s.add(job)
    return job.id


def queue_of(stack, job_id: str) -> dict | None:
    return stack.client.get(f"/jobs/{job_id}").json()["queue"]


def test_queued_jobs_show_their_place_and_estimated_start(stack):
    dataset = upload(stack.client, labelled_csv())["id"]
    # a past job on the model gives the plans their throughput (shared.jobs.planning.estimate_seconds)
    add_job(
        stack,
        dataset,
        JobStatus.SUCCEEDED,
        finished_at=utcnow(),
        train_metrics={"tokens_per_second": 2000.0, "padding_efficiency_unrounded": 0.5},
    )
    running = add_job(
        stack,
        dataset,
        JobStatus.RUNNING,
        eta_seconds=100.0,
        lease_owner="elsewhere",
        lease_expires_at=utcnow() + timedelta(hours=1),
    )
    first = add_job(stack, dataset, JobStatus.QUEUED, plan_seconds=30.0, planned_at=utcnow())
    second = add_job(stack, dataset, JobStatus.QUEUED)  # not planned yet
    third = add_job(stack, dataset, JobStatus.QUEUED)

    q1, q2, q3 = queue_of(stack, first), queue_of(stack, second), queue_of(stack, third)
    assert (q1["position"], q1["ahead"], q2["position"], q3["position"]) == (1, 0, 2, 3)
    assert 90 < q1["estimated_start_seconds"] <= 100  # when the running job's ETA runs out
    assert 120 < q2["estimated_start_seconds"] <= 130  # + the first one's plan estimate, on the one worker
    assert q3["estimated_start_seconds"] is None and q3["estimated_start_at"] is None  # the second: no plan yet
    assert queue_of(stack, running) is None
    assert queue_line(JobOut.model_validate(stack.client.get(f"/jobs/{third}").json())) == "#3 in queue · start unknown"

    estimate_queued()  # the API's recovery loop does this in the background
    with session_scope() as s:
        planned = s.get(Job, second).plan_seconds
    assert planned > 0  # its dry-run plan at 1000 padded tokens/s
    q3 = queue_of(stack, third)
    assert abs(q3["estimated_start_seconds"] - (q2["estimated_start_seconds"] + planned)) < 5

    listed = {j["id"]: j["queue"] for j in stack.client.get("/jobs", params={"limit": 100}).json()["data"]}
    assert listed[first]["position"] == 1 and listed[third]["position"] == 3 and listed[running] is None
    line = queue_line(JobOut.model_validate(stack.client.get(f"/jobs/{third}").json()))
    assert line.startswith("#3 in queue · starts in ~2:") or line.startswith("#3 in queue · starts in ~3:"), line

    # the stream sends a new progress message when the place changes, though the job's row does not
    # (it may send others with the same place: its row changes when the API plans it in the background)
    with stack.client.stream("GET", f"/jobs/{third}/stream") as stream:
        places = []
        for line in stream.iter_lines():
            if line.startswith("data: {") and '"queue"' in line:
                place = json.loads(line[len("data: ") :])["queue"]["position"]
                if not places:
                    stack.client.post(f"/jobs/{first}/cancel")
                if not places or places[-1] != place:
                    places.append(place)
                if place == 2:
                    break
    assert places == [3, 2]
    for job_id in (second, third):
        stack.client.post(f"/jobs/{job_id}/cancel")
