"""The one authentication dependency: ``Authorization: Bearer <API key>`` -> ``Caller`` (tenant,
admin), then the key's request rate.

``create_app`` installs ``authenticate`` on the whole application, so every route, including any
added later, requires a key unless its path is listed in ``PUBLIC_PATHS``. A route that needs the
caller declares ``caller: CallerDep`` (FastAPI resolves the dependency once per request) and
passes it to the ``shared`` query helpers (``shared.store.tenancy``). The static documentation pages
(``/docs``, ``/redoc``, ``/openapi.json`` and their assets) are not API routes and stay public:
they carry no tenant data.

A browser signed in to the dashboard (``/ui``, ``shared.store.ui_sessions``) sends no key: its
session cookie stands for the key it signed in with, on the same routes and through the same
checks, so the dashboard's scripts use this API (streams, uploads, job creation) as any client
does. A state-changing request (not GET/HEAD/OPTIONS) made with the cookie must also carry the
session's CSRF token in ``X-CSRF-Token``; a request with a key never uses the cookie.
"""

import logging
import math
import threading
import time
from functools import lru_cache
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from limits import RateLimitItem, aio, parse_many
from limits.errors import StorageError
from limits.storage import storage_from_string
from limits.strategies import SlidingWindowCounterRateLimiter

from api import db
from api.security import SAFE_METHODS
from shared.errors import UserError
from shared.logs import Outage
from shared.settings import get_settings
from shared.store import keys, ui_sessions
from shared.store.tenancy import Caller

log = logging.getLogger(__name__)

# Routes anyone may call: they carry no tenant data (liveness, and the documentation pages, which
# fastapi-offline serves as routes of the app).
PUBLIC_PATHS = frozenset({"/healthz", "/docs", "/docs/oauth2-redirect", "/redoc"})

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="APIKey",
    description="An API key: `tunejob keys create --tenant NAME`, or the local key that `tunejob serve` "
    "writes to <TUNEJOB_DATA_DIR>/api_key.",
)
UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


