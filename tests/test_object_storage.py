"""Object storage (``TUNEJOB_STORAGE_URL=s3://...``, ``shared.store.objects``) against a real S3
server, SeaweedFS's ``weed mini`` (``tests/s3_support.py``): files go to the bucket before their
rows, come back checked against the manifest, the host cache stays bounded, deletes reach the
bucket, and a job runs on "hosts" that share nothing but the bucket and the job store."""

import asyncio
import contextlib
import io
import json
import os
import socket
import tarfile
import threading
import time
import uuid
from pathlib import Path
from unittest import mock

import httpx
import pytest

from tests import s3_support
from tests.conftest import BASE_URL, auth_header, configure_stack, service_variables
from tests.test_api_jobs import labelled_csv, submit, upload
from tests.test_predictions import body_for, scoring_csv


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = s3_support.start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    s3_support.stop(server)


@pytest.fixture
def bucket_env(s3_server, tmp_path, monkeypatch):
    """AWS_* pointing at the server, and a fresh prefix of its bucket as ``TUNEJOB_STORAGE_URL``;
    no other TUNEJOB_* setting, and none that the test sets (``on_host``, ``configure_stack``) is
    left behind."""
    from shared.settings import get_settings

    for key in {
        *service_variables(),
        "TUNEJOB_DATA_DIR",
        "TUNEJOB_DATABASE_URL",
        "TUNEJOB_BROKER_URL",
        "TUNEJOB_STORAGE_CACHE_BYTES",
    }:
        monkeypatch.setenv(key, "")  # recorded, so that teardown restores (or removes) it
        monkeypatch.delenv(key)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TUNEJOB_STORAGE_URL", f"s3://{s3_support.BUCKET}/{uuid.uuid4().hex[:12]}")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def mock_env(env: dict[str, str]):
    """``os.environ`` with ``env`` set, restored after (obstore reads ``AWS_*`` when a store is made)."""
    return mock.patch.dict(os.environ, env)


def on_host(data_dir: Path, **env: str):
    """Make this process "a host" with its own (empty) data directory; returns the store."""
    from shared.settings import get_settings
    from shared.store import objects

    os.environ.update(TUNEJOB_DATA_DIR=str(data_dir), **env)
    get_settings.cache_clear()
    return objects.store()


def files_outside_cache(data_dir: Path) -> list[str]:
    return sorted(
        p.relative_to(data_dir).as_posix()
        for p in data_dir.rglob("*")
        if p.is_file() and p.relative_to(data_dir).parts[0] != "cache"
    )


def collect(stream) -> bytes:
    """The bytes of an async iterable (as a StreamingResponse reads ``TarStream``), joined."""

    async def chunks() -> bytes:
        return b"".join([bytes(chunk) async for chunk in stream])

    return asyncio.run(chunks())


def model_dir_with_manifest(data_dir: Path, job_id: str, weight_bytes: int = 1 << 20) -> Path:
    from shared.store import artifacts

    directory = data_dir / "artifacts" / job_id / "model"
    (directory / "runs").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(os.urandom(weight_bytes))
    (directory / "runs" / "events").write_text("x")
    artifacts.write_manifest(directory)
    return directory


def test_published_files_come_back_checked_against_the_manifest(bucket_env, tmp_path):
    import obstore

    from shared.store import artifacts

    store = on_host(tmp_path / "a")
    ref = store.publish(model_dir_with_manifest(tmp_path / "a", "job_1"))
    assert ref == "artifacts/job_1/model" and files_outside_cache(tmp_path / "a") == []
    assert set(store.files(ref)) == {"manifest.json", "model.safetensors", "runs/events"}

    store = on_host(tmp_path / "b")  # another host: nothing on its disk
    local = store.local(ref)
    assert (tmp_path / "b" / "cache") in local.parents
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == [
        "manifest.json",
        "model.safetensors",
        "runs/events",
    ]
    tar = artifacts.TarStream(store.files(ref))
    assert sum(len(chunk) for chunk in tar) == tar.size
    # The API's way (async: Remote.achunks, no thread hop per chunk) gives the same bytes.
    assert collect(artifacts.TarStream(store.files(ref))) == b"".join(artifacts.TarStream(store.files(ref)))

    # The bucket's copy of the weights changes (same size): a download no longer matches the manifest.
    obstore.put(store.store, f"{ref}/model.safetensors", os.urandom(1 << 20))
    store = on_host(tmp_path / "c")
    with pytest.raises(OSError, match="does not match its manifest"):
        store.local(ref)
    assert not (tmp_path / "c" / "cache" / "objects").exists() or not any(
        p.is_file() for p in (tmp_path / "c" / "cache" / "objects").rglob("*")
    )
    with pytest.raises(OSError, match="does not match its manifest"):
        b"".join(artifacts.TarStream(store.files(ref)))
    with pytest.raises(OSError, match="does not match its manifest"):
        collect(artifacts.TarStream(store.files(ref)))


