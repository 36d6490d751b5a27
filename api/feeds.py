"""Live job feeds behind ``GET /jobs/{id}/stream`` (server-sent events).

One reader per streamed job reads the job store every ``stream_poll_seconds`` while anyone
listens, and fans what it finds out to every open stream of that job: a hundred open streams of
a job cost the store what one costs. Each read is one short transaction: the job row (by primary
key), the job's events after the last one seen and, only when the job row changed (the worker
writes its metric rows in the same transaction as the row's progress), its metric rows after the
last one seen.

Event ids are a cursor over the two append-only tables, ``m<last metric row id>-e<last event
id>``. A stream that connects, or reconnects with ``Last-Event-ID``, first reads what it missed
from the store itself (once), then takes the feed's reads, dropping rows it already sent: every
metric row and event is delivered exactly once. Metric and event ids grow in commit order for one
job, because one worker writes a job's rows, under its lease. After a restart the resumed attempt
logs the steps after its checkpoint again, as new rows (an event ``job_restarted`` comes first).

Messages: ``progress`` (the job, whenever its row changed), ``metrics`` (``{"data": [rows]}``),
``events`` (``{"data": [events]}``), ``end`` (the job) once it finished and every row before
that was sent, and ``error`` (``{"error": {...}}``) if the job disappears or the store fails.
A comment line every ``stream_heartbeat_seconds`` keeps idle connections open (sse-starlette).
"""

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from pydantic import TypeAdapter
from sqlalchemy import func, select
from sse_starlette import ServerSentEvent
from starlette.concurrency import run_in_threadpool

from shared.errors import NotFound, UserError
from shared.jobs import lifecycle, predictions
from shared.jobs.positions import moved, queue_positions
from shared.schemas.jobs import EventOut, JobOut, MetricOut
from shared.schemas.predictions import PredictionOut
from shared.settings import get_settings
from shared.store.engine import read_session
from shared.store.rows import Job, JobEvent, JobMetric, JobStatus

ROWS_PER_MESSAGE = 5000  # a long job's history goes out in messages of this many rows, each resumable
log = logging.getLogger("tunejob.api")
QUEUE_SIZE = 256  # reads a slow stream may fall behind before it is dropped and re-reads the store
_CURSOR = re.compile(r"m(\d+)-e(\d+)")
# pydantic's JSON (a non-finite metric value, e.g. a diverged loss, becomes null; json.dumps would refuse it)
_ROWS = TypeAdapter(dict[str, list[MetricOut] | list[EventOut]])
VIEWS = {"train": lifecycle.to_out, predictions.KIND: predictions.to_out}  # the API view of a job of each kind


@dataclass
class Cursor:
    """Where a stream stands: the ids of the last metric row and the last job event it sent."""

    metric_id: int = 0
    event_id: int = 0

    def __str__(self) -> str:
        return f"m{self.metric_id}-e{self.event_id}"

    @classmethod
    def parse(cls, last_event_id: str | None) -> "Cursor":
        """The cursor of a ``Last-Event-ID`` header; None or empty: the start of the job.

        Raises:
            UserError: ``invalid_last_event_id`` (422) for anything but an id this stream sends.
        """
        if not last_event_id:
            return cls()
        match = _CURSOR.fullmatch(last_event_id.strip())
        if match is None:
            raise UserError("invalid_last_event_id", f"Last-Event-ID {last_event_id!r} is not an id of this stream "
                            "(m<metric row id>-e<event id>)", "Last-Event-ID")
        return cls(int(match[1]), int(match[2]))


@dataclass
class Read:
    """What one read of the store found after a cursor: the job, and new rows as (id, row)."""

    job: JobOut | PredictionOut
    updated_at: datetime
    metrics: list[tuple[int, MetricOut]] = field(default_factory=list)
    events: list[tuple[int, EventOut]] = field(default_factory=list)

    # Serialized once per read, for all the streams that send it whole.
    @cached_property
    def job_json(self) -> str:
        return self.job.model_dump_json()

    @cached_property
    def metrics_json(self) -> str:
        return rows_json(self.metrics)

    @cached_property
    def events_json(self) -> str:
        return rows_json(self.events)

    @property
    def complete(self) -> bool:
        """False when ROWS_PER_MESSAGE cut the rows short: read again at once."""
        return len(self.metrics) < ROWS_PER_MESSAGE and len(self.events) < ROWS_PER_MESSAGE

    @property
    def finished(self) -> bool:
        """The job has ended and every row up to its end was read (the row is read first, and the
        worker writes the final status and its event in one transaction)."""
        return self.job.status in JobStatus.FINISHED and self.complete


