"""A streamed download (``model.tar``, ``model.tar.gz``, a model file, a checkpoint, a prediction's
results) that fails after its headers were sent: the client sees the connection cut (never a clean
end of the body), and the API logs it once: one WARNING line for a known failure (the bucket failed,
an object no longer matches its manifest), one traceback for an unexpected one, and never uvicorn's
"Exception in ASGI application" on top.

The API runs under uvicorn (in a thread, with the production protocol, ``api.server.HeaderDeadline``)
on an embedded store; the files a route streams are objects in an in-memory obstore bucket."""

import hashlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import obstore
import pytest
from obstore.exceptions import GenericError
from obstore.store import MemoryStore

from shared.store.objects import CHUNK, Remote
from tests.conftest import auth_header, service_variables
from tests.faults_support import free_port

JOB, PREDICTION, REQUEST_ID = "job_streamcut", "pred_streamcut", "stream-cut-1"
WEIGHTS = os.urandom(3 * CHUNK + 1000)
# obstore's messages are pages of Rust debug output; the log line keeps the first line
S3_FAILURE = 'Generic S3 error: error decoding response body\n\nDebug source:\nGeneric {\n    store: "S3",\n}'


@dataclass(frozen=True)
class FailingRemote(Remote):
    """An object whose download fails after its first ``CHUNK`` bytes: ``error`` is raised in place of
    the rest (``chunks`` as ``model.tar.gz`` reads it, in a thread; ``achunks`` as the other routes do)."""

    error: Exception = GenericError(S3_FAILURE)

    def chunks(self) -> Iterator[memoryview]:
        yield next(super().chunks())[:CHUNK]
        raise self.error

    async def achunks(self) -> AsyncIterator[memoryview]:
        async for view in super().achunks():
            yield view[:CHUNK]
            raise self.error


def weights(fault: str) -> Remote:
    """``model.safetensors`` in a bucket of its own: as the manifest says, or with ``fault``:
    ``storage`` (the bucket fails after the first chunk), ``manifest`` (other bytes of the same size
    than the manifest's sha256), ``bug`` (a RuntimeError after the first chunk)."""
    bucket = SimpleNamespace(store=MemoryStore())
    obstore.put(bucket.store, "model.safetensors", os.urandom(len(WEIGHTS)) if fault == "manifest" else WEIGHTS)
    args = dict(bucket=bucket, key="model.safetensors", size=len(WEIGHTS), mtime=0.0)
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    if fault == "storage":
        return FailingRemote(**args, sha256=sha256)  # type: ignore[arg-type]
    if fault == "bug":
        return FailingRemote(**args, sha256=sha256, error=RuntimeError("a bug"))  # type: ignore[arg-type]
    return Remote(**args, sha256=sha256)  # type: ignore[arg-type]


@dataclass
class Served:
    url: str
    server: Any  # uvicorn.Server

    def settled(self, timeout: float = 10) -> None:
        """Wait until the server has done with every request: it logs an exception raised after a
        complete response (a 500's) once the client may already have read that response."""
        deadline = time.monotonic() + timeout
        while self.server.server_state.tasks:
            assert time.monotonic() < deadline, "uvicorn still handling a request"
            time.sleep(0.01)


