"""Batch prediction jobs through HTTP (``/predictions``), on every stack: predict with a trained
job and with a base model, results in input order in three formats that agree, the dry run, cancel,
tenant isolation, the kind check between ``/jobs`` and ``/predictions``, and bad input refused
with a 4xx that names the field, nothing queued. A multi_label job's label sets are its model's
sigmoid scores against its saved threshold; a token_classification job's entities are those of
``pipeline("token-classification", aggregation_strategy="simple")``, and word lists are refused. Last, with real processes (``tests/test_faults.py``'s
machinery): ``kill -9`` of the worker mid-prediction, and the resumed attempt writes each row once."""

import io
import json
import os
import random
import signal

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import TINY_MODEL, wait_for_status, wait_until
from tests.test_api_jobs import labelled_csv, submit, upload
from tests.test_cancel import LONG, wait_until_training
from tests.test_faults import stacks  # noqa: F401  (the fixture of the kill test)

FINISHED = {"succeeded", "failed", "cancelled"}
PART_ROWS = 8  # results parts of 8 rows: the test datasets span several parts


@pytest.fixture(scope="module")
def small_parts(stack):
    """``TUNEJOB_PREDICT_PART_ROWS`` for the stack's in-process API and worker."""
    from shared.settings import get_settings

    os.environ["TUNEJOB_PREDICT_PART_ROWS"] = str(PART_ROWS)
    get_settings.cache_clear()
    yield
    del os.environ["TUNEJOB_PREDICT_PART_ROWS"]
    get_settings.cache_clear()


def scoring_csv(rows: int = 29, seed: int = 1) -> bytes:
    """Texts to score with ids that are not row numbers, some far longer than 16 tokens."""
    rng = random.Random(seed)
    words = ["match", "goal", "team", "shares", "market", "profit", "bank", "coach"]
    data = [
        {"doc": f"d-{1000 - i}", "body": " ".join(rng.choices(words, k=rng.choice([2, 5, 40]))), "other": "x"}
        for i in range(rows)
    ]
    return pd.DataFrame(data).to_csv(index=False).encode()


def wait_prediction(client, prediction_id: str, statuses: set[str] = FINISHED, timeout: float = 180) -> dict:
    return wait_for_status(client, prediction_id, statuses, timeout, path="/predictions")


def predict(client, body: dict, expect: int = 201, **params) -> dict:
    r = client.post("/predictions", json=body, params=params)
    assert r.status_code == expect, r.text
    return r.json()


def results(client, prediction_id: str, fmt: str) -> bytes:
    r = client.get(f"/predictions/{prediction_id}/results", params={"format": fmt})
    assert r.status_code == 200, r.text
    return r.content


def count_predictions(client) -> int:
    return len(client.get("/predictions", params={"limit": 100}).json()["data"])


