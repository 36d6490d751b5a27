"""One logging configuration for the API and the worker: every line on stderr as
``2026-11-25 21:04:38,123 WARNING tunejob.api [req 3f2a…] message``, with the request id of the
API request (or the job id in a worker) that the line was logged for.

The API's server (uvicorn) applies it through its ``log_config`` (``api.server.run``), so its own
lines (start-up, access log) look the same; a Celery worker applies it from Celery's
``setup_logging`` signal (while a receiver exists, Celery configures no logging of its own; Celery
docs, "Signals: setup_logging"). The level is ``TUNEJOB_LOG_LEVEL``. Python's ``logging.config``
dictionary schema: https://docs.python.org/3/library/logging.config.html#logging-config-dictschema
"""

import contextvars
import logging
import logging.config
import re
import time
from typing import Any

from shared.errors import first_line
from shared.settings import get_settings

log_context: contextvars.ContextVar[str] = contextvars.ContextVar("tunejob_log_context", default="-")
"""What a log line is about: ``req <request id>`` in the API, ``job <id>`` in a worker; ``-`` for
neither. Set per request (``api.request_id``) or per job (``worker.tasks.run_job``)."""

FORMAT = "%(asctime)s %(levelname)s %(name)s [%(context)s] %(message)s"


class ContextFilter(logging.Filter):
    """Adds ``record.context`` (``log_context``) to every record a handler emits."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.context = log_context.get()
        return True


def logging_config(level: str | None = None) -> dict[str, Any]:
    """The ``logging.config.dictConfig`` dictionary: one stderr handler on the root logger, at
    ``level`` (default ``TUNEJOB_LOG_LEVEL``); uvicorn's and Celery's loggers pass their records to
    it instead of keeping handlers of their own."""
    level = (level or get_settings().log_level).upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter}},
        "formatters": {"default": {"format": FORMAT}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "default",
                "filters": ["context"],
            }
        },
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {
            **{
                name: {"level": level, "handlers": [], "propagate": True}
                for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery")
            },
            # "setup plugin alembic.autogenerate.…": seven lines at INFO each time a process checks
            # the store's revision (Alembic 1.17's plugins), twice per API process at its start
            "alembic.runtime.plugins": {"level": level if level in ("DEBUG", "ERROR", "CRITICAL") else "WARNING"},
        },
    }


def configure_logging(level: str | None = None) -> None:
    """Apply ``logging_config(level)`` to this process."""
    logging.config.dictConfig(logging_config(level))


# Lines a dependency logs on every import that read as errors but are none (issue 34): torchao's
# wheel ships optional CUDA kernels (mxfp8, CUTLASS) built for other Python and CUDA versions, and
# fails to load them at import (transformers imports torchao whenever it is installed; its int8 path,
# shared.inference.int8, needs none of them); and torchao registers enums with torch's pytree, which
# torch now deprecates. Only these messages are dropped: anything else either logs still shows.
KNOWN_NOISE = {
    "torchao": re.compile(r"^Failed to load .*/torchao/_C\w*\.[\w.-]*so: "),
    "torch.utils._pytree": re.compile(r" is an Enum subclass and is now natively supported by torch\.compile"),
}


class DropKnownNoise(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern`` (``KNOWN_NOISE``)."""

    def __init__(self, pattern: re.Pattern[str]):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def drop_known_noise() -> None:
    """Attach ``DropKnownNoise`` to each logger of ``KNOWN_NOISE``, once; call before those packages are
    imported (``worker/__init__.py`` does, so any import of the worker does)."""
    for name, pattern in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropKnownNoise) for f in logger.filters):
            logger.addFilter(DropKnownNoise(pattern))


DURATIONS = re.compile(r"\d+(?:\.\d+)?\s?(?:ms|s)\b")  # "in 515.080873ms": obstore's retries' time


class Outage:
    """A retried operation's failures as the log tells them: a line when it starts failing, none for
    the tries that fail the same way after it, and one when it works again, with how long it failed.
    A database restart had the loops that retry every second log a traceback a second.

    One per operation that is tried again: each chore of the recovery loop (``shared.queue``), a
    job's lease heartbeat (``worker.tasks``), a worker's writes to the job store
    (``worker.reporter``), the API's shared rate-limit counters (``api.auth``). Not thread-safe: one
    thread calls it, or callers hold a lock.

    Args:
        logger: where the lines go.
        what: the operation, as the lines name it (``"the job store"``, ``"deliver_due"``).
        traceback: log the failure at ERROR with its traceback (for failures a developer must
            read), else at WARNING with its message's first line only (an expected outage).
        per_error: log again, within one outage, when the failure's first line changes (a
            refused connection becomes a full disk), durations aside (obstore's names the
            milliseconds its retries took, different every time).
    """

    def __init__(self, logger: logging.Logger, what: str, *, traceback: bool = True, per_error: bool = True):
        self.logger, self.what, self.traceback, self.per_error = logger, what, traceback, per_error
        self.since: float | None = None
        """``time.monotonic()`` of the outage's first failed try; None while the operation works."""
        self._said: str | None = None  # the first line of the failure logged last, durations as "#"

    @property
    def down(self) -> bool:
        """Whether the last try failed."""
        return self.since is not None

    def failed(self, e: BaseException, then: str) -> None:
        """Count a failed try: log ``"<what> fails (<e's first line>); <then>"`` if it starts an
        outage, or (``per_error``) fails otherwise than the failure logged last. ``then`` says what
        happens meanwhile (``"trying again every 5 s"``)."""
        error = first_line(e)
        kind = DURATIONS.sub("#", error)
        if self.since is None or (self.per_error and kind != self._said):
            level = logging.ERROR if self.traceback else logging.WARNING
            self.logger.log(level, "%s fails (%s); %s", self.what, error, then, exc_info=e if self.traceback else None)
            self._said = kind
        if self.since is None:
            self.since = time.monotonic()

    def ended(self) -> None:
        """Count a try that worked: log ``"<what> works again, after <s> s"`` if it ends an outage."""
        if self.since is not None:
            self.logger.warning("%s works again, after %.1f s", self.what, time.monotonic() - self.since)
            self.since = self._said = None
