"""Real processes for the fault tests (``tests/test_faults.py``): the API and Celery workers as
subprocesses (``python -m tunejob api|worker``), a private ``redis-server``, and bounded waits.
``Cluster.http`` sends the local API key that the API process writes to ``<data dir>/api_key``.

Every process writes stdout and stderr to its own log file; ``Cluster.diagnostics()`` returns the
tails of all of them, and every timed-out wait puts them in its assertion message.
"""

import io
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import service_variables

ROOT = Path(__file__).resolve().parent.parent
FINISHED = {"succeeded", "failed", "cancelled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 80) -> str:
    """The last ``lines`` lines of a log, without the API's access-log lines for successful requests."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    kept = [line for line in text.splitlines() if not re.search(r'HTTP/1\.1" 20[01] ', line)]
    return "\n".join(kept[-lines:])


def wait_for(
    what: str,
    predicate: Callable[[], Any],
    timeout: float,
    interval: float = 0.2,
    diagnostics: Callable[[], str] = lambda: "",
) -> Any:
    """Call ``predicate`` until it returns something truthy (returned), for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{diagnostics()}")
        time.sleep(interval)


class Process:
    """A subprocess whose output goes to ``log``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path):
        self.name, self.args, self.log = name, args, log
        self._log_file = open(log, "ab")
        self.popen = subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it is still running after ``timeout`` s."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL (a crash, or teardown) and reap it."""
        if self.alive():
            self.popen.kill()
        self.wait(30)
        self._log_file.close()

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s."""
        if self.alive():
            self.popen.terminate()
            if self.wait(timeout) is None:
                self.popen.kill()
        self.kill()

    def tail(self, lines: int = 80) -> str:
        state = "running" if self.alive() else f"exited {self.popen.returncode}"
        return f"----- {self.name} (pid {self.pid}, {state}) {self.log} -----\n{tail(self.log, lines)}"


class RedisServer:
    """A private ``redis-server`` on a free port, which a test may stop and start again."""

    def __init__(self, workdir: Path, appendonly: bool = False):
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port, self.appendonly = free_port(), appendonly
        self.process: Process | None = None
        self.starts = 0

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 20) -> None:
        self.starts += 1
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.dir),
        ]
        self.process = Process(f"redis-{self.starts}", args, dict(os.environ), self.dir / f"redis-{self.starts}.log")
        wait_for(f"redis-server on port {self.port}", self.ping, timeout, 0.05, self.process.tail)

    def ping(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """SIGTERM: redis writes its append-only file and exits."""
        if self.process is not None:
            self.process.stop(timeout=15)


class Cluster:
    """One service stack for one test: an API process, any number of worker processes, all with
    the same ``TUNEJOB_*`` environment, and an HTTP client for the API."""

    def __init__(self, name: str, workdir: Path, env: dict[str, str]):
        self.name, self.workdir = name, workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in service_variables()}
        # One thread per process: two workers and the API share two cores, and the model is tiny.
        # The tests poll every few milliseconds, faster than the default rate limit per API key.
        self.env = {
            **base,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TQDM_DISABLE": "1",
            "TUNEJOB_RATE_LIMIT": "1000000/second",
            **env,
        }
        self.processes: list[Process] = []
        self.extra_logs: list[Callable[[], str]] = []
        self.api: Process | None = None
        self.http: httpx.Client | None = None
        self._count: dict[str, int] = {}

    # ------------------------------------------------------------------ processes

    def _spawn(self, kind: str, args: list[str]) -> Process:
        n = self._count[kind] = self._count.get(kind, 0) + 1
        name = f"{kind}-{n}"
        process = Process(name, [sys.executable, "-m", "tunejob", *args], self.env, self.workdir / f"{name}.log")
        self.processes.append(process)
        return process

    def start(self, workers: int = 1, timeout: float = 90) -> list[Process]:
        """Migrate the job store, then start the API and ``workers`` workers side by side (each
        would run the migrations itself on start; run first, they find nothing to do). Returns
        the workers once the API answers."""
        self.python("from shared.store.engine import upgrade_database; upgrade_database()")
        port = free_port()
        self.api = self._spawn("api", ["api", "--host", "127.0.0.1", "--port", str(port)])
        started = [self.start_worker() for _ in range(workers)]
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

        def healthy() -> bool:
            assert self.api.alive(), f"the API exited\n{self.diagnostics()}"
            try:
                return self.http.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        self.wait_for("the API to answer /healthz", healthy, timeout)
        # On 127.0.0.1 with no key in the store, the API wrote a local key before it listened.
        key = Path(self.env["TUNEJOB_DATA_DIR"]) / "api_key"
        self.http.headers["Authorization"] = f"Bearer {key.read_text().strip()}"
        return started

    def start_worker(self) -> Process:
        return self._spawn("worker", ["worker"])

    def wait_worker_ready(self, worker: Process, timeout: float = 90) -> None:
        """Until Celery has connected and consumes (its ``ready.`` line)."""

        def ready() -> bool:
            assert worker.alive(), f"{worker.name} exited\n{self.diagnostics()}"
            return " ready." in tail(worker.log, 400)

        self.wait_for(f"{worker.name} to be ready", ready, timeout)

    def python(self, code: str, timeout: float = 60) -> str:
        """Run ``code`` in a fresh interpreter with the stack's environment; returns its output."""
        result = subprocess.run(
            [sys.executable, "-c", code], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        assert result.returncode == 0, f"{code!r} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def close(self) -> None:
        """Kill every process (teardown): nothing of this test may outlive it."""
        for process in self.processes:
            process.kill()
        if self.http is not None:
            self.http.close()

    def diagnostics(self, lines: int = 80) -> str:
        parts = [p.tail(lines) for p in self.processes] + [f() for f in self.extra_logs]
        return f"===== logs of stack {self.name} =====\n" + "\n".join(parts)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
        return wait_for(what, predicate, timeout, interval, self.diagnostics)

    # ------------------------------------------------------------------ the API

    def request(self, method: str, path: str, expect: int | None = 200, **kwargs) -> httpx.Response:
        r = self.http.request(method, path, **kwargs)
        if expect is not None:
            assert r.status_code == expect, f"{method} {path}: {r.status_code} {r.text}\n{self.diagnostics(30)}"
        return r

    def upload(self, content: bytes, filename: str = "train.csv") -> dict:
        files = {"file": (filename, io.BytesIO(content), "text/csv")}
        return self.request("POST", "/datasets", 201, files=files).json()

    def submit(self, dataset_id: str, **hyperparameters) -> dict:
        from tests.conftest import TINY_MODEL

        body = {
            "base_model": TINY_MODEL,
            "task": "classification",
            "training_dataset": dataset_id,
            "text_column": "text",
            "label_column": "label",
            "hyperparameters": {
                "epochs": 2,
                "batch_size": 8,
                "max_length": 64,
                "learning_rate": 1e-3,
                **hyperparameters,
            },
        }
        return self.request("POST", "/jobs", 201, json=body).json()

    def job(self, job_id: str) -> dict:
        return self.request("GET", f"/jobs/{job_id}").json()

    def cancel(self, job_id: str) -> dict:
        return self.request("POST", f"/jobs/{job_id}/cancel").json()

    def events(self, job_id: str) -> list[dict]:
        return self.request("GET", f"/jobs/{job_id}/events").json()["data"]

    def codes(self, job_id: str) -> list[str]:
        return [e["code"] for e in self.events(job_id)]

    def metrics(self, job_id: str, name: str | None = None) -> list[dict]:
        rows = self.request("GET", f"/jobs/{job_id}/metrics", params={"limit": 100_000}).json()["data"]
        return [m for m in rows if name is None or m["name"] == name]

    def checkpoints(self, job_id: str) -> list[dict]:
        return self.request("GET", f"/jobs/{job_id}/checkpoints").json()["data"]

    def wait_status(self, job_id: str, statuses: set[str], timeout: float) -> dict:
        return self.wait_for(
            f"job {job_id} to be {'/'.join(sorted(statuses))}",
            lambda: (j := self.job(job_id))["status"] in statuses and j,
            timeout,
        )

    def wait_finished(self, job_id: str, timeout: float) -> dict:
        return self.wait_status(job_id, FINISHED, timeout)

    def wait_step(
        self, job_id: str, predicate: Callable[[dict], bool], what: str, timeout: float, interval: float = 0.05
    ) -> dict:
        """Poll the running job until ``predicate(job)``; fails at once if it finishes first."""

        def check():
            job = self.job(job_id)
            assert job["status"] in {"queued", "running"}, f"job ended before {what}: {job}\n{self.diagnostics()}"
            return job["status"] == "running" and predicate(job) and job

        return self.wait_for(f"job {job_id}: {what}", check, timeout, interval)
