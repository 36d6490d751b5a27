"""Test fixtures: a tiny BERT built at test time, and the service stacks the API tests run on.

``stack`` runs each API test module twice: on the embedded default (SQLite + kombu's filesystem
broker) and on PostgreSQL + Redis. The second skips, with the reason, when those services are not
reachable, unless ``TUNEJOB_REQUIRE_SERVICES=1`` (set by ``.ci/run``), which makes it fail instead.
Its ``client`` sends a (non-admin) API key of the tenant ``stack.tenant``; ``stack.client_for``
makes clients with keys of other tenants, or admin keys.
"""

import gc
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import psycopg
import pytest
import redis
from celery.contrib.testing.worker import start_worker
from cryptography.fernet import Fernet
from fastapi import FastAPI
from fastapi.testclient import TestClient

from worker.doctor import build_tiny_bert
from worker.reporter import MemoryReporter as RecordingReporter  # noqa: F401 (the tests' name for it)

POSTGRES_URL = os.environ.get("TUNEJOB_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TUNEJOB_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
REQUIRE_SERVICES = os.environ.get("TUNEJOB_REQUIRE_SERVICES") == "1"
# Celery's keys in the test Redis database live under a prefix of this process's own (kombu's
# global_keyprefix, ``TUNEJOB_BROKER_KEY_PREFIX``): concurrent runs, and the workers of one
# pytest-xdist run, never take each other's messages, and no test flushes the database. Named after
# the process, not a random id: pytest imports this file twice (as ``conftest`` and, for the test
# modules, ``tests.conftest``), and both copies must clean up the same keys.
REDIS_RUN_PREFIX = f"tunejob-test:{socket.gethostname()}:{os.getpid()}:"
# The tests' own TUNEJOB_* variables: what they run against and where they write, not the service's
# settings, so no stack's set-up (``configure``) drops them. And one service setting the whole suite
# pins, subprocesses included: precision auto is fp32 on every CPU (TUNEJOB_CPU_BF16=false), so that
# no figure a test checks depends on whether the machine has AMX (where auto is bf16); the tests of
# that choice set it themselves.
TEST_VARIABLES = frozenset(
    {
        "TUNEJOB_REQUIRE_SERVICES",
        "TUNEJOB_UI_SCREENSHOTS",
        "TUNEJOB_CHROMIUM",
        "TUNEJOB_TEST_POSTGRES_URL",
        "TUNEJOB_TEST_REDIS_URL",
        "TUNEJOB_CPU_BF16",
    }
)
os.environ["TUNEJOB_CPU_BF16"] = "false"
TINY_MODEL = "tiny-bert"
BASE_URL = "http://localhost"  # a Host the API answers (TestClient's default, "testserver", is refused)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_tiny_bert(root / TINY_MODEL)
    return root


def pytest_collection_finish(session) -> None:
    """Move everything alive after collection (torch, transformers, every test module: about 900,000
    objects) to the garbage collector's permanent generation (``gc.freeze``), so that no collection
    walks them again. The worker calls ``gc.collect()`` after every job (``release_device_memory``),
    which in a process holding the whole suite took seconds, holding the GIL the in-process API and
    the test also need; and so did every automatic full collection."""
    gc.collect()
    gc.freeze()


def services_unavailable() -> str | None:
    """Why PostgreSQL or Redis cannot be used, or None when both answer."""
    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=2).close()
    except psycopg.Error as e:
        return f"PostgreSQL at {POSTGRES_URL} is not reachable ({e.__class__.__name__})"
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as e:
        return f"Redis at {REDIS_URL} is not reachable ({e.__class__.__name__})"
    return None


def require_services() -> None:
    reason = services_unavailable()
    if reason is None:
        return
    if REQUIRE_SERVICES:
        pytest.fail(f"{reason}, and TUNEJOB_REQUIRE_SERVICES=1 makes these tests mandatory")
    pytest.skip(f"{reason}; set TUNEJOB_REQUIRE_SERVICES=1 to make this a failure")


def redis_broker_env() -> dict[str, str]:
    """The settings of a Redis broker with an empty namespace of its own in the test Redis database."""
    return {"TUNEJOB_BROKER_URL": REDIS_URL, "TUNEJOB_BROKER_KEY_PREFIX": f"{REDIS_RUN_PREFIX}{uuid.uuid4().hex[:8]}:"}


def pytest_sessionfinish(session) -> None:
    """Delete the keys this process's brokers left in the test Redis database."""
    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        keys = list(client.scan_iter(f"{REDIS_RUN_PREFIX}*", count=1000))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass  # nothing to delete where Redis is not reachable


def fresh_postgres_database() -> tuple[str, callable]:
    """Create an empty database for one test module; returns its SQLAlchemy URL and a drop function."""
    name = f"tunejob_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = POSTGRES_URL.rsplit("/", 1)[0]

    def drop() -> None:
        from shared.store.cache import PostgresCache, cache_for
        from shared.store.engine import engine_for

        PostgresCache.close_all()  # their listeners end when the drop below closes their connections
        cache_for.cache_clear()
        engine_for(f"postgresql+psycopg://{base.split('://', 1)[1]}/{name}").dispose()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"postgresql+psycopg://{base.split('://', 1)[1]}/{name}", drop


