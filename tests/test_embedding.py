"""task "embedding" (issue 36): pairs checked at upload, sentence-transformers' losses run in tunejob's
loop (loss and gradient parity with sentence-transformers itself), duplicate-free micro-batches,
retrieval metrics with the zero-shot figures, and the artifact loaded by ``SentenceTransformer``."""

import io
import json
import random

import numpy as np
import pandas as pd
import pytest
import torch

from tests.conftest import TINY_MODEL, RecordingReporter, wait_for_status
from tests.test_api_errors import assert_error
from tests.test_predictions import PART_ROWS, small_parts  # noqa: F401  (the fixture: parts of PART_ROWS rows)

TINY_ST = "tiny-st"  # the tiny BERT saved as a sentence-transformers directory
TOPICS = [
    "football",
    "election",
    "guitar",
    "volcano",
    "bakery",
    "satellite",
    "chess",
    "harbour",
    "orchestra",
    "glacier",
    "marathon",
    "parliament",
]


def pairs(rows: int, seed: int = 0) -> pd.DataFrame:
    """Anchors (a topic and a number) with positives that repeat the topic; hard negatives name another topic."""
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        topic, other = rng.sample(TOPICS, 2)
        out.append(
            {
                "anchor": f"{topic} question {i}",
                "positive": f"an answer about the {topic} number {i}",
                "negative": f"an answer about the {other} number {i}",
            }
        )
    return pd.DataFrame(out)


