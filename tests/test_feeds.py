"""The job streams' one store reader (``api.feeds``), on every stack: the streams of several jobs
cost one read of the store per poll, a SQLite store that nothing was committed to is not read at
all, and every stream still gets each metric row once, across a reconnect with its last id."""

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import contextmanager

import pytest
from sqlalchemy import event, make_url, update

from api import feeds
from api.feeds import Cursor, Feeds
from shared.schemas.jobs import JobCreate
from shared.store import engine
from shared.store.engine import get_engine, session_scope, upgrade_database
from shared.store.rows import Dataset, Job, JobMetric, JobStatus, utcnow
from tests.conftest import configure_stack

JOBS = [f"job_feed{i}" for i in range(5)]


@pytest.fixture(params=["embedded", "postgres+redis"])
def store(request, tmp_path) -> str:
    """A store holding the running jobs JOBS, read every 50 ms by the feeds."""
    drop = configure_stack(
        request.param, {"TUNEJOB_DATA_DIR": str(tmp_path / "data"), "TUNEJOB_STREAM_POLL_SECONDS": "0.05"}
    )
    upgrade_database()
    spec = JobCreate(base_model="tiny-bert", training_dataset="ds_feed").model_dump(mode="json")
    with session_scope() as s:
        s.add(
            Dataset(
                id="ds_feed",
                filename="f.csv",
                format="csv",
                path=str(tmp_path / "f.csv"),
                rows=1,
                columns=["text", "label"],
                bytes=1,
                sha256="0" * 64,
            )
        )
        s.flush()
        s.add_all(
            Job(
                id=job_id,
                status=JobStatus.RUNNING,
                base_model="tiny-bert",
                task="classification",
                training_dataset_id="ds_feed",
                spec=spec,
                total_steps=100,
                timings={},
            )
            for job_id in JOBS
        )
    yield request.param
    drop()


def report_step(step: int) -> None:
    """Each job's progress and a metric row of ``step``, in one transaction, as a worker reports
    (no SELECT: the reads counted below are the feeds')."""
    with session_scope() as s:
        s.execute(update(Job).where(Job.id.in_(JOBS)).values(step=step, updated_at=utcnow()))
        s.add_all(
            JobMetric(job_id=job_id, step=step, epoch=0.0, name="train_loss", value=1 / step, time=utcnow())
            for job_id in JOBS
        )


@contextmanager
def selects():
    """The SELECT statements sent to the job store meanwhile, with their parameters."""
    seen: list[tuple[str, set]] = []

    def record(_conn, _cursor, statement, parameters, _context, _many):
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, set(parameters.values() if isinstance(parameters, dict) else parameters)))

    event.listen(get_engine(), "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(get_engine(), "before_cursor_execute", record)


class Reader:
    """One stream of a job, read in a task: the steps of the metric rows it got, and its last id."""

    def __init__(self, feeds_: Feeds, job_id: str, cursor: Cursor):
        self.steps: list[int] = []
        self.progress = 0
        self.last_id = str(cursor)
        self.task = asyncio.create_task(self.read(feeds_.stream(job_id, cursor)))

    async def read(self, stream) -> None:
        async for message in stream:
            self.last_id = message.id
            if message.event == "metrics":
                self.steps += [row["step"] for row in json.loads(message.data)["data"]]
            elif message.event == "progress":
                self.progress += 1

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def until(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_the_streams_of_many_jobs_cost_one_read_per_poll_and_get_each_row_once(store):
    async def main() -> None:
        feeds_ = Feeds()
        readers = {job_id: Reader(feeds_, job_id, Cursor()) for job_id in JOBS}
        await until(lambda: all(r.progress for r in readers.values()), "every stream's catch-up")
        with selects() as seen:
            await asyncio.to_thread(report_step, 1)
            await until(lambda: all(r.steps == [1] for r in readers.values()), "step 1 on every stream")
        metric_reads = [params for statement, params in seen if "FROM job_metrics" in statement]
        job_reads = [params for statement, params in seen if "FROM jobs" in statement]
        assert len(metric_reads) == 1 and set(JOBS) <= metric_reads[0]  # one read of the five jobs' rows
        assert job_reads and all(set(JOBS) <= params for params in job_reads)

        # a stream that drops and reconnects with its last id gets what it missed, once
        first = readers[JOBS[0]]
        await first.close()
        await asyncio.to_thread(report_step, 2)
        again = Reader(feeds_, JOBS[0], Cursor.parse(first.last_id))
        await asyncio.to_thread(report_step, 3)
        await until(
            lambda: again.steps == [2, 3] and all(r.steps == [1, 2, 3] for r in list(readers.values())[1:]),
            "steps 2 and 3 on every stream",
        )
        for reader in [again, *readers.values()]:
            await reader.close()

    asyncio.run(main())


def test_an_unchanged_sqlite_store_is_not_read(store, monkeypatch):
    if store != "embedded":
        pytest.skip("PostgreSQL has no data_version: the feeds read it every poll")
    versions = []

    class Counted(engine.DataVersion):
        def read(self) -> int:
            versions.append(super().read())
            return versions[-1]

    monkeypatch.setattr(feeds, "data_version", lambda url: Counted(make_url(url).database))

    async def main() -> None:
        feeds_ = Feeds()
        readers = [Reader(feeds_, job_id, Cursor()) for job_id in JOBS[:2]]
        await until(lambda: all(r.progress for r in readers), "every stream's catch-up")
        polls = len(versions)
        with selects() as seen:
            await until(lambda: len(versions) >= polls + 5, "5 polls")
        assert seen == []
        await asyncio.to_thread(report_step, 1)
        await until(lambda: all(r.steps == [1] for r in readers), "step 1 on every stream")
        for reader in readers:
            await reader.close()

    asyncio.run(main())