def read_store(job_id: str, after: Cursor, unchanged_since: datetime | None = None) -> Read:
    """One transaction: the job row, its events after ``after`` and, unless the row still has
    ``updated_at == unchanged_since``, its metric rows after ``after``; up to ROWS_PER_MESSAGE each.

    Raises:
        NotFound: no such job.
    """
    with read_session() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFound("job", job_id)
        view = VIEWS[job.kind](job)
        if job.status == JobStatus.QUEUED:  # its place changes while its own row does not
            view.queue = queue_positions(s).get(job_id)
        read = Read(view, job.updated_at)
        read.events = [(e.id, EventOut.model_validate(e)) for e in s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after.event_id)
            .order_by(JobEvent.id).limit(ROWS_PER_MESSAGE))]
        if job.updated_at != unchanged_since:
            read.metrics = [(m.id, MetricOut.model_validate(m)) for m in s.scalars(
                select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.id > after.metric_id)
                .order_by(JobMetric.id).limit(ROWS_PER_MESSAGE))]
        return read


def read_head(job_id: str) -> tuple[Cursor, datetime]:
    """The cursor after the job's newest rows, and its row's ``updated_at``.

    Raises:
        NotFound: no such job.
    """
    with read_session() as s:
        updated_at = s.scalar(select(Job.updated_at).where(Job.id == job_id))
        if updated_at is None:
            raise NotFound("job", job_id)
        metric_id = s.scalar(select(func.max(JobMetric.id)).where(JobMetric.job_id == job_id))
        event_id = s.scalar(select(func.max(JobEvent.id)).where(JobEvent.job_id == job_id))
        return Cursor(metric_id or 0, event_id or 0), updated_at


class JobFeed:
    """The one reader of one job. It starts at the store's newest rows and puts every later
    ``Read``, then ``END``, on each subscriber's queue; a subscriber QUEUE_SIZE reads behind gets
    ``BEHIND`` instead and is dropped (it catches up from the store and subscribes again)."""

    END, BEHIND = "end", "behind"

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.subscribers: set[asyncio.Queue] = set()
        self.started = asyncio.Event()  # set once the start is read: subscribers read the past after it
        self.error: Exception | None = None
        self.task: asyncio.Task | None = None

    async def run(self, registry: dict[str, "JobFeed"]) -> None:
        poll = get_settings().stream_poll_seconds
        try:
            cursor, updated_at = await run_in_threadpool(read_head, self.job_id)
            queue = None  # the queued job's place as last published
            self.started.set()
            while self.subscribers:
                read = await run_in_threadpool(read_store, self.job_id, cursor, updated_at)
                if read.metrics or read.events or read.updated_at != updated_at or moved(queue, read.job.queue):
                    self._publish(read)
                    queue = read.job.queue
                cursor, updated_at = advance(cursor, read), read.updated_at
                if read.finished:
                    self._publish(self.END)
                    return
                if read.complete:
                    await asyncio.sleep(poll)
        except Exception as e:  # the job is gone or the store failed: every stream of the job ends
            if not isinstance(e, UserError):
                log.exception("feed of job %s failed", self.job_id)
            self.error = e
            self._publish(self.END)
        finally:
            self.started.set()
            if registry.get(self.job_id) is self:  # no await since the last publish: no one missed END
                del registry[self.job_id]

    def _publish(self, item: "Read | str") -> None:
        for queue in list(self.subscribers):
            if queue.qsize() >= QUEUE_SIZE - 1:
                queue.put_nowait(self.BEHIND)
                self.subscribers.discard(queue)
            else:
                queue.put_nowait(item)


