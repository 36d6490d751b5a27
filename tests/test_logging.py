"""One logging configuration for the API and the worker (``shared.logs``): every line has its time,
level, logger and the request id (API) or job id (worker) it belongs to; a request's id comes back
in ``X-Request-ID``, and an unhandled error is logged under it and named in the 500 answer."""

import io
import logging
import re
import sys
import threading

import pytest
import uvicorn

from api.request_id import HEADER
from shared.logs import logging_config
from shared.queue import send
from tests.conftest import TINY_MODEL, service_variables, wait_until
from tests.test_api_jobs import labelled_csv, upload

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>\S+) \[(?P<context>[^]]+)] ")


@pytest.fixture
def log_lines():
    """The lines the configured root handler writes, once the configuration is applied as the
    API's server applies it (uvicorn's ``log_config``)."""
    uvicorn.Config("api.main:app", log_config=logging_config("INFO"))  # applies the configuration
    stream = io.StringIO()
    handler = logging.getLogger().handlers[0]
    handler.setStream(stream)
    yield lambda: stream.getvalue().splitlines()
    handler.setStream(sys.stderr)


def test_each_request_gets_an_id_echoed_back(stack):
    first, second = stack.client.get("/models"), stack.client.get("/models")
    assert re.fullmatch(r"[0-9a-f]{32}", first.headers[HEADER]) and first.headers[HEADER] != second.headers[HEADER]
    assert stack.client.get("/models", headers={HEADER: "edge-42.abc"}).headers[HEADER] == "edge-42.abc"
    forged = stack.client.get("/models", headers={HEADER: "x\ty" * 40}).headers[HEADER]
    assert re.fullmatch(r"[0-9a-f]{32}", forged)  # not a sane id: replaced


def test_an_unhandled_error_is_logged_with_time_level_and_request_id(stack, log_lines):
    def boom():
        raise RuntimeError("the disk vanished")

    stack.app.add_api_route("/test-boom", boom)
    from fastapi.testclient import TestClient

    client = TestClient(
        stack.app,
        base_url=str(stack.client.base_url),
        headers=dict(stack.client.headers),
        raise_server_exceptions=False,
    )
    answer = client.get("/test-boom", headers={HEADER: "boom-1"})
    assert answer.status_code == 500 and answer.headers[HEADER] == "boom-1"
    assert answer.json()["error"]["message"].endswith("(request id boom-1)")
    errors = [m for line in log_lines() if (m := LINE.match(line)) and m["level"] == "ERROR"]
    assert [(m["logger"], m["context"]) for m in errors] == [("tunejob.api", "req boom-1")]
    assert "RuntimeError: the disk vanished" in "\n".join(log_lines())  # with its traceback


def test_a_worker_logs_under_the_job_id(stack, log_lines):
    dataset = upload(stack.client, labelled_csv())
    job = stack.client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "training_dataset": dataset["id"],
            "text_column": "text",
            "label_column": "label",
        },
    ).json()
    stack.client.post(f"/jobs/{job['id']}/cancel")
    send(job["id"])  # a message for a job that has ended: the worker skips it, and says so

    def skipped() -> list[re.Match]:
        return [m for line in log_lines() if (m := LINE.match(line)) and "not claimable" in line]

    wait_until(lambda: skipped(), "the worker logged the skipped message")
    assert {(m["logger"], m["context"]) for m in skipped()} == {("worker.tasks", f"job {job['id']}")}
    # the next message's "received" line is the worker's, not the job's it ran last
    send(job["id"])
    wait_until(lambda: len(skipped()) == 2, "the worker logged the second skipped message")
    received = [m for line in log_lines() if (m := LINE.match(line)) and "] received" in line]
    assert [m["context"] for m in received][-1:] == ["-"], log_lines()


