"""task "reranking" (issue 36): a cross-encoder trained with binary cross-entropy on (query, passage,
label) rows, validated by reranking each query's passages, loaded by ``CrossEncoder`` and served by
``POST /models/{job_id}/rerank``."""

import io
import random

import numpy as np
import pandas as pd
import pytest
import torch

from tests.conftest import TINY_MODEL, RecordingReporter, wait_for_status
from tests.test_api_errors import assert_error
from tests.test_embedding import TOPICS, assert_same_loss_and_gradients


def rows(queries: int, seed: int = 0) -> pd.DataFrame:
    """Each query (a topic) with two relevant passages (label 1) and two about other topics (label 0)."""
    rng = random.Random(seed)
    out = []
    for q in range(queries):
        topic = rng.choice(TOPICS)
        for i in range(4):
            about = topic if i < 2 else rng.choice([t for t in TOPICS if t != topic])
            out.append(
                {
                    "query": f"tell me about {topic} {q}",
                    "passage": f"a text about the {about} {q}.{i}",
                    "label": 1.0 if i < 2 else 0.0,
                }
            )
    return pd.DataFrame(out)


def test_ranking_metrics_follow_their_definitions():
    from worker.reranking import ranking_metrics

    queries = ["a", "a", "a", "b", "b", "c"]  # c has one passage: not counted
    labels = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    scores = np.array([0.9, 0.5, 0.1, 0.8, 0.2, 0.3])
    metrics = ranking_metrics(queries, scores, labels)
    assert metrics["mrr@10"] == pytest.approx((1 / 2 + 1) / 2)
    assert metrics["ndcg@10"] == pytest.approx((1 / np.log2(3) + 1) / 2)


def test_spec_fields_and_refusals():
    from pydantic import ValidationError

    from shared.schemas.jobs import JobCreate

    spec = JobCreate(base_model="m", task="reranking", training_dataset="ds")
    assert (spec.query_column, spec.passage_column, spec.label_column) == ("query", "passage", "label")
    assert spec.hyperparameters.metric_for_best_model == "ndcg@10"
    for bad in [
        {"task": "classification", "query_column": "q"},
        {"task": "reranking", "passage_column": "query"},
        {"task": "reranking", "text_pair_column": "x"},
        {"task": "classification", "hyperparameters": {"pos_weight": 4.0}},
        {"task": "reranking", "hyperparameters": {"pos_weight": 0.0}},
    ]:
        with pytest.raises(ValidationError):
            JobCreate(base_model="m", training_dataset="ds", **bad)


def test_positive_weight_is_the_negatives_per_positive_unless_given():
    from worker.reranking import positive_weight

    assert positive_weight(None, [1.0, 0.0, 0.0, 0.0, 0.0]) == pytest.approx(4.0)
    assert positive_weight(None, [0.8, 0.2]) == pytest.approx(1.0)  # scores: sum(1 - y) / sum(y)
    assert positive_weight(None, [1.0, 1.0]) == 1.0 and positive_weight(None, [0.0, 0.0]) == 1.0
    assert positive_weight(2.5, [1.0, 0.0, 0.0, 0.0, 0.0]) == 2.5


def reranking_job(job_id: str, **hyperparameters):
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job

    spec = JobCreate(
        base_model=TINY_MODEL,
        task="reranking",
        training_dataset="ds_test",
        hyperparameters={
            "epochs": 4,
            "batch_size": 16,
            "max_length": 32,
            "precision": "fp32",
            "learning_rate": 2e-3,
            **hyperparameters,
        },
    )
    return Job(id=job_id, task="reranking", base_model=TINY_MODEL, spec=spec.model_dump(mode="json"))


