"""Fault tests with real processes: the API (``python -m tunejob api``) and Celery workers
(``python -m tunejob worker``) run as subprocesses, and the tests kill, signal and restart them
(and Redis) while jobs train. What they check is the job lifecycle of ``shared.jobs``:

1. ``kill -9`` of a worker mid-training: the lease expires, the reaper re-queues (``job_restarted``),
   a new worker resumes from the checkpoint; each step's metrics exist exactly once.
2. A job longer than Redis' visibility timeout: kombu redelivers its message to the idle worker,
   whose claim is a no-op.
3. 20 jobs at once on 2 workers, while the recovery loop re-sends the message of every waiting job: each
   runs once.
4. Redis restarted mid-job: the job finishes once; a job submitted while Redis is down runs later.
5. SIGTERM mid-job: the worker checkpoints, re-queues (``requeued``) and exits; another resumes.
6. Cancel a queued job (it never starts) and a running one (the worker takes the next job).
7. The same task message delivered twice: the job runs once.
8. The API and a worker writing one SQLite store hard at once: no 500, no "database is locked".

Tests on the ``postgres+redis`` stack skip when PostgreSQL/Redis are not reachable, unless
``TUNEJOB_REQUIRE_SERVICES=1`` (see ``tests/conftest.py``); they use a fresh PostgreSQL database
and a private ``redis-server`` (or, without the binary, the shared test Redis). Every process logs
to a file under the test's ``tmp_path``; a failing test prints the tails of all of them.
"""

import random
import re
import signal
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    REQUIRE_SERVICES,
    fresh_postgres_database,
    redis_broker_env,
    require_services,
)
from tests.faults_support import FINISHED, Cluster, Process, RedisServer
from tests.test_api_jobs import labelled_csv

STACKS = ["embedded", "postgres+redis"]
# Short lifecycle timings: a dead worker's lease expires after 4 s, and API and workers run the
# recovery loop every second.
FAST = {
    "TUNEJOB_DEVICE": "cpu",
    "TUNEJOB_LEASE_SECONDS": "4",
    "TUNEJOB_RECOVERY_SECONDS": "1",
    "TUNEJOB_METRICS_FLUSH_SECONDS": "0.2",
}
# 44 training rows (48 less the 10% validation split) in micro-batches of 4: 11 optimizer steps an
# epoch. The tiny model trains 30-100 steps a second on one CPU core, so LONG (231 steps) lasts a
# few seconds; an evaluation every epoch and frequent checkpoints slow it down.
LONG = {"epochs": 20, "batch_size": 4}
TINY = {"epochs": 1, "batch_size": 8}


# ----------------------------------------------------------------------------- fixtures


def require_redis_server() -> None:
    if RedisServer.available():
        return
    reason = "redis-server is not installed"
    if REQUIRE_SERVICES:
        pytest.fail(f"{reason}, and TUNEJOB_REQUIRE_SERVICES=1 makes these tests mandatory")
    pytest.skip(reason)


class Stacks:
    """Builds the test's stacks and tears all of them down: every process is killed."""

    def __init__(self, tmp_path: Path, models_dir: Path):
        self.tmp_path, self.models_dir = tmp_path, models_dir
        self.clusters: list[Cluster] = []
        self.redis_servers: list[RedisServer] = []
        self.cleanups: list = []

    def redis(self, appendonly: bool = False) -> RedisServer:
        """A private redis-server, started."""
        require_redis_server()
        server = RedisServer(self.tmp_path / f"redis-{len(self.redis_servers) + 1}", appendonly=appendonly)
        self.redis_servers.append(server)
        server.start()
        return server

    def make(self, kind: str, redis: RedisServer | None = None, **env: str) -> Cluster:
        """A stack's environment: ``embedded`` (SQLite and the filesystem broker under the data
        directory) or ``postgres+redis``; ``env`` adds or overrides ``TUNEJOB_*`` variables."""
        n = len(self.clusters) + 1
        base = {
            **FAST,
            "TUNEJOB_DATA_DIR": str(self.tmp_path / f"data-{n}"),
            "TUNEJOB_MODELS_DIR": str(self.models_dir),
        }
        if kind == "postgres+redis":
            require_services()
            database_url, drop = fresh_postgres_database()
            self.cleanups.append(drop)
            base.update(TUNEJOB_DATABASE_URL=database_url, **self.broker_env(redis))
        else:
            assert kind == "embedded" and redis is None, kind
        cluster = Cluster(kind, self.tmp_path / f"stack-{n}", {**base, **env})
        cluster.extra_logs.append(lambda: "\n".join(s.process.tail() for s in self.redis_servers if s.process))
        self.clusters.append(cluster)
        return cluster

    def broker_env(self, redis: RedisServer | None) -> dict[str, str]:
        if redis is not None:
            return {"TUNEJOB_BROKER_URL": redis.url()}
        if RedisServer.available():
            return {"TUNEJOB_BROKER_URL": self.redis().url()}
        return redis_broker_env()

    def close(self, failed: bool) -> None:
        for cluster in self.clusters:
            cluster.close()
        if failed:
            for cluster in self.clusters:
                print(cluster.diagnostics(lines=150))
        for server in self.redis_servers:
            server.stop()
        for cleanup in reversed(self.cleanups):
            cleanup()


