"""The evaluation report (issue 37): ``evaluation.json`` and its pictures in the artifact,
``GET /jobs/{id}/evaluation``, and its figures recomputed from the downloaded model."""

import io
import json
import random
import tarfile

import numpy as np
import pytest

from tests.conftest import TINY_MODEL, wait_for_status
from worker.evaluation import calibration, classification_report, regression_report, token_report

WORDS = {
    "sports": ["goal", "match", "team", "score"],
    "tech": ["chip", "code", "cloud", "data"],
    "food": ["bread", "soup", "salt", "cake"],
}


def topic_rows(rows: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    names = sorted(WORDS)
    return [
        {
            "text": " ".join(rng.choices(WORDS[names[i % 3]] + ["the", "a"], k=rng.randint(3, 12))),
            "label": names[i % 3],
            "score": float(i % 3) + rng.random(),
        }
        for i in range(rows)
    ]


def upload(client, rows: list[dict], filename: str) -> str:
    content = "".join(json.dumps(row) + "\n" for row in rows).encode()
    r = client.post("/datasets", files={"file": (filename, io.BytesIO(content), "application/octet-stream")})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def train(client, task: str, train_id: str, validation_id: str | None, label_column: str, **fields) -> dict:
    r = client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "task": task,
            "training_dataset": train_id,
            "validation_dataset": validation_id,
            "text_column": "text",
            "label_column": label_column,
            **fields,
            "hyperparameters": {
                "epochs": 2,
                "batch_size": 8,
                "max_length": 32,
                "learning_rate": 1e-3,
                "precision": "fp32",
            },
        },
    )
    assert r.status_code == 201, r.text
    job = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["error"]
    return job


def download(client, job_id: str, into) -> None:
    r = client.get(f"/jobs/{job_id}/artifacts/model.tar")
    assert r.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        tar.extractall(into, filter="data")


def test_the_confusion_matrix_is_what_the_downloaded_model_predicts(stack, tmp_path):
    import torch
    from sklearn.metrics import confusion_matrix
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from shared.store.manifest import verify_manifest

    client = stack.client
    validation = topic_rows(30, seed=2)
    job = train(
        client,
        "classification",
        upload(client, topic_rows(60, seed=1), "train.jsonl"),
        upload(client, validation, "dev.jsonl"),
        "label",
    )
    r = client.get(f"/jobs/{job['id']}/evaluation")
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["rows"] == 30 and report["figures"] == ["confusion_matrix.png", "reliability_diagram.png"]
    assert report["accuracy"] == pytest.approx(job["validation_metrics"]["accuracy"])

    download(client, job["id"], tmp_path)
    assert verify_manifest(tmp_path) == []  # the report and its pictures are in the manifest
    assert json.loads((tmp_path / "evaluation.json").read_text()) == report
    assert (tmp_path / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    texts = [row["text"] for row in validation]
    with torch.no_grad():
        predicted = model(**tokenizer(texts, return_tensors="pt", padding=True, truncation=True)).logits.argmax(-1)
    names = job["label_names"]
    gold = [row["label"] for row in validation]
    expected = confusion_matrix(gold, [names[i] for i in predicted.tolist()], labels=names)
    assert report["confusion_matrix"]["labels"] == names
    assert report["confusion_matrix"]["counts"] == expected.tolist()
    assert [report["per_class"][n]["support"] for n in names] == expected.sum(axis=1).tolist()
    assert all(m["label"] != m["prediction"] for m in report["mistakes"])

    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == TINY_MODEL and card.data.pipeline_tag == "text-classification"
    assert card.data.datasets == [job["training_dataset"]] and card.data.library_name == "transformers"
    results = card.data.eval_results
    assert {r.metric_type: r.metric_value for r in results} == report["metrics"]
    assert {r.dataset_type for r in results} == {job["validation_dataset"]}
    assert "## Intended use and limitations" in card.text and "AutoModelForSequenceClassification" in card.text


def score(client, job_id: str, dataset_id: str, label_column: str | None, expect: int = 201, **fields) -> dict:
    """A prediction of ``dataset_id`` with ``job_id``'s model (``label_column``: its gold labels),
    waited for when created."""
    r = client.post(
        "/predictions",
        json={"model": job_id, "dataset": dataset_id, "text_column": "text", "label_column": label_column, **fields},
    )
    assert r.status_code == expect, r.text
    if expect != 201:
        return r.json()["error"]
    prediction = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"}, path="/predictions")
    assert prediction["status"] == "succeeded", prediction["error"]
    return prediction


def through_the_cli(stack, argv: list[str]) -> tuple[str, str]:
    """(what the command drew, what it printed) for ``tunejob ARGV`` against the stack's API."""
    import argparse
    import contextlib

    from rich.console import Console

    from client import Client, cli
    from tests.conftest import BASE_URL
    from tests.test_webhooks import ViaTestClient

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers(dest="command", required=True))
    key = stack.client.headers["Authorization"].removeprefix("Bearer ")
    screen, printed = io.StringIO(), io.StringIO()
    with (
        Client(BASE_URL, api_key=key, transport=ViaTestClient(stack.client)) as client,
        contextlib.redirect_stdout(printed),
    ):
        args = parser.parse_args(argv)
        args.handler(client, args, Console(file=screen, width=200))
    return screen.getvalue(), printed.getvalue()


