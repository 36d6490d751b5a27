"""The main job through HTTP: upload, submit, poll, download, predict; on every stack."""

import io
import random
import tarfile

import pandas as pd

from tests.conftest import TINY_MODEL, wait_for_status, wait_until

WORDS = {
    "sports": ["match", "goal", "team", "coach", "league"],
    "business": ["shares", "market", "profit", "bank", "sales"],
}


def labelled_csv(rows: int = 48, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    data = []
    for i in range(rows):
        label = ["sports", "business"][i % 2]
        text = " ".join(rng.choices(WORDS[label], k=rng.randint(3, 30)))
        data.append({"text": text, "label": label})
    return pd.DataFrame(data).to_csv(index=False).encode()


def upload(client, content: bytes, filename: str = "train.csv") -> dict:
    r = client.post("/datasets", files={"file": (filename, io.BytesIO(content), "text/csv")})
    assert r.status_code == 201, r.text
    return r.json()


def submit(client, dataset_id: str, **hyperparameters) -> dict:
    body = {
        "base_model": TINY_MODEL,
        "task": "classification",
        "training_dataset": dataset_id,
        "text_column": "text",
        "label_column": "label",
        "hyperparameters": {"epochs": 2, "batch_size": 8, "max_length": 64, "learning_rate": 1e-3, **hyperparameters},
    }
    r = client.post("/jobs", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_upload_submit_poll_download_predict(stack, tmp_path):
    from transformers import pipeline

    client = stack.client
    dataset = upload(client, labelled_csv())
    assert dataset["rows"] == 48 and dataset["columns"] == ["text", "label"] and dataset["format"] == "csv"
    job = submit(client, dataset["id"], save_every_steps=3)
    assert job["status"] in {"queued", "running"}  # the worker may claim it before the response

    job = wait_for_status(client, job["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["error"]
    assert job["progress"]["step"] == job["progress"]["total_steps"] > 0
    assert job["progress"]["fraction"] == 1.0
    assert 0 < job["train_metrics"]["padding_efficiency"] <= 1
    assert job["train_metrics"]["tokens_per_second"] > 0
    assert set(job["validation_metrics"]) >= {"accuracy", "f1_macro", "loss"}

    metrics = client.get(f"/jobs/{job['id']}/metrics").json()["data"]
    names = {m["name"] for m in metrics}
    assert {
        "train_loss",
        "learning_rate",
        "grad_norm",
        "tokens_per_second",
        "padding_efficiency",
        "peak_memory_mb",
        "eval_accuracy",
    } <= names
    steps = sorted({m["step"] for m in metrics if m["name"] == "train_loss"})
    assert steps == list(range(1, job["progress"]["total_steps"] + 1))
    later = client.get(f"/jobs/{job['id']}/metrics", params={"after_step": 3}).json()["data"]
    assert later and min(m["step"] for m in later) == 4

    # Checkpoints were saved while it ran (every 3 steps); a succeeded job keeps none: its model is
    # in the artifacts.
    events = [e["code"] for e in client.get(f"/jobs/{job['id']}/events").json()["data"]]
    assert events[0] == "created" and events[-2:] == ["timings", "succeeded"]
    assert client.get(f"/jobs/{job['id']}/checkpoints").json()["data"] == []
    wait_until(lambda: not (stack.data_dir / "checkpoints" / job["id"]).exists(), "checkpoints deleted")

    artifacts = {a["name"]: a for a in client.get(f"/jobs/{job['id']}/artifacts").json()["data"]}
    assert {"model.tar", "metrics.json", "model/model.safetensors", "model/manifest.json"} <= set(artifacts)
    r = client.get(f"/jobs/{job['id']}/artifacts/model.tar")
    assert r.status_code == 200 and len(r.content) == artifacts["model.tar"]["bytes"]
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(tmp_path / "model", filter="data")
    files = {p.name for p in (tmp_path / "model").iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "training_args.json",
        "metrics.json",
        "manifest.json",
    } <= files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)

    classify = pipeline("text-classification", model=str(tmp_path / "model"), device="cpu")
    predictions = classify(["goal team coach", "market profit bank"])
    assert {p["label"] for p in predictions} <= {"sports", "business"}


def test_artifact_download_is_by_listed_name_only(stack):
    dataset = upload(stack.client, labelled_csv(rows=16))
    job = wait_for_status(stack.client, submit(stack.client, dataset["id"], epochs=1)["id"], {"succeeded"})
    for name in [
        "../../tunejob.db",
        "model",
        "..%2F..%2Ftunejob.db",
        "model/..%2F..%2F..%2Ftunejob.db",
        "model/training_args.json/..",
        "manifest.json",
        "model/.model.tmp",
    ]:
        r = stack.client.get(f"/jobs/{job['id']}/artifacts/{name}")
        assert r.status_code == 404, name
        assert "error" in r.json()


def test_long_reads_leave_the_event_loop(monkeypatch):
    """``api.db.read_rows`` on SQLite: a short read (a poll's new metrics) runs on the event loop;
    when ``INLINE_ROWS`` rows are not all, the whole read runs again in the thread pool, and its rows
    are the answer."""
    import asyncio
    import threading

    from api import db

    calls = []

    def rows(available: int, limit: int) -> list[int]:
        calls.append((limit, threading.current_thread() is threading.main_thread()))
        return list(range(min(available, limit)))

    monkeypatch.setattr(db, "reads_inline", lambda: True)
    for available, limit, expected_calls in [
        (30, 10_000, [(100, True)]),
        (250, 10_000, [(100, True), (10_000, False)]),
        (250, 100, [(100, True)]),
        (100, 150, [(100, True), (150, False)]),
    ]:
        calls.clear()
        assert asyncio.run(db.read_rows(rows, available, limit=limit)) == list(range(min(available, limit)))
        assert calls == expected_calls