@pytest.fixture
def stacks(request, tmp_path, models_dir):
    failures = request.session.testsfailed
    made = Stacks(tmp_path, models_dir)
    try:
        yield made
    finally:
        # The call phase's report is counted by the time teardown runs.
        made.close(failed=request.session.testsfailed > failures)


# ----------------------------------------------------------------------------- helpers


def parse_time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def train_loss_steps(cluster: Cluster, job_id: str) -> list[int]:
    return sorted(m["step"] for m in cluster.metrics(job_id, "train_loss"))


def assert_steps_once(cluster: Cluster, job: dict) -> None:
    """``train_loss`` was recorded exactly once for every step 1..total_steps."""
    steps, total = train_loss_steps(cluster, job["id"]), job["progress"]["total_steps"]
    duplicated = sorted(s for s, n in Counter(steps).items() if n > 1)
    missing = sorted(set(range(1, total + 1)) - set(steps))
    assert steps == list(range(1, total + 1)), (
        f"train_loss steps are not 1..{total} exactly once: duplicated {duplicated}, missing {missing}"
    )


def resumed_step(cluster: Cluster, job_id: str) -> int:
    messages = [e["message"] for e in cluster.events(job_id) if e["code"] == "resumed"]
    assert len(messages) == 1, messages
    match = re.search(r"step (\d+)", messages[0])
    assert match, messages[0]
    return int(match.group(1))


def assert_ran_once(cluster: Cluster, job: dict) -> None:
    codes = cluster.codes(job["id"])
    assert job["status"] == "succeeded", (job, codes)
    assert job["attempts"] == 1, (job["attempts"], codes)
    assert codes.count("started") == 1, codes
    assert codes == ["created", "started", "precision", "tokenized", "timings", "succeeded"], codes


def assert_never_twice_at_once(codes: list[str]) -> None:
    """Between two ``started`` events the job went back to the queue (a worker can only claim a
    queued job, or one whose holder's lease expired and that the reaper re-queued)."""
    since_start = None
    for code in codes:
        if code == "started":
            assert since_start in (None, "requeued", "job_restarted"), f"started twice without a requeue: {codes}"
            since_start = "started"
        elif code in ("requeued", "job_restarted"):
            since_start = code


def results(worker: Process) -> list[str]:
    """What ``run_job`` returned for each task message the worker handled, in order (Celery logs
    it): "succeeded", "cancelled", "shutdown", ... or "skipped" for a no-op."""
    return re.findall(
        r"Task tunejob\.run_job\[[^\]]*\] succeeded in [0-9.e-]+s: '(\w+)'", worker.log.read_text(errors="replace")
    )


def received(worker: Process) -> int:
    """Task messages the worker has received."""
    return len(re.findall(r"Task tunejob\.run_job\[[^\]]*\] received", worker.log.read_text(errors="replace")))


def skipped_messages(*workers: Process) -> int:
    return sum(results(w).count("skipped") for w in workers)


def wait_exit(cluster: Cluster, process: Process, timeout: float) -> int:
    code = process.wait(timeout)
    assert code is not None, f"{process.name} still running {timeout}s after the signal\n{cluster.diagnostics()}"
    return code


