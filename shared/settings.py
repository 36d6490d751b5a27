"""The one settings object, read from ``TUNEJOB_*`` environment variables (pydantic-settings)."""

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Service settings. Every field can be set as ``TUNEJOB_<FIELD>`` in the environment.

    On the embedded default (nothing set) all state lives under ``data_dir``: a SQLite job store,
    kombu's filesystem broker, uploads, checkpoints and artifacts.
    """

    model_config = SettingsConfigDict(env_prefix="TUNEJOB_")

    data_dir: Path = Path("~/.tunejob")
    database_url: str | None = None  # default: sqlite:///<data_dir>/tunejob.db
    broker_url: str | None = None  # default: filesystem:// under <data_dir>/broker
    models_dir: Path | None = None  # extra Hugging Face model directories, one per model
    device: Literal["auto", "cuda", "cpu"] = "auto"
    cpu_reuse_freed_memory: bool = True  # CPU workers: keep freed memory in the heap (worker.device)
    host: str = "127.0.0.1"
    port: int = 8000
    max_upload_bytes: int = 2 * 1024**3
    max_job_seconds: int = 7 * 24 * 3600  # time limit of one training attempt
    visibility_timeout: int | None = None  # Redis: redeliver unacked messages after this; default max_job_seconds + 1h
    lease_seconds: int = 120  # a running job's lease; renewed by the worker's heartbeat
    max_restarts: int = 3  # times a job is resumed after its worker died or failed unexpectedly
    metrics_flush_seconds: float = 2.0  # metrics are buffered and written at most this often
    sweep_seconds: float = 15.0  # how often API and workers run the reaper/sweeper (shared.jobs.recover)
    resend_after_seconds: float = 600.0  # re-send a queued job's message after this long (lost messages)

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser().resolve()

    @property
    def sqlalchemy_url(self) -> str:
        return self.database_url or f"sqlite:///{self.data_path / 'tunejob.db'}"

    @property
    def celery_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

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