def test_the_host_cache_is_bounded_least_recently_used_first(bucket_env, tmp_path):
    store = on_host(tmp_path / "a", TUNEJOB_STORAGE_CACHE_BYTES=str(3 << 20))
    refs = []
    for name in ("one", "two", "three"):
        path = tmp_path / "a" / "uploads" / f"ds_{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(1 << 20))
        refs.append(store.publish(path))
    os.utime(store._entry(refs[0]), (1, 1))  # the oldest entries: used long ago ...
    os.utime(store._entry(refs[1]), (2, 2))
    store.local(refs[0])  # ... but using one makes it the most recent
    path = tmp_path / "a" / "uploads" / "ds_four.csv"
    path.write_bytes(os.urandom(1 << 20))
    refs.append(store.publish(path))

    cached = {ref for ref in refs if store._entry(ref).exists()}
    assert cached == {refs[0], refs[2], refs[3]}  # "two" was the least recently used
    assert sum(p.stat().st_size for p in (tmp_path / "a" / "cache").rglob("*") if p.is_file()) <= 3 << 20
    assert store.local(refs[1]).stat().st_size == 1 << 20  # evicted here, still in the bucket


def test_the_api_and_workers_share_only_the_bucket_and_the_store(bucket_env, models_dir, tmp_path, monkeypatch):
    """ "Hosts", each with its own empty data directory: the API takes the upload and the job; a
    worker trains it until SIGTERM's checkpoint; another worker resumes from the bucket's
    checkpoint (steps exact); the API serves the model from the bucket; a prediction's parts go
    through the bucket too; single files redirect to presigned URLs; deletes empty the bucket."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from shared.store import objects
    from shared.store.manifest import verify_manifest
    from worker import reporter, tasks

    env = {k: v for k, v in os.environ.items() if k.startswith(("TUNEJOB_STORAGE", "AWS_"))}
    drop = configure_stack(
        "postgres+redis", {"TUNEJOB_DATA_DIR": str(tmp_path / "api"), "TUNEJOB_MODELS_DIR": str(models_dir), **env}
    )
    try:
        with TestClient(create_app(), base_url=BASE_URL) as client:
            client.headers.update(auth_header("tenant-a"))
            dataset = upload(client, labelled_csv())
            job = submit(client, dataset["id"], epochs=2, save_every_steps=100)
            assert files_outside_cache(tmp_path / "api") == []
            assert objects.store().files(dataset_ref(dataset["id"])), "the upload is in the bucket"

            # Worker 1 trains until "SIGTERM" at its 4th step: it checkpoints, then gives the job back.
            on_host(tmp_path / "worker-1")
            calls = iter(range(1000))
            real_should_stop = reporter.Reporter.should_stop
            monkeypatch.setattr(
                reporter.Reporter,
                "should_stop",
                lambda self: "shutdown" if next(calls) >= 3 else real_should_stop(self),
            )
            assert tasks.run_job(job["id"]) == "shutdown"
            monkeypatch.setattr(reporter.Reporter, "should_stop", real_should_stop)
            [checkpoint] = client.get(f"/jobs/{job['id']}/checkpoints").json()["data"]
            assert checkpoint["step"] == 4

            on_host(tmp_path / "worker-2")  # Worker 2 has never seen the job or its data.
            assert tasks.run_job(job["id"]) == "succeeded"
            assert files_outside_cache(tmp_path / "worker-2") == []

            on_host(tmp_path / "api-2")  # the API on a host with nothing on its disk
            job = client.get(f"/jobs/{job['id']}").json()
            assert job["status"] == "succeeded", job
            codes = [e["code"] for e in client.get(f"/jobs/{job['id']}/events").json()["data"]]
            assert codes.count("resumed") == 1, codes
            steps = sorted(
                m["step"] for m in client.get(f"/jobs/{job['id']}/metrics").json()["data"] if m["name"] == "train_loss"
            )
            assert steps == list(range(1, job["progress"]["total_steps"] + 1))  # each step once

            r = client.get(f"/jobs/{job['id']}/artifacts/model.tar")
            assert r.status_code == 200, r.text
            with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
                tar.extractall(tmp_path / "downloaded", filter="data")
            assert verify_manifest(tmp_path / "downloaded") == []
            r = client.get(f"/jobs/{job['id']}/evaluation")  # read from the bucket too
            assert r.status_code == 200 and r.json() == json.loads(
                (tmp_path / "downloaded/evaluation.json").read_text()
            )
            assert files_outside_cache(tmp_path / "api-2") == []

            # A prediction with that model: scored on worker 1's host, in parts (the bucket's),
            # served by the API on a host that has none of them.
            scored = upload(client, scoring_csv(rows=11), "score.csv")
            r = client.post("/predictions", json=body_for(job["id"], scored))
            assert r.status_code == 201, r.text
            prediction = r.json()
            on_host(tmp_path / "worker-1", TUNEJOB_PREDICT_PART_ROWS="4")
            assert tasks.run_job(prediction["id"]) == "succeeded"
            assert len(objects.store().listing(f"artifacts/{prediction['id']}/predictions")) == 3
            on_host(tmp_path / "api-3", TUNEJOB_STORAGE_PRESIGNED_SECONDS="60")
            r = client.get(f"/predictions/{prediction['id']}/results", params={"format": "jsonl"})
            assert [json.loads(row)["id"] for row in r.text.splitlines()] == [f"d-{1000 - i}" for i in range(11)]

            # With presigned URLs, a single file is a redirect to the bucket, which serves it.
            r = client.get(f"/jobs/{job['id']}/artifacts/metrics.json", follow_redirects=False)
            assert r.status_code == 307 and r.headers["location"].startswith(os.environ["AWS_ENDPOINT_URL"])
            assert httpx.get(r.headers["location"]).content == (tmp_path / "downloaded" / "metrics.json").read_bytes()

            assert client.delete(f"/predictions/{prediction['id']}").status_code == 204
            assert client.delete(f"/jobs/{job['id']}").status_code == 204
            for dataset_id in (dataset["id"], scored["id"]):
                assert client.delete(f"/datasets/{dataset_id}").status_code == 204
            store = objects.store()
            assert store.listing("artifacts") == store.listing("checkpoints") == store.listing("uploads") == []
    finally:
        drop()


def dataset_ref(dataset_id: str) -> str:
    from shared.store.engine import read_session
    from shared.store.rows import Dataset

    with read_session() as s:
        return s.get(Dataset, dataset_id).path


def add_dataset_row(dataset_id: str, path: str, sha256: str = "0" * 64, deleted: bool = False) -> None:
    """A one-row CSV dataset's row pointing at ``path`` (a store reference), deleted or not."""
    from shared.store.engine import session_scope
    from shared.store.rows import Dataset, utcnow

    with session_scope() as s:
        s.add(
            Dataset(
                id=dataset_id,
                filename="a.csv",
                format="csv",
                path=path,
                rows=1,
                columns=["text"],
                bytes=7,
                sha256=sha256,
                deleted_at=utcnow() if deleted else None,
            )
        )


