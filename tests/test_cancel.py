"""POST /jobs/{id}/cancel on every stack: a queued job never starts, a running one stops at its next
optimizer step without producing a model, and a finished one is left as it is.

The stack's worker runs one job at a time, so a job submitted while a long one runs stays queued.
"""

import time

import pytest

from tests.conftest import wait_for_status
from tests.test_api_jobs import labelled_csv, submit, upload

FINISHED = {"succeeded", "failed", "cancelled"}
# Hundreds of epochs of 6 micro-batches: far longer than any test waits, so it only ends by cancel.
# No per-epoch evaluation or checkpoint, so that steps follow each other quickly.
LONG = {"epochs": 500, "eval_every_steps": 10**6, "save_every_steps": 10**6}


def get(client, job_id: str) -> dict:
    r = client.get(f"/jobs/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def wait_until_training(client, job_id: str, timeout: float = 120) -> dict:
    """Poll until the job is running and has reported at least one optimizer step."""
    deadline = time.monotonic() + timeout
    while True:
        job = get(client, job_id)
        assert job["status"] in {"queued", "running"}, job
        if job["status"] == "running" and job["progress"]["step"] >= 1:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} did not start training within {timeout}s: {job}")
        time.sleep(0.1)


def event_codes(client, job_id: str) -> list[str]:
    return [e["code"] for e in client.get(f"/jobs/{job_id}/events").json()["data"]]


def artifact_names(client, job_id: str) -> set[str]:
    return {a["name"] for a in client.get(f"/jobs/{job_id}/artifacts").json()["data"]}


def cancel(client, job_id: str) -> dict:
    r = client.post(f"/jobs/{job_id}/cancel")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def dataset(stack) -> dict:
    return upload(stack.client, labelled_csv(rows=48, seed=3))


def assert_cancelled_mid_training(client, job_id: str) -> dict:
    job = wait_for_status(client, job_id, FINISHED, timeout=120)
    assert job["status"] == "cancelled", job
    assert job["error"] is None
    assert job["started_at"] is not None and job["finished_at"] is not None
    assert job["finished_at"] >= job["started_at"]
    assert 1 <= job["progress"]["step"] < job["progress"]["total_steps"]
    assert job["progress"]["fraction"] < 1.0
    codes = event_codes(client, job_id)
    assert codes[0] == "created" and "started" in codes
    assert codes.count("cancel_requested") == 1
    assert codes.index("cancel_requested") < codes.index("cancelled")
    assert codes[-1] == "cancelled" and "succeeded" not in codes and "failed" not in codes
    assert "model.tar" not in artifact_names(client, job_id)
    return job


def test_queued_job_is_cancelled_at_once_and_never_starts(stack, dataset):
    client = stack.client
    running = submit(client, dataset["id"], **LONG)
    wait_until_training(client, running["id"])

    queued = submit(client, dataset["id"], epochs=1)
    assert queued["status"] == "queued"  # the single worker is busy with the long job
    cancelled = cancel(client, queued["id"])
    assert cancelled["status"] == "cancelled"
    assert cancelled["finished_at"] is not None and cancelled["started_at"] is None

    # The long job carries on until it too is cancelled; it stops at a step short of the end.
    assert get(client, running["id"])["status"] == "running"
    assert cancel(client, running["id"])["status"] in {"running", "cancelled"}  # stops at its next step
    assert_cancelled_mid_training(client, running["id"])

    # The cancelled job's message is still in the queue, behind nothing but this one: once a job
    # submitted after it has run, the worker has seen it, and must have skipped it.
    after = submit(client, dataset["id"], epochs=1)
    assert wait_for_status(client, after["id"], FINISHED)["status"] == "succeeded"
    job = get(client, queued["id"])
    assert job["status"] == "cancelled"
    assert job["started_at"] is None and job["attempts"] == 0 and job["progress"]["step"] == 0
    assert job["finished_at"] == cancelled["finished_at"]
    assert event_codes(client, queued["id"]) == ["created", "cancelled"]
    assert artifact_names(client, queued["id"]) == set()
    assert client.get(f"/jobs/{queued['id']}/metrics").json()["data"] == []


