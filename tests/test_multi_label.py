"""task "multi_label" through HTTP on every stack: list labels (JSONL, Parquet) and delimited text
(CSV with label_separator), the saved model that transformers' pipeline reads, the decision
threshold, and the 4xx for bad input."""

import io
import json
import random
import tarfile

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import TINY_MODEL, wait_for_status

GENRES = {
    "drama": ["tears", "family", "loss"],
    "comedy": ["joke", "laugh", "funny"],
    "action": ["chase", "gun", "fight"],
}


def genre_rows(rows: int = 48, seed: int = 0) -> list[dict]:
    """Texts built from the words of 0 to 2 genres, with those genres as labels (every 8th row has none)."""
    rng = random.Random(seed)
    data = []
    for i in range(rows):
        genres = [] if i % 8 == 0 else rng.sample(sorted(GENRES), 1 + i % 2)
        words = [w for g in genres for w in GENRES[g]] or ["plain"]
        data.append({"text": " ".join(rng.choices(words, k=rng.randint(4, 20))), "genres": genres})
    return data


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def csv_with_separator(rows: list[dict], separator: str = "|") -> bytes:
    return pd.DataFrame([{**row, "genres": separator.join(row["genres"])} for row in rows]).to_csv(index=False).encode()


def upload(client, content: bytes, filename: str) -> dict:
    r = client.post("/datasets", files={"file": (filename, io.BytesIO(content), "application/octet-stream")})
    assert r.status_code == 201, r.text
    return r.json()


def body(dataset_id: str, **fields) -> dict:
    return {
        "base_model": TINY_MODEL,
        "task": "multi_label",
        "training_dataset": dataset_id,
        "text_column": "text",
        "label_column": "genres",
        "hyperparameters": {"epochs": 2, "batch_size": 8, "max_length": 32, "learning_rate": 1e-3},
        **fields,
    }


def submit(client, dataset_id: str, **fields) -> dict:
    r = client.post("/jobs", json=body(dataset_id, **fields))
    assert r.status_code == 201, r.text
    return wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})


def download_model(client, job_id: str, into) -> dict:
    """Extract the job's model.tar into ``into``; returns its config.json."""
    r = client.get(f"/jobs/{job_id}/artifacts/model.tar")
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(into, filter="data")
    return json.loads((into / "config.json").read_text())


def test_jsonl_list_labels_train_a_model_the_pipeline_reads(stack, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    from shared.store.manifest import verify_manifest

    client = stack.client
    dataset = upload(client, jsonl(genre_rows()), "movies.jsonl")
    r = client.post("/jobs", params={"dry_run": "true"}, json=body(dataset["id"], tune_threshold=True))
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan["labels"] == 3 and plan["rows_without_labels"] == 6  # rows 0, 8, ..., 40 of 48
    assert "6 row(s) of 'movies.jsonl' have no label" in plan["notes"][0]

    job = submit(
        client,
        dataset["id"],
        tune_threshold=True,
        hyperparameters={**body("")["hyperparameters"], "metric_for_best_model": "f1_micro"},
    )
    assert job["status"] == "succeeded", job["error"]
    assert job["label_names"] == ["action", "comedy", "drama"] and job["task"] == "multi_label"
    metrics = job["validation_metrics"]
    assert {"loss", "f1_micro", "f1_macro", "subset_accuracy", "threshold"} <= set(metrics)
    assert set(metrics["f1_per_label"]) == set(GENRES)
    assert metrics["f1_macro"] == pytest.approx(np.mean(list(metrics["f1_per_label"].values())))
    assert metrics["threshold"] in np.round(np.arange(0.05, 0.951, 0.05), 2)

    model_dir = tmp_path / "model"
    config = download_model(client, job["id"], model_dir)
    assert config["problem_type"] == "multi_label_classification"
    assert config["id2label"] == {"0": "action", "1": "comedy", "2": "drama"}
    best = json.loads((model_dir / "metrics.json").read_text())["validation"]
    assert config["decision_threshold"] == best["threshold"]
    assert verify_manifest(model_dir) == []  # config.json was rewritten after the weights were hashed

    texts = ["joke laugh chase gun", "tears family"]
    scores = pipeline("text-classification", model=str(model_dir), device="cpu", top_k=None)(texts)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        expected = torch.sigmoid(model(**tokenizer(texts, return_tensors="pt", padding=True)).logits)
    for row, want in zip(scores, expected.tolist()):
        assert {s["label"] for s in row} == set(GENRES)  # every label's score, not only the top one
        got = {s["label"]: s["score"] for s in row}
        assert [got[name] for name in ("action", "comedy", "drama")] == pytest.approx(want, abs=1e-5)
    assert model.config.decision_threshold == best["threshold"]


def test_csv_labels_split_on_the_separator(stack, tmp_path):
    client = stack.client
    dataset = upload(stack.client, csv_with_separator(genre_rows(seed=1)), "movies.csv")
    job = submit(client, dataset["id"], label_separator="|", decision_threshold=0.3)
    assert job["status"] == "succeeded", job["error"]
    assert job["label_names"] == ["action", "comedy", "drama"]
    assert job["label_separator"] == "|" and job["validation_metrics"]["threshold"] == 0.3
    assert download_model(client, job["id"], tmp_path / "model")["decision_threshold"] == 0.3


def test_parquet_list_column_is_accepted(stack):
    table = pa.table({"text": [r["text"] for r in genre_rows()], "genres": [r["genres"] for r in genre_rows()]})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    dataset = upload(stack.client, buffer.getvalue(), "movies.parquet")
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=body(dataset["id"]))
    assert r.status_code == 200, r.text
    assert r.json()["plan"]["labels"] == 3