@pytest.fixture(scope="module")
def tiny_st(models_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize

    path = models_dir / TINY_ST
    if not (path / "modules.json").is_file():
        model = SentenceTransformer(str(models_dir / TINY_MODEL), device="cpu", local_files_only=True)
        model.append(Normalize())
        model.save(str(path), create_model_card=False)
    return path


def embedding_job(job_id: str, negatives: bool = False, score: bool = False, **hyperparameters):
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job

    extra = {"negative_columns": ["negative"]} if negatives else {"score_column": "score"} if score else {}
    spec = JobCreate(
        base_model=TINY_ST,
        task="embedding",
        training_dataset="ds_test",
        **extra,
        hyperparameters={
            "epochs": 1,
            "batch_size": 8,
            "max_length": 32,
            "precision": "fp32",
            "learning_rate": 1e-3,
            **hyperparameters,
        },
    )
    return Job(id=job_id, task="embedding", base_model=TINY_ST, spec=spec.model_dump(mode="json"))


# ----------------------------------------------------------------------------- spec


def test_spec_defaults_and_refusals():
    from pydantic import ValidationError

    from shared.schemas.jobs import JobCreate

    spec = JobCreate(base_model="m", task="embedding", training_dataset="ds")
    assert (spec.anchor_column, spec.positive_column) == ("anchor", "positive")
    assert spec.hyperparameters.metric_for_best_model == "ndcg@10"
    for bad in [
        {"task": "classification", "anchor_column": "q"},
        {"task": "embedding", "negative_columns": ["positive"]},
        {"task": "embedding", "score_column": "s", "negative_columns": ["n"]},
        {"task": "embedding", "hyperparameters": {"metric_for_best_model": "accuracy"}},
    ]:
        with pytest.raises(ValidationError):
            JobCreate(base_model="m", training_dataset="ds", **bad)


# ----------------------------------------------------------------------------- batches


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("strategy", ["smart", "dynamic", "token_budget"])
def test_no_micro_batch_holds_an_anchor_or_positive_twice(seed, strategy):
    """Property: with texts repeated at random (a query with several positives, a positive shared
    by queries), every row appears once per epoch and no micro-batch repeats a text."""
    from shared.data.batching import DistinctBatchPlan

    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 200))
    keys = rng.integers(0, max(2, n // int(rng.integers(1, 6))), size=(n, 2))
    batch_size = int(rng.integers(2, 17))
    plan = DistinctBatchPlan(rng.integers(1, 64, n), keys, batch_size, strategy, seed, batch_size * 40)
    for epoch in range(2):
        batches = plan.epoch_batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(n))
        for batch in batches:
            rows = [set(keys[i].tolist()) for i in batch]  # a row's own anchor may equal its positive
            assert len(set().union(*rows)) == sum(map(len, rows))
            assert len(batch) >= 1 and (strategy == "token_budget" or len(batch) <= batch_size)


def test_smart_batches_stay_length_sorted_without_duplicates():
    from shared.data.batching import BatchPlan, DistinctBatchPlan

    lengths = np.arange(400) % 97 + 3
    keys = np.stack([np.arange(400), np.arange(400) + 1000], axis=1)  # no repeats: the plan is BatchPlan's
    assert DistinctBatchPlan(lengths, keys, 16, "smart", 1).epoch_batches(0) == BatchPlan(
        lengths, 16, "smart", 1
    ).epoch_batches(0)


# ----------------------------------------------------------------------------- loss parity


def capture_gradients(run) -> list[dict[str, torch.Tensor]]:
    """The gradients of the trainable parameters, by name, each time the optimizer steps (the
    transformer's pooler, unused by sentence-transformers, has none)."""
    captured = []

    def before_step(optimizer, args, kwargs):
        captured.append({n: p.grad.detach().clone() for n, p in run.model.st.named_parameters() if p.grad is not None})

    run.optimizer.register_step_pre_hook(before_step)
    return captured


def setup(job, data, reporter):
    """The recipe of ``job`` set up on the CPU, its steps ready (``warm_up``)."""
    from worker.training.recipe import Recipe

    run = Recipe(job, torch.device("cpu")).setup(data, reporter)
    run.warm_up()
    return run


def st_batch(model, frame: pd.DataFrame, columns: list[str]) -> list[dict]:
    return [model.tokenize(frame[c].tolist()) for c in columns]


@pytest.mark.parametrize("kind", ["negatives", "pairs", "score"])
def test_loss_and_gradients_equal_sentence_transformers_own(engine_env, tiny_st, kind):
    """One optimizer step of the loop on a micro-batch gives sentence-transformers' own loss (MNRL with
    and without hard negatives, CoSENT) on the same rows, and the same gradients, in fp32."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import (
        CoSENTLoss,
        MultipleNegativesRankingLoss,
    )

    from tests.conftest import no_dropout
    from worker.data import JobData

    frame = pairs(8)
    frame["score"] = np.linspace(0, 1, 8).astype(np.float32)
    job = embedding_job("parity", negatives=kind == "negatives", score=kind == "score")
    run = setup(job, JobData(frame, None), RecordingReporter())
    no_dropout(run.model)
    grads = capture_gradients(run)
    js = run.job_setup
    values, _ = run.train_step([js.collator([js.train_set[i] for i in range(8)])])

    reference = SentenceTransformer(str(tiny_st), device="cpu", local_files_only=True)
    no_dropout(reference)
    reference.max_seq_length = 32
    columns = ["anchor", "positive"] + (["negative"] if kind == "negatives" else [])
    loss_fn = CoSENTLoss(reference) if kind == "score" else MultipleNegativesRankingLoss(reference)
    labels = torch.tensor(frame["score"].values) if kind == "score" else torch.zeros(8)
    assert_same_loss_and_gradients(values, grads, loss_fn(st_batch(reference, frame, columns), labels), reference)


def assert_same_loss_and_gradients(values, grads, loss: torch.Tensor, model: torch.nn.Module) -> None:
    """The loop's first step (its loss ``values[0]`` and gradients ``grads[0]``, unclipped: the loop
    clips inside the fused AdamW, ``worker.training.steps.Steps.update``) against sentence-transformers'
    ``loss`` of the same batch on ``model``: the same value (1e-5 relative) and gradients."""
    loss.backward()
    assert values[0].item() == pytest.approx(loss.item(), rel=1e-5)
    theirs = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[0].keys() == theirs.keys()
    for name, grad in theirs.items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=1e-6)


def test_cached_loss_takes_the_accumulated_examples_as_one_batch_of_negatives(engine_env, tiny_st):
    """gradient_accumulation_steps 2 at batch_size 4: one micro-batch of 8 rows (GradCache, 4 at a
    time) whose loss and gradients equal plain MNRL over all 8."""
    from tests.conftest import no_dropout
    from worker.data import JobData

    frame = pairs(8)
    runs = {}
    for name, hp in [("cached", {"batch_size": 4, "gradient_accumulation_steps": 2}), ("plain", {"batch_size": 8})]:
        run = setup(embedding_job(name, **hp), JobData(frame, None), RecordingReporter())
        no_dropout(run.model)
        grads = capture_gradients(run)
        js = run.job_setup
        assert len(js.plan.batches) == 1 and js.hp.gradient_accumulation_steps == 1
        values, _ = run.train_step([js.collator([js.train_set[i] for i in range(8)])])
        runs[name] = values[0].item(), grads
    assert runs["cached"][0] == pytest.approx(runs["plain"][0], rel=1e-5)
    cached, plain = runs["cached"][1][0], runs["plain"][1][0]
    assert cached.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(cached[name], plain[name], rtol=1e-4, atol=1e-6)


def test_an_embedding_job_asked_to_pack_trains_padded_and_says_so(engine_env, tiny_st):
    """``packing: true`` (issue 40) lays out a classifier's micro-batch; an embedding job's columns
    side by side cannot be packed: it trains padded, and its ``packing`` event says why."""
    from worker.data import JobData
    from worker.training.recipe import Recipe

    reporter = RecordingReporter()
    run = Recipe(embedding_job("packed", packing=True), torch.device("cpu")).setup(JobData(pairs(16), None), reporter)
    run.warm_up(reporter)
    assert not run.steps.packing and reporter.events[-1] == "packing"
    assert reporter.messages[-1].startswith("padded micro-batches: Objective")


# ----------------------------------------------------------------------------- training and artifact


def test_training_end_to_end_improves_retrieval_and_saves_a_sentence_transformer(engine_env, tiny_st):
    from sentence_transformers import SentenceTransformer

    from worker.data import JobData
    from worker.training.recipe import fine_tune

    train, val = pairs(96, seed=1), pairs(24, seed=2)
    reporter = RecordingReporter()
    job = embedding_job("e2e", negatives=True, epochs=3, batch_size=16, learning_rate=2e-3)
    assert fine_tune(job, JobData(train, val), torch.device("cpu"), reporter) == "succeeded"
    ndcg = reporter.series("eval_ndcg@10")
    assert 0 in ndcg and len(ndcg) >= 2
    assert ndcg[max(ndcg)] > ndcg[0]  # fine-tuning lifted ndcg@10 above the base model's (zero-shot)
    assert "zero_shot" in reporter.events

    from shared.store import artifacts

    path = artifacts.model_dir("e2e")
    for name in [
        "modules.json",
        "1_Pooling/config.json",
        "sentence_bert_config.json",
        "model.safetensors",
        "metrics.json",
        "manifest.json",
    ]:
        assert (path / name).is_file(), name
    model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
    vectors = model.encode(["football question 1", "an answer about the football number 1"])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)  # normalized


def test_the_manifest_holds_the_saved_files_hashes(engine_env, tiny_st):
    """One epoch: the last evaluation is the best, and the artifact takes the final weights hashed
    as they were written. sentence-transformers saves a tokenizer beside them; the artifact's own
    tokenizer overwrote it after it was hashed, so the manifest was wrong for tokenizer.json and a
    bucket's download refused it (a 500 on /v1/embeddings, a cut model.tar)."""
    from shared.store import artifacts
    from shared.store.manifest import verify_manifest
    from worker.data import JobData
    from worker.training.recipe import fine_tune

    reporter = RecordingReporter()
    job = embedding_job("manifest", epochs=1, batch_size=16, learning_rate=2e-3)
    assert fine_tune(job, JobData(pairs(48, seed=1), pairs(16, seed=2)), torch.device("cpu"), reporter) == "succeeded"
    assert max(reporter.series("eval_ndcg@10")) > 0  # evaluated after its one epoch
    assert verify_manifest(artifacts.model_dir("manifest")) == []


