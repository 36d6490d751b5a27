"""A finished job's files and their lifecycle, on every stack: one copy of the weights, a manifest
that matches, ``model.tar`` streamed from the model directory, phase timings, the tokenization
cache, checkpoints of a running job, DELETE of jobs and datasets, and the retention sweep."""

import hashlib
import io
import json
import tarfile

import pytest

from tests.conftest import wait_for_status, wait_until
from tests.test_api_jobs import labelled_csv, submit, upload
from tests.test_cancel import LONG, cancel, event_codes, wait_until_training

FINISHED = {"succeeded", "failed", "cancelled"}
PHASES = ["queued", "load", "tokenize", "warmup", "train", "evaluate", "save"]


@pytest.fixture(scope="module")
def dataset(stack) -> dict:
    return upload(stack.client, labelled_csv(rows=48, seed=5))


@pytest.fixture(scope="module")
def finished(stack, dataset) -> dict:
    """A succeeded job that saved step checkpoints while it ran."""
    job = submit(stack.client, dataset["id"], epochs=2, save_every_steps=2)
    job = wait_for_status(stack.client, job["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]
    wait_until(lambda: not (stack.data_dir / "checkpoints" / job["id"]).exists(), "checkpoints deleted")
    return job


def job_files(data_dir, job_id: str) -> list:
    return [
        p for folder in ("checkpoints", "artifacts") for p in (data_dir / folder / job_id).rglob("*") if p.is_file()
    ]


def download_model(client, job_id: str, dest):
    r = client.get(f"/jobs/{job_id}/artifacts/model.tar")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-tar"
    assert int(r.headers["content-length"]) == len(r.content)
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        # files, at the top level but for the TensorBoard logs in runs/
        assert all(m.isfile() and ("/" not in m.name or m.name.startswith("runs/")) for m in tar.getmembers())
        tar.extractall(dest, filter="data")
    return dest


def test_a_finished_job_keeps_one_copy_of_the_weights_and_no_resume_state(stack, finished):
    files = job_files(stack.data_dir, finished["id"])
    names = [p.name for p in files]
    assert names.count("model.safetensors") == 1
    assert "training_state.pt" not in names and not any(n.endswith((".tar", ".tar.gz")) for n in names)
    # Footprint: the model directory and nothing else (a few KB of metadata and pictures beside the weights).
    model_dir = stack.data_dir / "artifacts" / finished["id"] / "model"
    assert all(model_dir in p.parents for p in files)


def test_model_tar_files_and_manifest_match(stack, finished, tmp_path):
    from safetensors.torch import load_file

    client, job_id = stack.client, finished["id"]
    listed = {a["name"]: a for a in client.get(f"/jobs/{job_id}/artifacts").json()["data"]}
    model = download_model(client, job_id, tmp_path / "model")
    manifest = json.loads((model / "manifest.json").read_text())
    on_disk = sorted(
        p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file() and p.name != "manifest.json"
    )  # runs/ (TensorBoard) included
    assert [f["name"] for f in manifest["files"]] == on_disk
    for f in manifest["files"]:
        data = (model / f["name"]).read_bytes()
        assert len(data) == f["bytes"] == listed[f"model/{f['name']}"]["bytes"]
        assert hashlib.sha256(data).hexdigest() == f["sha256"], f["name"]
        # Each file on its own, by its listed name, is the same file.
        r = client.get(f"/jobs/{job_id}/artifacts/model/{f['name']}")
        assert r.status_code == 200 and r.content == data, f["name"]
    assert load_file(model / "model.safetensors")  # loads, safetensors only

    # The unlisted gzip variant for older clients is the same tar, compressed on the fly.
    r = client.get(f"/jobs/{job_id}/artifacts/model.tar.gz")
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == sorted(on_disk + ["manifest.json"])
        assert tar.extractfile("model.safetensors").read() == (model / "model.safetensors").read_bytes()

    metrics = client.get(f"/jobs/{job_id}/artifacts/metrics.json").json()
    assert metrics == json.loads((model / "metrics.json").read_text())
    assert set(metrics["timings"]) >= set(PHASES) | {"total"}


def test_the_exported_tokenizer_truncates_at_the_jobs_max_length(stack, finished, tmp_path):
    from transformers import AutoTokenizer, pipeline

    model = download_model(stack.client, finished["id"], tmp_path / "model")
    max_length = finished["hyperparameters"]["max_length"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer.model_max_length == max_length
    long_text = "goal team coach market profit " * 400  # about 2,000 tokens: past the 512 positions
    assert len(tokenizer(long_text, truncation=True)["input_ids"]) == max_length
    classify = pipeline("text-classification", model=str(model), device="cpu")
    [prediction] = classify([long_text], truncation=True)  # no max_length needed: the tokenizer knows it
    assert prediction["label"] in {"sports", "business"}


def test_timings_are_reported_and_sum_to_at_most_the_total(stack, finished):
    from datetime import datetime

    timings = finished["timings"]
    assert set(timings) == set(PHASES) | {"total"}
    assert all(timings[p] is not None and timings[p] >= 0 for p in timings), timings
    assert timings["train"] > 0 and timings["load"] > 0 and timings["save"] > 0 and timings["evaluate"] > 0
    wall = datetime.fromisoformat(finished["finished_at"]) - datetime.fromisoformat(finished["created_at"])
    assert timings["total"] == pytest.approx(wall.total_seconds(), abs=0.01)
    phases = sum(timings[p] for p in PHASES)
    assert 0.5 * timings["total"] <= phases <= timings["total"], timings  # the rest is bookkeeping between phases
    events = stack.client.get(f"/jobs/{finished['id']}/events").json()["data"]
    [line] = [e["message"] for e in events if e["code"] == "timings"]
    assert all(f"{p} " in line for p in PHASES + ["total"]), line
    # the last event says how it ended in a line (it read "succeeded: succeeded")
    loss = finished["validation_metrics"]["loss"]
    steps = finished["progress"]["total_steps"]
    assert events[-1]["message"] == f"after {steps:,} steps; validation loss {loss:.4g}", events[-1]
    # nothing is captured on the CPU (this once asserted a warm-up of exactly 0 s, which building
    # the eager steps on a loaded machine rounds up to 0.001 s)
    assert not [e for e in events if e["code"].startswith("cuda_graphs")]


def test_a_second_job_on_the_same_data_reads_the_tokenization_cache(stack, dataset, finished):
    client = stack.client
    messages = {e["code"]: e["message"] for e in client.get(f"/jobs/{finished['id']}/events").json()["data"]}
    assert messages["tokenized"].endswith("tokenized and cached")
    cache = stack.data_dir / "cache" / "tokenized" / dataset["sha256"]
    assert len(list(cache.glob("*.safetensors"))) == 2  # the training part and the validation split

    again = wait_for_status(client, submit(client, dataset["id"], epochs=1)["id"], FINISHED)
    assert again["status"] == "succeeded", again["error"]
    messages = {e["code"]: e["message"] for e in client.get(f"/jobs/{again['id']}/events").json()["data"]}
    assert messages["tokenized"].endswith("read from the tokenization cache")
    # Another max_length tokenizes anew, and is cached beside the first.
    other = wait_for_status(client, submit(client, dataset["id"], epochs=1, max_length=16)["id"], FINISHED)
    messages = {e["code"]: e["message"] for e in client.get(f"/jobs/{other['id']}/events").json()["data"]}
    assert messages["tokenized"].endswith("tokenized and cached")
    assert len(list(cache.glob("*.safetensors"))) == 4


def test_checkpoints_of_a_running_job_download_and_delete_waits_for_the_end(stack, dataset, tmp_path):
    from transformers import AutoModelForSequenceClassification

    client = stack.client
    job = submit(client, dataset["id"], **{**LONG, "save_every_steps": 2})
    wait_until_training(client, job["id"])
    wait_until(lambda: client.get(f"/jobs/{job['id']}/checkpoints").json()["data"], "a checkpoint")
    step = client.get(f"/jobs/{job['id']}/checkpoints").json()["data"][-1]["step"]
    r = client.get(f"/jobs/{job['id']}/checkpoints/{step}/model.tar")
    assert r.status_code == 200, r.text
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "checkpoint", filter="data")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names and "training_state.pt" not in names
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "checkpoint").num_labels == 2
    r = client.get(f"/jobs/{job['id']}/checkpoints/999999/model.tar")
    assert r.status_code == 404 and r.json()["error"]["param"] == "step"

    r = client.delete(f"/jobs/{job['id']}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_not_finished", r.text
    assert "cancel" in r.json()["error"]["message"]
    r = client.delete(f"/datasets/{dataset['id']}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "dataset_in_use", r.text
    assert job["id"] in r.json()["error"]["message"]

    cancel(client, job["id"])
    assert wait_for_status(client, job["id"], FINISHED)["status"] == "cancelled"
    assert job_files(stack.data_dir, job["id"])  # a cancelled job keeps its checkpoints until deleted
    assert client.delete(f"/jobs/{job['id']}").status_code == 204
    assert job_files(stack.data_dir, job["id"]) == []


def test_delete_job_removes_its_files_and_leaves_a_tombstone(stack, dataset):
    client = stack.client
    job = wait_for_status(client, submit(client, dataset["id"], epochs=1)["id"], FINISHED)
    assert job_files(stack.data_dir, job["id"])
    r = client.delete(f"/jobs/{job['id']}")
    assert r.status_code == 204 and r.content == b""
    assert job_files(stack.data_dir, job["id"]) == []
    # a job that never succeeded has no model, and says so (it was a 404 "artifact does not exist")
    cancelled = submit(client, dataset["id"], **LONG)["id"]
    client.post(f"/jobs/{cancelled}/cancel")
    assert wait_for_status(client, cancelled, FINISHED)["status"] == "cancelled"
    r = client.get(f"/jobs/{cancelled}/artifacts/model.tar")
    assert (r.status_code, r.json()["error"]["code"]) == (409, "model_not_ready"), r.text
    assert "is cancelled; only a succeeded job has a model" in r.json()["error"]["message"]
    for path in ["", "/artifacts", "/artifacts/model.tar", "/metrics", "/events", "/checkpoints"]:
        r = client.get(f"/jobs/{job['id']}{path}")
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == "deleted" and "was deleted at" in r.json()["error"]["message"]
    assert client.delete(f"/jobs/{job['id']}").status_code == 404
    assert client.post(f"/jobs/{job['id']}/cancel").status_code == 404
    assert job["id"] not in {j["id"] for j in client.get("/jobs", params={"limit": 100}).json()["data"]}
    r = client.delete("/jobs/job_0123456789abcdef")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_delete_dataset_removes_its_file_and_cache(stack):
    client = stack.client
    dataset = upload(client, labelled_csv(rows=24, seed=11))
    job = wait_for_status(client, submit(client, dataset["id"], epochs=1)["id"], FINISHED)
    cache = stack.data_dir / "cache" / "tokenized" / dataset["sha256"]
    assert cache.is_dir() and list((stack.data_dir / "uploads").glob(f"{dataset['id']}.*"))

    assert client.delete(f"/datasets/{dataset['id']}").status_code == 204
    assert not cache.exists() and not list((stack.data_dir / "uploads").glob(f"{dataset['id']}.*"))
    r = client.get(f"/datasets/{dataset['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "deleted"
    assert dataset["id"] not in {d["id"] for d in client.get("/datasets").json()["data"]}
    assert client.delete(f"/datasets/{dataset['id']}").json()["error"]["code"] == "deleted"
    assert client.delete("/datasets/ds_0123456789abcdef").json()["error"]["code"] == "not_found"
    r = client.post("/jobs", json={"base_model": job["base_model"], "training_dataset": dataset["id"]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_dataset"
    assert "deleted" in r.json()["error"]["message"]
    # The job trained on it keeps its model.
    assert client.get(f"/jobs/{job['id']}/artifacts/model.tar").status_code == 200


def test_an_upload_left_by_a_killed_api_is_removed_and_one_in_progress_is_not(engine_env):
    """``kill -9`` of the API mid-upload left ``uploads/.<uuid>.tmp`` for good (52 MB in a walk);
    one being written (touched within ``DEAD_UPLOAD_SECONDS``) stays."""
    import os
    import time

    from shared.jobs import retention

    folder = engine_env / "uploads"
    folder.mkdir(parents=True)
    dead, live, dataset = folder / ".dead.tmp", folder / ".live.tmp", folder / "ds_0123456789abcdef.csv"
    for f in (dead, live, dataset):
        f.write_bytes(b"x")
    old = time.time() - retention.DEAD_UPLOAD_SECONDS - 60
    for f in (dead, dataset):
        os.utime(f, (old, old))
    retention.remove_dead_uploads()
    assert sorted(p.name for p in folder.iterdir()) == [".live.tmp", "ds_0123456789abcdef.csv"]


def test_retention_removes_old_jobs_files_and_leftovers(stack, dataset, monkeypatch):
    from shared.jobs import retention
    from shared.settings import get_settings

    client = stack.client
    job = wait_for_status(client, submit(client, dataset["id"], epochs=1)["id"], FINISHED)
    # A succeeded job's checkpoint directory that a dying worker left behind goes too.
    leftover = stack.data_dir / "checkpoints" / job["id"] / "step-00000001"
    leftover.mkdir(parents=True)
    (leftover / "training_state.pt").write_bytes(b"x")

    retention.clean_up_files()  # no retention set: only the leftover goes
    assert not leftover.parent.exists()
    assert client.get(f"/jobs/{job['id']}/artifacts/model.tar").status_code == 200

    monkeypatch.setenv("TUNEJOB_ARTIFACT_RETENTION_DAYS", "0")
    get_settings.cache_clear()
    try:
        # a model that an alias names is in use however old it is: its files stay
        assert client.put("/models/aliases/production", json={"job_id": job["id"]}).status_code == 200
        retention.clean_up_files()
        assert client.get(f"/jobs/{job['id']}/artifacts/model.tar").status_code == 200
        assert client.delete("/models/aliases/production").status_code == 204
        retention.clean_up_files()
    finally:
        monkeypatch.delenv("TUNEJOB_ARTIFACT_RETENTION_DAYS")
        get_settings.cache_clear()
    assert job_files(stack.data_dir, job["id"]) == []
    kept = client.get(f"/jobs/{job['id']}").json()  # the job stays, with its metrics and events
    assert kept["status"] == "succeeded" and kept["files_deleted_at"] is not None
    assert client.get(f"/jobs/{job['id']}/artifacts").json()["data"] == []
    gone = client.get(f"/jobs/{job['id']}/artifacts/model.tar")  # 409 saying why (it was a 404 "does not exist")
    assert (gone.status_code, gone.json()["error"]["code"]) == (409, "model_files_deleted"), gone.text
    assert "files_deleted" in event_codes(client, job["id"])
    assert client.get(f"/jobs/{job['id']}/metrics").json()["data"]
