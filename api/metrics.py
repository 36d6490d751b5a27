"""Prometheus metrics at ``GET /metrics`` (text exposition format).

- HTTP requests, by route template (``handler``), method and status: ``http_requests_total`` and
  the ``http_request_duration_seconds`` histogram, recorded by prometheus-fastapi-instrumentator's
  middleware.
- The job store, read once per scrape by ``StoreCollector`` (``shared.store.monitoring.snapshot``), never
  per request: jobs by status, queue depth and the oldest queued job's wait, and each running
  job's step, tokens/s, padding efficiency, memory and heartbeat age.

Each app has its own registry (``app.state.metrics_registry``), so apps built in one process (the
tests) do not share or clash. Under ``tunejob api --workers N`` (N processes) the command sets
``PROMETHEUS_MULTIPROC_DIR`` to a fresh directory: prometheus_client then keeps each process's
counters and histograms in files there, and a scrape, whichever process answers it, adds up every
process's (``MultiProcessCollector``), so the counts stay right across processes; a process that
exits marks its files dead (``process_exiting``). The job-store gauges are not per process: they
are read from the store at scrape time. Names and units follow the Prometheus naming guide (base units:
seconds, bytes; ``_total`` for counters).
"""

import logging
import os

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics
from sqlalchemy.exc import SQLAlchemyError

from api.auth import CallerDep
from api.errors import error_responses
from shared.errors import UserError
from shared.store.monitoring import StoreSnapshot, snapshot

log = logging.getLogger("tunejob.api")
disable_created_metrics()  # no `_created` series beside every counter and histogram: nothing here reads them
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
MIB = 2**20

router = APIRouter(tags=["monitoring"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition format",
        },
        **error_responses(403),
    },
)
def metrics(request: Request, caller: CallerDep) -> Response:
    """The service's Prometheus metrics, for admin keys (they cover every tenant's jobs); the
    job-store gauges are read now, at scrape time.

    403 ``admin_key_required`` for any other key."""
    if not caller.admin:
        raise UserError(
            "admin_key_required",
            "GET /metrics covers every tenant: it needs an admin key (`tunejob keys create --tenant ops --admin`)",
            "Authorization",
            status=403,
        )
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)


def install_metrics(app: FastAPI) -> None:
    """Record HTTP metrics for every request of ``app`` and serve them, with the job store's
    gauges, at ``/metrics``."""
    registry = CollectorRegistry()
    instrumentator = Instrumentator(should_group_status_codes=False, registry=registry)
    instrumentator.add(http_metrics.requests(registry=registry))
    instrumentator.add(http_metrics.latency(should_include_status=True, buckets=LATENCY_BUCKETS, registry=registry))
    instrumentator.instrument(app)
    if multiprocess_mode():  # the values are in files; this registry would hold this process's only
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    registry.register(StoreCollector())
    app.state.metrics_registry = registry
    app.include_router(router)


def multiprocess_mode() -> bool:
    """Whether this API process is one of several (``tunejob api --workers N``, which sets
    ``PROMETHEUS_MULTIPROC_DIR``)."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


def process_exiting() -> None:
    """At the end of an API process: in multiprocess mode, drop its live gauges' files (prometheus_client's
    ``mark_process_dead``; its counters and histograms stay counted)."""
    if multiprocess_mode():
        multiprocess.mark_process_dead(os.getpid())


def _gauge(name: str, help_: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_, labels=list(labels))


class StoreCollector(Collector):
    """Gauges read from the job store at scrape time. When the store does not answer, only
    ``tunejob_store_up 0`` is exported (and the error is logged), so the scrape itself succeeds."""

    def collect(self):
        up = _gauge("tunejob_store_up", "1 if the job store answered this scrape's queries, else 0")
        try:
            state = snapshot()
        except SQLAlchemyError:
            log.exception("metrics: the job store did not answer")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from store_metrics(state)


def store_metrics(state: StoreSnapshot) -> list[GaugeMetricFamily]:
    """The job-store metric families of one snapshot (names documented in docs/production/monitoring.md)."""
    jobs = _gauge("tunejob_jobs", "Jobs in the store, by status", ("status",))
    for status, count in state.jobs_by_status.items():
        jobs.add_metric([status], count)
    depth = _gauge("tunejob_queue_depth", "Jobs waiting for a worker (status queued)")
    depth.add_metric([], state.jobs_by_status["queued"])
    oldest = _gauge(
        "tunejob_queue_oldest_age_seconds",
        "How long the longest-waiting queued job has waited since it (re-)entered the queue; 0 when none",
    )
    oldest.add_metric([], state.oldest_queued_seconds)

    info = _gauge(
        "tunejob_job_info",
        "A running job: its base model, device and worker (value 1)",
        ("job_id", "base_model", "device", "worker"),
    )
    per_job = {
        "step": _gauge("tunejob_job_step", "Optimizer steps done by a running job", ("job_id",)),
        "total_steps": _gauge("tunejob_job_total_steps", "Optimizer steps a running job will take", ("job_id",)),
        "tokens_per_second": _gauge(
            "tunejob_job_tokens_per_second", "Real (non-padding) tokens per second of training time so far", ("job_id",)
        ),
        "padding_efficiency": _gauge(
            "tunejob_job_padding_efficiency", "Real tokens / padded tokens so far (1 = no padding)", ("job_id",)
        ),
        "memory_mb": _gauge(
            "tunejob_job_memory_bytes",
            "Memory in use at the latest step: CUDA tensors on a GPU, worker RSS on the CPU",
            ("job_id",),
        ),
        "peak_memory_mb": _gauge(
            "tunejob_job_peak_memory_bytes",
            "Peak memory: CUDA max_memory_allocated on a GPU, worker max RSS on the CPU",
            ("job_id",),
        ),
        "heartbeat_age_seconds": _gauge(
            "tunejob_job_heartbeat_age_seconds", "Seconds since the job's worker last renewed its lease", ("job_id",)
        ),
    }
    for job in state.running:
        info.add_metric([job.id, job.base_model, job.device or "", job.worker or ""], 1)
        values = {
            **job.train_metrics,
            "step": job.step,
            "total_steps": job.total_steps,
            "heartbeat_age_seconds": job.heartbeat_age_seconds,
        }
        for key, family in per_job.items():
            value = values.get(key)
            if value is not None:
                family.add_metric([job.id], value * MIB if key.endswith("memory_mb") else value)
    return [jobs, depth, oldest, info, *per_job.values()]
