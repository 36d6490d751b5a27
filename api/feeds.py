"""Live job feeds behind ``GET /jobs/{id}/stream`` (server-sent events).

One reader per API process reads the job store for every job that has an open stream, and fans
what it finds out to each open stream of each job: a hundred open streams, of one job or of a
hundred, cost the store one read every ``stream_poll_seconds``. A read is one short transaction:
the jobs' rows (``WHERE id IN (...)``), their events after the last one seen and, for the jobs
whose row changed (the worker writes its metric rows in the same transaction as the row's
progress), their metric rows after the last one seen. On SQLite the reader first asks the store
whether anything was committed since its last read (``PRAGMA data_version``, microseconds) and
skips the read when nothing was; PostgreSQL has no such counter, so there it reads every time.

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
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from pydantic import TypeAdapter
from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session
from sse_starlette import ServerSentEvent

from api import db
from shared.errors import NotFound, UserError
from shared.jobs import lifecycle, predictions
from shared.jobs.positions import moved, queue_positions
from shared.schemas.jobs import EventOut, JobOut, MetricOut
from shared.schemas.predictions import PredictionOut
from shared.schemas.queue import QueuePosition
from shared.settings import get_settings
from shared.store.engine import data_version, read_session
from shared.store.rows import Job, JobEvent, JobMetric, JobStatus

ROWS_PER_MESSAGE = 5000  # a long job's history goes out in messages of this many rows, each resumable
log = logging.getLogger("tunejob.api")
QUEUE_SIZE = 256  # reads a slow stream may fall behind before it is dropped and re-reads the store
_CURSOR = re.compile(r"m([0-9]{1,18})-e([0-9]{1,18})")  # ASCII digits, ids a 64-bit integer column holds
# pydantic's JSON (a non-finite metric value, e.g. a diverged loss, becomes null; json.dumps would refuse it)
_ROWS = TypeAdapter(dict[str, list[MetricOut | EventOut]])
VIEWS: dict[str, Callable[[Job], JobOut | PredictionOut]] = {  # the API view of a job of each kind
    "train": lifecycle.to_out,
    predictions.KIND: predictions.to_out,
}


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
            raise UserError(
                "invalid_last_event_id",
                f"Last-Event-ID {last_event_id!r} is not an id of this stream (m<metric row id>-e<event id>)",
                "Last-Event-ID",
            )
        return cls(int(match[1]), int(match[2]))


@dataclass
class Read:
    """What one read of the store found after a cursor: the job, and new rows as (id, row)."""

    job: JobOut | PredictionOut
    updated_at: datetime
    metrics: list[tuple[int, MetricOut]] = field(default_factory=list)
    events: list[tuple[int, EventOut]] = field(default_factory=list)
    complete: bool = True  # False when ROWS_PER_MESSAGE cut the rows short: read again at once

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
    def finished(self) -> bool:
        """The job has ended and every row up to its end was read (the row is read first, and the
        worker writes the final status and its event in one transaction)."""
        return self.job.status in JobStatus.FINISHED and self.complete


def read_store(after: dict[str, Cursor], unchanged_since: dict[str, datetime] | None = None) -> dict[str, Read]:
    """One transaction: for each job of ``after``, its row, its events after its cursor and, unless
    its row still has ``updated_at == unchanged_since[job]``, its metric rows after its cursor.
    At most ROWS_PER_MESSAGE rows of each table in all, in id order: each job's rows are the first
    of those after its cursor, and if a table had more, every read is ``complete=False``.

    Returns:
        The reads by job id; a job that is not in the store is left out.
    """
    unchanged_since = unchanged_since or {}
    with read_session() as s:
        jobs = s.scalars(select(Job).where(Job.id.in_(list(after)))).all()
        # a queued job's place changes while its own row does not
        places = queue_positions(s) if any(j.status == JobStatus.QUEUED for j in jobs) else {}
        reads = {}
        for job in jobs:
            view = VIEWS[job.kind](job)
            if job.status == JobStatus.QUEUED:
                view.queue = places.get(job.id)
            reads[job.id] = Read(view, job.updated_at)
        events = _rows_after(s, JobEvent, {i: after[i].event_id for i in reads})
        changed = {i: after[i].metric_id for i, read in reads.items() if read.updated_at != unchanged_since.get(i)}
        metrics = _rows_after(s, JobMetric, changed)
        for row in events:
            reads[row.job_id].events.append((row.id, EventOut.model_validate(row)))
        for row in metrics:
            reads[row.job_id].metrics.append((row.id, MetricOut.model_validate(row)))
        if ROWS_PER_MESSAGE in (len(events), len(metrics)):
            for read in reads.values():
                read.complete = False
        return reads


def _rows_after(s: Session, table: type[JobEvent] | type[JobMetric], after: dict[str, int]) -> list:
    """The rows of ``table`` after id ``after[job]`` of each job, in id order, ROWS_PER_MESSAGE at most."""
    if not after:
        return []
    return list(
        s.scalars(
            select(table)
            .where(or_(*(and_(table.job_id == job_id, table.id > row_id) for job_id, row_id in after.items())))
            .order_by(table.id)
            .limit(ROWS_PER_MESSAGE)
        )
    )


def read_job(job_id: str, after: Cursor) -> Read:
    """``read_store`` of one job.

    Raises:
        NotFound: no such job.
    """
    read = read_store({job_id: after}).get(job_id)
    if read is None:
        raise NotFound("job", job_id)
    return read


def read_heads(job_ids: list[str]) -> dict[str, tuple[Cursor, datetime]]:
    """The cursor after each job's newest rows, and its row's ``updated_at``, by job id (one
    transaction; a job that is not in the store is left out)."""
    with read_session() as s:
        rows = s.execute(select(Job.id, Job.updated_at).where(Job.id.in_(job_ids))).all()
        last = [
            dict(
                s.execute(
                    select(table.job_id, func.max(table.id)).where(table.job_id.in_(job_ids)).group_by(table.job_id)
                ).all()
            )
            for table in (JobMetric, JobEvent)
        ]
        return {
            job_id: (Cursor(last[0].get(job_id, 0), last[1].get(job_id, 0)), updated_at) for job_id, updated_at in rows
        }


class JobFeed:
    """The open streams of one job. The reader of ``Feeds`` starts it at the store's newest rows
    and puts every later ``Read``, then ``END``, on each subscriber's queue; a subscriber
    QUEUE_SIZE reads behind gets ``BEHIND`` instead and is dropped (it catches up from the store
    and subscribes again)."""

    END, BEHIND = "end", "behind"

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.subscribers: set[asyncio.Queue] = set()
        self.started = asyncio.Event()  # set once the start is read: subscribers read the past after it
        self.error: Exception | None = None
        self.cursor = Cursor()
        self.updated_at: datetime | None = None
        self.queue: QueuePosition | None = None  # the queued job's place as last published

    def start(self, cursor: Cursor, updated_at: datetime) -> None:
        self.cursor, self.updated_at = cursor, updated_at
        self.started.set()

    def take(self, read: Read) -> None:
        """Publish ``read`` if it has anything new, and move the cursor past it."""
        if read.metrics or read.events or read.updated_at != self.updated_at or moved(self.queue, read.job.queue):
            self._publish(read)
            self.queue = read.job.queue
        self.cursor, self.updated_at = advance(self.cursor, read), read.updated_at

    def end(self, error: Exception | None = None) -> None:
        self.error = error
        self.started.set()
        self._publish(self.END)

    def _publish(self, item: "Read | str") -> None:
        for queue in list(self.subscribers):
            if queue.qsize() >= QUEUE_SIZE - 1:
                queue.put_nowait(self.BEHIND)
                self.subscribers.discard(queue)
            else:
                queue.put_nowait(item)


class Feeds:
    """The feeds of the jobs streamed by this API process, one per job, and their one reader, a
    task that runs while any job is streamed (kept on ``app.state``)."""

    def __init__(self):
        self.by_job: dict[str, JobFeed] = {}
        self.reader: asyncio.Task | None = None
        self.wake = asyncio.Event()  # a new feed wants its start read now

    async def subscribe(self, job_id: str) -> tuple[JobFeed, asyncio.Queue]:
        """A queue that receives everything the job's feed reads from now on."""
        if self.reader is not None and self.reader.get_loop() is not asyncio.get_running_loop():
            # their loop is gone: a TestClient outside `with` runs each request on a loop of its own
            self.by_job, self.reader = {}, None
        feed = self.by_job.get(job_id)
        if feed is None:
            feed = self.by_job[job_id] = JobFeed(job_id)
            if self.reader is None or self.reader.done():
                self.wake = asyncio.Event()
                self.reader = asyncio.create_task(self.read(), name="feeds-reader")
            self.wake.set()
        queue: asyncio.Queue = asyncio.Queue(QUEUE_SIZE)
        feed.subscribers.add(queue)
        try:
            await feed.started.wait()
        except BaseException:  # the client went away before the start was read
            feed.subscribers.discard(queue)
            raise
        return feed, queue

    async def read(self) -> None:
        """The reader: while any job is streamed, every ``stream_poll_seconds`` (at once when a
        read was cut short, or a new feed waits for its start), one read for all the started feeds,
        unless the SQLite store is unchanged since the last one."""
        settings = get_settings()
        poll, changes = settings.stream_poll_seconds, data_version(settings.sqlalchemy_url)  # None on PostgreSQL
        seen = None  # the store's data_version before the last read that covered every feed
        while self.by_job:
            self.wake.clear()
            complete = True
            try:
                # asked before reading: a commit after it changes it again, and the next poll reads
                version = changes.read() if changes is not None else None
                for job_id in [i for i, feed in self.by_job.items() if feed.started.is_set() and not feed.subscribers]:
                    del self.by_job[job_id]  # its last stream closed
                new = [feed for feed in self.by_job.values() if not feed.started.is_set()]
                if new:
                    heads = await db.in_thread(read_heads, [feed.job_id for feed in new])
                    for feed in new:
                        self._start_or_end(feed, heads.get(feed.job_id))
                # not those just started (read after `version`), nor those subscribed meanwhile (next round)
                running = [feed for feed in self.by_job.values() if feed.started.is_set() and feed not in new]
                if running and (version is None or version != seen):
                    reads = await db.in_thread(
                        read_store, {f.job_id: f.cursor for f in running}, {f.job_id: f.updated_at for f in running}
                    )
                    complete = all(read.complete for read in reads.values())
                    for feed in running:
                        self._take(feed, reads.get(feed.job_id))
                seen = version if complete else None
            except Exception as e:  # the store failed: every stream ends (and may reconnect)
                log.exception("the job feeds' reader failed")
                for feed in list(self.by_job.values()):
                    self._end(feed, e)
            if complete and self.by_job:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), poll)

    def _start_or_end(self, feed: JobFeed, head: tuple[Cursor, datetime] | None) -> None:
        if head is None:
            self._end(feed, NotFound("job", feed.job_id))
        else:
            feed.start(*head)

    def _take(self, feed: JobFeed, read: Read | None) -> None:
        if read is None:  # deleted while it was streamed
            self._end(feed, NotFound("job", feed.job_id))
            return
        feed.take(read)
        if read.finished:
            self._end(feed)

    def _end(self, feed: JobFeed, error: Exception | None = None) -> None:
        """END to every stream of ``feed``, and no more reads of it: a later stream starts a new
        feed (no await between the two, so no stream misses the END)."""
        feed.end(error)
        if self.by_job.get(feed.job_id) is feed:
            del self.by_job[feed.job_id]

    async def stream(self, job_id: str, cursor: Cursor) -> AsyncIterator[ServerSentEvent]:
        """The server-sent events of one stream of ``job_id``, from just after ``cursor``."""
        sent = Sent(cursor)
        while True:  # a second round only after falling behind the feed
            feed, queue = await self.subscribe(job_id)
            try:
                read = await db.in_thread(read_job, job_id, sent.cursor)
                for message in sent.new(read, catching_up=True):
                    yield message
                while not read.complete:
                    read = await db.in_thread(read_job, job_id, sent.cursor)
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

    async def watch(self, job_ids: list[str], gone: Sequence[str] = ()) -> AsyncIterator[ServerSentEvent]:
        """``progress`` (the job) of each of ``job_ids`` whenever its row changes, and ``end`` (the
        job) once it finished, from now on, until all of them ended: the streams of the jobs from
        their newest rows, merged, without their metrics and events (the jobs page's live rows).
        ``gone`` (``{"id": ...}``) for each of ``gone``, and for a job not, or no longer, in the store."""
        merged: asyncio.Queue = asyncio.Queue()  # messages, and None when a job's stream ended

        async def forward(job_id: str, cursor: Cursor) -> None:
            try:
                async for message in self.stream(job_id, cursor):
                    if message.event in ("progress", "end"):  # without its id: a cursor of one job
                        merged.put_nowait(ServerSentEvent(message.data, event=message.event))
                    elif message.event == "error":
                        merged.put_nowait(gone_message(job_id))
            finally:
                merged.put_nowait(None)

        heads = await db.in_thread(read_heads, job_ids)
        for job_id in [*gone, *(i for i in job_ids if i not in heads)]:
            yield gone_message(job_id)
        tasks = [asyncio.create_task(forward(job_id, cursor)) for job_id, (cursor, _) in heads.items()]
        try:
            running = len(tasks)
            while running:
                message = await merged.get()
                if message is None:
                    running -= 1
                else:
                    yield message
        finally:
            for task in tasks:
                task.cancel()


def gone_message(job_id: str) -> ServerSentEvent:
    return ServerSentEvent(json.dumps({"id": job_id}), event="gone")


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
            error = {
                "code": "stream_failed",
                "message": f"the job store could not be read ({type(e).__name__}); reconnect with Last-Event-ID",
                "param": None,
            }
        return ServerSentEvent(json.dumps({"error": error}), event="error")

    def _message(self, event: str, data: str) -> ServerSentEvent:
        return ServerSentEvent(data, event=event, id=str(self.cursor))


def rows_json(rows: Sequence[tuple[int, MetricOut | EventOut]]) -> str:
    """``{"data": [rows]}`` without the ids."""
    return _ROWS.dump_json({"data": [row for _, row in rows]}).decode()


def advance(cursor: Cursor, read: Read) -> Cursor:
    """The cursor after ``read``'s rows."""
    return Cursor(
        read.metrics[-1][0] if read.metrics else cursor.metric_id,
        read.events[-1][0] if read.events else cursor.event_id,
    )