class Feeds:
    """The feeds of the jobs streamed by this API process, one per job (kept on ``app.state``)."""

    def __init__(self):
        self.by_job: dict[str, JobFeed] = {}

    async def subscribe(self, job_id: str) -> tuple[JobFeed, asyncio.Queue]:
        """A queue that receives everything the job's feed reads from now on."""
        feed = self.by_job.get(job_id)
        if feed is None:
            feed = self.by_job[job_id] = JobFeed(job_id)
            feed.task = asyncio.create_task(feed.run(self.by_job), name=f"feed-{job_id}")
        queue: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        feed.subscribers.add(queue)
        await feed.started.wait()
        return feed, queue

    async def stream(self, job_id: str, cursor: Cursor) -> AsyncIterator[ServerSentEvent]:
        """The server-sent events of one stream of ``job_id``, from just after ``cursor``."""
        sent = Sent(cursor)
        while True:  # a second round only after falling behind the feed
            feed, queue = await self.subscribe(job_id)
            try:
                read = await run_in_threadpool(read_store, job_id, sent.cursor)
                for message in sent.new(read, catching_up=True):
                    yield message
                while not read.complete:
                    read = await run_in_threadpool(read_store, job_id, sent.cursor)
                    for message in sent.new(read):
                        yield message
                if read.finished:
                    yield sent.end()
                    return
                while (item := await queue.get()) is not JobFeed.BEHIND:
                    if item is JobFeed.END:
                        yield sent.end() if feed.error is None else sent.error(feed.error)
                        return
                    for message in sent.new(item):
                        yield message
            except Exception as e:  # the job was deleted while it was streamed, or the store failed
                if not isinstance(e, UserError):
                    log.exception("stream of job %s failed", job_id)
                yield sent.error(e)
                return
            finally:
                feed.subscribers.discard(queue)


class Sent:
    """What one stream has sent: its cursor, and the job as of its last ``progress``."""

    def __init__(self, cursor: Cursor):
        self.cursor = cursor
        self.updated_at: datetime | None = None
        self.job_json = ""

    def new(self, read: Read, catching_up: bool = False) -> list[ServerSentEvent]:
        """The messages for what ``read`` has that this stream has not sent; advances the cursor."""
        messages = []
        metrics = [(i, m) for i, m in read.metrics if i > self.cursor.metric_id]
        if metrics:
            self.cursor = Cursor(metrics[-1][0], self.cursor.event_id)
            whole = len(metrics) == len(read.metrics)
            messages.append(self._message("metrics", read.metrics_json if whole else rows_json(metrics)))
        events = [(i, e) for i, e in read.events if i > self.cursor.event_id]
        if events:
            self.cursor = Cursor(self.cursor.metric_id, events[-1][0])
            whole = len(events) == len(read.events)
            messages.append(self._message("events", read.events_json if whole else rows_json(events)))
        if catching_up or read.updated_at != self.updated_at or read.job_json != self.job_json:
            self.updated_at, self.job_json = read.updated_at, read.job_json
            messages.append(self._message("progress", read.job_json))
        return messages

    def end(self) -> ServerSentEvent:
        return self._message("end", self.job_json)

    def error(self, e: Exception) -> ServerSentEvent:
        if isinstance(e, UserError):
            error = {"code": e.code, "message": e.message, "param": e.param}
        else:
            error = {"code": "stream_failed", "message": f"the job store could not be read ({type(e).__name__}); "
                     "reconnect with Last-Event-ID", "param": None}
        return ServerSentEvent(json.dumps({"error": error}), event="error")

    def _message(self, event: str, data: str) -> ServerSentEvent:
        return ServerSentEvent(data, event=event, id=str(self.cursor))


def rows_json(rows: list[tuple[int, MetricOut | EventOut]]) -> str:
    """``{"data": [rows]}`` without the ids."""
    return _ROWS.dump_json({"data": [row for _, row in rows]}).decode()


def advance(cursor: Cursor, read: Read) -> Cursor:
    """The cursor after ``read``'s rows."""
    return Cursor(read.metrics[-1][0] if read.metrics else cursor.metric_id,
                  read.events[-1][0] if read.events else cursor.event_id)