def test_an_embedding_job_reports_the_padding_it_computes(engine_env, tiny_st, monkeypatch):
    """Short anchors beside long positives: each column runs at its own longest text
    (``split_columns``), so the job's padding efficiency is its real tokens over the tokens its
    model computed, not over the columns' shared width (which reported about half of this)."""
    from worker import embedding
    from worker.data import JobData
    from worker.training.recipe import fine_tune

    computed, real, split = [], [], embedding.split_columns

    def counted(batch, columns):
        pieces = split(batch, columns)
        computed.append(sum(p["input_ids"].numel() for p in pieces))
        real.append(sum(int(p["attention_mask"].sum()) for p in pieces))
        return pieces

    monkeypatch.setattr(embedding, "split_columns", counted)
    train = pairs(32, seed=3)
    train["anchor"] = [a + " and so on" * (i % 4) for i, a in enumerate(train["anchor"])]  # 3 to 12 more tokens
    train["positive"] = train["positive"] + " with many more words" * 5
    reporter = RecordingReporter()
    assert (
        fine_tune(embedding_job("padding", batch_size=8), JobData(train, None), torch.device("cpu"), reporter)
        == "succeeded"
    )
    efficiency = reporter.series("padding_efficiency")
    assert list(efficiency.values()) == pytest.approx([r / c for r, c in zip(real, computed)])
    assert 0.8 < min(efficiency.values()) < 1  # the anchors' own padding counted, not the positives' width


