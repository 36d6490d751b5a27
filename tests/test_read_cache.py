"""The polling routes' read cache (``api.db.cached``, ``shared.store.cache.JOBS``): a poll of an
unchanged job reads nothing from the store, a change committed by another process is seen (on
PostgreSQL once its trigger's notification arrives), and this process's own writes at once; on
every stack.

The job is written to the store directly with a lease held elsewhere, so that the stack's worker
leaves it as the test puts it."""

import subprocess
import sys
from datetime import timedelta

import pytest
from sqlalchemy import update

from shared.settings import get_settings
from shared.store.engine import session_scope
from shared.store.rows import Job, JobMetric, JobStatus, utcnow
from tests.conftest import wait_until
from tests.test_api_errors import assert_error
from tests.test_api_jobs import labelled_csv, upload
from tests.test_queue_position import add_job


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The store reads the two polling routes make: ``find_job`` (the job's row) and ``_metrics``."""
    import api.db
    import api.routers.jobs

    made = []
    for module, name in ((api.db, "find_job"), (api.routers.jobs, "_metrics")):

        def counted(*args, read=getattr(module, name), name=name):  # noqa: B008 (bound now)
            made.append(name)
            return read(*args)

        monkeypatch.setattr(module, name, counted)
    return made


def in_another_process(sql: str) -> None:
    """Run ``sql`` in a transaction of a new Python process (SQLAlchemy core, no ORM session)."""
    script = (
        "import sys; from sqlalchemy import create_engine, text\n"
        "with create_engine(sys.argv[1]).begin() as c: c.execute(text(sys.argv[2]))"
    )
    subprocess.run([sys.executable, "-c", script, get_settings().sqlalchemy_url, sql], check=True)


def test_polls_read_nothing_until_the_job_or_its_metrics_change(stack, reads):
    client = stack.client
    job_id = add_job(
        stack,
        upload(client, labelled_csv())["id"],
        JobStatus.RUNNING,
        step=3,
        total_steps=10,
        lease_owner="elsewhere",
        lease_expires_at=utcnow() + timedelta(hours=1),
    )
    with session_scope() as s:
        s.add(JobMetric(job_id=job_id, step=3, epoch=0.3, name="train_loss", value=0.7))

    def poll() -> tuple[int, list[int]]:
        job = client.get(f"/jobs/{job_id}").json()
        metrics = client.get(f"/jobs/{job_id}/metrics", params={"after_step": 2}).json()["data"]
        return job["progress"]["step"], [m["step"] for m in metrics]

    assert poll() == (3, [3])

    def poll_reads_nothing() -> bool:  # on PostgreSQL once the cache listens (a moment after its first use)
        reads.clear()
        return poll() == (3, [3]) and reads == []

    wait_until(poll_reads_nothing, "a poll of the unchanged job is answered from the cache")

    in_another_process(f"UPDATE jobs SET step = 4 WHERE id = '{job_id}'")
    in_another_process(
        f"INSERT INTO job_metrics (job_id, step, epoch, name, value, time) "
        f"VALUES ('{job_id}', 4, 0.4, 'train_loss', 0.6, '2026-01-01 00:00:00')"
    )
    if stack.name == "embedded":  # SQLite's data_version changed with the commit
        assert poll() == (4, [3, 4])
    else:  # the notifications come a socket hop after the commits
        wait_until(lambda: poll() == (4, [3, 4]), "the other process's changes are seen")
    assert "find_job" in reads and "_metrics" in reads


def test_a_change_made_through_the_api_is_read_by_the_next_request(stack):
    """Read-your-writes within one API process: its own commit empties its cache at once, before
    the notification (PostgreSQL) comes back."""
    client = stack.client
    job_id = add_job(
        stack,
        upload(client, labelled_csv())["id"],
        JobStatus.RUNNING,
        lease_owner="elsewhere",
        lease_expires_at=utcnow() + timedelta(hours=1),
    )
    client.get(f"/jobs/{job_id}/metrics")
    for _ in range(3):
        assert client.get(f"/jobs/{job_id}").json()["status"] == "running"
    assert client.delete(f"/jobs/{job_id}").status_code == 409  # still running: nothing changes
    with session_scope() as s:  # the worker of this process ends it
        s.get(Job, job_id).status = JobStatus.SUCCEEDED
    assert client.get(f"/jobs/{job_id}").json()["status"] == "succeeded"
    assert client.delete(f"/jobs/{job_id}").status_code == 204
    assert_error(client.get(f"/jobs/{job_id}"), 404, "deleted")
    assert_error(client.get(f"/jobs/{job_id}/metrics"), 404, "deleted")


def test_a_commit_in_this_process_empties_the_caches_of_the_tables_it_wrote(tmp_path):
    """PostgreSQL: the caches learn of this process's commits from the commits themselves, not
    from the notifications (none is sent on the channels here); a commit that wrote no table of a
    cache's, or a rollback, leaves it as it is."""
    from shared.store.cache import Channel, PostgresCache
    from shared.store.engine import upgrade_database
    from shared.store.keys import create_key
    from tests.conftest import configure_stack

    drop = configure_stack("postgres+redis", {"TUNEJOB_DATA_DIR": str(tmp_path)})
    try:
        upgrade_database()
        conninfo = get_settings().sqlalchemy_url.replace("+psycopg", "")
        jobs, keys = (
            PostgresCache(conninfo, Channel(f"tunejob_test_{name}", frozenset({table}), 10))
            for name, table in (("jobs", "jobs"), ("keys", "api_keys"))
        )
        wait_until(lambda: jobs.get("k")[1] is not None and keys.get("k")[1] is not None, "both caches listen")
        for cache in (jobs, keys):
            cache.put("k", "v", cache.get("k")[1])

        create_key("tenant-c")  # writes api_keys only
        assert (jobs.get("k")[0], keys.get("k")[0]) == ("v", None)
        keys.put("k", "v", keys.get("k")[1])
        with pytest.raises(RuntimeError), session_scope() as s:  # rolled back
            s.execute(update(Job).values(step=2))
            raise RuntimeError
        assert (jobs.get("k")[0], keys.get("k")[0]) == ("v", "v")
        with session_scope() as s:
            s.execute(update(Job).values(step=1))  # a statement, no rows flushed
        assert (jobs.get("k")[0], keys.get("k")[0]) == (None, "v")
    finally:
        PostgresCache.close_all()
        drop()


def test_the_polls_that_miss_together_make_one_read(monkeypatch):
    """Single-flight (``api.db.cached``): after a change empties the cache, the requests that then
    miss the same key (as 50 pollers do right after a job's commit) wait for one read of it; a
    change made while that read runs is read again by the requests after it."""
    import asyncio
    import threading

    import api.db
    from shared.store.cache import VersionedCache

    class Store(VersionedCache):
        now = 1

        def version(self) -> int:
            return self.now

    cache, started, release = Store(10), threading.Event(), threading.Event()
    monkeypatch.setattr(api.db, "cache_for", lambda *_: cache)
    monkeypatch.setattr(api.db, "reads_inline", lambda: False)  # reads in the thread pool, as on PostgreSQL
    reads = []

    def find(job_id: str) -> str:
        reads.append(job_id)
        started.set()
        release.wait(10)
        return f"{job_id} at {Store.now}"

    async def polls() -> tuple[list[str], str]:
        waiting = [asyncio.ensure_future(api.db.cached(("job", "j"), find, "j")) for _ in range(20)]
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        await asyncio.sleep(0)  # every poll has missed and waits
        Store.now = 2  # a commit while the read runs: a poll after it must not get that read's value
        later = asyncio.ensure_future(api.db.cached(("job", "j"), find, "j"))
        release.set()
        return await asyncio.gather(*waiting), await later

    first, after = asyncio.run(polls())
    assert first == ["j at 2"] * 20 and after == "j at 2"
    assert reads == ["j", "j"]  # one read for the 20 polls, one for the poll after the change
    assert cache.get(("job", "j"))[0] == "j at 2"
