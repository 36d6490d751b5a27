"""A rehearsal of two hosts on one machine (issue 39): PostgreSQL + Redis + SeaweedFS, ``tunejob
api`` and two workers as real processes, each with its own ``TUNEJOB_DATA_DIR``, and each in its
own mount namespace (``unshare -m``) where every other process's data directory is covered by an
empty tmpfs. A path that leaked into the store would not resolve anywhere but where it was
written, so what runs here would run on separate hosts that share only the job store, the broker
and the bucket.

A job is killed (``kill -9``) mid-training and resumed by the other worker from the bucket's
checkpoint; a sweep's trials then run on two workers. Needs root (to mount in the namespace)
and ``unshare``, as CI runs; skips elsewhere with the reason, unless
``TUNEJOB_REQUIRE_SERVICES=1``. The same by hand: docs/production/topology.md.
"""

import os
import shutil
import signal
import sys
import uuid

import pytest

from tests import faults_support, test_faults
from tests.faults_support import Process
from tests.s3_support import BUCKET
from tests.test_api_jobs import labelled_csv
from tests.test_faults import (  # noqa: F401
    LONG,
    assert_steps_once,
    results,
    resumed_step,
    stacks,
    wait_exit,
)
from tests.test_object_storage import s3_server  # noqa: F401
from tests.test_sweeps import ENDED, sweep_body

# Each process, in its own mount namespace: its own data directory kept (bound aside, then back),
# the folder of every process's data directory covered by an empty tmpfs.
ISOLATE = (
    'set -e; mount --make-rprivate /; mount --bind "$OWN" "$STAGE"; mount -t tmpfs tmpfs "$HOSTS"; '
    'mkdir "$OWN"; mount --bind "$STAGE" "$OWN"; exec "$@"'
)


def require_unshare() -> None:
    reason = None
    if os.geteuid() != 0:
        reason = "the rehearsal mounts in mount namespaces: it needs root"
    elif shutil.which("unshare") is None:
        reason = "unshare (util-linux) is not installed"
    if reason is None:
        return
    if os.environ.get("TUNEJOB_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason}, and TUNEJOB_REQUIRE_SERVICES=1 makes this test mandatory")
    pytest.skip(reason)


class Hosts(faults_support.Cluster):
    """A ``Cluster`` whose every process is a "host": its own data directory under ``hosts/``,
    and a mount namespace in which the others' are hidden."""

    def _spawn(self, kind: str, args: list[str]) -> Process:
        n = self._count[kind] = self._count.get(kind, 0) + 1
        name = f"{kind}-{n}"
        hosts, own, stage = self.workdir / "hosts", self.workdir / "hosts" / name, self.workdir / "stage" / name
        own.mkdir(parents=True)
        stage.mkdir(parents=True)
        env = {**self.env, "TUNEJOB_DATA_DIR": str(own), "OWN": str(own), "STAGE": str(stage), "HOSTS": str(hosts)}
        command = ["unshare", "-m", "sh", "-c", ISOLATE, "sh", sys.executable, "-m", "tunejob", *args]
        process = Process(name, command, env, self.workdir / f"{name}.log")
        self.processes.append(process)
        if kind == "api":
            self.env["TUNEJOB_DATA_DIR"] = str(own)  # where Cluster.start reads the local API key
        return process


def test_an_api_and_two_workers_on_separate_hosts(stacks, s3_server, monkeypatch):  # noqa: F811
    require_unshare()
    monkeypatch.setattr(test_faults, "Cluster", Hosts)
    c = stacks.make(
        "postgres+redis",
        TUNEJOB_STORAGE_URL=f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}",
        TUNEJOB_METRICS_FLUSH_SECONDS="0.05",
        **s3_server.env(),
    )
    first, second = c.start(workers=2)
    hosts = c.workdir / "hosts"

    # A job: the API takes the upload into the bucket; whichever worker claims it trains it.
    dataset = c.upload(labelled_csv(rows=48))
    job_id = c.submit(dataset["id"], **LONG, save_every_steps=20)["id"]
    c.wait_step(
        job_id,
        lambda job: bool(c.checkpoints(job_id)) and job["progress"]["step"] - c.checkpoints(job_id)[-1]["step"] >= 3,
        "3 steps past a checkpoint",
        timeout=150,
        interval=0.01,
    )
    owner = c.python(
        "from shared.store.engine import read_session; from shared.store.rows import Job\n"
        f"with read_session() as s: print(s.get(Job, {job_id!r}).lease_owner)"
    )  # host:pid:nonce
    trainer = next(w for w in (first, second) if w.popen.pid == int(owner.split(":")[1]))
    trainer.signal(signal.SIGKILL)
    assert wait_exit(c, trainer, 10) == -signal.SIGKILL
    checkpoint = c.checkpoints(job_id)[-1]["step"]

    # The other worker, which never saw the job's files, resumes from the bucket's checkpoint.
    job = c.wait_finished(job_id, timeout=180)
    assert job["status"] == "succeeded", (job, c.codes(job_id))
    assert resumed_step(c, job_id) == checkpoint
    assert_steps_once(c, job)

    r = c.request("GET", f"/jobs/{job_id}/artifacts/model.tar")
    assert len(r.content) == next(
        a["bytes"] for a in c.request("GET", f"/jobs/{job_id}/artifacts").json()["data"] if a["name"] == "model.tar"
    )
    # A sweep's trials run on both workers: the one that resumed and a new one (a third host).
    resumer = second if trainer is first else first
    third = c.start_worker()
    c.wait_worker_ready(third, timeout=300)  # a worker starts in 10-20 s; far longer on a loaded machine
    before = results(resumer).count("succeeded")
    sweep = c.request(
        "POST", "/sweeps", json=sweep_body(dataset["id"], max_trials=4, max_parallel_trials=2), expect=201
    ).json()
    c.wait_for(
        "the sweep to end", lambda: c.request("GET", f"/sweeps/{sweep['id']}").json()["status"] in ENDED, timeout=400
    )
    assert c.request("GET", f"/sweeps/{sweep['id']}").json()["status"] == "succeeded"
    assert results(resumer).count("succeeded") > before and "succeeded" in results(third), c.diagnostics()

    # Nothing but caches (and the API's local key) on the disks of the hosts that are still up.
    up = {c.api.name, resumer.name, third.name}
    leaked = [
        p
        for p in hosts.rglob("*")
        if p.is_file()
        and p.relative_to(hosts).parts[0] in up
        and p.relative_to(hosts).parts[1] not in ("cache", "api_key")
    ]
    assert leaked == [], leaked