def test_training_raises_ndcg_and_the_artifact_loads_in_a_cross_encoder(engine_env):
    from sentence_transformers import CrossEncoder

    from shared.store import artifacts
    from worker.data import JobData
    from worker.training.recipe import fine_tune

    reporter = RecordingReporter()
    job = reranking_job("rerank")
    assert fine_tune(job, JobData(rows(40, seed=1), rows(10, seed=2)), torch.device("cpu"), reporter) == "succeeded"
    ndcg = reporter.series("eval_ndcg@10")
    assert ndcg[max(ndcg)] > 0.9, ndcg
    model = CrossEncoder(str(artifacts.model_dir("rerank")), device="cpu", local_files_only=True)
    scores = model.predict(
        [
            ("tell me about chess 1", "a text about the chess 1.0"),
            ("tell me about chess 1", "a text about the volcano 1.3"),
        ]
    )
    assert 0 <= scores.min() and scores.max() <= 1 and scores[0] > scores[1]


@pytest.mark.parametrize("pos_weight", [None, 1.0])  # the default (2 negatives per positive), unweighted
def test_loss_and_gradients_equal_sentence_transformers_own(engine_env, pos_weight):
    """One optimizer step of the loop on a micro-batch of 1:2 labels gives sentence-transformers'
    ``BinaryCrossEntropyLoss`` on the same pairs and weights, with ``pos_weight`` the negatives per
    positive (2) by default, and the same gradients, in fp32."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    from shared.jobs.base_models import resolve_model
    from tests.conftest import no_dropout
    from worker.data import JobData
    from worker.training.recipe import Recipe

    frame = rows(2).iloc[[0, 2, 3, 4, 6, 7]].reset_index(drop=True)  # each query: one positive, two negatives
    extra = {} if pos_weight is None else {"pos_weight": pos_weight}
    reporter = RecordingReporter()
    run = Recipe(reranking_job("parity", **extra), torch.device("cpu")).setup(JobData(frame, None), reporter)
    run.warm_up()
    no_dropout(run.model)
    grads = []
    run.optimizer.register_step_pre_hook(
        lambda *_: grads.append(
            {n: p.grad.detach().clone() for n, p in run.model.named_parameters() if p.grad is not None}
        )
    )
    js = run.job_setup
    weight = 2.0 if pos_weight is None else pos_weight
    assert js.pos_weight == weight
    message = reporter.messages[reporter.events.index("pos_weight")]
    assert message.startswith(f"positive pairs weighted {weight:g} ")
    reference = CrossEncoder(  # the tiny model's checkpoint has a 2-label head: the loop's replaces it too
        str(resolve_model(TINY_MODEL)),
        num_labels=1,
        max_length=32,
        device="cpu",
        local_files_only=True,
        model_kwargs={"ignore_mismatched_sizes": True},
    )
    transformer = reference[0].auto_model
    transformer.load_state_dict(run.model.state_dict())  # the loop's initial weights, its head included
    values, _ = run.train_step([js.collator([js.train_set[i] for i in range(len(frame))])])

    no_dropout(reference)
    loss = BinaryCrossEntropyLoss(reference, pos_weight=torch.tensor(weight))(
        [frame["query"].tolist(), frame["passage"].tolist()], torch.tensor(frame["label"].values)
    )
    assert_same_loss_and_gradients(values, grads, loss, transformer)


def upload(client, frame: pd.DataFrame, filename: str = "rerank.csv") -> str:
    r = client.post("/datasets", files={"file": (filename, io.BytesIO(frame.to_csv(index=False).encode()), "text/csv")})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_without_a_validation_file_whole_queries_are_held_out(stack):
    """``validation_split`` holds out whole queries (each with all its passages, to be reranked),
    in the dry run as in the job: 20% of 12 queries is 3 queries, 12 of the 48 rows (a split of
    rows would hold out 10 rows, passages of several queries, some of them also trained on)."""
    client = stack.client
    body = {
        "base_model": TINY_MODEL,
        "task": "reranking",
        "training_dataset": upload(client, rows(12, seed=4)),
        "validation_split": 0.2,
        "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
    }
    plan = client.post("/jobs", json=body, params={"dry_run": "true"})
    assert plan.status_code == 200 and plan.json()["plan"]["examples"] == 36, plan.text
    job = wait_for_status(client, client.post("/jobs", json=body).json()["id"], {"succeeded", "failed"})
    assert job["status"] == "succeeded", job["error"]
    events = client.get(f"/jobs/{job['id']}/events").json()["data"]
    assert any(e["message"].startswith("36 training and 12 validation texts") for e in events), events
    assert 0 <= job["validation_metrics"]["ndcg@10"] <= 1  # every held-out query ranked: no NaN
    one_query = {**body, "training_dataset": upload(client, rows(1), "one.csv")}  # 4 rows, all one query
    queued = client.get("/jobs").json()["data"]
    r = client.post("/jobs", json=one_query)  # holding out that query would leave nothing to train on
    assert_error(r, 422, "too_few_rows", "validation_split", "1 distinct query or anchor text")
    assert client.get("/jobs").json()["data"] == queued  # refused before anything was queued


@pytest.mark.parametrize(
    "column, value, message",
    [
        ("passage", "", "column 'passage' is empty"),
        ("label", "2", "column 'label' is outside [0, 1]"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_column(stack, column, value, message):
    frame = rows(2).astype(object)
    frame.loc[2, column] = value
    r = stack.client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "task": "reranking",
            "training_dataset": upload(stack.client, frame, "bad.csv"),
        },
    )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "'bad.csv' row 3" in error["message"] and message in error["message"], error["message"]


def test_rerank_endpoint_orders_documents_best_first(stack):
    client = stack.client
    r = client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "task": "reranking",
            "training_dataset": upload(client, rows(40, seed=1)),
            "validation_dataset": upload(client, rows(10, seed=2), "dev.csv"),
            "hyperparameters": {"epochs": 4, "batch_size": 16, "max_length": 32, "learning_rate": 2e-3},
        },
    )
    assert r.status_code == 201, r.text
    job = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["error"]
    assert job["query_column"] == "query" and "mrr@10" in job["validation_metrics"]
    assert_error(client.get(f"/jobs/{job['id']}/evaluation"), 404, "no_evaluation", "job_id", "validation_metrics")
    documents = ["a text about the volcano 3.3", "a text about the chess 3.0", "a text about the bakery 3.2"]
    r = client.post(
        f"/models/{job['id']}/rerank", json={"query": "tell me about chess 3", "documents": documents, "top_n": 2}
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2 and results[0]["index"] == 1
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    # the CLI and the Python client (`tunejob predict rerank`): none had a way to call it
    import argparse
    import io

    from rich.console import Console

    from client import Client, cli
    from tests.conftest import BASE_URL
    from tests.test_webhooks import ViaTestClient

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers(dest="command", required=True))
    screen = io.StringIO()
    key = client.headers["Authorization"].removeprefix("Bearer ")
    with Client(BASE_URL, api_key=key, transport=ViaTestClient(client)) as python_client:
        assert python_client.rerank(job["id"], "tell me about chess 3", documents, top_n=2)["results"] == results
        args = parser.parse_args(["predict", "rerank", job["id"], "tell me about chess 3", *documents, "--top-n", "1"])
        args.handler(python_client, args, Console(file=screen, width=200))
    table = screen.getvalue()
    assert (
        "a text about the chess 3.0" in table
        and "volcano" not in table
        and f"{results[0]['relevance_score']:.4f}" in table
    )
    assert client.post(f"/models/{job['id']}/embed", json={"inputs": ["x"]}).status_code == 422
    too_many = {"query": "chess", "documents": ["a text"] * 65}  # max_sync_inputs: 64
    error = assert_error(
        client.post(f"/models/{job['id']}/rerank", json=too_many), 422, "too_many_inputs", "documents", "65"
    )
    assert "/predictions" not in error["message"]  # prediction jobs take no reranking model
    # /predict gave the raw logit, /rerank its sigmoid: one way to score a pair
    predicted = client.post(f"/models/{job['id']}/predict", json={"inputs": [["chess", "a text"]]})
    assert_error(predicted, 422, "unsupported_task", "job_id", "/rerank")