def test_a_test_set_gets_the_validation_report_and_its_figures_are_what_the_predictions_say(stack):
    """Scored as a test set, the validation rows give the job's own report; a test set with a label
    the model does not know is refused naming it, or, asked to, scored with its rows as errors, and
    the report's figures are recomputed from the downloaded predictions."""
    from sklearn.metrics import accuracy_score, confusion_matrix

    client = stack.client
    validation = topic_rows(30, seed=2)
    validation_id = upload(client, validation, "dev.jsonl")
    job = train(client, "classification", upload(client, topic_rows(60, seed=1), "train.jsonl"), validation_id, "label")
    expected = client.get(f"/jobs/{job['id']}/evaluation").json()
    prediction = score(client, job["id"], validation_id, "label")
    assert prediction["label_column"] == "label"
    assert prediction["evaluation_url"] == f"/predictions/{prediction['id']}/evaluation"
    report = client.get(prediction["evaluation_url"]).json()
    assert report["confusion_matrix"]["counts"] == expected["confusion_matrix"]["counts"]
    assert report["metrics"] == pytest.approx(expected["metrics"])
    assert {n: v["support"] for n, v in report["per_class"].items()} == {
        n: v["support"] for n, v in expected["per_class"].items()
    }
    assert sorted(m["row"] for m in report["mistakes"]) == sorted(m["row"] for m in expected["mistakes"])
    r = client.get(f"{prediction['evaluation_url']}/confusion_matrix.png")
    assert r.status_code == 200 and r.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert client.get(f"{prediction['evaluation_url']}/residuals.png").status_code == 404

    test_set = [{**row, "label": "music" if i % 5 == 0 else row["label"]} for i, row in enumerate(topic_rows(20, 7))]
    test_id = upload(client, test_set, "test.jsonl")
    before = len(client.get("/predictions", params={"limit": 100}).json()["data"])
    error = score(client, job["id"], test_id, "label", expect=422)
    assert (error["code"], error["param"]) == ("unknown_labels", "label_column")
    assert "'music' (first in row 1)" in error["message"] and "'test.jsonl'" in error["message"]
    assert len(client.get("/predictions", params={"limit": 100}).json()["data"]) == before  # nothing queued

    screen, prediction_id = through_the_cli(
        stack,
        [
            "predict",
            "create",
            "--model",
            job["id"],
            "--dataset",
            test_id,
            "--label-column",
            "label",
            "--count-unknown-labels",
            "--quiet",
        ],
    )
    prediction = wait_for_status(client, prediction_id.strip(), {"succeeded", "failed"}, path="/predictions")
    assert prediction["status"] == "succeeded", prediction["error"]
    screen, _ = through_the_cli(stack, ["predict", "evaluation", prediction["id"]])
    assert "does not know (counted as errors): music" in " ".join(screen.split()) and "f1_macro" in screen
    report = client.get(f"/predictions/{prediction['id']}/evaluation").json()
    assert report["unknown_labels"] == ["music"] and report["rows"] == 20
    results = [json.loads(line) for line in client.get(f"/predictions/{prediction['id']}/results").text.splitlines()]
    gold, predicted = [row["label"] for row in test_set], [row["label"] for row in results]
    names = job["label_names"] + ["music"]
    assert report["confusion_matrix"]["counts"] == confusion_matrix(gold, predicted, labels=names).tolist()
    assert report["accuracy"] == pytest.approx(accuracy_score(gold, predicted))  # "music" rows are errors
    assert report["per_class"]["music"]["support"] == 4
    events = client.get(f"/predictions/{prediction['id']}/events").json()["data"]
    [event] = [e for e in events if e["code"] == "evaluation"]
    assert "'music'" in event["message"] and event["level"] == "warning"

    plain = score(client, job["id"], test_id, None)
    r = client.get(f"/predictions/{plain['id']}/evaluation")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_evaluation"
    assert stack.client_for("tenant-b").get(f"/predictions/{prediction['id']}/evaluation").status_code == 404
    error = score(client, job["id"], test_id, "nope", expect=422)
    assert (error["code"], error["param"]) == ("missing_column", "label_column")


