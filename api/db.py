"""Short job-store calls from ``async`` routes and dependencies, with as few thread-pool hand-offs as
is safe.

A sync route or dependency runs in anyio's thread pool: two hand-offs between the event loop and a
thread per call, which on the polling routes (``GET /jobs/{id}``, its metrics, and the key check of
every request) cost more CPU than the SQLite read itself. On SQLite in WAL mode
a read never waits for a writer (``shared.store.engine``), so ``read`` calls it right on the event loop; on
PostgreSQL a call is a network round trip that must not hold up the loop, so it goes to the thread
pool (``in_thread``). Only short reads run inline: the loop serves no other request meanwhile, so a read
of many rows (``read_rows``) goes to the thread pool too.

What the polling routes read (a job's row, a few new metrics) is kept between requests while no
process has changed the jobs or their metrics (``cached``, ``job``; ``shared.store.cache``): under
polling load a job changes about once a step, and most polls then cost no read at all (on
PostgreSQL, no thread hand-off, no round trip and none of the server's CPU).
"""

import asyncio
import contextvars
import functools
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from shared.settings import get_settings
from shared.store.cache import JOBS, cache_for
from shared.store.engine import read_session
from shared.store.rows import Job
from shared.store.tenancy import Caller, find, of_kind, visible

T = TypeVar("T")
INLINE_ROWS = 100  # a poll's new rows (e.g. a few steps' metrics): a short read


@functools.cache
def _threads() -> ThreadPoolExecutor:
    """The threads that make the API's blocking store and rate-limit calls: one per pooled
    database connection (``TUNEJOB_DATABASE_POOL_SIZE``), so none waits for a connection."""
    return ThreadPoolExecutor(get_settings().database_pool_size, thread_name_prefix="tunejob-store")


async def in_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` in the store's threads, in this request's context (its request id).

    ``loop.run_in_executor`` rather than starlette's ``run_in_threadpool``: anyio's hand-off (its
    capacity limiter, cancel scope and ``current_task`` lookups) costs more CPU per request under
    polling load (profiled: docs/benchmarks.md)."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_threads(), functools.partial(context.run, fn, *args))


def reads_inline() -> bool:
    """Whether store reads run on the event loop: the store is SQLite."""
    return get_settings().sqlalchemy_url.startswith("sqlite")


async def read(fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, a read of a few rows of the job store: on the event loop on SQLite, else in the
    thread pool."""
    return fn(*args) if reads_inline() else await in_thread(fn, *args)


async def read_rows(fn: Callable[..., list], *args, limit: int) -> list:
    """``fn(*args, limit)``, a read of at most ``limit`` rows: on SQLite first on the event loop with
    at most ``INLINE_ROWS``; when those are not all, it is read again, whole, in the thread pool (so
    the loop never reads more than ``INLINE_ROWS``)."""
    if reads_inline():
        rows = fn(*args, min(limit, INLINE_ROWS))
        if len(rows) < INLINE_ROWS or limit <= INLINE_ROWS:
            return rows
    return await in_thread(fn, *args, limit)


async def cached(key: Hashable, fn: Callable[..., Any], *args, limit: int | None = None) -> Any:
    """``fn(*args)`` read with ``read`` (with ``limit``: ``fn(*args, limit)`` with ``read_rows``), a
    read of jobs or their metrics, kept under ``key`` in this process's cache until a job or a
    metric changes (``shared.store.cache.JOBS``). Not kept: None (nothing found), and lists of more
    than ``INLINE_ROWS``.

    Single-flight: the requests that miss the same key at the same version while its read is under
    way wait for that read instead of each making their own. A job that commits several times a
    second empties the cache as often, and without this every poll waiting at that moment (50 under
    ``bench.load``) read the store at once, each a thread hand-off and a PostgreSQL round trip."""
    cache = cache_for(get_settings().sqlalchemy_url, JOBS)
    value, version = cache.get(key) if cache is not None else (None, None)
    if value is not None:
        return value
    if cache is None or version is None:  # nothing can be cached: nor shared
        return await _read(fn, args, limit)
    flight = (asyncio.get_running_loop(), key, version)
    if (task := _flights.get(flight)) is None:
        task = _flights[flight] = asyncio.ensure_future(_read(fn, args, limit))
        task.add_done_callback(lambda _: _flights.pop(flight, None))
    value = await asyncio.shield(task)  # a waiter that goes away does not cancel the others' read
    if value is not None and (limit is None or len(value) <= INLINE_ROWS):
        cache.put(key, value, version)
    return value


_flights: dict[tuple[asyncio.AbstractEventLoop, Hashable, int], asyncio.Future] = {}  # reads under way (``cached``)


async def _read(fn: Callable[..., Any], args: tuple, limit: int | None) -> Any:
    return await (read(fn, *args) if limit is None else read_rows(fn, *args, limit=limit))


def find_job(job_id: str) -> Job | None:
    """The row of job ``job_id``, whoever's it is, or None (check it before showing it)."""
    with read_session() as s:
        return find(s, Job, job_id)


async def job(job_id: str, caller: Caller, kind: str = "train") -> Job:
    """The row of job ``job_id`` (``cached``; read only: never change it) if ``caller`` may see it
    and it is of ``kind``.

    Raises:
        NotFound, Deleted: as ``shared.store.tenancy.owned_job``.
    """
    return of_kind(visible(await cached(("job", job_id), find_job, job_id), Job, job_id, caller), kind)
