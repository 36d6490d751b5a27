"""The one settings object, read from ``TUNEJOB_*`` environment variables (pydantic-settings)."""

from functools import cached_property, lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.schemas.jobs import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
)


class Settings(BaseSettings):
    """Service settings. Every field can be set as ``TUNEJOB_<FIELD>`` in the environment.

    On the embedded default (nothing set) all state lives under ``data_dir``: a SQLite job store,
    kombu's filesystem broker, uploads, checkpoints and artifacts.
    """

    model_config = SettingsConfigDict(env_prefix="TUNEJOB_", populate_by_name=True)

    data_dir: Path = Path("~/.tunejob")
    database_url: str | None = None  # default: sqlite:///<data_dir>/tunejob.db
    # PostgreSQL connections each process keeps open (made on demand; none beyond): the API's thread
    # pool (40 threads) waits for one instead of opening and closing extra connections under load.
    # PostgreSQL's max_connections (100 by default) must cover API processes and workers x this.
    database_pool_size: int = 20
    broker_url: str | None = None  # default: filesystem:// under <data_dir>/broker
    # Redis broker: a prefix for every key and channel (kombu's global_keyprefix), so that several
    # deployments (or test runs) share one Redis database without taking each other's messages
    broker_key_prefix: str = ""
    # Fernet keys, comma-separated (the first encrypts), for the secrets stored encrypted (shared.store.sealed);
    # default: <data_dir>/secret_key, made on first use (mode 0600)
    secret_key: str | None = Field(None, repr=False)
    models_dir: Path | None = None  # extra Hugging Face model directories, one per model
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # What precision "auto" means on a CPU: bf16 (true) or fp32 (false); unset: bf16 where the CPU has AMX
    # tiles, where bf16 runs faster than fp32 (shared.inference.precision). false: the same arithmetic on
    # every CPU of a mixed fleet.
    cpu_bf16: bool | None = None
    cpu_reuse_freed_memory: bool = True  # CPU workers: keep freed memory in the heap (worker.device)
    cuda_graphs: bool = True  # CUDA workers replay captured training steps (worker.training.graphs); off: eager
    # ... for jobs whose micro-batches average fewer padded tokens than this (above it the GPU is busy)
    cuda_graphs_max_tokens: int = 8192
    cuda_graph_cache: int = 1  # captured models (with their graphs, weights, optimizer) a worker keeps
    host: str = "127.0.0.1"
    port: int = 8000
    max_upload_bytes: int = 2 * 1024**3  # largest upload, checked while it streams in
    # largest request body other than an upload (JSON: specs, texts to predict or embed), refused with 413
    # before it is read whole, and before authentication (api.body_limit)
    max_request_bytes: int = 16 * 1024**2
    max_dataset_bytes: int = 2 * 1024**3  # largest dataset once decompressed (Parquet), checked in batches
    max_job_seconds: int = 7 * 24 * 3600  # time limit of one training attempt
    predict_part_rows: int = 4096  # rows per results part of a prediction job (each written once, atomically)
    # rows a dry run tokenizes (in the API): a larger file is planned from a random sample, its counts scaled
    dry_run_rows: int = Field(default=20_000, ge=1000)
    visibility_timeout: int | None = None  # Redis: redeliver unacked messages after this; default max_job_seconds + 1h
    lease_seconds: int = 120  # a running job's lease; renewed by the worker's heartbeat
    max_restarts: int = 3  # times a job is resumed after its worker died or failed unexpectedly
    # A job that failed unexpectedly is re-sent after restart_backoff_seconds x 2^(restarts so far):
    # 30 s, 60 s, 120 s by default (worker.tasks.run_claimed_job), not at once.
    restart_backoff_seconds: float = 30.0
    metrics_flush_seconds: float = 2.0  # metrics are buffered and written at most this often
    # How often the API and the workers run the recovery loop (shared.queue.recovery_loop); TUNEJOB_SWEEP_SECONDS,
    # its name before sweeps were hyperparameter sweeps, is still read.
    recovery_seconds: float = Field(
        15.0, validation_alias=AliasChoices("TUNEJOB_RECOVERY_SECONDS", "TUNEJOB_SWEEP_SECONDS")
    )
    resend_after_seconds: float = 600.0  # re-send a queued job's message after this long (lost messages)
    stream_poll_seconds: float = 0.5  # GET /jobs/{id}/stream: how often the one reader of every streamed job polls
    ui_session_hours: float = 12.0  # a dashboard sign-in (/ui) lasts this long (shared.store.ui_sessions)
    stream_heartbeat_seconds: float = 15.0  # GET /jobs/{id}/stream: a comment line this often keeps proxies open
    # Security (docs/production/security.md): Host names the API answers besides the bound host and
    # the localhost forms (comma-separated; "*" turns the check off), and the request rate per API
    # key in the notation of the `limits` library ("100/second", "20/second;1000/minute").
    allowed_hosts: Annotated[list[str], NoDecode] = []
    rate_limit: str = "100/second"
    rate_limit_storage_url: str = "memory://"  # `limits` storage; e.g. redis://… to share it across API processes
    # Caps and quotas (docs/production/security.md, "Limits"). metadata: the OpenAI limits.
    max_metadata_keys: int = MAX_METADATA_KEYS
    max_metadata_key_chars: int = MAX_METADATA_KEY_CHARS
    max_metadata_value_chars: int = MAX_METADATA_VALUE_CHARS
    max_classes: int = 1000
    max_columns: int = 256
    max_active_jobs_per_tenant: int = 50  # queued + running
    max_trials_per_sweep: int = 200  # POST /sweeps: max_trials at most this (shared.jobs.sweeps)
    max_grid_points: int = 100_000  # POST /sweeps, algorithm grid: points at most this (shared.jobs.search_space)
    # POST /sweeps: max_duration_seconds at least this, taken as one evaluation's time: a trial's start (model,
    # data) and its first evaluation, plus the recovery loop's deadline check (recovery_seconds).
    min_sweep_duration_seconds: float = 60.0
    max_storage_bytes_per_tenant: int = 100 * 1024**3  # uploads + checkpoints + artifacts
    # Timeouts. A request that cannot get SQLite's write lock in sqlite_busy_timeout_seconds is
    # answered 503 with Retry-After. HTTP: idle keep-alive connections are closed after
    # http_keep_alive_seconds; a connection must deliver a request's headers within
    # http_header_timeout_seconds of opening (or of its previous response).
    sqlite_busy_timeout_seconds: float = 5.0
    http_keep_alive_seconds: int = 5
    http_header_timeout_seconds: float = 10.0
    # A stopping API (SIGTERM) cancels the requests still running this long after (open streams,
    # a slow upload, whose temporary file is then removed): under a supervisor's grace period
    # (docker-compose.yml's stop_grace_period, Kubernetes' 30 s), so that its SIGKILL never comes first.
    shutdown_grace_seconds: int = Field(20, ge=0)
    # uvicorn's line per request on stderr; off by default: it cost about 5% of the API's CPU under
    # polling load, and GET /metrics counts requests by route and status.
    access_log: bool = False
    # Behind a reverse proxy (docs/production/security.md): uvicorn takes the client's address and
    # scheme from X-Forwarded-For/-Proto sent by these addresses (comma-separated, "*" any; uvicorn's
    # own defaults); `tunejob api|serve --proxy-headers/--no-proxy-headers --forwarded-allow-ips` set them.
    proxy_headers: bool = True
    forwarded_allow_ips: str = "127.0.0.1"
    # The dashboard's session cookie is Secure: true always, false never; unset, when the request came
    # over https (as uvicorn sees it: through a proxy, only with the proxy headers trusted above).
    cookie_secure: bool | None = None
    log_level: str = "INFO"  # the API's and the workers' log lines (shared.logs), e.g. DEBUG, INFO, WARNING
    artifact_retention_days: float | None = None  # remove finished jobs' files this long after they end; None: keep
    # Object storage (shared.store.objects, docs/production/topology.md): s3://bucket/prefix keeps
    # uploads, checkpoints, models and prediction results in that bucket (credentials and endpoint:
    # the standard AWS_* variables); None: in data_dir. Each host's download cache holds at most
    # storage_cache_bytes (least recently used evicted). storage_presigned_seconds: single-file
    # downloads redirect (307) to a presigned URL valid this long instead of streaming through the API.
    # storage_timeout_seconds: a request to the bucket that receives nothing for this long fails
    # (an upload: its part sent and answered within it), and a failed request is tried again for
    # at most this long; a transfer that keeps moving is never cut short, however long it takes.
    storage_url: str | None = None
    storage_cache_bytes: int = 20 * 1024**3
    storage_presigned_seconds: int | None = None
    storage_timeout_seconds: float = Field(default=30.0, gt=0)
    broker_polling_seconds: float = 0.1  # filesystem broker: how often an idle worker looks for a message
    # POST /models/{job_id}/predict, answered by the API process on its CPU (api.routers.inference):
    # texts per request, fine-tuned models kept loaded (least recently used evicted), and torch's
    # CPU threads in the API process (None: half the cores, at least 1; the rest serve requests).
    max_sync_inputs: int = 64
    sync_model_cache: int = 2
    # Prediction jobs: models a worker keeps loaded between them (least recently used evicted), so a
    # model's second job pays neither its load nor int8's compile; a training job on CUDA empties it.
    worker_model_cache: int = 1
    sync_predict_threads: int | None = None

    # Webhooks (shared.jobs.webhooks): loopback, link-local and private URLs are refused unless
    # allowed; each attempt waits this long for an answer; a failed one is tried again after each
    # of these delays in turn (Svix's schedule, about 27.6 h in all: comma-separated seconds), then
    # it is failed; the API looks for due deliveries this often.
    webhooks_allow_private_urls: bool = False
    webhooks_timeout_seconds: float = 10.0  # one attempt in all: resolving, connecting, sending, reading the answer
    webhooks_senders: int = 16  # attempts in flight at once per API process (shared.jobs.webhooks)
    max_webhooks_per_tenant: int = 20  # POST /webhooks: endpoints per tenant
    webhooks_log_retention_days: float = 30.0  # ended deliveries are deleted this long after they were stored
    webhooks_retry_seconds: Annotated[list[float], NoDecode] = [5, 300, 1800, 7200, 18000, 36000, 36000]
    webhooks_poll_seconds: float = 1.0

    @field_validator("webhooks_retry_seconds", mode="before")
    @classmethod
    def _seconds_list(cls, value):
        return [float(v) for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @field_validator("storage_url")
    @classmethod
    def _s3_url(cls, value):
        if value is not None and not value.startswith("s3://"):
            raise ValueError("TUNEJOB_STORAGE_URL must be s3://bucket/prefix")
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        return [h.strip() for h in value.split(",") if h.strip()] if isinstance(value, str) else value

    @cached_property  # resolving walks the file system: once per settings object, not per query
    def data_path(self) -> Path:
        return self.data_dir.expanduser().resolve()

    @cached_property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_path / 'tunejob.db'}"

    @property
    def celery_broker_url(self) -> str:
        return self.broker_url or "filesystem://localhost//"  # a host named: kombu warns without one

    @property
    def uses_filesystem_broker(self) -> bool:
        return self.celery_broker_url.startswith("filesystem://")

    def path(self, *parts: str) -> Path:
        """A path under the data directory, its parent created."""
        p = self.data_path.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p


@lru_cache
def get_settings() -> Settings:
    return Settings()