async def authenticate(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Caller | None:
    """The caller behind the request's API key (None on a public route).

    Async, so that a request does not wait for a thread-pool hand-off to be authenticated: a cached
    key (``shared.store.keys.cached_caller``) is found on the event loop, a key not cached is looked
    up (``shared.store.keys.authenticate``) as ``api.db.read`` does, and the rate check runs on
    the event loop too where its counters are in this process (``memory://``).

    Raises:
        UserError: 401 ``missing_api_key`` / ``invalid_api_key`` (unknown or revoked); 403
            ``csrf_token_invalid`` (a dashboard session's state-changing request without its token);
            429 ``rate_limited`` with ``Retry-After`` past the key's ``TUNEJOB_RATE_LIMIT``.
    """
    route = request.scope.get("route")
    if route is not None and route.path in PUBLIC_PATHS:
        return None
    if credentials is None and (session := request.cookies.get(ui_sessions.COOKIE)):
        caller = await session_caller(request, session)
    elif credentials is None:
        raise UserError(
            "missing_api_key",
            "this route needs an API key: send `Authorization: Bearer <key>` (the "
            "local key is in <TUNEJOB_DATA_DIR>/api_key; more with `tunejob keys create`)",
            "Authorization",
            status=401,
            headers=UNAUTHORIZED,
        )
    else:
        found = keys.cached_caller(credentials.credentials) or await db.read(keys.authenticate, credentials.credentials)
        if found is None:
            raise UserError(
                "invalid_api_key",
                "the API key is not valid, or it was revoked",
                "Authorization",
                status=401,
                headers=UNAUTHORIZED,
            )
        caller = found
    await check_rate(caller)
    return caller


async def session_caller(request: Request, token: str) -> Caller:
    """The caller of the dashboard session whose cookie holds ``token``, checking the CSRF token of
    a state-changing request.

    Raises:
        UserError: 401 ``session_expired`` (unknown, expired or signed-out session, or its key
            revoked); 403 ``csrf_token_invalid``.
    """
    found = await db.read(ui_sessions.resolve, token)
    if found is None:
        raise UserError(
            "session_expired",
            "the dashboard session has expired or was signed out: sign in again at /ui/login",
            ui_sessions.COOKIE,
            status=401,
        )
    caller, csrf = found
    if request.method not in SAFE_METHODS and not ui_sessions.csrf_matches(
        csrf, request.headers.get(ui_sessions.CSRF_HEADER)
    ):
        raise UserError(
            "csrf_token_invalid",
            f"a dashboard request that changes something must send the page's "
            f"{ui_sessions.CSRF_HEADER} header; reload the page",
            ui_sessions.CSRF_HEADER,
            status=403,
        )
    return caller


CallerDep = Annotated[Caller, Depends(authenticate)]


@lru_cache
def _rate_limits(spec: str) -> list[RateLimitItem]:
    return parse_many(spec)


# How long a shared rate-limit store that failed is left alone before it is tried again (seconds),
# and the longest it may take to connect or answer: a rate check must never hold a request longer.
SHARED_RETRY_SECONDS = 10.0
SHARED_TIMEOUT_SECONDS = 2.0
_shared = Outage(log, "the rate-limit store (TUNEJOB_RATE_LIMIT_STORAGE_URL)", traceback=False, per_error=False)
_shared_tried_at = 0.0  # time.monotonic() a request last tried the store while it failed
_shared_lock = threading.Lock()


@lru_cache
def _limiter(storage_url: str) -> SlidingWindowCounterRateLimiter:
    """The shared counters at ``storage_url``; its errors raise ``limits.errors.StorageError``. A
    Redis connection (``redis://``, ``rediss://``, ``redis+unix://``) gives up after
    ``SHARED_TIMEOUT_SECONDS`` (redis-py waits forever by default, so a Redis that stopped answering
    held every request, and the thread running it, for good)."""
    redis = storage_url.startswith(("redis://", "rediss://", "redis+unix://"))
    timeouts = {"socket_timeout": SHARED_TIMEOUT_SECONDS, "socket_connect_timeout": SHARED_TIMEOUT_SECONDS}
    return SlidingWindowCounterRateLimiter(
        storage_from_string(storage_url, wrap_exceptions=True, **(timeouts if redis else {}))
    )


@lru_cache
def _local_limiter() -> aio.strategies.SlidingWindowCounterRateLimiter:
    """The counters in this process's memory, counted on the event loop. The asyncio storage of
    ``limits``, not its thread-safe ``memory://``: that one starts a timer thread to expire its
    counts whenever the last one has ended (10 ms after it started), so under load nearly every
    request started a thread, and ``Thread.start`` blocks the event loop until the new thread runs
    (a quarter of the loop's time under ``bench.load --job short-epochs`` on PostgreSQL, py-spy)."""
    return aio.strategies.SlidingWindowCounterRateLimiter(aio.storage.MemoryStorage())


def _hit(limiter: SlidingWindowCounterRateLimiter, item: RateLimitItem, key: str) -> float | None:
    """Count a request; None if ``item`` lets it through, else the time its window resets."""
    return None if limiter.hit(item, key) else limiter.get_window_stats(item, key).reset_time


async def _count(storage_url: str, item: RateLimitItem, key: str) -> float | None:
    """Count a request as ``_hit`` does: in the shared store at ``storage_url`` (in its threads: a
    network round trip), or in this process's memory (on the event loop) where the store is
    ``memory://`` or has failed in the last ``SHARED_RETRY_SECONDS``.

    A shared store that fails (Redis down or not answering) is logged once, when it starts and when
    it ends, and meanwhile each API process counts on its own: a key may then make up to (API
    processes) x its limit, rather than every request failing because a counter could not be read.
    Flask-Limiter's ``in_memory_fallback`` does the same. One request at a time tries a failed store
    again (the others count in memory meanwhile), so that an outage holds no more than one of the
    store's threads. ``_shared`` and ``_shared_tried_at`` are read and changed under ``_shared_lock``
    (event loops of other threads, as the test client's, share them)."""
    global _shared_tried_at
    tries = not storage_url.startswith("memory://")
    with _shared_lock:
        if tries and _shared.down:
            tries = time.monotonic() - _shared_tried_at >= SHARED_RETRY_SECONDS
            if tries:
                _shared_tried_at = time.monotonic()  # this request tries it; the others count in memory
    if tries:
        try:
            reset = await db.in_thread(_hit, _limiter(storage_url), item, key)
        except StorageError as e:
            with _shared_lock:  # logged by the first of the requests that were waiting on it
                _shared_tried_at = time.monotonic()
                _shared.failed(
                    e.storage_error,
                    "each API process counts in its own memory until it works, trying it again every "
                    f"{SHARED_RETRY_SECONDS:.0f} s",
                )
        else:
            with _shared_lock:
                _shared.ended()
            return reset
    local = _local_limiter()
    return None if await local.hit(item, key) else (await local.get_window_stats(item, key)).reset_time


async def check_rate(caller: Caller) -> None:
    """Count one request against ``caller``'s key (the ``limits`` library, sliding window counter;
    ``_count``: shared counters, or this process's).

    Raises:
        UserError: 429 ``rate_limited``, ``Retry-After`` = seconds until the window lets one through.
    """
    if caller.key_id is None:  # an internal caller: no key to count against
        return
    settings = get_settings()
    for item in _rate_limits(settings.rate_limit):
        reset = await _count(settings.rate_limit_storage_url, item, caller.key_id)
        if reset is not None:
            wait = max(1, math.ceil(reset - time.time()))
            raise UserError(
                "rate_limited",
                f"more than {item} requests with this API key (TUNEJOB_RATE_LIMIT="
                f"{settings.rate_limit!r}); retry in {wait} s",
                "Authorization",
                status=429,
                headers={"Retry-After": str(wait)},
            )