def test_a_resumed_job_continues_with_the_same_losses(engine_env, tiny_st):
    from tests.conftest import RecordingReporter as Reporter
    from worker.data import JobData
    from worker.training.recipe import Recipe

    data, cpu = JobData(pairs(48, seed=3), None), torch.device("cpu")

    def train(job, reporter, checkpoint=None):
        run = Recipe(job, cpu).setup(data, reporter, checkpoint)
        run.warm_up(reporter)
        return run, run.train(reporter)

    whole = Reporter()
    run, _ = train(embedding_job("whole", epochs=2, save_every_steps=100), whole)
    first = Reporter(stop_after_step=4)  # a SIGTERM after step 4: checkpoint, then stop
    job = embedding_job("resumed", epochs=2, save_every_steps=100)
    assert train(job, first)[1] == "shutdown"
    [(step, path)] = first.checkpoints
    second = Reporter()
    assert train(job, second, checkpoint=path)[1] == "completed"
    expected, after = whole.series("train_loss"), second.series("train_loss")
    assert sorted(after) == list(range(step + 1, run.job_setup.total_steps + 1))
    for s in after:
        assert after[s] == pytest.approx(expected[s], rel=1e-5, abs=1e-6), s


# ----------------------------------------------------------------------------- the API: bad input, end to end


def upload(client, frame: pd.DataFrame, filename: str = "pairs.csv") -> str:
    r = client.post("/datasets", files={"file": (filename, io.BytesIO(frame.to_csv(index=False).encode()), "text/csv")})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def submit(client, training: str, dry_run: bool = False, **fields):
    body = {
        "base_model": TINY_ST,
        "task": "embedding",
        "training_dataset": training,
        "hyperparameters": {"epochs": 2, "batch_size": 16, "max_length": 32, "learning_rate": 2e-3},
        **fields,
    }
    return client.post("/jobs", json=body, params={"dry_run": "true"} if dry_run else None)