# ----------------------------------------------------------------------------- 1. kill -9


@pytest.mark.parametrize("kind", STACKS)
def test_kill_9_mid_training_resumes_once_from_checkpoint(stacks, kind):
    # Metrics (and progress) written every 50 ms, checkpoints every 20 steps: the test sees the
    # job between two checkpoints, with metrics past the last one in the store.
    c = stacks.make(kind, TUNEJOB_METRICS_FLUSH_SECONDS="0.05")
    [first] = c.start(workers=1)
    dataset = c.upload(labelled_csv(rows=48))
    job_id = c.submit(dataset["id"], **LONG, save_every_steps=20)["id"]

    def past_a_checkpoint(job: dict) -> bool:
        """A checkpoint exists and the store holds metrics of a few steps after it."""
        checkpoints = c.checkpoints(job_id)
        return bool(checkpoints) and 3 <= job["progress"]["step"] - checkpoints[-1]["step"] <= 12

    c.wait_step(job_id, past_a_checkpoint, "3-12 steps past a checkpoint", timeout=120, interval=0.01)
    first.signal(signal.SIGKILL)
    assert wait_exit(c, first, 10) == -signal.SIGKILL
    killed_at = datetime.now(UTC)

    # What the dead worker left: metrics up to some step m past the checkpoint k, which the next
    # attempt must drop and train again.
    checkpoint = c.checkpoints(job_id)[-1]["step"]
    before = train_loss_steps(c, job_id)
    assert before == list(range(1, before[-1] + 1)) and before[-1] > checkpoint, (checkpoint, before)

    c.start_worker()
    job = c.wait_finished(job_id, timeout=150)
    codes = c.codes(job_id)
    assert job["status"] == "succeeded", (job, codes)
    assert job["attempts"] == 2, (job["attempts"], codes)
    # The lease expired and the reaper re-queued it; exactly one success.
    assert codes == [
        "created",
        "started",
        "precision",
        "tokenized",
        "job_restarted",
        "started",
        "precision",
        "tokenized",
        "resumed",
        "timings",
        "succeeded",
    ], codes
    assert resumed_step(c, job_id) == checkpoint
    assert_steps_once(c, job)

    # No step up to the checkpoint was trained twice: those rows are the first attempt's.
    resumed_at = parse_time(next(e["time"] for e in c.events(job_id) if e["code"] == "resumed"))
    assert resumed_at > killed_at
    for m in c.metrics(job_id, "train_loss"):
        if m["step"] <= checkpoint:
            assert parse_time(m["time"]) < killed_at, m
        else:
            assert parse_time(m["time"]) >= resumed_at, m


def test_kill_9_just_after_a_checkpoint_loses_no_metrics(stacks):
    """As test 1, but the worker dies right after its first checkpoint is recorded, with the
    default metrics flush interval (2 s)."""
    c = stacks.make("embedded", TUNEJOB_METRICS_FLUSH_SECONDS="2")
    [first] = c.start(workers=1)
    dataset = c.upload(labelled_csv(rows=48))
    job_id = c.submit(dataset["id"], **LONG, save_every_steps=10)["id"]
    c.wait_for("the first checkpoint", lambda: c.checkpoints(job_id), timeout=120, interval=0.01)
    first.signal(signal.SIGKILL)
    assert wait_exit(c, first, 10) == -signal.SIGKILL
    checkpoint = c.checkpoints(job_id)[-1]["step"]
    before = train_loss_steps(c, job_id)
    # A recorded checkpoint is one the next attempt resumes after: the steps up to it must have
    # their metrics in the store by then.
    assert before[:checkpoint] == list(range(1, checkpoint + 1)), (checkpoint, before)

    c.start_worker()
    job = c.wait_finished(job_id, timeout=150)
    assert job["status"] == "succeeded" and job["attempts"] == 2, job
    assert resumed_step(c, job_id) == checkpoint
    assert_steps_once(c, job)


# ----------------------------------------------------------------------------- 2. visibility timeout