def test_running_job_stops_before_the_end_without_a_model(stack, dataset):
    client = stack.client
    job = submit(client, dataset["id"], epochs=200)  # per-epoch evaluation and checkpoints, as by default
    wait_until_training(client, job["id"])
    cancel(client, job["id"])
    again = cancel(client, job["id"])  # a second request changes nothing
    assert again["status"] in {"running", "cancelled"}
    final = assert_cancelled_mid_training(client, job["id"])

    metrics = client.get(f"/jobs/{job['id']}/metrics").json()["data"]
    assert metrics and max(m["step"] for m in metrics) < final["progress"]["total_steps"]
    # The worker is free again: a short job after it runs to the end.
    short = submit(client, dataset["id"], epochs=1)
    assert wait_for_status(client, short["id"], FINISHED)["status"] == "succeeded"
    assert get(client, job["id"])["status"] == "cancelled"


def test_cancelling_a_finished_job_leaves_it_as_it_is(stack, dataset):
    client = stack.client
    job = wait_for_status(client, submit(client, dataset["id"], epochs=1)["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]
    events = event_codes(client, job["id"])
    artifacts = artifact_names(client, job["id"])
    assert "model.tar" in artifacts

    after = cancel(client, job["id"])
    assert after == job  # status, finished_at, progress and metrics all unchanged
    assert get(client, job["id"]) == job
    assert event_codes(client, job["id"]) == events  # no cancel_requested recorded
    assert artifact_names(client, job["id"]) == artifacts

    # A cancelled job, cancelled again, stays as it was too.
    long = submit(client, dataset["id"], **LONG)
    wait_until_training(client, long["id"])
    cancel(client, long["id"])
    cancelled = wait_for_status(client, long["id"], FINISHED)
    assert cancelled["status"] == "cancelled"
    codes = event_codes(client, long["id"])
    assert cancel(client, long["id"]) == cancelled
    assert event_codes(client, long["id"]) == codes


def test_cancelled_job_keeps_the_progress_and_metrics_of_every_step_it_trained(stack, dataset, monkeypatch):
    from shared.settings import get_settings

    # Buffer everything: only explicit flushes reach the store. Checkpoints are recorded directly,
    # so they show how far training got.
    monkeypatch.setattr(get_settings(), "metrics_flush_seconds", 3600.0)
    client = stack.client
    job = submit(client, dataset["id"], epochs=500, eval_every_steps=10**6, save_every_steps=1)
    deadline = time.monotonic() + 120
    while not client.get(f"/jobs/{job['id']}/checkpoints").json()["data"]:
        assert time.monotonic() < deadline, get(client, job["id"])
        time.sleep(0.1)
    cancel(client, job["id"])
    final = wait_for_status(client, job["id"], FINISHED, timeout=120)
    assert final["status"] == "cancelled"
    checkpoint_steps = [c["step"] for c in client.get(f"/jobs/{job['id']}/checkpoints").json()["data"]]
    losses = [m for m in client.get(f"/jobs/{job['id']}/metrics").json()["data"] if m["name"] == "train_loss"]
    assert final["progress"]["step"] >= max(checkpoint_steps) >= 1
    assert sorted(m["step"] for m in losses) == list(range(1, final["progress"]["step"] + 1))


def test_a_job_store_that_does_not_answer_for_a_while_does_not_fail_the_running_job(stack, dataset, monkeypatch):
    """The job store stops answering for a moment while a job trains (a PostgreSQL restart or
    failover: ``OperationalError``). Training goes on, its metrics buffered, and the job is the same
    attempt afterwards: no restart, every step's loss recorded once, and a cancel still heard. A
    2.8 s PostgreSQL restart failed the job (its cancel check fell in it), which then waited out
    its lease and trained again from its last checkpoint."""
    import threading

    from sqlalchemy.exc import OperationalError

    from shared.jobs import lifecycle
    from shared.settings import get_settings
    from worker.reporter import Reporter

    monkeypatch.setattr(Reporter, "CANCEL_CHECK_SECONDS", 0.05)
    monkeypatch.setattr(get_settings(), "metrics_flush_seconds", 0.05)
    down, refused = threading.Event(), {"cancel_requested": 0, "record_progress": 0}

    def unless_down(name: str):
        real = getattr(lifecycle, name)

        def call(*args, **kwargs):
            if down.is_set():
                refused[name] += 1
                raise OperationalError("SELECT", {}, ConnectionRefusedError("connection refused"))
            return real(*args, **kwargs)

        monkeypatch.setattr(lifecycle, name, call)

    for name in refused:
        unless_down(name)
    client = stack.client
    job = submit(client, dataset["id"], **LONG)
    wait_until_training(client, job["id"])
    down.set()
    deadline = time.monotonic() + 60
    while min(refused.values()) < 3:
        assert time.monotonic() < deadline, refused
        time.sleep(0.05)
    down.clear()
    step_after_outage = get(client, job["id"])["progress"]["step"]
    deadline = time.monotonic() + 60
    while get(client, job["id"])["progress"]["step"] <= step_after_outage:  # written again, going on
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancel(client, job["id"])
    final = assert_cancelled_mid_training(client, job["id"])
    assert final["attempts"] == 1 and "job_restarted" not in event_codes(client, job["id"])
    losses = [m["step"] for m in client.get(f"/jobs/{job['id']}/metrics").json()["data"] if m["name"] == "train_loss"]
    assert sorted(losses) == list(range(1, final["progress"]["step"] + 1))


def test_a_first_write_that_fails_is_not_tried_again_at_every_step(monkeypatch):
    """The first step's metrics are written at once; when the store does not answer then, the
    write waits for the next flush (``metrics_flush_seconds``), not the next step: each try can
    wait out SQLite's busy timeout or a connect timeout."""
    from sqlalchemy.exc import OperationalError

    from shared.jobs import lifecycle
    from shared.settings import get_settings
    from worker.reporter import Reporter

    monkeypatch.setattr(get_settings(), "metrics_flush_seconds", 3600.0)
    tries = []

    def down(*_):
        tries.append(1)
        raise OperationalError("UPDATE", {}, ConnectionRefusedError("connection refused"))

    monkeypatch.setattr(lifecycle, "record_progress", down)
    reporter = Reporter("job_down", "worker-1")
    for step in range(1, 101):
        reporter.log(step, 0.0, {"train_loss": 1.0})
        reporter.progress(step=step)
    assert len(tries) == 1


def test_events_checkpoints_and_pruning_go_on_while_the_store_does_not_answer(engine_env, monkeypatch, tmp_path):
    """The other writes of training, in a store outage: an event waits for the next write, with the
    time it happened; a checkpoint goes unrecorded and its files are deleted (no row points at
    them); a trial is not pruned then. Each raised ``OperationalError`` and failed the attempt (a
    checkpoint falling in a PostgreSQL restart), which then waited out its lease."""
    from sqlalchemy.exc import OperationalError

    from shared.jobs import lifecycle, sweeps
    from shared.store import objects
    from shared.store.engine import upgrade_database
    from worker.reporter import Reporter
    from worker.training.state import record_checkpoint

    upgrade_database()
    down, written, recorded = [True], [], []

    def unless_down(real):
        def call(*args, **kwargs):
            if down[0]:
                raise OperationalError("INSERT", {}, ConnectionRefusedError("connection refused"))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(lifecycle, "record_progress", unless_down(lambda *a: True))
    monkeypatch.setattr(lifecycle, "add_event", unless_down(lambda *a: written.append(a[1])))
    monkeypatch.setattr(lifecycle, "record_checkpoint", unless_down(lambda *a: recorded.append(a[1]) or []))
    monkeypatch.setattr(sweeps, "should_prune", unless_down(lambda *a: True))
    reporter = Reporter("job_outage", "worker-1", trial=True)

    reporter.event("out_of_memory", "halved the micro-batch")
    assert written == []  # kept
    path = tmp_path / "step-00000010"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"x" * 10)
    record_checkpoint(reporter, 10, path, None, keep=2)
    assert recorded == [] and not path.exists()  # not recorded: its files gone
    assert reporter.should_prune(10, {"accuracy": 0.1}) is False

    down[0] = False
    later = tmp_path / "step-00000020"
    later.mkdir()
    (later / "model.safetensors").write_bytes(b"x" * 10)
    record_checkpoint(reporter, 20, later, None, keep=2)
    assert recorded == [20] and objects.store().files(str(later))
    assert written == ["out_of_memory"]  # written first
    assert reporter.should_prune(20, {"accuracy": 0.1}) is True

    # an attempt that ends in a failure writes what an outage held back (its cause may be there)
    down[0] = True
    reporter.event("out_of_memory", "a micro-batch of 1 does not fit")
    down[0] = False
    reporter.write_pending()
    assert written[-1] == "out_of_memory"


def test_a_store_that_answers_reads_but_takes_no_write_is_one_outage(monkeypatch, caplog):
    """SQLite on a full disk answers the cancel check's reads and refuses every write: the log said
    "fails" and "works again" by turns (36 lines in two minutes); one outage now, ended
    by the first write that gets through."""
    from sqlalchemy.exc import OperationalError

    from shared.jobs import lifecycle
    from shared.settings import get_settings
    from worker.reporter import Reporter

    full = [True]

    def record_progress(*_):
        if full[0]:
            raise OperationalError("UPDATE", {}, Exception("database or disk is full"))
        return True

    monkeypatch.setattr(lifecycle, "record_progress", record_progress)
    monkeypatch.setattr(lifecycle, "cancel_requested", lambda _: False)
    monkeypatch.setattr(Reporter, "CANCEL_CHECK_SECONDS", 0.0)
    monkeypatch.setattr(get_settings(), "metrics_flush_seconds", 0.0)
    reporter = Reporter("job_full", "worker-1")
    with caplog.at_level("WARNING", logger="worker.reporter"):
        for step in range(1, 21):
            reporter.log(step, 0.0, {"train_loss": 1.0})
            reporter.progress(step=step)
            assert reporter.should_stop() is None
            if step == 15:
                full[0] = False
    said = [r.getMessage().split(" (")[0].split(",")[0] for r in caplog.records]
    assert said == ["the job store fails", "the job store works again"], said


def test_a_job_cancelled_while_it_tokenizes_stops_there(stack, monkeypatch):
    """Tokenizing a large training set takes minutes (1.35 million rows: two); a cancel (or a
    SIGTERM) is heard between its batches, not at the first optimizer step after it."""
    from worker import data
    from worker.reporter import Reporter

    asked = []
    monkeypatch.setattr(data, "TOKENIZE_BATCH", 8)  # 48 rows: several batches
    monkeypatch.setattr(
        Reporter, "interrupted", lambda self: asked.append(1) or ("cancelled" if len(asked) > 2 else None)
    )
    tokenized = []
    real = data.Ragged.of
    monkeypatch.setattr(data.Ragged, "of", staticmethod(lambda rows: tokenized.append(len(rows)) or real(rows)))
    fresh = upload(stack.client, labelled_csv(rows=48, seed=11))  # texts no other test tokenized: no cache hit
    job = submit(stack.client, fresh["id"], **LONG)
    final = wait_for_status(stack.client, job["id"], FINISHED, timeout=120)
    assert final["status"] == "cancelled" and final["progress"]["step"] == 0, final
    assert "model.tar" not in artifact_names(stack.client, job["id"])
    assert len(asked) == 3 and len(tokenized) == 2 * 3  # two batches of its three inputs, then it stopped