@pytest.mark.parametrize(
    "column, value, fields, message",
    [
        ("anchor", "", {}, "column 'anchor' is empty"),
        ("positive", "  ", {}, "column 'positive' is empty"),
        ("negative", "", {"negative_columns": ["negative"]}, "column 'negative' is empty"),
        ("score", "1.5", {"score_column": "score"}, "column 'score' is outside [0, 1]"),
        ("score", "high", {"score_column": "score"}, "column 'score' is not a number"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_column(stack, tiny_st, column, value, fields, message):
    frame = pairs(6)
    frame["score"] = "0.5"
    frame[column] = frame[column].astype(object)
    frame.loc[3, column] = value
    dataset = upload(stack.client, frame, "bad.csv")
    jobs = stack.client.get("/jobs").json()["data"]
    r = submit(stack.client, dataset, **fields)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "'bad.csv' row 4" in error["message"] and message in error["message"], error["message"]
    assert error["problems"][0]["row"] == 4 and error["problems"][0]["column"] == column
    assert stack.client.get("/jobs").json()["data"] == jobs  # nothing stored or queued


def test_a_missing_column_and_a_negative_column_empty_everywhere_are_refused(stack, tiny_st):
    frame = pairs(6).drop(columns=["negative"])
    r = submit(stack.client, upload(stack.client, frame), negative_columns=["negative"])
    assert r.status_code == 422 and r.json()["error"]["param"] == "negative_columns", r.text
    frame["negative"] = ""
    r = submit(stack.client, upload(stack.client, frame, "empty.csv"), negative_columns=["negative"])
    assert r.status_code == 422, r.text
    assert "'empty.csv' row 1: column 'negative' is empty" in r.json()["error"]["message"]


def test_dry_run_plans_rows_by_their_longest_text(stack, tiny_st):
    r = submit(stack.client, upload(stack.client, pairs(40)), dry_run=True, validation_split=0.25)
    assert r.status_code == 200, r.text
    plan = r.json()["plan"]
    assert plan["examples"] == 30 and plan["token_lengths"]["max"] >= 8  # the positives, longer than anchors
    r = submit(
        stack.client,
        upload(stack.client, pairs(40)),
        dry_run=True,
        validation_split=0.25,
        hyperparameters={"batch_size": 16, "gradient_accumulation_steps": 2},
    )
    assert r.json()["plan"]["micro_batches_per_epoch"] == 1  # GradCache: one micro-batch of 32 per step


def test_the_dry_run_estimates_every_text_of_a_row(stack, tiny_st):
    """The dry run's ``estimated_seconds`` counts each text of a row (anchor and positive, each
    computed at its own length), as the job computes them: an embedding job planned again after it
    ran is estimated at about its own training time (its basis), not at the share of its longest texts."""
    client = stack.client_for("estimates")
    dataset = upload(client, pairs(64, seed=5))
    r = submit(client, dataset, validation_split=0)
    assert r.status_code == 201, r.text
    job = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["error"]
    plan = submit(client, dataset, dry_run=True, validation_split=0).json()["plan"]
    assert plan["estimate_basis"].startswith(f"job {job['id']}:")
    assert plan["estimated_seconds"] / job["train_metrics"]["train_seconds"] == pytest.approx(1, abs=0.15)


def test_the_dry_run_plans_the_micro_batches_and_padding_the_job_computes(stack, tiny_st):
    """An embedding job's dry run plans as the job does: no text twice in a micro-batch (an anchor
    with several positives: its rows move, so there are more micro-batches) and each column padded
    to its own longest (short anchors beside long positives). It planned every row at its longest
    text without moving any: 13 steps against the job's 17."""
    rng = random.Random(3)
    rows = (
        [
            {
                "anchor": f"{topic} " + "question " * rng.randint(1, 4),
                "positive": f"{topic} answer {j} " + "word " * rng.randint(4, 20),
            }  # fmt: skip
            for topic in TOPICS[:8]
            for j in range(4)  # each anchor four times
        ]
        * 3
    )
    client = stack.client_for("plans")
    dataset = upload(client, pd.DataFrame(rows).sample(frac=1, random_state=0))
    plan = submit(client, dataset, dry_run=True, validation_split=0, hyperparameters={"epochs": 1, "batch_size": 8, "max_length": 32}).json()["plan"]  # fmt: skip
    r = submit(client, dataset, validation_split=0, hyperparameters={"epochs": 1, "batch_size": 8, "max_length": 32})
    job = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["error"]
    assert plan["total_steps"] == job["progress"]["total_steps"] > len(rows) / 8
    planned = plan["padding_efficiency"]["smart"]["unrounded"]
    assert planned == pytest.approx(job["train_metrics"]["padding_efficiency"], abs=1e-3), (
        planned,
        job["train_metrics"],
    )


@pytest.fixture(scope="module")
def api_job(stack, tiny_st) -> dict:
    """An embedding job trained through the stack's API and worker (with hard negatives and a validation set)."""
    client = stack.client
    train, validation = upload(client, pairs(64, seed=1)), upload(client, pairs(16, seed=2), "dev.csv")
    r = submit(client, train, validation_dataset=validation, negative_columns=["negative"])
    assert r.status_code == 201, r.text
    return wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})


def test_training_through_the_api_then_embed_and_the_openai_sdk(stack, api_job):
    """A job through the API and the worker; its artifact loads in ``SentenceTransformer`` and
    encodes as ``/models/{id}/embed`` and ``/v1/embeddings`` (the ``openai`` SDK, float and its
    default base64) answer."""
    from openai import NotFoundError, OpenAI
    from sentence_transformers import SentenceTransformer

    client, job = stack.client, api_job
    assert job["status"] == "succeeded", job["error"]
    assert (job["anchor_column"], job["positive_column"], job["negative_columns"]) == (
        "anchor",
        "positive",
        ["negative"],
    )
    assert set(job["validation_metrics"]) >= {"ndcg@10", "mrr@10", "recall@1", "recall@10", "map@100"}
    steps = {m["step"] for m in client.get(f"/jobs/{job['id']}/metrics").json()["data"] if m["name"] == "eval_ndcg@10"}
    assert 0 in steps and len(steps) >= 2  # the zero-shot figure, then each evaluation

    texts = ["football question 3", "an answer about the glacier number 7"]
    r = client.post(f"/models/{job['id']}/embed", json={"inputs": texts})
    assert r.status_code == 200, r.text
    served = np.array(r.json()["embeddings"])
    assert r.json()["dimensions"] == served.shape[1] and r.json()["tokens"] > 0
    local = SentenceTransformer(
        str(stack.data_dir / "artifacts" / job["id"] / "model"), device="cpu", local_files_only=True
    ).encode(texts)
    cosine = (served * local).sum(1) / np.linalg.norm(served, axis=1) / np.linalg.norm(local, axis=1)
    assert cosine.min() >= 0.9999
    too_many = client.post(f"/models/{job['id']}/embed", json={"inputs": ["x"] * 65})  # max_sync_inputs: 64
    assert_error(too_many, 422, "too_many_inputs", "inputs", "65")
    assert client.put("/models/aliases/search-prod", json={"job_id": job["id"]}).status_code == 200
    by_alias = client.post("/models/search-prod/embed", json={"inputs": texts}).json()
    assert by_alias["model"] == job["id"] and by_alias["embeddings"] == r.json()["embeddings"]  # the job, as /predict
    assert client.delete("/models/aliases/search-prod").status_code == 204

    key = client.headers["Authorization"].removeprefix("Bearer ")
    sdk = OpenAI(base_url="http://localhost/v1", api_key=key, http_client=client, max_retries=0)
    for fmt in ("float", "base64"):
        response = sdk.embeddings.create(model=job["id"], input=texts, encoding_format=fmt)
        vectors = np.array([d.embedding for d in response.data]) if fmt == "float" else None
        if fmt == "base64":  # the SDK returns the base64 text when asked for it explicitly
            import base64

            vectors = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in response.data])
        np.testing.assert_allclose(vectors, served, atol=1e-6)
        assert response.usage.prompt_tokens == r.json()["tokens"]
    default = sdk.embeddings.create(model=TINY_ST, input="football question 3")  # a base model, one string
    assert len(default.data) == 1 and len(default.data[0].embedding) == served.shape[1]
    r = client.post("/v1/embeddings", json={"model": TINY_ST, "input": []})  # the list member's error, not the str's
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input: List should have at least 1 item")
    for body, param in (({"input": ""}, "input"), ({"input": ["a", ""]}, "input.1")):  # OpenAI refuses them too
        r = client.post("/v1/embeddings", json={"model": TINY_ST, **body})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
        assert r.json()["error"]["message"].startswith(f"{param}: String should have at least 1 character")
    assert_error(
        client.post(f"/models/{job['id']}/embed", json={"inputs": ["a", ""]}), 422, "invalid_request", "inputs.1"
    )
    for unknown in ("no-such-model", "job_0000000000000000"):  # OpenAI's status for a model it lacks
        with pytest.raises(NotFoundError) as e:
            sdk.embeddings.create(model=unknown, input="x")
        assert (e.value.code, e.value.param) == ("unknown_model", "model") and unknown in e.value.message
        r = client.post(f"/models/{unknown}/embed", json={"inputs": ["x"]})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_model"), r.text
    # it said "architectures ['BertModel'] are not sequence or token classification"
    predicted = client.post(f"/models/{job['id']}/predict", json={"inputs": texts})
    assert_error(predicted, 422, "unsupported_task", "job_id", "an embedding model", f"/models/{job['id']}/embed")