def test_job_longer_than_visibility_timeout_runs_once(stacks):
    """kombu redelivers a message unacknowledged for ``visibility_timeout`` seconds. The second
    worker starts once the running job's message is older than that: its first poll restores the
    message (kombu scans at a worker's start; later scans are ~100 s apart) and receives it. The
    job trains until the test cancels it, after the second worker has handled the redelivered
    message, so nothing depends on how long training or a worker's start takes on a busy machine."""
    c = stacks.make("postgres+redis", TUNEJOB_VISIBILITY_TIMEOUT="3")
    [first] = c.start(workers=1)
    dataset = c.upload(labelled_csv(rows=48))
    job_id = c.submit(dataset["id"], epochs=1000, batch_size=4)["id"]  # 10,000 steps: runs until cancelled
    started = c.wait_step(job_id, lambda j: j["progress"]["step"] >= 1, "training", timeout=90)
    time.sleep(max(0.0, 4 - (datetime.now(UTC) - parse_time(started["started_at"])).total_seconds()))

    second = c.start_worker()
    c.wait_for("the second worker to skip the redelivered message", lambda: results(second) == ["skipped"], timeout=120)
    assert c.job(job_id)["status"] == "running"  # redelivered and skipped while the first worker trains it

    c.cancel(job_id)
    job = c.wait_finished(job_id, timeout=120)
    codes = c.codes(job_id)
    assert job["status"] == "cancelled" and job["attempts"] == 1 and codes.count("started") == 1, (job, codes)
    c.wait_for("the first worker to be done with the message", lambda: results(first), timeout=30)
    assert results(first) == ["cancelled"] and results(second) == ["skipped"], (results(first), results(second))


# ----------------------------------------------------------------------------- 3. many jobs


@pytest.mark.parametrize("kind", STACKS)
def test_twenty_jobs_on_two_workers_each_run_once(stacks, kind):
    """Jobs wait up to tens of seconds in the queue; with ``TUNEJOB_RESEND_AFTER_SECONDS=2`` the
    recovery loops of the API and both workers re-send every waiting job's message (as they do for a
    broker that lost one), so the workers also receive many duplicates, which must be no-ops."""
    c = stacks.make(kind, TUNEJOB_RESEND_AFTER_SECONDS="2")
    workers = c.start(workers=2)
    dataset = c.upload(labelled_csv(rows=16, seed=1))
    job_ids = [c.submit(dataset["id"], **TINY)["id"] for _ in range(20)]

    c.wait_for(
        "all 20 jobs to finish", lambda: all(c.job(j)["status"] in FINISHED for j in job_ids), timeout=240, interval=1
    )
    for job_id in job_ids:
        assert_ran_once(c, c.job(job_id))
    # The re-sent messages queue behind the originals, so when the last two jobs end together none
    # may have been taken yet: wait for the workers to take one (each is a no-op) rather than
    # counting at the moment the last job ended.
    c.wait_for("a duplicate message to be skipped", lambda: skipped_messages(*workers) > 0, timeout=60)
    for job_id in job_ids:
        assert_ran_once(c, c.job(job_id))  # and the duplicates ran nothing
    assert all(w.alive() for w in workers)


# ----------------------------------------------------------------------------- 4. Redis restart


def test_redis_restart_mid_job(stacks):
    """Redis (append-only, so queued messages survive) is stopped for a few seconds and started
    again on the same port while a job trains. The job ends succeeded, having run once at a time;
    a job submitted while Redis is down is accepted, stays queued, and the recovery loop sends it later."""
    redis = stacks.redis(appendonly=True)
    c = stacks.make("postgres+redis", redis=redis)
    [worker] = c.start(workers=1)
    dataset = c.upload(labelled_csv(rows=48))
    running_id = c.submit(dataset["id"], epochs=40, batch_size=4, save_every_steps=10)["id"]
    c.wait_step(running_id, lambda j: j["progress"]["step"] >= 20, "step 20", timeout=90)

    redis.stop()
    waiting = c.submit(dataset["id"], **TINY)  # the API cannot send it
    assert waiting["status"] == "queued"
    time.sleep(1)
    assert c.job(running_id)["status"] == "running"
    redis.start()

    for job_id in (running_id, waiting["id"]):
        job = c.wait_finished(job_id, timeout=150)
        codes = c.codes(job_id)
        assert job["status"] == "succeeded", (job, codes)
        assert codes.count("started") == job["attempts"] >= 1, codes
        assert_never_twice_at_once(codes)
        assert_steps_once(c, job)
    assert worker.alive()