def test_loading_a_model_in_the_worker_prints_no_known_noise():
    """torchao's optional CUDA kernels that fail to load, and torch's pytree deprecation, read as
    errors on every worker start (issue 34): dropped; any other line of those loggers still shows."""
    import subprocess
    import sys

    code = (
        "import logging, worker\n"
        "from transformers import AutoModelForSequenceClassification, BertConfig\n"
        "AutoModelForSequenceClassification.from_config(BertConfig(hidden_size=32, num_hidden_layers=1, "
        "num_attention_heads=2, intermediate_size=37))\n"
        "logging.getLogger('torchao').warning('Failed to load something else')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "torchao/_C" not in result.stderr and "Enum subclass" not in result.stderr, result.stderr
    assert "Failed to load something else" in result.stderr


def test_a_worker_s_log_has_no_progress_bars(tmp_path):
    """Each model a worker loaded or saved drew transformers' tqdm bars ("Loading weights",
    "Writing model shards") into its service log; ``preload`` turns them off."""
    import subprocess
    import sys

    code = (
        "import sys, worker.tasks as tasks\n"
        "tasks.available_models = lambda: {}\n"
        "if sys.argv[1] == 'preload': tasks.preload()\n"
        "from transformers import AutoModelForSequenceClassification, BertConfig\n"
        "model = AutoModelForSequenceClassification.from_config(BertConfig(hidden_size=32, num_hidden_layers=1, "
        "num_attention_heads=2, intermediate_size=37))\n"
        f"model.save_pretrained({str(tmp_path)!r})\n"
        f"AutoModelForSequenceClassification.from_pretrained({str(tmp_path)!r})\n"
    )

    def stderr(*args: str) -> str:
        run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return run.stderr

    assert "Loading weights" in stderr("no-preload")  # the bar this test looks for
    quiet = stderr("preload")
    assert "Loading weights" not in quiet and "it/s]" not in quiet, quiet


def test_a_job_handed_back_at_shutdown_is_logged_without_a_traceback(monkeypatch, caplog):
    """A message delivered while the worker shuts down is rejected back to the queue
    (``ShutdownReject``): Celery logs it, as every ``Reject``, at WARNING with its traceback, which
    read as an error at each Ctrl-C of ``tunejob serve``; the line stays, the traceback goes."""
    from celery.app.task import Context
    from celery.app.trace import REJECTED, TraceInfo

    from worker import tasks

    monkeypatch.setattr(tasks, "stopping", threading.Event())
    tasks.stopping.set()
    request = Context(id="t1", hostname="w@h", args=["job_x"], kwargs={})
    with caplog.at_level(logging.WARNING, logger="celery.app.trace"):
        try:
            tasks.run_job("job_x")
        except tasks.ShutdownReject as e:
            assert e.requeue
            TraceInfo(REJECTED, e).handle_reject(tasks.run_job, request)
    [record] = [r for r in caplog.records if r.name == "celery.app.trace"]
    assert "worker shutting down; job job_x left for another worker" in record.getMessage()
    assert record.exc_info is None and not record.exc_text


def test_a_store_check_logs_no_alembic_plugin_lines(tmp_path):
    """Each process that checks the store's revision (the API twice at its start) logged seven
    "setup plugin alembic.autogenerate.…" lines at INFO; the migrations themselves still show."""
    import os
    import subprocess
    import sys

    code = (
        "from shared.logs import configure_logging\n"
        "configure_logging('INFO')\n"
        "from shared.store.engine import upgrade_database\n"
        "upgrade_database()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in service_variables()} | {"TUNEJOB_DATA_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert "Running upgrade" in run.stderr and "setup plugin" not in run.stderr, run.stderr


def test_an_outage_is_logged_when_it_starts_when_it_fails_otherwise_and_when_it_ends(caplog):
    """``Outage``: one line for a run of tries failing the same way (a loop retrying every second
    logged a traceback a second), another when the failure changes (``per_error``), one at the end."""
    from shared.logs import Outage

    logger = logging.getLogger("tests.outage")
    chore = Outage(logger, "chore")
    store = Outage(logger, "the store", traceback=False, per_error=False)
    with caplog.at_level("WARNING", logger="tests.outage"):
        for error in ("refused\nDETAIL: restarting", "refused", "disk full", None, "refused"):
            for outage in (chore, store):
                if error:
                    outage.failed(OSError(error), "trying again")
                else:
                    outage.ended()
    said = [(r.levelname, r.getMessage().split(",")[0], r.exc_info is not None) for r in caplog.records]
    assert said == [
        ("ERROR", "chore fails (refused); trying again", True),
        ("WARNING", "the store fails (refused); trying again", False),
        ("ERROR", "chore fails (disk full); trying again", True),  # the store's outage goes on: not logged
        ("WARNING", "chore works again", False),
        ("WARNING", "the store works again", False),
        ("ERROR", "chore fails (refused); trying again", True),
        ("WARNING", "the store fails (refused); trying again", False),
    ], said
    assert chore.down and store.down


def test_an_outage_whose_message_differs_only_in_its_duration_is_logged_once(caplog):
    """obstore's first line names the milliseconds its retries took: a bucket outage logged a
    traceback at every turn of the recovery loop (47 in two minutes). Other numbers still tell
    failures apart (a status 503 that becomes a 403)."""
    from shared.logs import Outage

    outage = Outage(logging.getLogger("tests.outage"), "clean_up_files")
    with caplog.at_level("WARNING", logger="tests.outage"):
        for ms in ("515.080873", "612.5", "1003"):
            outage.failed(OSError(f"Generic S3 error: GET http://127.0.0.1:19303/b in {ms}ms, after 4 retries"), "")
        outage.failed(OSError("Generic S3 error: access denied"), "")
        for status in (503, 503, 403):
            outage.failed(OSError(f"Generic S3 error: HTTP status {status} in 20ms"), "")
    assert len(caplog.records) == 4, [r.getMessage() for r in caplog.records]


def test_first_line_of_a_wrapped_database_error_is_the_drivers():
    """SQLAlchemy's first line was its own remark on autoflush: a full disk's log lines never said
    "No space left on device"."""
    from sqlalchemy.exc import OperationalError

    from shared.errors import first_line

    wrapped = OperationalError("INSERT", {}, OSError("could not extend file: No space left on device\nHINT: free"))
    wrapped.args = ("(raised as a result of Query-invoked autoflush; consider using a session.no_autoflush block)\n",)
    assert first_line(wrapped) == "could not extend file: No space left on device"