def test_regression_and_multi_label_reports(stack):
    client = stack.client
    rows = topic_rows(48, seed=3)
    dev = upload(client, rows[36:], "dev.jsonl")
    job = train(client, "regression", upload(client, rows[:36], "train.jsonl"), dev, "score")
    report = client.get(f"/jobs/{job['id']}/evaluation").json()
    prediction = score(client, job["id"], dev, "score")  # the validation rows, as a test set
    tested = client.get(f"/predictions/{prediction['id']}/evaluation").json()
    assert tested["metrics"] == pytest.approx(report["metrics"]) and tested["figures"] == ["residuals.png"]
    values = [
        json.loads(line)["value"] for line in client.get(f"/predictions/{prediction['id']}/results").text.splitlines()
    ]
    assert tested["mae"] == pytest.approx(np.mean(np.abs(np.array(values) - [r["score"] for r in rows[36:]])))
    assert report["task"] == "regression" and report["figures"] == ["residuals.png"]
    assert report["rmse"] ** 2 == pytest.approx(job["validation_metrics"]["mse"], rel=1e-4)
    assert {"mae", "pearson_r", "spearman_r"} <= set(report) and len(report["largest_errors"]) == 12
    assert client.get(f"/jobs/{job['id']}/artifacts/model/residuals.png").status_code == 200

    multi = [{"text": r["text"], "topics": [r["label"]] + (["tech"] if i % 4 == 0 else [])} for i, r in enumerate(rows)]
    dev = upload(client, multi[36:], "dev.jsonl")
    job = train(client, "multi_label", upload(client, multi[:36], "train.jsonl"), dev, "topics", tune_threshold=True)
    report = client.get(f"/jobs/{job['id']}/evaluation").json()
    prediction = score(client, job["id"], dev, "topics")
    tested = client.get(f"/predictions/{prediction['id']}/evaluation").json()
    assert tested["per_label"] == report["per_label"] and tested["threshold"] == report["threshold"]
    assert report["threshold"] == job["validation_metrics"]["threshold"]  # the tuned one
    per_label = {n: v["f1"] for n, v in report["per_label"].items()}
    assert per_label == pytest.approx(job["validation_metrics"]["f1_per_label"])


def test_token_classification_report_agrees_with_validation(stack):
    from tests.test_token_classification import conll, submit, tagged_jsonl
    from tests.test_token_classification import upload as upload_file

    client = stack.client
    train_id = upload_file(client, conll(120, seed=1), "train.conll").json()["id"]
    r = submit(client, train_id, upload_file(client, tagged_jsonl(30, seed=2), "dev.jsonl").json()["id"])
    job = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    report = client.get(f"/jobs/{job['id']}/evaluation").json()
    metrics = job["validation_metrics"]
    assert report["task"] == "token_classification" and report["rows"] == 30
    assert report["entity_f1"] == pytest.approx(metrics["entity_f1"])
    for kind, figures in metrics["per_entity"].items():
        assert report["per_entity"][kind] == pytest.approx(figures)
    assert all(s["errors"] > 0 for s in report["worst_sentences"])
    error = score(client, job["id"], train_id, "tags", expect=422)  # predictions read raw text, not tagged words
    assert (error["code"], error["param"]) == ("unsupported_task", "label_column")