# ----------------------------------------------------------------------------- 5. SIGTERM


@pytest.mark.parametrize("kind", STACKS)
def test_sigterm_checkpoints_requeues_and_resumes(stacks, kind):
    # No periodic checkpoints: the only one is the one the worker saves on SIGTERM.
    c = stacks.make(kind)
    [first] = c.start(workers=1)
    dataset = c.upload(labelled_csv(rows=48))
    job_id = c.submit(dataset["id"], epochs=30, batch_size=4, save_every_steps=10**6)["id"]
    c.wait_step(job_id, lambda j: j["progress"]["step"] >= 30, "step 30", timeout=120)

    first.signal(signal.SIGTERM)
    assert wait_exit(c, first, 60) == 0
    job = c.job(job_id)
    codes = c.codes(job_id)
    assert job["status"] == "queued" and codes == ["created", "started", "precision", "tokenized", "requeued"], (
        job,
        codes,
    )
    checkpoints = [cp["step"] for cp in c.checkpoints(job_id)]
    assert len(checkpoints) == 1 and 30 <= checkpoints[0] < job["progress"]["total_steps"], checkpoints
    stopped_at = checkpoints[0]
    assert job["progress"]["step"] == stopped_at  # the checkpoint is where it stopped

    c.start_worker()
    job = c.wait_finished(job_id, timeout=150)
    codes = c.codes(job_id)
    assert job["status"] == "succeeded" and job["attempts"] == 2, (job, codes)
    assert codes == [
        "created",
        "started",
        "precision",
        "tokenized",
        "requeued",
        "started",
        "precision",
        "tokenized",
        "resumed",
        "timings",
        "succeeded",
    ], codes
    assert resumed_step(c, job_id) == stopped_at
    assert_steps_once(c, job)


# ----------------------------------------------------------------------------- 6. cancel


@pytest.mark.parametrize("kind", STACKS)
def test_cancel_queued_and_running_jobs(stacks, kind):
    c = stacks.make(kind)
    c.start(workers=0)
    dataset = c.upload(labelled_csv(rows=48))

    # No worker at all: the job stays queued; cancelled, it never starts once a worker comes.
    queued_id = c.submit(dataset["id"], **TINY)["id"]
    time.sleep(2)  # sweeps by the API's recovery loop
    assert c.job(queued_id)["status"] == "queued"
    cancelled = c.cancel(queued_id)
    assert cancelled["status"] == "cancelled" and cancelled["started_at"] is None

    worker = c.start_worker()
    running_id = c.submit(dataset["id"], epochs=500, batch_size=4, eval_every_steps=10**6, save_every_steps=10**6)[
        "id"
    ]  # queued behind the cancelled job's message
    c.wait_step(running_id, lambda j: j["progress"]["step"] >= 5, "step 5", timeout=120)
    job = c.job(queued_id)  # its message came first, and was a no-op
    assert job["status"] == "cancelled" and job["started_at"] is None and job["attempts"] == 0, job
    assert results(worker) == ["skipped"], results(worker)
    c.cancel(running_id)
    job = c.wait_finished(running_id, timeout=60)
    assert job["status"] == "cancelled", job
    assert 1 <= job["progress"]["step"] < job["progress"]["total_steps"]
    codes = c.codes(running_id)
    assert codes == ["created", "started", "precision", "tokenized", "cancel_requested", "timings", "cancelled"], codes

    # The worker lives on and takes the next job.
    next_job = c.wait_finished(c.submit(dataset["id"], **TINY)["id"], timeout=90)
    assert_ran_once(c, next_job)
    assert worker.alive()

    job = c.job(queued_id)
    assert job["status"] == "cancelled" and job["started_at"] is None and job["attempts"] == 0, job
    assert c.codes(queued_id) == ["created", "cancelled"]


# ----------------------------------------------------------------------------- 7. duplicate message