@pytest.fixture(scope="module")
def trained(stack) -> dict:
    """A succeeded classification job of the stack's tenant."""
    job = submit(stack.client, upload(stack.client, labelled_csv(rows=32, seed=5))["id"], epochs=1)
    job = wait_for_status(stack.client, job["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]
    return job


@pytest.fixture(scope="module")
def to_score(stack, small_parts) -> dict:
    return upload(stack.client, scoring_csv(), "score.csv")


def body_for(model: str, dataset: dict, **fields) -> dict:
    return {
        "model": model,
        "dataset": dataset["id"],
        "text_column": "body",
        "id_column": "doc",
        "max_length": 16,
        "batch_size": 4,
        **fields,
    }


def test_predict_with_a_trained_job_writes_every_row_once_in_input_order(stack, trained, to_score):
    client = stack.client
    body = body_for(trained["id"], to_score)
    plan = predict(client, body, expect=200, dry_run="true")["plan"]
    prediction = predict(client, body)
    assert prediction["status"] in {"queued", "running"} and prediction["model"] == trained["id"]
    assert prediction["task"] == "classification" and prediction["label_names"] == trained["label_names"]

    done = wait_prediction(client, prediction["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["progress"]["rows_done"] == done["progress"]["total_rows"] == 29
    assert done["progress"]["fraction"] == 1.0
    result = done["result"]
    assert result["rows"] == 29 and result["max_length"] == 16
    # The stack's worker runs on the CPU, as the plan batches.
    assert [result[k] for k in ("truncated", "tokens", "padded_tokens")] == [
        plan[k] for k in ("truncated", "tokens", "padded_tokens")
    ]
    assert 0 < result["truncated"] < 29  # the 40-word texts only
    assert 0 < result["padding_efficiency"] <= 1 and result["rows_per_second"] > 0
    assert done["results_url"] == f"/predictions/{prediction['id']}/results"

    expected_ids = pd.read_csv(io.BytesIO(scoring_csv()))["doc"].tolist()
    lines = [json.loads(line) for line in results(client, prediction["id"], "jsonl").decode().splitlines()]
    assert [row["id"] for row in lines] == expected_ids
    for row in lines:
        assert list(row["probabilities"]) == trained["label_names"]
        assert sum(row["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
        assert row["label"] == max(row["probabilities"], key=row["probabilities"].get)
        assert row["score"] == pytest.approx(row["probabilities"][row["label"]])

    parquet = pq.read_table(io.BytesIO(results(client, prediction["id"], "parquet"))).to_pylist()
    assert parquet == lines
    csv = pd.read_csv(io.BytesIO(results(client, prediction["id"], "csv")), dtype={"id": str})
    assert csv["id"].tolist() == expected_ids and csv["label"].tolist() == [row["label"] for row in lines]
    for name in trained["label_names"]:
        assert csv[f"probabilities.{name}"].tolist() == pytest.approx([row["probabilities"][name] for row in lines])

    parts = sorted((stack.data_dir / "artifacts" / prediction["id"] / "predictions").glob("part-*.parquet"))
    assert len(parts) == 4  # 29 rows in parts of 8
    events = client.get(f"/predictions/{prediction['id']}/events").json()["data"]
    codes = [e["code"] for e in events]
    assert codes[0] == "created" and "started" in codes and "results" in codes and codes[-1] == "succeeded"
    assert events[-1]["message"] == "29 rows scored"  # it read "succeeded"


def test_rows_are_numbered_by_index_without_an_id_column_and_a_base_model_with_a_head_predicts(stack, to_score):
    client = stack.client
    done = wait_prediction(client, predict(client, body_for(TINY_MODEL, to_score, id_column=None))["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["label_names"] == ["LABEL_0", "LABEL_1"] and done["model"] == TINY_MODEL
    rows = [json.loads(line) for line in results(client, done["id"], "jsonl").decode().splitlines()]
    assert [row["id"] for row in rows] == list(range(29))

    no_limit = wait_prediction(client, predict(client, body_for(TINY_MODEL, to_score, max_length=None))["id"])
    assert no_limit["max_length"] == no_limit["result"]["max_length"] == 512  # the model's limit
    assert no_limit["result"]["truncated"] == 0
    paired = wait_prediction(
        client, predict(client, body_for(TINY_MODEL, to_score, max_length=None, text_pair_column="other"))["id"]
    )
    assert paired["status"] == "succeeded", paired["error"]
    assert paired["result"]["tokens"] == no_limit["result"]["tokens"] + 2 * 29  # "x" and a [SEP] a row


def test_a_regression_model_predicts_values(stack, to_score):
    client = stack.client
    data = pd.DataFrame({"text": ["short", "a longer text here", "mid text"] * 8, "label": [0.5, 2.0, 1.0] * 8})
    dataset = upload(client, data.to_csv(index=False).encode(), "reg.csv")
    r = client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "task": "regression",
            "training_dataset": dataset["id"],
            "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
        },
    )
    assert r.status_code == 201, r.text
    job = wait_for_status(client, r.json()["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]

    done = wait_prediction(client, predict(client, body_for(job["id"], to_score))["id"])
    assert done["status"] == "succeeded" and done["task"] == "regression" and done["label_names"] is None
    csv = pd.read_csv(io.BytesIO(results(client, done["id"], "csv")))
    assert list(csv.columns) == ["id", "value"] and len(csv) == 29 and csv["value"].notna().all()


def test_a_dry_run_stores_and_queues_nothing(stack, trained, to_score):
    client = stack.client
    before = count_predictions(client)
    out = predict(client, body_for(trained["id"], to_score), expect=200, dry_run="true")
    plan = out["plan"]
    assert out["dry_run"] is True and plan["rows"] == 29 and plan["max_length"] == 16
    assert plan["tokens"] <= plan["padded_tokens"] and 0 < plan["padding_efficiency"] <= 1
    assert plan["task"] == "classification" and "estimate_basis" in plan
    assert count_predictions(client) == before


def test_a_dry_run_of_many_rows_is_planned_from_a_sample(stack, trained, to_score, monkeypatch):
    """Past ``TUNEJOB_DRY_RUN_ROWS`` rows a dry run tokenizes a random sample (it runs in the API),
    scales its counts to the whole file, and says so."""
    from shared.settings import get_settings

    client = stack.client
    whole = predict(client, body_for(trained["id"], to_score), expect=200, dry_run="true")["plan"]
    assert whole["sampled_rows"] is None and whole["notes"] == []
    monkeypatch.setattr(get_settings(), "dry_run_rows", 10)
    plan = predict(client, body_for(trained["id"], to_score), expect=200, dry_run="true")["plan"]
    assert plan["rows"] == 29 and 3 <= plan["sampled_rows"] < 29  # each row with probability 10/29 (seeded)
    assert plan["notes"] == [
        f"planned from {plan['sampled_rows']} of the 29 rows, a random sample (TUNEJOB_DRY_RUN_ROWS): the counts "
        "and the estimate are scaled to the whole"
    ]
    # scaled to the whole file (10 texts pad worse than 29: batches of a sample are less alike)
    assert 0.7 * whole["tokens"] <= plan["tokens"] <= 1.3 * whole["tokens"], (plan, whole)
    assert plan["tokens"] <= plan["padded_tokens"] <= 1.5 * whole["padded_tokens"], (plan, whole)


def test_an_idempotency_key_makes_one_prediction(stack, trained, to_score):
    client = stack.client
    headers = {"Idempotency-Key": "predict-once"}
    first = client.post("/predictions", json=body_for(trained["id"], to_score), headers=headers)
    second = client.post("/predictions", json=body_for(trained["id"], to_score), headers=headers)
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] == second.json()["id"]
    wait_prediction(client, first.json()["id"])


def test_jobs_and_predictions_do_not_answer_for_each_other(stack, trained, to_score):
    client = stack.client
    prediction = wait_prediction(client, predict(client, body_for(trained["id"], to_score))["id"])
    for path in [f"/jobs/{prediction['id']}", f"/jobs/{prediction['id']}/events", f"/jobs/{prediction['id']}/metrics"]:
        assert client.get(path).status_code == 404, path
    for path in [
        f"/predictions/{trained['id']}",
        f"/predictions/{trained['id']}/events",
        f"/predictions/{trained['id']}/results",
    ]:
        assert client.get(path).status_code == 404, path
    assert client.post(f"/predictions/{trained['id']}/cancel").status_code == 404
    assert client.delete(f"/predictions/{trained['id']}").status_code == 404
    assert prediction["id"] not in {j["id"] for j in client.get("/jobs", params={"limit": 100}).json()["data"]}
    assert trained["id"] not in {p["id"] for p in client.get("/predictions", params={"limit": 100}).json()["data"]}


def test_the_stream_ends_with_the_prediction(stack, trained, to_score):
    client = stack.client
    prediction = wait_prediction(client, predict(client, body_for(trained["id"], to_score))["id"])
    with client.stream("GET", f"/predictions/{prediction['id']}/stream") as r:
        assert r.status_code == 200
        lines = [line.split(":", 1) for line in r.iter_lines() if line.startswith(("event:", "data:"))]
    events = [value.strip() for field, value in lines if field == "event"]
    assert {"progress", "events"} <= set(events) and events[-1] == "end"
    end = json.loads(lines[-1][1])
    assert end["id"] == prediction["id"] and end["progress"]["rows_done"] == 29


def test_a_queued_prediction_is_cancelled_and_never_runs(stack, trained, to_score):
    client = stack.client
    training = submit(client, upload(client, labelled_csv(rows=48, seed=3))["id"], **LONG)
    wait_until_training(client, training["id"])  # the one worker is busy: the prediction stays queued
    prediction = predict(client, body_for(trained["id"], to_score))
    r = client.delete(f"/jobs/{trained['id']}")  # its model is in use
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_in_use" and prediction["id"] in r.text
    cancelled = client.post(f"/predictions/{prediction['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["started_at"] is None
    client.post(f"/jobs/{training['id']}/cancel")
    assert wait_for_status(client, training["id"], FINISHED)["status"] == "cancelled"
    codes = [e["code"] for e in client.get(f"/predictions/{prediction['id']}/events").json()["data"]]
    assert codes == ["created", "cancelled"]
    r = client.get(f"/predictions/{prediction['id']}/results")
    assert r.status_code == 409 and r.json()["error"]["code"] == "results_not_ready"


def test_a_running_prediction_stops_after_its_part_when_cancelled(stack, small_parts):
    from shared.store.engine import read_session
    from shared.store.rows import Job

    client = stack.client
    rows = 40_000  # 5,000 parts of 8: far longer than the cancel takes to be seen
    data = pd.DataFrame({"text": [f"goal {i % 13} team" for i in range(rows)]})
    dataset = upload(client, data.to_csv(index=False).encode(), "long.csv")
    prediction = predict(client, {"model": TINY_MODEL, "dataset": dataset["id"]})
    url = f"/predictions/{prediction['id']}"

    def running_with_a_part() -> bool:
        job = client.get(url).json()
        assert job["status"] in {"queued", "running"}, job
        return job["progress"]["rows_done"] > 0

    wait_until(running_with_a_part, "a first part written", timeout=120)
    with read_session() as s:  # the tenant's quota counts the parts written so far, not only at the end
        assert s.get(Job, prediction["id"]).files_bytes > 0
    assert client.post(f"{url}/cancel").json()["status"] == "running"
    done = wait_prediction(client, prediction["id"])
    assert done["status"] == "cancelled" and done["error"] is None, done
    assert 0 < done["progress"]["rows_done"] < rows and done["results_url"] is None
    codes = [e["code"] for e in client.get(f"{url}/events").json()["data"]]
    assert codes.index("cancel_requested") < codes.index("cancelled") and "results" not in codes
    assert client.get(f"{url}/results").json()["error"]["code"] == "results_not_ready"


def test_delete_removes_the_results(stack, trained, to_score):
    client = stack.client
    prediction = wait_prediction(client, predict(client, body_for(trained["id"], to_score))["id"])
    assert client.delete(f"/predictions/{prediction['id']}").status_code == 204
    r = client.get(f"/predictions/{prediction['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "deleted"
    assert not (stack.data_dir / "artifacts" / prediction["id"]).exists()


def test_another_tenant_sees_nothing_and_cannot_use_the_job(stack, trained, to_score):
    client = stack.client
    prediction = wait_prediction(client, predict(client, body_for(trained["id"], to_score))["id"])
    other = stack.client_for("tenant-b")
    theirs = upload(other, scoring_csv(), "score.csv")
    assert other.get(f"/predictions/{prediction['id']}").status_code == 404
    assert other.get(f"/predictions/{prediction['id']}/results").status_code == 404
    assert other.get("/predictions").json()["data"] == []
    r = other.post("/predictions", json=body_for(trained["id"], theirs))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "unknown_model"
    assert other.get("/predictions").json()["data"] == []


@pytest.mark.parametrize(
    "fields, status, code, param, named",
    [
        ({"text_column": "nope"}, 422, "missing_column", "text_column", "'nope'"),
        ({"id_column": "ident"}, 422, "missing_column", "id_column", "'ident'"),
        ({"text_pair_column": "pair"}, 422, "missing_column", "text_pair_column", "'pair'"),
        ({"model": "all-MiniLM-L6-v2"}, 422, "model_without_head", "model", "'all-MiniLM-L6-v2'"),
        ({"model": "no-such-model"}, 422, "unknown_model", "model", "'no-such-model'"),
        ({"model": "job_0000000000000000"}, 404, "unknown_model", "model", "'job_0000000000000000'"),
        ({"dataset": "ds_0000000000000000"}, 422, "unknown_dataset", "dataset", "'ds_0000000000000000'"),
        ({"max_length": 4096}, 422, "max_length_too_long", "max_length", "4096"),
    ],
)
def test_bad_input_is_refused_naming_the_field_and_nothing_is_queued(
    stack, trained, to_score, fields, status, code, param, named
):
    client = stack.client
    before = count_predictions(client)
    r = client.post("/predictions", json={**body_for(trained["id"], to_score), **fields})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param) and named in error["message"]
    assert count_predictions(client) == before


def test_an_empty_text_is_reported_by_row_and_column(stack, trained):
    client = stack.client
    dataset = upload(client, b"doc,body\na,fine text\nb,\n", "gaps.csv")
    r = client.post("/predictions", json=body_for(trained["id"], dataset))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["problems"] == [{"row": 2, "column": "body", "value": "", "message": "is empty"}]


def test_a_repeated_id_is_reported_by_row_naming_the_first_and_nothing_is_queued(stack, trained):
    """Results are named by ``id_column``: a repeated id made two result rows of one name."""
    client = stack.client
    before = count_predictions(client)
    dataset = upload(client, b"doc,body\na,one\nb,two\na,three\nc,four\nb,five\na,six\n", "repeats.csv")
    r = client.post("/predictions", json=body_for(trained["id"], dataset))
    assert r.status_code == 422 and r.json()["error"]["code"] == "duplicate_id", r.text
    problems = r.json()["error"]["problems"]
    assert [(p["row"], p["column"]) for p in problems] == [(3, "doc"), (5, "doc"), (6, "doc")]
    assert all(
        ["row 1:" in problems[0]["message"], "row 2:" in problems[1]["message"], "row 1:" in problems[2]["message"]]
    )
    assert count_predictions(client) == before


def test_a_job_that_did_not_succeed_or_was_deleted_is_refused(stack, to_score):
    client = stack.client
    dataset = upload(client, labelled_csv(rows=16, seed=9))
    unfinished = submit(client, dataset["id"], **LONG)
    client.post(f"/jobs/{unfinished['id']}/cancel")
    assert wait_for_status(client, unfinished["id"], FINISHED)["status"] == "cancelled"
    r = client.post("/predictions", json=body_for(unfinished["id"], to_score))
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_ready", r.text
    assert r.json()["error"]["param"] == "model" and "cancelled" in r.json()["error"]["message"]

    assert client.delete(f"/jobs/{unfinished['id']}").status_code == 204
    r = client.post("/predictions", json=body_for(unfinished["id"], to_score))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_deleted", r.text
    assert r.json()["error"]["param"] == "model"


# ----------------------------------------------------------------------------- multi_label and token_classification

THRESHOLD = 0.35  # the multi_label job's decision_threshold: not the 0.5 default


def train_multi_label(client) -> dict:
    """A succeeded multi_label job of the tiny model (max_length 32) with ``decision_threshold``
    ``THRESHOLD``, trained long enough for its scores to part from 0.5."""
    from tests.test_multi_label import genre_rows, jsonl
    from tests.test_multi_label import submit as train

    job = train(
        client,
        upload(client, jsonl(genre_rows()), "movies.jsonl")["id"],
        decision_threshold=THRESHOLD,
        hyperparameters={"epochs": 10, "batch_size": 8, "max_length": 32, "learning_rate": 3e-3},
    )
    assert job["status"] == "succeeded", job["error"]
    return job


def train_tagger(client) -> dict:
    """A succeeded token_classification job of the tiny model (max_length 32), tags ``TAGS``."""
    from tests.test_token_classification import conll
    from tests.test_token_classification import submit as train

    r = train(client, upload(client, conll(160, seed=1), "train.conll")["id"])
    assert r.status_code == 201, r.text
    job = wait_for_status(client, r.json()["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]
    return job


def model_dir(stack, job: dict):
    return stack.data_dir / "artifacts" / job["id"] / "model"


def sigmoid_scores(directory, texts: list[str], max_length: int) -> list[list[float]]:
    """The saved multi_label model run directly: each text's sigmoid score per label."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer = (
        AutoModelForSequenceClassification.from_pretrained(directory),
        AutoTokenizer.from_pretrained(directory),
    )
    with torch.no_grad():
        logits = model(
            **tokenizer(texts, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        ).logits
    return torch.sigmoid(logits).tolist()


def assert_label_sets(rows: list[dict], directory, texts: list[str], max_length: int) -> None:
    """``rows`` (``labels``, ``probabilities``) are the model's sigmoid scores, labelled at its saved threshold."""
    config = json.loads((directory / "config.json").read_text())
    names = [config["id2label"][str(i)] for i in range(len(config["id2label"]))]
    assert config["decision_threshold"] == THRESHOLD
    for row, scores in zip(rows, sigmoid_scores(directory, texts, max_length), strict=True):
        assert list(row["probabilities"]) == names
        assert list(row["probabilities"].values()) == pytest.approx(scores, abs=1e-4)
        assert row["labels"] == [n for n, p in zip(names, scores) if p >= THRESHOLD]


def pipeline_entities(directory, texts: list[str]) -> list[list[dict]]:
    """``pipeline("token-classification", aggregation_strategy="simple")`` on the saved model,
    scores as floats compared to 1e-4."""
    from transformers import pipeline

    ner = pipeline("token-classification", model=str(directory), aggregation_strategy="simple", device="cpu")
    return [[{**e, "score": pytest.approx(float(e["score"]), abs=1e-4)} for e in entities] for entities in ner(texts)]


def raw_sentences() -> list[str]:
    """Sentences as raw text: capitals, punctuation, odd spacing, and one far past 32 tokens."""
    from tests.test_token_classification import sentences

    plain = [" ".join(words) for words, _ in sentences(12, seed=7)]
    return plain + ["Carol went to New York, then home.", "  bob   flew to paris!", "alice met dave in berlin " * 8]


@pytest.fixture(scope="module")
def multi_label_job(stack) -> dict:
    return train_multi_label(stack.client)


@pytest.fixture(scope="module")
def tagger(stack) -> dict:
    return train_tagger(stack.client)


def text_dataset(client, texts: list[str]) -> dict:
    return upload(
        client,
        pd.DataFrame({"doc": [f"d-{i}" for i in range(len(texts))], "body": texts}).to_csv(index=False).encode(),
        "texts.csv",
    )


def all_formats(client, prediction_id: str) -> tuple[list[dict], list[dict], pd.DataFrame]:
    """The results as JSONL rows, Parquet rows and a CSV frame; JSONL and Parquet agree."""
    lines = [json.loads(line) for line in results(client, prediction_id, "jsonl").decode().splitlines()]
    parquet = pq.read_table(io.BytesIO(results(client, prediction_id, "parquet")))
    csv = pd.read_csv(io.BytesIO(results(client, prediction_id, "csv")), dtype={"id": str})
    assert parquet.to_pylist() == lines
    return lines, parquet, csv


def test_a_multi_label_model_predicts_label_sets_at_its_saved_threshold(stack, multi_label_job, small_parts):
    from tests.test_multi_label import genre_rows

    client = stack.client
    texts = [row["text"] for row in genre_rows(rows=20, seed=3)]
    body = body_for(multi_label_job["id"], text_dataset(client, texts), max_length=None)
    plan = predict(client, body, expect=200, dry_run="true")["plan"]
    assert plan["task"] == "multi_label" and plan["label_names"] == multi_label_job["label_names"]
    done = wait_prediction(client, predict(client, body)["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["task"] == "multi_label" and done["result"]["tokens"] == plan["tokens"]

    lines, parquet, csv = all_formats(client, done["id"])
    assert_label_sets(lines, model_dir(stack, multi_label_job), texts, 32)
    assert 0 < sum(len(row["labels"]) for row in lines) < len(lines) * len(multi_label_job["label_names"])
    assert parquet.schema.field("labels").type == pa.list_(pa.string())
    assert [json.loads(cell) for cell in csv["labels"]] == [row["labels"] for row in lines]
    assert list(csv.columns) == ["id", "labels"] + [f"probabilities.{n}" for n in multi_label_job["label_names"]]
    for name in multi_label_job["label_names"]:
        assert csv[f"probabilities.{name}"].tolist() == pytest.approx([row["probabilities"][name] for row in lines])


def test_a_token_classification_model_predicts_the_pipeline_s_entities(stack, tagger, small_parts):
    client = stack.client
    texts = raw_sentences()
    body = body_for(tagger["id"], text_dataset(client, texts), max_length=None)
    plan = predict(client, body, expect=200, dry_run="true")["plan"]
    assert plan["task"] == "token_classification" and plan["label_names"] == tagger["label_names"]
    assert plan["max_length"] == 32 and plan["truncated"] == 1
    done = wait_prediction(client, predict(client, body)["id"])
    assert done["status"] == "succeeded", done["error"]
    assert [done["result"][k] for k in ("truncated", "tokens")] == [1, plan["tokens"]]

    lines, parquet, csv = all_formats(client, done["id"])
    assert [row["id"] for row in lines] == [f"d-{i}" for i in range(len(texts))]
    assert [row["entities"] for row in lines] == pipeline_entities(model_dir(stack, tagger), texts)
    assert {e["entity_group"] for row in lines for e in row["entities"]} == {"PER", "LOC"}  # it learnt them
    for text, row in zip(texts, lines):  # offsets into the text (the uncased tokenizer lowercases words)
        assert all(
            text[e["start"] : e["end"]].lower().replace(" ", "") == e["word"].replace(" ", "")
            for e in row["entities"]
            if "#" not in e["word"]
        )
    assert parquet.schema.field("entities").type.value_type.names == ["entity_group", "score", "word", "start", "end"]
    assert list(csv.columns) == ["id", "entities"]
    assert [json.loads(cell) for cell in csv["entities"]] == [row["entities"] for row in lines]


def words_files() -> list[tuple[bytes, str]]:
    """One dataset of word lists (column ``tokens``) in each format that holds lists."""
    from tests.test_token_classification import conll, sentences, tagged_jsonl

    buffer = io.BytesIO()
    pd.DataFrame([{"tokens": w, "tags": t} for w, t in sentences(3)]).to_parquet(buffer)
    return [(conll(3), "words.conll"), (tagged_jsonl(3), "words.jsonl"), (buffer.getvalue(), "words.parquet")]


def test_word_lists_and_text_pairs_are_refused_for_token_classification(stack, tagger):
    client = stack.client
    before = count_predictions(client)
    for content, filename in words_files():
        dataset = upload(client, content, filename)
        r = client.post("/predictions", json={"model": tagger["id"], "dataset": dataset["id"], "text_column": "tokens"})
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_text", "text_column"), filename
        assert error["problems"][0]["column"] == "tokens" and "holds a list, not text" in error["message"]
        assert "raw text" in error["message"] and f"{filename!r}" in error["message"]
    paired = {
        **body_for(tagger["id"], text_dataset(client, ["carol went home"])),
        "text_pair_column": "doc",
        "id_column": None,
    }
    r = client.post("/predictions", json=paired)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_text_pair_column", r.text
    assert r.json()["error"]["param"] == "text_pair_column"
    assert count_predictions(client) == before


def test_parts_regroup_the_rows_after_those_already_written():
    from shared.jobs.predictions import PredictionBatch, parts_of

    batches = [
        PredictionBatch(0, list("abcde"), list("ABCDE"), list(range(5))),
        PredictionBatch(5, list("fghij"), list("FGHIJ"), list(range(5, 10))),
        PredictionBatch(10, ["k"], ["K"], [10]),
    ]
    for skip in (0, 3, 4, 7, 11):
        parts = list(parts_of(iter(batches), 4, skip))
        assert [p.start for p in parts] == list(range(skip, 11, 4))
        assert "".join(t for p in parts for t in p.texts) == "abcdefghijk"[skip:]
        assert [i for p in parts for i in p.ids] == list(range(skip, 11))
        assert all(p.pairs == [t.upper() for t in p.texts] and len(p.texts) <= 4 for p in parts)


# ----------------------------------------------------------------------------- a killed or stopped worker

KILL_ROWS, KILL_PART_ROWS = 20_000, 50  # 400 parts: seconds of work, stopped after the first


@pytest.mark.parametrize("kind", ["embedded", "postgres+redis"])
@pytest.mark.parametrize("stop, code", [("kill", "job_restarted"), ("sigterm", "requeued")])
def test_a_worker_stopped_mid_prediction_is_resumed_and_every_row_is_written_once(
    stacks,  # noqa: F811
    kind,
    stop,
    code,
):
    """``kill -9`` (frozen first, so that it writes nothing after the check): the lease expires and
    the reaper re-queues the job. SIGTERM: the worker re-queues it after its current part and exits.
    Either way a new worker resumes after the parts written."""
    cluster = stacks.make(kind, TUNEJOB_PREDICT_PART_ROWS=str(KILL_PART_ROWS))
    (worker,) = cluster.start(workers=1)
    cluster.wait_worker_ready(worker)
    ids = [f"row-{i}" for i in range(KILL_ROWS)]
    data = pd.DataFrame({"doc": ids, "text": [f"match goal {i % 97} team" for i in range(KILL_ROWS)]})
    dataset = cluster.upload(data.to_csv(index=False).encode(), "many.csv")
    body = {"model": TINY_MODEL, "dataset": dataset["id"], "id_column": "doc", "max_length": 32}
    prediction = cluster.request("POST", "/predictions", 201, json=body).json()
    url = f"/predictions/{prediction['id']}"

    def part_written() -> dict | bool:
        job = cluster.request("GET", url).json()
        assert job["status"] in {"queued", "running"}, f"ended before a part was written: {job}"
        return job["progress"]["rows_done"] >= KILL_PART_ROWS and job

    cluster.wait_for("a first part to be written", part_written, timeout=120, interval=0.02)
    worker.signal(signal.SIGSTOP if stop == "kill" else signal.SIGTERM)
    stopped = cluster.request("GET", url).json()
    assert stopped["progress"]["rows_done"] < KILL_ROWS, stopped
    if stop == "kill":
        assert stopped["status"] == "running", stopped
        worker.kill()
    else:
        assert worker.wait(60) is not None, f"the worker did not exit\n{cluster.diagnostics()}"
        assert cluster.request("GET", url).json()["status"] == "queued"

    cluster.start_worker()
    done = cluster.wait_for(
        "the prediction to finish",
        lambda: (j := cluster.request("GET", url).json())["status"] in FINISHED and j,
        timeout=180,
    )
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 2 and done["result"]["rows"] == KILL_ROWS
    events = cluster.request("GET", f"{url}/events").json()["data"]
    codes = [e["code"] for e in events]
    assert codes.count(code) == 1 and codes.count("resumed") == 1, codes
    resumed = next(e["message"] for e in events if e["code"] == "resumed")
    written = int(resumed.split("resuming after ")[1].split(" rows")[0])
    assert written >= stopped["progress"]["rows_done"] and written % KILL_PART_ROWS == 0, resumed
    rows = [json.loads(line) for line in cluster.request("GET", f"{url}/results").content.splitlines()]
    assert [row["id"] for row in rows] == ids


def test_a_part_the_bucket_did_not_take_leaves_no_copy_on_the_workers_disk(tmp_path, monkeypatch):
    """A part written and renamed into place, then refused by the bucket, stayed in the worker's
    data directory for good (outside its bounded cache; the attempt that resumed wrote it anew)."""
    import pyarrow as pa
    from obstore.exceptions import GenericError

    from shared.jobs import prediction_results
    from shared.store import objects

    class Refusing:
        def publish(self, path):
            raise GenericError("Generic S3 error: connection refused")

    monkeypatch.setattr(objects, "store", Refusing)
    table = pa.table({"id": [1, 2], "label": ["a", "b"]})
    with pytest.raises(GenericError):
        prediction_results.write_part(tmp_path, 1, table, dict.fromkeys(prediction_results.PART_COUNTS, 2))
    assert list(tmp_path.iterdir()) == []
