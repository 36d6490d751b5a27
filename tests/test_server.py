"""The API as a real process (``python -m tunejob ...``): API keys from the command line, secure
by default on start (a local key on loopback, a refusal beyond it), the Host check over real HTTP,
slow and idle connections (slowloris), the migration of rows created before API keys, and several
API processes (``tunejob api --workers 2``) sharing metrics and rate limits."""

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REDIS_URL, configure_stack, require_services, service_variables
from tests.faults_support import ROOT, Process, free_port, wait_for
from tests.test_metrics import requests_counted

KEY_PATTERN = re.compile(r"tj_[A-Za-z0-9_-]{43}")


def tunejob_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in service_variables()}
    return {**env, "TUNEJOB_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}


def tunejob(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "tunejob", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert not check or result.returncode == 0, f"tunejob {' '.join(args)}: {result.stdout}\n{result.stderr}"
    return result


class Api:
    """``tunejob api`` on a free port, stopped at the end of the ``with``."""

    def __init__(self, tmp_path: Path, env: dict[str, str], host: str = "127.0.0.1", *args: str):
        self.port, self.host = free_port(), host
        self.process = Process(
            "api",
            [sys.executable, "-m", "tunejob", "api", "--host", host, "--port", str(self.port), *args],
            env,
            tmp_path / f"api-{self.port}.log",
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Api":
        def up() -> bool:
            assert self.process.alive(), self.process.tail()
            try:
                return httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_for("the API to answer /healthz", up, 90, diagnostics=self.process.tail)
        return self

    def __exit__(self, *_) -> None:
        self.process.stop()


def test_keys_are_printed_once_and_stored_only_as_hashes(tmp_path):
    env = tunejob_env(tmp_path / "data")
    created = tunejob(env, "keys", "create", "--tenant", "acme", "--admin", "--name", "ops")
    key = created.stdout.strip()
    assert KEY_PATTERN.fullmatch(key), created.stdout
    assert "acme" in created.stderr and "only this once" in created.stderr
    store = b"".join(p.read_bytes() for p in (tmp_path / "data").glob("tunejob.db*"))
    assert key.encode() not in store and key[12:].encode() not in store  # neither the key nor its secret part

    second = tunejob(env, "keys", "create", "--tenant", "beta").stdout.strip()
    assert second != key
    listing = tunejob(env, "keys", "list").stdout
    assert key not in listing and key[:11] in listing and second[:11] in listing
    row = next(line for line in listing.splitlines() if key[:11] in line)
    assert "acme" in row and "yes" in row and "ops" in row

    key_id = row.split()[0]
    revoked = tunejob(env, "keys", "revoke", key_id)
    assert "revoked" in revoked.stderr
    row = next(line for line in tunejob(env, "keys", "list").stdout.splitlines() if key[:11] in line)
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d .*\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row), row  # created, revoked

    unknown = tunejob(env, "keys", "revoke", "key_nope", check=False)
    assert unknown.returncode != 0 and "'key_nope' does not exist" in unknown.stderr
    bad = tunejob(env, "keys", "create", "--tenant", "no spaces", check=False)
    assert bad.returncode != 0 and "tenant 'no spaces'" in bad.stderr


def test_without_a_key_the_api_refuses_to_listen_beyond_loopback(tmp_path):
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "tunejob", "api", "--host", "0.0.0.0", "--port", str(port)],
        env=tunejob_env(tmp_path / "data"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0 without an API key" in result.stderr
    assert "tunejob keys create" in result.stderr
    assert not (tmp_path / "data" / "api_key").exists()


def test_on_loopback_the_api_writes_a_local_key_and_requires_it(tmp_path):
    data = tmp_path / "data"
    env = tunejob_env(data)
    with Api(tmp_path, env) as api:
        path = data / "api_key"
        key = path.read_text().strip()  # written before the API answered /healthz
        assert KEY_PATTERN.fullmatch(key)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert httpx.get(f"{api.url}/jobs").status_code == 401
        assert httpx.get(f"{api.url}/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # the machine's own user is an admin: a local Prometheus scrape needs no second key
        assert httpx.get(f"{api.url}/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        # DNS rebinding: the right address under another name is refused, even for /healthz.
        r = httpx.get(f"{api.url}/healthz", headers={"Host": f"rebind.attacker.example:{api.port}"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    with Api(tmp_path, env):  # a key exists now: nothing new is created
        assert path.read_text().strip() == key
    assert len([line for line in tunejob(env, "keys", "list").stdout.splitlines()[1:] if line.strip()]) == 1


def test_idle_and_slow_connections_do_not_hold_the_server(tmp_path):
    """200 connections that send nothing or trickle a request's headers: a normal client is still
    served, and the server closes them once the header deadline passes."""
    deadline = 2.0
    data = tmp_path / "data"
    env = tunejob_env(data, TUNEJOB_HTTP_HEADER_TIMEOUT_SECONDS=str(deadline))
    with Api(tmp_path, env) as api:
        key = (data / "api_key").read_text().strip()
        idle = []
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", api.port), timeout=10)
            if i % 2:  # half of them start a request and never finish its headers
                s.sendall(b"GET /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            idle.append(s)
        opened = time.monotonic()
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
            for _ in range(5):
                assert client.get("/healthz").status_code == 200
                assert client.get("/jobs").status_code == 200
                for s in idle[1::2]:
                    s.send(b"a")  # a byte now and then: uvicorn's keep-alive timer alone would never fire
            closed = 0
            for s in idle:
                s.settimeout(max(0.1, opened + deadline + 8 - time.monotonic()))
                try:
                    closed += s.recv(1024) == b""
                except ConnectionResetError:
                    closed += 1
                except TimeoutError:
                    pass
                finally:
                    s.close()
            assert closed == len(idle), f"only {closed} of {len(idle)} slow connections were closed"
            assert client.get("/jobs").status_code == 200


def test_rows_created_before_api_keys_belong_to_the_default_tenant(engine_env):
    """Migration 0002 on a store with data: old datasets and jobs go to the tenant "default" (that
    of ``tunejob serve``'s local key); a downgrade and upgrade round-trips. Migration 0005 makes a
    local key written before it an admin key, and leaves other keys alone."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import text

    from shared.errors import NotFound
    from shared.jobs.lifecycle import get_job
    from shared.store.engine import MIGRATIONS_DIR, get_engine, read_session
    from shared.store.keys import (
        authenticate,
        create_key,
        ensure_key_for,
        local_key_path,
    )
    from shared.store.tenancy import Caller, owned_job

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection_engine"] = get_engine()
    command.upgrade(config, "0001")
    with get_engine().begin() as conn:
        conn.execute(
            text(
                "INSERT INTO datasets (id, filename, format, path, rows, columns, bytes, sha256, created_at) "
                "VALUES ('ds_old', 'a.csv', 'csv', '/x', 1, '[]', 1, 'x', '2026-01-01 00:00:00')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO jobs (id, status, base_model, task, training_dataset_id, spec, created_at, updated_at, "
                "cancel_requested, step, epoch, attempts, restarts) VALUES ('job_old', 'succeeded', 'm', "
                "'classification', 'ds_old', '{}', '2026-01-01 00:00:00', '2026-01-01 00:00:00', 0, 0, 0, 1, 0)"
            )
        )
    command.upgrade(config, "head")
    command.downgrade(config, "0001")
    command.upgrade(config, "head")

    local = authenticate(ensure_key_for("127.0.0.1").read_text().strip())
    assert local == Caller("default", True, local.key_id)
    other, _ = create_key("default")
    command.downgrade(config, "0004")  # as a local key written before 0005 was
    assert authenticate(local_key_path().read_text().strip()).admin is False
    command.upgrade(config, "head")
    assert authenticate(local_key_path().read_text().strip()).admin is True
    assert authenticate(other).admin is False
    assert get_job("job_old", local).training_dataset_id == "ds_old"
    with read_session() as s:
        assert owned_job(s, "job_old", local).tenant == "default"
    with pytest.raises(NotFound):
        get_job("job_old", Caller("someone-else"))


def test_worker_nice_lowers_its_cpu_priority(tmp_path):
    """`tunejob serve` starts its worker with --nice 10, so that on a shared CPU the API's
    requests are scheduled before training."""
    worker = Process(
        "worker",
        [sys.executable, "-m", "tunejob", "worker", "--nice", "7"],
        tunejob_env(tmp_path / "data", TUNEJOB_DEVICE="cpu"),
        tmp_path / "worker.log",
    )
    try:
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        wait_for(
            "the worker to lower its priority",
            lambda: worker.alive() and os.getpriority(os.PRIO_PROCESS, worker.pid) == base + 7,
            60,
            diagnostics=worker.tail,
        )
    finally:
        worker.stop()


@pytest.mark.alone
def test_workers_stop_when_serve_is_killed(tmp_path):
    """A worker of `tunejob serve` that is killed is started again; a SIGKILL of `tunejob serve`
    (which cannot stop its workers) does not leave them running beside the workers of the next
    serve: each stops as on SIGTERM (issue 25: kill -9 mid-sweep).

    Marked ``alone``: serve's workers run at nice 10 and load the training stack before they
    consume (about 10 s of CPU each); beside a parallel worker's training they got about a tenth
    of a core, and their start outlasted the wait (reproduced with two busy processes at nice 0)."""
    serve = Process(
        "serve",
        [sys.executable, "-m", "tunejob", "serve", "--port", str(free_port()), "--workers", "2"],
        tunejob_env(tmp_path / "data", TUNEJOB_DEVICE="cpu"),
        tmp_path / "serve.log",
    )
    try:

        def two_workers_up() -> bool:
            assert serve.alive(), serve.tail()
            children = psutil.Process(serve.pid).children()
            return (
                len(children) == 2
                and all(str(serve.pid) in c.cmdline() for c in children)
                and serve.tail(400).count(" ready.") >= 2
            )  # both consuming: "celery@<host> ready."

        wait_for("serve's two workers", two_workers_up, 60, diagnostics=serve.tail)
        # each a Celery node of its own (both were celery@<host>)
        assert len(set(re.findall(r"(tunejob-cpu-\d+@\S+) ready\.", serve.tail(400)))) == 2, serve.tail()
        # a worker killed (as by the out-of-memory killer) is started again, in a session of its own
        lost = psutil.Process(serve.pid).children()[0]
        lost.kill()
        wait_for(
            "a worker in place of the killed one",
            lambda: lost.pid not in [c.pid for c in psutil.Process(serve.pid).children()] and two_workers_up(),
            60,
            diagnostics=serve.tail,
        )
        assert f"(pid {lost.pid}) was killed by SIGKILL" in serve.tail(400), serve.tail()
        workers = psutil.Process(serve.pid).children()
        assert all(os.getsid(w.pid) == w.pid for w in workers)  # a terminal's Ctrl-C reaches serve only
        serve.kill()
        gone, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, f"workers still running after serve was killed: {[w.pid for w in alive]}\n{serve.tail()}"
    finally:
        serve.kill()
        for worker in psutil.Process().children(recursive=True):
            if "tunejob" in " ".join(worker.cmdline()):
                worker.kill()


def test_api_processes_share_their_metrics_and_rate_limits(tmp_path):
    """``tunejob api --workers 2``: requests answered by either process are all counted at
    ``/metrics``, and a key's rate limit counts its requests to both (Redis). Which process
    accepts a new connection is up to the kernel, so each is made to, by stopping the other
    (SIGSTOP: it accepts nothing until SIGCONT). Without shared counters it refuses to start."""
    require_services()  # the rate counts live in the test Redis, under the new keys' ids (nothing to flush)
    env = tunejob_env(tmp_path / "data", TUNEJOB_RATE_LIMIT="3/minute")
    refused = tunejob(env, "api", "--workers", "2", "--port", str(free_port()), check=False)
    assert refused.returncode != 0 and "TUNEJOB_RATE_LIMIT_STORAGE_URL" in refused.stderr

    env["TUNEJOB_RATE_LIMIT_STORAGE_URL"] = REDIS_URL
    user = {"Authorization": f"Bearer {tunejob(env, 'keys', 'create', '--tenant', 'acme').stdout.strip()}"}
    admin = {"Authorization": f"Bearer {tunejob(env, 'keys', 'create', '--tenant', 'ops', '--admin').stdout.strip()}"}
    with Api(tmp_path, env, "127.0.0.1", "--workers", "2") as api:
        workers = [p for p in psutil.Process(api.process.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2

        def served_by(worker: psutil.Process, path: str, headers: dict | None = None) -> int:
            """GET ``path`` on a new connection, which only ``worker`` can accept; its status."""
            other = next(w for w in workers if w.pid != worker.pid)
            other.send_signal(signal.SIGSTOP)
            try:
                return httpx.get(f"{api.url}{path}", headers=headers, timeout=10).status_code
            finally:
                other.send_signal(signal.SIGCONT)

        def scrape() -> dict[str, list]:
            r = httpx.get(f"{api.url}/metrics", headers=admin, timeout=10)
            assert r.status_code == 200
            return {f.name: f.samples for f in text_string_to_metric_families(r.text)}

        before = requests_counted(scrape(), "/healthz", "GET", "200")
        assert [served_by(workers[0], "/healthz") for _ in range(2)] == [200, 200]
        assert [served_by(workers[1], "/healthz") for _ in range(3)] == [200, 200, 200]
        assert requests_counted(scrape(), "/healthz", "GET", "200") - before == 5

        assert [served_by(workers[0], "/datasets", user) for _ in range(2)] == [200, 200]
        assert [served_by(workers[1], "/datasets", user) for _ in range(2)] == [200, 429]  # 3/minute in all


def test_on_postgres_a_read_session_holds_no_transaction_and_a_write_session_one(tmp_path):
    """Read sessions run in autocommit on PostgreSQL (``shared.store.engine``): no BEGIN and
    ROLLBACK round trips, and no connection left idle in a transaction between their statements;
    a write session is still one transaction."""
    from psycopg.pq import TransactionStatus
    from sqlalchemy import text

    from shared.store.engine import read_session, session_scope

    drop = configure_stack("postgres+redis", {"TUNEJOB_DATA_DIR": str(tmp_path)})
    try:

        def status(session) -> TransactionStatus:
            return session.connection().connection.dbapi_connection.info.transaction_status

        with read_session() as s:
            assert s.execute(text("SELECT 1")).scalar() == 1
            assert status(s) == TransactionStatus.IDLE
        with session_scope() as s:
            s.execute(text("SELECT 1"))
            assert status(s) == TransactionStatus.INTRANS
    finally:
        drop()


def test_on_postgres_processes_starting_at_once_migrate_one_after_the_other(tmp_path):
    """Four ``tunejob db upgrade`` processes started together on an empty PostgreSQL database (as
    API processes and workers starting at once do) all succeed: an advisory lock makes them migrate
    one after the other (issue 34; without it, concurrent CREATE TABLEs fail with a duplicate)."""
    from tests.conftest import fresh_postgres_database

    require_services()
    database_url, drop = fresh_postgres_database()
    try:
        env = tunejob_env(tmp_path, TUNEJOB_DATABASE_URL=database_url)
        processes = [
            subprocess.Popen(
                [sys.executable, "-m", "tunejob", "db", "upgrade"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        results = [(p.wait(timeout=120), p.stderr.read(), p.stdout.read()) for p in processes]
        assert all(code == 0 for code, _, _ in results), [err[-2000:] for code, err, _ in results if code]
        head = sorted(p.stem for p in (ROOT / "migrations" / "versions").glob("0*.py"))[-1].split("_")[0]
        # each says what it found and left (it printed "at the latest revision" on an empty database too)
        assert f"database upgraded from empty to {head}\n" in [out for _, _, out in results]
        again = subprocess.run(
            [sys.executable, "-m", "tunejob", "db", "upgrade"], env=env, cwd=ROOT, capture_output=True, text=True
        )
        assert again.stdout == f"database already at {head}, the latest revision\n", again
    finally:
        drop()


def signed_in_cookie(url: str, key: str, **headers: str) -> str:
    """The Set-Cookie header of a dashboard sign-in with ``key``."""
    r = httpx.post(f"{url}/ui/login", data={"key": key, "next": "/ui/jobs"}, headers=headers)
    assert r.status_code == 303, r.text
    return r.headers["set-cookie"]


def test_the_session_cookie_is_secure_as_the_proxy_options_and_tunejob_cookie_secure_say(tmp_path):
    """Behind a proxy, ``tunejob api --forwarded-allow-ips`` says whose X-Forwarded-Proto to trust:
    from an address not listed, https is not believed, so the cookie is not ``Secure``; from one
    listed it is; ``TUNEJOB_COOKIE_SECURE=true`` makes it ``Secure`` whatever the scheme (issue 34)."""
    data = tmp_path / "data"
    with Api(tmp_path, tunejob_env(data), "127.0.0.1", "--forwarded-allow-ips", "10.9.9.9") as api:
        key = (data / "api_key").read_text().strip()
        assert "secure" not in signed_in_cookie(api.url, key, **{"X-Forwarded-Proto": "https"}).lower()
    with Api(tmp_path, tunejob_env(data), "127.0.0.1", "--forwarded-allow-ips", "127.0.0.1") as api:
        assert "secure" in signed_in_cookie(api.url, key, **{"X-Forwarded-Proto": "https"}).lower()
        assert "secure" not in signed_in_cookie(api.url, key).lower()
    with Api(tmp_path, tunejob_env(data, TUNEJOB_COOKIE_SECURE="true"), "127.0.0.1", "--no-proxy-headers") as api:
        assert "secure" in signed_in_cookie(api.url, key).lower()


def test_serve_starts_a_worker_again_when_one_exits(monkeypatch, capfd):
    """``tunejob.cli.Workers`` with stand-in commands: a worker that exits is started again (it
    was not: serve kept accepting jobs no worker ran), after a delay that doubles while it keeps
    exiting at once; ``stop`` SIGTERMs the workers and starts none again."""
    from tunejob.cli import Workers

    monkeypatch.setattr(Workers, "QUICK_EXIT_SECONDS", 0.0)  # every exit counts as after a long run
    short = ([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ))
    long = ([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ))
    workers = Workers([short, long], poll_seconds=0.05)
    try:
        first = workers.processes[1]
        assert first is not None and os.getsid(first.pid) == first.pid  # its own session
        said: list[str] = []

        def exits() -> int:
            said.append(capfd.readouterr().err)
            return "".join(said).count("worker 1 (pid")

        wait_for("worker 1 started again twice", lambda: exits() >= 3, 30)
        assert "exited with code 3 after 0 s; starting another; a job it ran is queued again" in "".join(said)
    finally:
        workers.stop()
    assert first.returncode == -signal.SIGTERM and workers.processes[1] is first  # never restarted
    stopped = list(workers.processes)
    time.sleep(0.3)
    assert workers.processes == stopped  # nothing started after stop

    monkeypatch.setattr(Workers, "QUICK_EXIT_SECONDS", 30.0)
    quick = Workers([long], poll_seconds=60)
    try:
        dead = quick.processes[0]
        dead.kill()
        dead.wait()
        delays = []
        for _ in range(4):
            quick._exited(0, dead)
            delays.append(quick.delays[0])
        assert delays == [1.0, 2.0, 4.0, 8.0]
    finally:
        quick.stop()
    err = capfd.readouterr().err
    assert f"worker 1 (pid {dead.pid}) was killed by SIGKILL (the kernel's out-of-memory killer" in err
    assert "starting another in 8 s" in err


def test_a_job_store_that_cannot_be_reached_is_one_line_without_the_password(tmp_path):
    """``tunejob db upgrade`` (and ``api``, ``worker``, ``keys``) with a job store that refuses the
    connection printed a 40-line traceback; it says which store (password hidden) and why."""
    env = tunejob_env(
        tmp_path, TUNEJOB_DATABASE_URL=f"postgresql+psycopg://tunejob:s3cret@127.0.0.1:{free_port()}/tunejob"
    )
    result = tunejob(env, "db", "upgrade", check=False)
    assert result.returncode == 1
    assert result.stderr.startswith("tunejob db: the job store postgresql+psycopg://tunejob:***@127.0.0.1:"), (
        result.stderr
    )
    assert "Connection refused" in result.stderr and "Traceback" not in result.stderr and "s3cret" not in result.stderr


def test_a_stopping_api_cancels_a_slow_upload_after_its_grace_and_removes_its_file(tmp_path):
    """SIGTERM mid-upload: uvicorn waited for the request without end (a slow client's 300 MB, for
    minutes), until a supervisor's SIGKILL left the upload's temporary file behind for good. After
    ``TUNEJOB_SHUTDOWN_GRACE_SECONDS`` the request is cancelled, its file removed, and the API exits."""
    data = tmp_path / "data"
    env = tunejob_env(data, TUNEJOB_SHUTDOWN_GRACE_SECONDS="1")
    with Api(tmp_path, env) as api:
        key = (data / "api_key").read_text().strip()
        s = socket.create_connection(("127.0.0.1", api.port), timeout=10)
        head = (
            f"POST /datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000000\r\n\r\n"
            '--b\r\nContent-Disposition: form-data; name="file"; filename="slow.csv"\r\n\r\ntext,label\r\n'
        )
        s.sendall(head.encode() + b"a,b\n" * 1000)
        uploads = data / "uploads"
        wait_for("the upload's file", lambda: list(uploads.glob(".*.tmp")), 30, diagnostics=api.process.tail)
        api.process.signal(signal.SIGTERM)
        assert api.process.wait(15) is not None, "the API waited for the upload\n" + api.process.tail()
        s.close()
    assert list(uploads.glob(".*.tmp")) == []


def test_a_client_gone_mid_upload_is_no_server_error(tmp_path):
    """A client that closed its connection mid-upload was logged as a 500 with a traceback and
    counted as one in ``GET /metrics`` (tripping 5xx alerts): it is a 499, logged in a line."""
    from prometheus_client.parser import text_string_to_metric_families

    data = tmp_path / "data"
    with Api(tmp_path, tunejob_env(data)) as api:
        key = (data / "api_key").read_text().strip()
        s = socket.create_connection(("127.0.0.1", api.port), timeout=10)
        s.sendall(
            f"POST /datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 1000000\r\n\r\n"
            '--b\r\nContent-Disposition: form-data; name="file"; filename="cut.csv"\r\n\r\ntext,label\r\na,b\n'.encode()
        )
        wait_for("the upload's file", lambda: list((data / "uploads").glob(".*.tmp")), 30, diagnostics=api.process.tail)
        s.close()

        def counted() -> dict[str, list]:
            r = httpx.get(f"{api.url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            return {f.name: f.samples for f in text_string_to_metric_families(r.text)}

        wait_for("the request to end", lambda: requests_counted(counted(), "/datasets", "POST", "499"), 30)
        assert requests_counted(counted(), "/datasets", "POST", "500") == 0
        assert list((data / "uploads").glob(".*.tmp")) == []
        assert "Traceback" not in api.process.tail(400) and "client closed the connection" in api.process.tail(400)


def test_a_malformed_secret_key_stops_the_api_and_db_reseal_in_one_line(tmp_path):
    """A ``TUNEJOB_SECRET_KEY`` that is no Fernet key: the API started, and every webhook request
    answered 500; ``tunejob db reseal`` printed a traceback."""
    env = tunejob_env(tmp_path, TUNEJOB_SECRET_KEY="not-a-key")
    for command in (("db", "reseal"), ("api", "--port", str(free_port()))):
        result = tunejob(env, *command, check=False)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "TUNEJOB_SECRET_KEY: not a comma-separated list of Fernet keys" in result.stderr, result.stderr