@dataclass
class Stack:
    name: str
    client: TestClient  # sends a key of ``tenant``
    data_dir: Path
    app: FastAPI
    tenant: str = "tenant-a"

    def client_for(self, tenant: str, admin: bool = False) -> TestClient:
        """A client of the same app with a new API key for ``tenant`` (an admin key if ``admin``)."""
        return TestClient(self.app, base_url=BASE_URL, headers=auth_header(tenant, admin))


def auth_header(tenant: str, admin: bool = False) -> dict[str, str]:
    """``Authorization`` with a new API key for ``tenant`` in the configured store."""
    from shared.store.keys import create_key

    key, _ = create_key(tenant, admin)
    return {"Authorization": f"Bearer {key}"}


def service_variables() -> list[str]:
    """The TUNEJOB_* variables set now that configure the service (all but ``TEST_VARIABLES``)."""
    return [k for k in os.environ if k.startswith("TUNEJOB_") and k not in TEST_VARIABLES]


@pytest.fixture
def no_tunejob_env(monkeypatch):
    """No TUNEJOB_* variable but ``TEST_VARIABLES``, for a test that builds ``Settings`` itself:
    an earlier test file in the same process (an xdist worker runs several) leaves its stack's
    variables in the environment (``configure``)."""
    for key in service_variables():
        monkeypatch.delenv(key)


def configure(env: dict[str, str]) -> None:
    """Point settings, the job store and the Celery app at ``env`` (TUNEJOB_* variables): every
    other service variable is dropped, ``TEST_VARIABLES`` are kept."""
    for key in service_variables():
        del os.environ[key]
    os.environ.update(env)
    from shared.queue import app, celery_config
    from shared.settings import get_settings

    get_settings.cache_clear()
    app.conf.update(celery_config(get_settings()))
    app._pool = None  # drop broker connections made for the previous stack
    app.amqp._producer_pool = None


def configure_stack(kind: str, env: dict[str, str]) -> callable:
    """``configure`` ``env`` on the stack ``kind`` ("embedded", or "postgres+redis": a fresh
    database and an empty Redis namespace, ``redis_broker_env``); returns what drops the database afterwards (or does nothing).
    An in-process client sends requests faster than any default rate limit allows; the limit itself
    is tested in test_auth.py."""
    env, drop = {"TUNEJOB_DEVICE": "cpu", "TUNEJOB_RATE_LIMIT": "1000000/second", **env}, (lambda: None)
    if kind == "postgres+redis":
        require_services()
        database_url, drop = fresh_postgres_database()
        env.update(
            TUNEJOB_DATABASE_URL=database_url, **redis_broker_env(), TUNEJOB_SECRET_KEY=Fernet.generate_key().decode()
        )  # required on PostgreSQL (shared.store.sealed)
    configure(env)
    return drop


@pytest.fixture(scope="module", params=["embedded", "postgres+redis"])
def stack(request, tmp_path_factory, models_dir) -> Iterator[Stack]:
    """The API (in-process, over HTTP via TestClient) and a real Celery worker thread."""
    data_dir = tmp_path_factory.mktemp("data")
    cleanup = configure_stack(
        request.param,
        {
            "TUNEJOB_DATA_DIR": str(data_dir),
            "TUNEJOB_MODELS_DIR": str(models_dir),
            "TUNEJOB_METRICS_FLUSH_SECONDS": "0.2",
        },
    )
    from api.main import create_app
    from worker.tasks import app as celery_app

    app = create_app()
    try:
        with (
            TestClient(app, base_url=BASE_URL) as client,
            start_worker(celery_app, pool="solo", perform_ping_check=False, loglevel="WARNING", shutdown_timeout=60),
        ):
            stack = Stack(request.param, client, data_dir, app)
            client.headers.update(auth_header(stack.tenant))  # the store is migrated once the client started
            yield stack
    finally:
        cleanup()


def wait_for_status(
    client: TestClient, job_id: str, statuses: set[str], timeout: float = 180, path: str = "/jobs"
) -> dict:
    """Poll ``GET {path}/{id}`` (a job, or with ``path="/predictions"`` a prediction) until it reaches
    one of ``statuses``."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"{path}/{job_id}").json()
        if job["status"] in statuses:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {job['status']} after {timeout}s: {job}")
        time.sleep(0.2)


def wait_until(condition, what: str, timeout: float = 30) -> None:
    """Poll ``condition()`` until it is true (e.g. a clean-up that follows a status change)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout}s: {what}")
        time.sleep(0.1)


@pytest.fixture
def engine_env(models_dir, tmp_path, monkeypatch) -> Path:
    """Settings for driving the training engine in-process: the tiny model, a private data
    directory, the CPU. Returns the data directory."""
    from shared.settings import get_settings

    for key in service_variables():
        monkeypatch.delenv(key)
    monkeypatch.setenv("TUNEJOB_MODELS_DIR", str(models_dir))
    monkeypatch.setenv("TUNEJOB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TUNEJOB_DEVICE", "cpu")
    get_settings.cache_clear()
    yield tmp_path / "data"
    get_settings.cache_clear()


def no_dropout(model) -> None:
    """Dropout off in every module, whatever mode the training code puts the model in."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