@pytest.fixture
def api(tmp_path, monkeypatch) -> Iterator[Served]:
    """The API under uvicorn on an embedded store in ``tmp_path``."""
    import uvicorn

    from api.main import create_app
    from api.server import HeaderDeadline
    from shared.settings import get_settings
    from shared.store.engine import upgrade_database

    for key in service_variables():
        monkeypatch.delenv(key)
    monkeypatch.setenv("TUNEJOB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("TUNEJOB_RATE_LIMIT", "1000000/second")
    get_settings.cache_clear()
    upgrade_database()
    # uvicorn's records reach the root logger (caplog), however an earlier test configured them
    for name in ("uvicorn", "uvicorn.error", "tunejob", "tunejob.api"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
        monkeypatch.setattr(logging.getLogger(name), "disabled", False)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(), host="127.0.0.1", port=free_port(), lifespan="off", log_config=None, http=HeaderDeadline
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield Served(f"http://127.0.0.1:{server.config.port}", server)
    finally:
        server.should_exit = True
        thread.join(30)
        get_settings.cache_clear()


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Set the fault (``files("storage")``) of the job's model, its checkpoint and the prediction's results."""
    from shared.jobs import models

    config = tmp_path / "config.json"
    config.write_text('{"model_type": "bert"}')

    def model(fault: str) -> None:
        remote = weights(fault)
        monkeypatch.setattr(
            models, "model_files", lambda *_, **__: {"config.json": config, "model.safetensors": remote}
        )
        monkeypatch.setattr(models, "get_checkpoint", lambda *_: {"config.json": config, "model.safetensors": remote})

        def results(*_) -> Iterator[bytes]:
            yield b'{"id": "0", "label": "sports"}\n'
            raise GenericError(S3_FAILURE)

        monkeypatch.setattr("api.routers.predictions.results_stream", results)

    return model


def download(base_url: str, path: str) -> tuple[int, Exception | None]:
    """GET ``path``: the body's bytes received, and the error that ended it (None: a complete body)."""
    headers = {**auth_header("tenant-a"), "X-Request-ID": REQUEST_ID}
    received = 0
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        with client.stream("GET", path) as r:
            assert r.status_code == 200, r.read()
            try:
                for chunk in r.iter_raw():
                    received += len(chunk)
            except httpx.RemoteProtocolError as e:  # the connection was closed mid-body
                return received, e
    return received, None


def the_one_record(caplog) -> logging.LogRecord:
    """The one record at WARNING or above (the download's: nothing else logs meanwhile)."""
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1, [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records]
    return records[0]


@pytest.mark.parametrize(
    "path, what",
    [
        (f"/jobs/{JOB}/artifacts/model.tar", f"job {JOB} model.tar"),
        (f"/jobs/{JOB}/artifacts/model.tar.gz", f"job {JOB} model.tar.gz"),
        (f"/jobs/{JOB}/artifacts/model/model.safetensors", f"job {JOB} model/model.safetensors"),
        (f"/jobs/{JOB}/checkpoints/7/model.tar", f"job {JOB} checkpoint 7"),
        (f"/predictions/{PREDICTION}/results?format=jsonl", f"prediction {PREDICTION} results.jsonl"),
    ],
)
def test_a_bucket_failing_mid_stream_cuts_the_download_and_logs_one_line(api, files, caplog, path, what):
    from shared.logs import ContextFilter

    files("storage")
    caplog.handler.addFilter(ContextFilter())  # record.context: the request id the line is logged under
    received, error = download(api.url, path)
    assert error is not None and received > 0, "the body ended cleanly: the client would think it complete"
    record = the_one_record(caplog)
    assert (record.name, record.levelno, record.exc_info) == ("tunejob.api", logging.WARNING, None)
    assert record.getMessage() == (
        f"download of {what} cut after {received:,} bytes: storage unavailable: "
        "Generic S3 error: error decoding response body"
    )
    assert record.context == f"req {REQUEST_ID}"


@pytest.mark.parametrize("name", ["model.tar", "model/model.safetensors"])
def test_an_object_that_no_longer_matches_its_manifest_cuts_the_download_and_logs_one_line(api, files, caplog, name):
    """A single file's last chunk is held back until its sha256 is checked: sent first, the body had
    its whole Content-Length and looked complete (a tar's padding and trailer still follow)."""
    files("manifest")
    received, error = download(api.url, f"/jobs/{JOB}/artifacts/{name}")
    assert error is not None, "the body ended cleanly: the client would think it complete"
    assert received < len(WEIGHTS) or name == "model.tar"
    record = the_one_record(caplog)
    assert (record.name, record.levelno, record.exc_info) == ("tunejob.api", logging.WARNING, None)
    message = record.getMessage()
    assert message.startswith(f"download of job {JOB} {name} cut after {received:,} bytes: object model.safetensors")
    assert "does not match its manifest" in message and "\n" not in message


def test_an_unexpected_error_mid_stream_logs_its_traceback_once(api, files, caplog):
    files("bug")
    received, error = download(api.url, f"/jobs/{JOB}/artifacts/model.tar")
    assert error is not None and received > 0, "the body ended cleanly"
    record = the_one_record(caplog)
    assert (record.name, record.levelno) == ("tunejob.api", logging.ERROR)
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    assert (
        record.getMessage() == f"download of job {JOB} model.tar failed after {received:,} bytes: RuntimeError: a bug"
    )
    assert "Exception in ASGI application" not in caplog.text


def test_an_unhandled_error_before_the_response_is_one_500_and_one_traceback(api, monkeypatch, caplog):
    """Starlette raises the exception again after the handler's 500 has been sent, and uvicorn
    logged it a second time ("Exception in ASGI application"): every 500 was two tracebacks."""
    from shared.jobs import models

    def broken(*_, **__):
        raise RuntimeError("a bug")

    monkeypatch.setattr(models, "model_files", broken)
    with httpx.Client(base_url=api.url, headers=auth_header("tenant-a"), timeout=30) as client:
        r = client.get(f"/jobs/{JOB}/artifacts/model.tar")
    api.settled()
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    record = the_one_record(caplog)
    assert (record.name, record.levelno) == ("tunejob.api", logging.ERROR)
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    assert "Exception in ASGI application" not in caplog.text