def test_the_recovery_loop_collects_orphans_but_nothing_a_row_points_at(bucket_env, tmp_path):
    """An object whose row was never written (the process died in between) is deleted once it is
    older than the grace period; an object with its row stays."""
    from datetime import timedelta

    from shared.jobs import orphans
    from shared.store.engine import upgrade_database

    store = on_host(tmp_path / "a")
    upgrade_database()

    def publish(name: str) -> str:
        path = tmp_path / "a" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"text\nx\n")
        return store.publish(path.parent if "/step-" in name or "/model/" in name else path)

    kept = publish("uploads/ds_kept.csv")
    add_dataset_row("ds_kept", kept)
    for name in (
        "uploads/ds_lost.csv",
        "checkpoints/job_gone/step-00000001/training_state.pt",
        "artifacts/job_gone/model/config.json",
    ):
        publish(name)

    assert orphans.collect_orphans(force=True) == []  # all younger than the grace period
    assert sorted(orphans.collect_orphans(grace=timedelta(0), force=True)) == sorted(
        ["uploads/ds_lost.csv", "checkpoints/job_gone/step-00000001", "artifacts/job_gone"]
    )
    assert [key for key, _, _ in store.listing("uploads")] == [kept]
    assert store.listing("checkpoints") == store.listing("artifacts") == []


