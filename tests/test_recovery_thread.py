"""The recovery loop lives exactly as long as the API or worker that runs it.

The in-process worker of the API tests (``celery.contrib.testing.worker.start_worker``) stops with
a cold shutdown, which sends no ``worker_shutdown`` signal. Its recovery loop used to be started by
a ``worker_init`` handler and stopped only by that signal, so every test module left one behind,
polling the store of whatever test ran next (a migration test's SQLite file included)."""

import threading

from celery.contrib.testing.worker import start_worker
from fastapi.testclient import TestClient

from tests.conftest import BASE_URL, configure_stack


def recovery_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "tunejob-recover" and t.is_alive()}


def test_a_workers_recovery_loop_stops_with_the_worker(tmp_path, models_dir):
    configure_stack("embedded", {"TUNEJOB_DATA_DIR": str(tmp_path), "TUNEJOB_MODELS_DIR": str(models_dir)})
    from worker.tasks import app

    before = recovery_threads()
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING", shutdown_timeout=60):
        assert len(recovery_threads() - before) == 1
    assert recovery_threads() == before


def test_the_apis_recovery_loop_stops_with_the_app(tmp_path, models_dir):
    configure_stack("embedded", {"TUNEJOB_DATA_DIR": str(tmp_path), "TUNEJOB_MODELS_DIR": str(models_dir)})
    from api.main import create_app

    before = recovery_threads()
    with TestClient(create_app(), base_url=BASE_URL):
        assert len(recovery_threads() - before) == 1
    assert recovery_threads() == before


def test_the_recovery_period_is_read_under_its_former_name_too(monkeypatch):
    """``TUNEJOB_RECOVERY_SECONDS`` was ``TUNEJOB_SWEEP_SECONDS`` before sweeps meant hyperparameter
    sweeps: a deployment that sets the old name keeps its period; the new name wins over it."""
    from shared.settings import Settings

    monkeypatch.delenv("TUNEJOB_RECOVERY_SECONDS", raising=False)
    monkeypatch.setenv("TUNEJOB_SWEEP_SECONDS", "3")
    assert Settings().recovery_seconds == 3
    monkeypatch.setenv("TUNEJOB_RECOVERY_SECONDS", "4")
    assert Settings().recovery_seconds == 4


def test_a_job_whose_lease_expired_is_sent_again_at_once(tmp_path, models_dir):
    """A worker killed mid-job: the recovery loop re-queued its job, then left the message to its
    next round but one (the grace for jobs never sent: ``updated_at`` had just changed), so the job
    waited 15-30 s more on an idle worker. ``recover`` returns what it re-queued, to send now."""
    from shared.jobs import lifecycle
    from shared.store.engine import session_scope
    from shared.store.rows import Job, JobStatus

    job = dead_workers_job(tmp_path, models_dir)
    assert lifecycle.recover() == [job.id]
    with session_scope() as s:
        assert s.get(Job, job.id).status == JobStatus.QUEUED
    lifecycle.mark_enqueued(job.id)
    assert lifecycle.recover() == []  # sent: not again until resend_after_seconds


def test_a_job_cancelled_while_its_worker_was_dead_ends_cancelled_not_requeued(tmp_path, models_dir):
    """A worker killed, its running job then cancelled: at its lease's end the job was re-queued,
    resumed and trained on by another worker (or failed ``too_many_restarts`` once out of them)."""
    from shared.jobs import lifecycle
    from shared.store.engine import session_scope
    from shared.store.rows import Job, JobEvent, JobStatus

    job = dead_workers_job(tmp_path, models_dir, cancel_requested=True, eta_seconds=12.5)
    assert lifecycle.recover() == []
    with session_scope() as s:
        ended = s.get(Job, job.id)
        assert (ended.status, ended.restarts, ended.finished_at is not None) == (JobStatus.CANCELLED, 0, True)
        said = [(e.code, e.message) for e in s.query(JobEvent).filter_by(job_id=job.id)]
        assert ended.eta_seconds is None
    assert [code for code, _ in said] == ["cancelled"] and "resum" not in said[0][1], said


def dead_workers_job(tmp_path, models_dir, **fields):
    """A running job whose worker's lease expired a second ago, in a fresh embedded store."""
    from datetime import timedelta

    configure_stack("embedded", {"TUNEJOB_DATA_DIR": str(tmp_path), "TUNEJOB_MODELS_DIR": str(models_dir)})
    from shared.store.engine import session_scope, upgrade_database
    from shared.store.rows import Dataset, Job, JobStatus, new_id, utcnow

    upgrade_database()
    now = utcnow()
    dataset = Dataset(filename="d.csv", format="csv", path="uploads/d.csv", rows=1, columns=[], bytes=1, sha256="0")
    job = Job(
        id=new_id("job"),
        tenant="t",
        base_model="tiny-bert",
        task="classification",
        spec={},
        status=JobStatus.RUNNING,
        created_at=now - timedelta(minutes=5),
        enqueued_at=now - timedelta(minutes=5),
        lease_owner="vm:1:dead",
        lease_expires_at=now - timedelta(seconds=1),
        **fields,
    )
    with session_scope() as s:
        s.add(dataset)
        s.flush()
        job.training_dataset_id = dataset.id
        s.add(job)
    return job


def test_a_chore_that_keeps_failing_logs_its_traceback_once_and_says_when_it_runs_again(caplog):
    """A store outage made the API's webhook loop (every second) log a traceback a second; now one
    per failure, another when it fails otherwise, and a line when the chore runs again."""
    from shared.queue import recovery_loop

    outcomes = [
        OSError("connection refused\nDETAIL: the server is restarting"),
        OSError("connection refused"),
        OSError("connection refused"),
        OSError("the disk is full"),
        None,
        OSError("connection refused"),
    ]

    def deliver_due() -> None:
        if outcome := outcomes.pop(0):
            raise outcome

    class Turns:
        """The loop's stop event: it ends the loop once every outcome was used."""

        def wait(self, seconds: float) -> bool:
            return not outcomes

    with caplog.at_level("WARNING", logger="shared.queue"):
        recovery_loop(Turns(), (deliver_due,), lambda: 0.0)  # type: ignore[arg-type]
    lines = [(r.levelname, r.getMessage().split(";")[0].split(",")[0], r.exc_info is not None) for r in caplog.records]
    assert lines == [
        ("ERROR", "deliver_due fails (connection refused)", True),  # once for three turns
        ("ERROR", "deliver_due fails (the disk is full)", True),
        ("WARNING", "deliver_due works again", False),
        ("ERROR", "deliver_due fails (connection refused)", True),  # failing again after it ran
    ], lines