def assert_report(r, status: int, code: str, row: int, column: str, value: str, filename: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and filename in error["message"], error
    first = error["problems"][0]
    assert (first["row"], first["column"], first["value"]) == (row, column, value), error


def test_bad_labels_are_refused_naming_file_row_column_and_value(stack):
    client = stack.client
    jobs_before = {j["id"] for j in client.get("/jobs").json()["data"]}
    rows = genre_rows()

    csv_without_separator = upload(client, csv_with_separator(rows), "no_sep.csv")
    r = client.post("/jobs", json=body(csv_without_separator["id"]))
    assert_report(r, 422, "invalid_label", 1, "genres", "", "no_sep.csv")  # row 1 has no genre: "" is text
    assert "label_separator" in r.json()["error"]["problems"][0]["message"]

    # pandas' to_csv of a list column: the advice to give label_separator "," would read "['drama'"
    pandas_csv = pd.DataFrame({"text": [r["text"] for r in rows], "genres": [r["genres"] for r in rows]}).to_csv(index=False)  # fmt: skip
    listed = upload(client, pandas_csv.encode(), "pandas.csv")
    r = client.post("/jobs", json=body(listed["id"]))
    problem = r.json()["error"]["problems"][0]
    assert r.status_code == 422 and "a list written as text" in problem["message"] and "JSONL" in problem["message"]

    float_label = upload(client, jsonl(rows[:5] + [{"text": "x y", "genres": ["drama", 1.5]}]), "floats.jsonl")
    r = client.post("/jobs", json=body(float_label["id"]))
    assert_report(r, 422, "invalid_label", 6, "genres", "['drama', 1.5]", "floats.jsonl")
    assert "holds a label that is a float" in r.json()["error"]["message"]

    train = upload(client, jsonl(rows), "train.jsonl")
    val = upload(client, jsonl(rows[:3] + [{"text": "space ship", "genres": ["drama", "sci-fi"]}]), "val.jsonl")
    r = client.post("/jobs", json=body(train["id"], validation_dataset=val["id"]))
    assert_report(r, 422, "unknown_label", 4, "genres", "sci-fi", "val.jsonl")

    no_labels = upload(client, jsonl([{**row, "genres": []} for row in rows]), "none.jsonl")
    r = client.post("/jobs", json=body(no_labels["id"]))
    assert r.status_code == 422 and r.json()["error"]["code"] == "no_labels", r.text

    r = client.post("/jobs", json={**body(train["id"], label_separator="|"), "task": "classification"})
    assert r.status_code == 422 and "label_separator applies to task 'multi_label' only" in r.text, r.text
    assert {j["id"] for j in client.get("/jobs").json()["data"]} == jobs_before  # nothing stored


def test_openai_facade_maps_multi_label(stack):
    dataset = upload(stack.client, csv_with_separator(genre_rows(rows=16)), "small.csv")
    request = {
        "model": TINY_MODEL,
        "training_file": dataset["id"],
        "task": "multi_label",
        "label_column": "genres",
        "label_separator": "|",
        "hyperparameters": {"n_epochs": 1},
    }
    r = stack.client.post("/v1/fine_tuning/jobs", json=request)
    assert r.status_code == 200, r.text
    job = wait_for_status(stack.client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded" and job["task"] == "multi_label", job["error"]

    r = stack.client.post("/v1/fine_tuning/jobs", json={**request, "label_separator": None})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_label", r.text


def test_cli_sends_the_multi_label_options():
    import argparse

    from client.options import add_create_arguments, job_spec

    parser = argparse.ArgumentParser()
    add_create_arguments(parser)
    args = parser.parse_args(
        ["--model", "m", "--dataset", "ds_1", "--task", "multi_label", "--label-separator", "|", "--tune-threshold"]
    )
    spec = job_spec(args)
    assert (spec["task"], spec["label_separator"], spec["tune_threshold"]) == ("multi_label", "|", True)
    assert "decision_threshold" not in spec  # not given: the server's default
    assert "tune_threshold" not in job_spec(parser.parse_args(["--model", "m", "--dataset", "ds_1"]))


def test_threshold_tuning_takes_the_lowest_threshold_with_the_best_micro_f1():
    from worker.training.metrics import multi_label_metrics

    y = np.array([[1, 0], [0, 1], [1, 1]])
    scores = np.array([[0.3, 0.1], [0.2, 0.35], [0.4, 0.3]])
    at_half = multi_label_metrics(y, scores, ["a", "b"], 0.5)
    assert at_half["f1_micro"] == 0 and at_half["subset_accuracy"] == 0 and at_half["threshold"] == 0.5
    tuned = multi_label_metrics(y, scores, ["a", "b"], None)
    assert tuned["threshold"] == 0.25  # 0.25 and 0.30 both get every label right; 0.20 predicts row 2's "a"
    assert tuned["f1_micro"] == tuned["subset_accuracy"] == 1.0 and tuned["f1_per_label"] == {"a": 1.0, "b": 1.0}


def test_loss_is_the_trainers_bce_with_logits():
    import torch

    from worker.training.steps import example_losses

    logits, labels = torch.randn(4, 3), torch.tensor([[1.0, 0, 0], [0, 0, 0], [1, 1, 0], [0, 1, 1]])
    per_example = example_losses(logits, labels, "multi_label")
    assert per_example.shape == (4,)
    assert per_example.mean() == pytest.approx(torch.nn.BCEWithLogitsLoss()(logits, labels).item(), rel=1e-6)