def test_a_deleted_datasets_leftover_files_are_removed_once(bucket_env, tmp_path, monkeypatch):
    """A deleted dataset's row stays for good (a tombstone). What a process that died between the
    row and the files left behind (the upload, this host's tokenization cache) the recovery loop's
    ``clean_up_files`` removes once; at its later turns it finds nothing more to remove, where it
    deleted every deleted dataset's objects again at every turn. A cache whose content a live
    dataset also has stays."""
    from shared.jobs import retention
    from shared.store import artifacts, objects
    from shared.store.engine import upgrade_database

    store = on_host(tmp_path / "a")
    upgrade_database()
    removed: list[str] = []
    remove = objects.Bucket.remove
    monkeypatch.setattr(objects.Bucket, "remove", lambda self, ref: removed.append(ref) or remove(self, ref))

    def dataset(dataset_id: str, sha256: str, deleted: bool, files: bool = True) -> str:
        path = tmp_path / "a" / "uploads" / f"{dataset_id}.csv"
        ref = store.ref(path)
        if files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"text\nx\n")
            store.publish(path)
            artifacts.tokenized_cache_dir(sha256).mkdir(parents=True, exist_ok=True)
        add_dataset_row(dataset_id, ref, sha256, deleted)
        return ref

    left = dataset("ds_left", "1" * 64, deleted=True)
    kept = dataset("ds_kept", "2" * 64, deleted=False)
    same = dataset("ds_same", "2" * 64, deleted=True)  # the same content as ds_kept
    dataset("ds_gone", "3" * 64, deleted=True, files=False)  # deleted in full at the time

    retention.clean_up_files()
    assert sorted(removed) == sorted([left, same])
    assert [key for key, _, _ in store.listing("uploads")] == [kept]
    assert not artifacts.tokenized_cache_dir("1" * 64).exists()
    assert artifacts.tokenized_cache_dir("2" * 64).is_dir()  # ds_kept's

    removed.clear()
    retention.clean_up_files()
    assert removed == []
    assert [key for key, _, _ in store.listing("uploads")] == [kept]


class Silent:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a hung bucket)."""

    def __enter__(self) -> str:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()
        return f"http://127.0.0.1:{self.server.getsockname()[1]}"

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.server.accept()[0])

    def __exit__(self, *_) -> None:
        for s in [self.server, *self.accepted]:
            s.close()


class Throttled:
    """A TCP proxy on 127.0.0.1 to ``target`` (``host:port``) that passes at most ``rate`` bytes
    per second each way and connection, in ``CHUNK``-byte steps (a slow link that keeps moving)."""

    CHUNK = 64 << 10

    def __init__(self, target: str, rate: float):
        self.target, self.rate = target, rate

    def __enter__(self) -> str:
        self.server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()
        return f"http://127.0.0.1:{self.server.getsockname()[1]}"

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client = self.server.accept()[0]
                host, port = self.target.rsplit(":", 1)
                upstream = socket.create_connection((host, int(port)))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(self.CHUNK):
                sink.sendall(data)
                time.sleep(len(data) / self.rate)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def __exit__(self, *_) -> None:
        self.server.close()


class Forward(httpx.BaseTransport):
    """The Python client's requests, passed to the API in process (a TestClient), counted."""

    def __init__(self, api):
        self.api, self.sent = api, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        answer = self.api.request(
            request.method, str(request.url), headers=dict(request.headers), content=request.read()
        )
        return httpx.Response(answer.status_code, headers=answer.headers.multi_items(), content=answer.content)