def test_a_job_without_validation_rows_has_no_report_and_a_running_one_409(stack):
    client = stack.client
    job = train(
        client,
        "classification",
        upload(client, topic_rows(30, seed=4), "train.jsonl"),
        None,
        "label",
        validation_split=0.0,
    )
    r = client.get(f"/jobs/{job['id']}/evaluation")
    assert r.status_code == 404 and "evaluation report" in r.json()["error"]["message"]
    assert client.get("/jobs/job_doesnotexist/evaluation").status_code == 404
    other = stack.client_for("tenant-b")
    assert other.get(f"/jobs/{job['id']}/evaluation").status_code == 404


def test_a_held_out_split_is_reported_on_its_rows(stack):
    """Without a validation dataset the report scores the held-out ``validation_split`` rows."""
    client = stack.client
    job = train(
        client,
        "classification",
        upload(client, topic_rows(60, seed=5), "train.jsonl"),
        None,
        "label",
        validation_split=0.25,
    )
    report = client.get(f"/jobs/{job['id']}/evaluation").json()
    assert report["rows"] == 15
    assert report["accuracy"] == pytest.approx(job["validation_metrics"]["accuracy"])


# ----------------------------------------------------------------------------- the report's figures


def rows_of(names: list[str], probabilities: list[list[float]]) -> list[dict]:
    return [{"label": names[int(np.argmax(p))], "probabilities": dict(zip(names, p))} for p in probabilities]


def test_unknown_gold_labels_count_as_errors_and_mistakes_are_most_confident_first():
    names = ["neg", "pos"]
    rows = rows_of(names, [[0.9, 0.1], [0.2, 0.8], [0.4, 0.6], [0.3, 0.7]])
    report = classification_report(names, ["neg", "neg", "pos", "meh"], rows, ["a", "b", "c", "d"])
    assert report["unknown_labels"] == ["meh"]
    assert report["confusion_matrix"]["labels"] == ["neg", "pos", "meh"]
    assert report["confusion_matrix"]["counts"] == [[1, 1, 0], [0, 1, 0], [0, 1, 0]]
    assert report["accuracy"] == 0.5  # "meh" is an error, as trainer.evaluate counts it
    assert [m["text"] for m in report["mistakes"]] == ["b", "d"]  # 0.8 before 0.7
    assert report["per_class"]["meh"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1}
    assert report["roc_auc"] == pytest.approx(1 / 3)  # "pos" (0.6) above 0.1, below 0.8 and 0.7


def test_expected_calibration_error_weights_each_bin_by_its_rows():
    confidence = np.array([0.95, 0.95, 0.95, 0.95, 0.55, 0.55])
    correct = np.array([True, True, True, False, True, False])
    result = calibration(confidence, correct)
    # bin 0.9-1.0: accuracy 0.75 at confidence 0.95 (4 rows); bin 0.5-0.6: 0.5 at 0.55 (2 rows)
    assert result["ece"] == pytest.approx(4 / 6 * 0.2 + 2 / 6 * 0.05)
    assert [b["count"] for b in result["bins"]] == [2, 4]


def test_regression_lists_the_largest_errors_first():
    report = regression_report(np.array([1.0, 2.0, 3.0]), np.array([1.5, 0.0, 3.1]), ["a", "b", "c"])
    assert [e["text"] for e in report["largest_errors"]] == ["b", "a", "c"]
    assert report["mae"] == pytest.approx((0.5 + 2.0 + 0.1) / 3)


def test_token_report_lists_the_sentences_with_most_errors():
    names = ["B-PER", "I-PER", "O"]
    gold = [["B-PER", "O", "O"], ["B-PER", "I-PER", "O"], ["O", "O", "O"]]
    predicted = [["B-PER", "O", "O"], ["O", "O", "B-PER"], ["O", "O"]]  # the last one truncated
    report = token_report(names, gold, predicted, [["a", "b", "c"], ["d", "e", "f"], ["g", "h", "i"]])
    assert [s["row"] for s in report["worst_sentences"]] == [1]
    assert report["worst_sentences"][0]["errors"] == 3
    assert report["per_entity"]["PER"]["support"] == 2 and report["entity_recall"] == 0.5