@pytest.mark.parametrize("kind", STACKS)
def test_duplicate_message_runs_job_once(stacks, kind):
    c = stacks.make(kind)
    c.start(workers=0)
    dataset = c.upload(labelled_csv(rows=48))
    job_id = c.submit(dataset["id"], epochs=3, batch_size=4)["id"]
    # The same task message again, sent as the API sends it.
    c.python(f"from shared.queue import send; send({job_id!r})")

    worker = c.start_worker()
    c.wait_for("the worker to handle both messages", lambda: len(results(worker)) >= 2, timeout=120)
    job = c.job(job_id)
    assert_ran_once(c, job)
    assert results(worker) == ["succeeded", "skipped"], results(worker)
    assert_steps_once(c, job)


# ----------------------------------------------------------------------------- 8. SQLite under load


def test_api_and_worker_hammer_one_sqlite_store(stacks):
    """A job writes metrics at every optimizer step while four clients upload, submit, cancel and
    read for 15 s. Every response is the expected 2xx/4xx and nobody sees "database is locked"."""
    # The store is what is hammered here, not the quota of active jobs (tests/test_auth.py checks it).
    c = stacks.make("embedded", TUNEJOB_METRICS_FLUSH_SECONDS="0", TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT="100000")
    [worker] = c.start(workers=1)
    dataset = c.upload(labelled_csv(rows=48))
    training_id = c.submit(dataset["id"], epochs=500, batch_size=4, save_every_steps=25)["id"]
    c.wait_step(training_id, lambda j: j["progress"]["step"] >= 1, "training", timeout=120)

    unexpected: list[str] = []
    counts: Counter = Counter()
    stop = time.monotonic() + 15
    csv = labelled_csv(rows=16, seed=7)

    def client(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[str] = []
        http = httpx.Client(base_url=c.http.base_url, headers=c.http.headers, timeout=60)

        def check(op: str, r, expected: set[int]) -> None:
            counts[op] += 1
            if r.status_code not in expected:
                unexpected.append(f"{op}: {r.status_code} {r.text[:300]}")

        body = {"base_model": "tiny-bert", "training_dataset": dataset["id"], "hyperparameters": TINY}
        while time.monotonic() < stop:
            op = rng.choice(["upload", "submit", "submit", "cancel", "get", "list", "metrics", "events", "bad"])
            try:
                if op == "upload":
                    check(op, http.post("/datasets", files={"file": ("t.csv", csv, "text/csv")}), {201})
                elif op == "submit":
                    r = http.post("/jobs", json=body)
                    check(op, r, {201})
                    if r.status_code == 201:
                        mine.append(r.json()["id"])
                elif op == "cancel" and mine:
                    check(op, http.post(f"/jobs/{mine.pop(rng.randrange(len(mine)))}/cancel"), {200})
                elif op == "get":
                    check(op, http.get(f"/jobs/{training_id}"), {200})
                elif op == "list":
                    check(op, http.get("/jobs", params={"limit": 50}), {200})
                elif op == "metrics":
                    check(op, http.get(f"/jobs/{training_id}/metrics", params={"limit": 500}), {200})
                elif op == "events":
                    check(op, http.get(f"/jobs/{training_id}/events"), {200})
                elif op == "bad":
                    check(op, http.post("/jobs", json={**body, "training_dataset": "ds_missing"}), {400, 404, 422})
                    check(op, http.get("/jobs/job_missing"), {404})
            except Exception as e:  # a dropped connection or a timeout is a failure too
                unexpected.append(f"{op}: {type(e).__name__}: {e}")
        for job_id in mine:
            try:
                check("cancel", http.post(f"/jobs/{job_id}/cancel"), {200})
            except Exception as e:
                unexpected.append(f"cancel: {type(e).__name__}: {e}")
        http.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client thread hung"

    assert c.job(training_id)["status"] == "running"
    c.cancel(training_id)
    assert c.wait_finished(training_id, timeout=60)["status"] == "cancelled"
    assert not unexpected, unexpected[:20]
    assert counts["submit"] > 10 and counts["upload"] > 5 and counts["cancel"] > 5, counts
    for process in (c.api, worker):
        assert "database is locked" not in process.log.read_text(errors="replace"), process.tail()
