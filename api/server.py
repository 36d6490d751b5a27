"""Serving the API with uvicorn, with limits on slow and idle connections (slowloris).

uvicorn closes a keep-alive connection that stays idle ``TUNEJOB_HTTP_KEEP_ALIVE_SECONDS`` after a
response, but it has no limit on how long a request's headers may take (Kludex/uvicorn#157): a
connection that sends nothing, or trickles header bytes (each byte cancels the keep-alive timer),
stays open forever, and enough of them use up the process's file descriptors. ``HeaderDeadline``
adds that limit, like Go's ``http.Server.ReadHeaderTimeout``. A request's body is not limited in
time (uploads may be large and slow); the app reads it without blocking other requests.
"""

import asyncio

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shared.logs import logging_config
from shared.settings import get_settings


class HeaderDeadline(HttpToolsProtocol):
    """uvicorn's httptools protocol, which closes a connection whose request headers are not complete
    ``TUNEJOB_HTTP_HEADER_TIMEOUT_SECONDS`` after it opened or after its previous response."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = get_settings().http_header_timeout_seconds
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's own
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers have the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.header_deadline = self.loop.call_later(self.header_timeout, self._deadline_passed)

    def _disarm(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _deadline_passed(self) -> None:
        self.header_deadline = None
        if self.cycle is None or self.cycle.response_complete:  # not while a (pipelined) request runs
            self.transport.close()


def run(app, host: str, port: int, workers: int = 1) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM; with ``workers`` > 1, ``app`` is the
    import string of an application, which each of ``workers`` processes imports (uvicorn's
    supervisor restarts one that dies). Proxy headers are trusted as ``TUNEJOB_PROXY_HEADERS`` and
    ``TUNEJOB_FORWARDED_ALLOW_IPS`` say. On SIGTERM, requests still running after
    ``TUNEJOB_SHUTDOWN_GRACE_SECONDS`` are cancelled (an upload's temporary file removed): uvicorn waited
    for them without end, a slow upload for as long as it took, until a supervisor's SIGKILL left
    its file behind."""
    settings = get_settings()
    uvicorn.run(
        app,
        host=host,
        port=port,
        workers=workers,
        log_config=logging_config(),
        http=HeaderDeadline,
        access_log=settings.access_log,
        timeout_keep_alive=settings.http_keep_alive_seconds,
        proxy_headers=settings.proxy_headers,
        forwarded_allow_ips=settings.forwarded_allow_ips,
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
    )