def test_cli_jobs_create_takes_the_embedding_columns():
    import argparse

    from client.cli import add_commands
    from client.options import job_spec
    from shared.schemas.jobs import JobCreate

    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "jobs",
            "create",
            "--model",
            "all-MiniLM-L6-v2",
            "--dataset",
            "ds_1",
            "--task",
            "embedding",
            "--anchor-column",
            "title",
            "--positive-column",
            "body",
            "--negative-column",
            "n1",
            "--negative-column",
            "n2",
        ]
    )
    spec = JobCreate(**job_spec(args))
    assert (spec.task, spec.anchor_column, spec.positive_column, spec.negative_columns) == (
        "embedding",
        "title",
        "body",
        ["n1", "n2"],
    )


def test_a_prediction_job_writes_each_row_s_vector_a_part_at_a_time(stack, api_job, small_parts):  # noqa: F811
    """``POST /predictions`` with an embedding job: every row's vector, in input order, equal to
    ``SentenceTransformer(path).encode`` at the prediction's ``max_length``; Parquet holds them as
    fixed-size float32 lists, JSONL and CSV as lists. Memory is bounded by the part size, whatever
    the dataset's: the worker writes parts of ``PART_ROWS`` rows and the download streams one part
    (one Parquet row group) at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    client = stack.client
    texts = [f"{TOPICS[i % len(TOPICS)]} question {i}" + " and more words" * (i % 5) for i in range(21)]
    dataset = upload(client, pd.DataFrame({"doc": [f"d{i}" for i in range(21)], "text": texts}), "texts.csv")
    body = {"model": api_job["id"], "dataset": dataset, "id_column": "doc", "max_length": 12, "batch_size": 4}
    plan = client.post("/predictions", json=body, params={"dry_run": "true"})
    assert plan.status_code == 200 and plan.json()["plan"]["rows"] == 21, plan.text
    r = client.post("/predictions", json=body)
    assert r.status_code == 201 and r.json()["task"] == "embedding", r.text
    done = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"}, path="/predictions")
    assert done["status"] == "succeeded", done["error"]
    result = done["result"]
    assert result["rows"] == 21 and 0 < result["truncated"] < 21 and result["tokens"] > 0
    assert 0 < result["padding_efficiency"] <= 1

    directory = stack.data_dir / "artifacts" / done["id"] / "predictions"
    parts = sorted(directory.glob("part-*.parquet"))
    assert [pq.read_metadata(p).num_rows for p in parts] == [PART_ROWS, PART_ROWS, 21 - 2 * PART_ROWS]
    download = client.get(f"/predictions/{done['id']}/results", params={"format": "parquet"})
    parquet = pq.ParquetFile(io.BytesIO(download.content))
    assert max(parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)) <= PART_ROWS
    table = parquet.read()
    model = SentenceTransformer(
        str(stack.data_dir / "artifacts" / api_job["id"] / "model"), device="cpu", local_files_only=True
    )
    dimensions = model.get_embedding_dimension()
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), dimensions)
    assert table.column("id").to_pylist() == [f"d{i}" for i in range(21)]
    model.max_seq_length = 12
    local = model.encode(texts, normalize_embeddings=True)
    # the tokens computed, after truncation (it counted texts before truncation, so its padding
    # efficiency could read above the truth)
    assert result["tokens"] == sum(min(len(ids), 12) for ids in model.tokenizer(texts)["input_ids"])
    vectors = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    assert (vectors * local).sum(1).min() >= 0.9999

    lines = [
        json.loads(line)
        for line in client.get(f"/predictions/{done['id']}/results", params={"format": "jsonl"}).text.splitlines()
    ]
    np.testing.assert_allclose([row["embedding"] for row in lines], vectors, atol=1e-7)
    csv = pd.read_csv(io.BytesIO(client.get(f"/predictions/{done['id']}/results", params={"format": "csv"}).content))
    np.testing.assert_allclose(np.array([json.loads(cell) for cell in csv["embedding"]]), vectors, atol=1e-7)

    before = client.get("/predictions").json()["data"]
    for fields, param in [
        ({"text_pair_column": "doc", "id_column": None}, "text_pair_column"),
        ({"precision": "int8"}, "precision"),
    ]:
        r = client.post("/predictions", json={**body, **fields})
        assert r.status_code == 422 and r.json()["error"]["param"] == param, r.text
    assert client.get("/predictions").json()["data"] == before  # nothing stored or queued


def test_a_sweep_of_embedding_jobs_optimises_a_retrieval_metric(stack, tiny_st):
    """``ndcg@10``, ``mrr@10`` and ``recall@10`` are objectives of an embedding sweep (issue 36,
    item 4): each plans (a dry run, nothing queued); a sweep on ``ndcg@10`` runs its trials and keeps
    the best by each trial's validation ``ndcg@10``; a classification metric is refused, naming the field."""
    from tests.test_sweeps import ids

    client = stack.client
    body = {
        "base_model": TINY_ST,
        "task": "embedding",
        "training_dataset": upload(client, pairs(48, seed=3)),
        "validation_split": 0.25,
        "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
        "search_space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        "objective": {"metric": "ndcg@10"},
        "algorithm": "random",
        "seed": 3,
        "early_stopping": {"type": "none"},
        "max_trials": 2,
    }
    jobs = ids(client, "/jobs")
    for metric in ("ndcg@10", "mrr@10", "recall@10"):
        r = client.post("/sweeps", json={**body, "objective": {"metric": metric}}, params={"dry_run": "true"})
        assert r.status_code == 200 and r.json()["objective"] == {"metric": metric, "direction": "maximize"}, r.text
    r = client.post("/sweeps", json={**body, "objective": {"metric": "accuracy"}})
    assert r.status_code == 422 and r.json()["error"]["param"] == "objective.metric", r.text
    assert ids(client, "/jobs") == jobs  # nothing queued

    r = client.post("/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"}, timeout=900, path="/sweeps")
    assert sweep["status"] == "succeeded", sweep
    trials = client.get(f"/sweeps/{sweep['id']}/trials").json()["data"]
    values = {t["job_id"]: client.get(f"/jobs/{t['job_id']}").json()["validation_metrics"]["ndcg@10"] for t in trials}
    assert len(values) == 2
    assert sweep["best_trial"]["value"] == pytest.approx(max(values.values()))
    assert sweep["best_trial"]["job_id"] == max(values, key=values.get)