@pytest.mark.parametrize("bucket", ["refuses connections", "accepts and never answers"])
def test_a_failing_bucket_is_a_502_at_once_and_leaves_no_row(bucket, bucket_env, models_dir, tmp_path, monkeypatch):
    """An upload while the bucket refuses connections, or accepts them and never answers: within
    about ``TUNEJOB_STORAGE_TIMEOUT_SECONDS`` (its silence, then its retries), a 502
    ``storage_unavailable`` (not a 500), which the Python client and the CLI do not send again (a
    503 they would, five times; a hung bucket kept ``datasets upload`` silent for 3 min 5 s); no
    dataset row and no file left behind."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from client import Client
    from client.api import TunejobError
    from tests.faults_support import free_port

    with contextlib.ExitStack() as stack:
        endpoint = (
            f"http://127.0.0.1:{free_port()}" if bucket == "refuses connections" else stack.enter_context(Silent())
        )
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        env = {k: v for k, v in os.environ.items() if k.startswith("TUNEJOB_STORAGE")}
        drop = configure_stack(
            "embedded",
            {
                "TUNEJOB_DATA_DIR": str(tmp_path / "api"),
                "TUNEJOB_MODELS_DIR": str(models_dir),
                "TUNEJOB_STORAGE_TIMEOUT_SECONDS": "1",
                **env,
            },
        )
        stack.callback(drop)
        api = stack.enter_context(TestClient(create_app(), base_url=BASE_URL))
        api.headers.update(auth_header("tenant-a"))
        forward = Forward(api)
        path = tmp_path / "train.csv"
        path.write_bytes(labelled_csv())
        started = time.monotonic()
        with Client(BASE_URL, api_key=api.headers["Authorization"].removeprefix("Bearer "), transport=forward) as c:
            with pytest.raises(TunejobError) as raised:
                c.upload_dataset(path)
        waited = time.monotonic() - started
        assert (raised.value.status, raised.value.code) == (502, "storage_unavailable"), raised.value
        assert forward.sent == 1 and waited < 10, (forward.sent, waited)
        assert api.get("/datasets").json()["data"] == []
        assert not any(name.startswith("uploads/") for name in files_outside_cache(tmp_path / "api"))


def test_a_slow_download_is_bounded_by_its_silences_not_its_length(s3_server, tmp_path):
    """A download that keeps moving is not cut short however long it takes: object_store's default
    bounds a whole request by 30 s (a 100 MiB object at 1.5 MB/s failed at 30.0 s, measured), so a
    large model on a slow link could not be downloaded. Here a 2 MiB object at 0.5 MB/s (about 4 s)
    with a 1 s timeout comes whole; the timeout is the longest silence."""
    import obstore

    from shared.store.objects import Bucket

    prefix = uuid.uuid4().hex[:12]
    url = f"s3://{s3_support.BUCKET}/{prefix}"
    env = s3_server.env()
    payload = os.urandom(2 << 20)
    with mock_env(env):
        obstore.put(Bucket(url, tmp_path / "a", 1 << 30).store, "slow", payload)
    with Throttled(env["AWS_ENDPOINT_URL"].removeprefix("http://"), rate=500_000) as slow:
        with mock_env({**env, "AWS_ENDPOINT_URL": slow}):
            bucket = Bucket(url, tmp_path / "b", 1 << 30, timeout_s=1.0)
        started = time.monotonic()
        got = b"".join(bytes(c) for c in obstore.get(bucket.store, "slow").stream(min_chunk_size=1 << 20))
    assert got == payload and time.monotonic() - started > 2  # longer than the timeout, twice over


def test_retention_and_the_storage_quota_see_the_bucket(bucket_env, models_dir, tmp_path, monkeypatch):
    """The quota counts what the bucket holds (the API's disk holds none of it), a deleted dataset
    frees its bytes, and retention (the recovery loop's ``clean_up_files``, run on a host with
    nothing on its disk) deletes a finished job's objects, which frees the quota too."""
    from fastapi.testclient import TestClient

    from api.main import create_app
    from shared.jobs import retention
    from shared.settings import get_settings
    from shared.store import objects
    from shared.store.engine import read_session
    from shared.store.rows import Job
    from worker import tasks

    env = {k: v for k, v in os.environ.items() if k.startswith(("TUNEJOB_STORAGE", "AWS_"))}
    drop = configure_stack(
        "postgres+redis",
        {
            "TUNEJOB_DATA_DIR": str(tmp_path / "api"),  # the SQLite store
            "TUNEJOB_MODELS_DIR": str(models_dir),
            **env,
        },
    )  # is in a data dir

    def job_objects(job_id: str) -> list[str]:
        store = objects.store()
        return [key for folder in ("checkpoints", "artifacts") for key, _, _ in store.listing(f"{folder}/{job_id}/")]

    def set_quota(limit: int) -> None:
        monkeypatch.setenv("TUNEJOB_MAX_STORAGE_BYTES_PER_TENANT", str(limit))
        get_settings.cache_clear()

    try:
        with TestClient(create_app(), base_url=BASE_URL) as client:
            client.headers.update(auth_header("tenant-q"))
            dataset = upload(client, labelled_csv())
            job = submit(client, dataset["id"], epochs=1)
            on_host(tmp_path / "worker")
            assert tasks.run_job(job["id"]) == "succeeded"
            on_host(tmp_path / "api")
            model_bytes = sum(size for _, size, _ in objects.store().listing(f"artifacts/{job['id']}/"))
            assert model_bytes > 100_000 and files_outside_cache(tmp_path / "api") == []
            with read_session() as s:
                assert s.get(Job, job["id"]).files_bytes == model_bytes  # recorded as the job ended

            # Room for the dataset and the model in the bucket, and 1,000 bytes more: a second
            # upload of the same size does not fit. The check lists no job's objects (it listed every
            # tenant's checkpoints and artifacts on each upload and job: seconds in a large bucket).
            set_quota(dataset["bytes"] + model_bytes + 1000)
            listed: list[str] = []
            listing = objects.Bucket.listing
            monkeypatch.setattr(objects.Bucket, "listing", lambda self, f: listed.append(f) or listing(self, f))
            r = client.post("/datasets", files={"file": ("b.csv", io.BytesIO(labelled_csv(seed=1)), "text/csv")})
            assert r.status_code == 413 and r.json()["error"]["code"] == "storage_quota_exceeded", r.text
            assert not [f for f in listed if f.startswith(("checkpoints", "artifacts"))], listed

            # Deleting the dataset frees its bytes (its object leaves the bucket): the same upload fits.
            assert client.delete(f"/datasets/{dataset['id']}").status_code == 204
            assert objects.store().listing("uploads/") == []
            second = upload(client, labelled_csv(seed=1), "b.csv")

            # Retention, on a host with an empty data directory: the job's objects go, and so does
            # their share of the quota.
            on_host(tmp_path / "recovery", TUNEJOB_ARTIFACT_RETENTION_DAYS="0")
            retention.clean_up_files()
            monkeypatch.delenv("TUNEJOB_ARTIFACT_RETENTION_DAYS")
            on_host(tmp_path / "api")
            assert job_objects(job["id"]) == []
            assert client.get(f"/jobs/{job['id']}/artifacts/model.tar").status_code == 409  # model_files_deleted
            assert client.get(f"/jobs/{job['id']}").json()["files_deleted_at"] is not None
            set_quota(second["bytes"] + 5000)
            upload(client, labelled_csv(rows=10, seed=2), "c.csv")
    finally:
        drop()


@pytest.mark.parametrize("fault, status", [("a wrong secret key", "403"), ("a bucket that does not exist", "404")])
def test_a_process_refuses_to_start_on_a_bucket_it_cannot_use(fault, status, bucket_env, tmp_path, monkeypatch):
    """A worker (or the API) whose credentials the bucket refuses would take every job and fail each
    (seen: a worker with a wrong key, ready, failed each job's download with a 403). It exits at start
    with the bucket's answer instead, and ``tunejob doctor`` fails its storage check."""
    from shared.settings import get_settings
    from shared.store import objects
    from tunejob.cli import require_bucket
    from worker import doctor

    monkeypatch.setenv("TUNEJOB_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    assert doctor.storage().ok is True
    if fault == "a wrong secret key":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    else:
        monkeypatch.setenv("TUNEJOB_STORAGE_URL", "s3://no-such-bucket/x")
    get_settings.cache_clear()
    objects._store_for.cache_clear()  # the client reads AWS_* when it is made, once per process
    with pytest.raises(SystemExit) as exited:
        require_bucket("tunejob worker")
    message = str(exited.value.code)
    assert message.startswith(f"tunejob worker: the object storage {get_settings().storage_url} cannot be used")
    assert f"status code: {status}" in message and "<?xml" not in message, message
    check = doctor.storage()
    assert check.ok is False and f"status code: {status}" in check.detail
