"""task "token_classification" (issue 19): CoNLL, JSONL and Parquet uploads of words and tags,
subword alignment, training end to end, the artifact in ``pipeline("token-classification")``, and
bad input refused with a report naming the file, row, column and value."""

import io
import json
import random

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from shared.data.columns import JobColumns
from shared.data.labels import read_job_table
from tests.conftest import TINY_MODEL, wait_for_status
from worker.tagging import (
    IGNORE,
    align_labels,
    inside_tags,
    tagging_metrics,
    tokenize_words,
)

PEOPLE = ["alice", "bob", "carol", "dave"]
PLACES = [["paris"], ["london"], ["new", "york"], ["berlin"]]
FILLER = ["went", "to", "the", "market", "with", "friends", "yesterday", "and", "then", "home"]
TAGS = ["B-LOC", "B-PER", "I-LOC", "O"]


def sentences(rows: int, seed: int = 0) -> list[tuple[list[str], list[str]]]:
    """``rows`` sentences of filler words with a person (B-PER) and a place (B-LOC, I-LOC) in them."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        place = rng.choice(PLACES)
        words = [rng.choice(PEOPLE)] + rng.choices(FILLER, k=rng.randint(1, 5)) + place + rng.choices(FILLER, k=2)
        tags = ["B-PER"] + ["O"] * (len(words) - len(place) - 3) + ["B-LOC"] + ["I-LOC"] * (len(place) - 1) + ["O"] * 2
        out.append((words, tags))
    return out


def conll(rows: int, seed: int = 0) -> bytes:
    """CoNLL-2003 layout: -DOCSTART-, four fields a line (token, POS, chunk, NER tag)."""
    lines = ["-DOCSTART- -X- -X- O", ""]
    for words, tags in sentences(rows, seed):
        lines += [f"{w} NN I-NP {t}" for w, t in zip(words, tags)] + [""]
    return "\n".join(lines).encode()


def jsonl(rows: list) -> bytes:
    return "\n".join(json.dumps(row) for row in rows).encode()


def tagged_jsonl(rows: int, seed: int = 0) -> bytes:
    return jsonl([{"tokens": w, "tags": t} for w, t in sentences(rows, seed)])


@pytest.fixture(scope="module")
def tokenizer(models_dir):
    return AutoTokenizer.from_pretrained(models_dir / TINY_MODEL)


# ----------------------------------------------------------------------------- alignment


def test_tag_goes_on_the_first_subword_and_the_rest_are_ignored(tokenizer):
    words = ["alice", "visited", "schwarzenegger", "today"]
    enc = tokenizer(words, is_split_into_words=True)
    word_ids = enc.word_ids()
    assert word_ids.count(2) > 1  # the test needs a word of several subwords
    labels = align_labels(word_ids, [1, 3, 0, 3], inside=None)
    assert len(labels) == len(enc["input_ids"])
    assert labels[0] == labels[-1] == IGNORE  # [CLS], [SEP]
    firsts = [i for i, w in enumerate(word_ids) if w is not None and (i == 0 or word_ids[i - 1] != w)]
    assert [labels[i] for i in firsts] == [1, 3, 0, 3]
    assert all(labels[i] == IGNORE for i in range(len(labels)) if i not in firsts)


def test_label_all_subwords_gives_later_subwords_the_inside_tag(tokenizer):
    names = ["B-LOC", "B-PER", "I-LOC", "O"]
    inside = inside_tags(names)
    assert inside == [2, 1, 2, 3]  # B-LOC -> I-LOC; B-PER has no I-PER in the set: kept
    word_ids = tokenizer(["schwarzenegger"], is_split_into_words=True).word_ids()
    labels = align_labels(word_ids, [0], inside)
    assert labels[1] == 0 and set(labels[2:-1]) == {2} and labels[0] == labels[-1] == IGNORE


def test_truncation_drops_the_tags_of_cut_words(tokenizer):
    words, tags = ["alice"] + ["market"] * 20, ["B-PER"] + ["O"] * 20
    data = tokenize_words(tokenizer, pd.DataFrame({"tokens": [words], "tags": [tags]}), "tokens", "tags", TAGS, 8)
    assert len(data.encodings["input_ids"][0]) == 8
    assert data.labels[0] == [IGNORE, 1] + [3] * 5 + [IGNORE]  # [CLS] alice market x5 [SEP]


def test_metrics_are_entity_level_and_per_type():
    gold = [["B-PER", "O", "B-LOC", "I-LOC"], ["B-PER", "O"]]
    predicted = [["B-PER", "O", "B-LOC", "O"], ["B-PER", "O"]]  # one LOC cut short: wrong entity
    metrics = tagging_metrics(gold, predicted, TAGS)
    assert metrics["entity_precision"] == pytest.approx(2 / 3) and metrics["entity_recall"] == pytest.approx(2 / 3)
    assert metrics["token_accuracy"] == pytest.approx(5 / 6)
    assert metrics["per_entity"]["PER"]["f1"] == 1.0 and metrics["per_entity"]["LOC"]["f1"] == 0.0
    # strict IOB2: an entity opened by I- is not an entity
    assert tagging_metrics([["B-PER"]], [["I-PER"]], ["B-PER", "I-PER", "O"])["entity_recall"] == 0.0


# ----------------------------------------------------------------------------- reading


def test_conll_file_reads_as_sentences_of_tokens_and_tags(tmp_path):
    path = tmp_path / "wnut.conll"
    path.write_bytes(conll(5))
    df, summary = read_job_table(
        path, "conll", "wnut.conll", JobColumns("token_classification", "tokens", None, "tags")
    )
    expected = sentences(5)
    assert df["tokens"].tolist() == [w for w, _ in expected] and df["tags"].tolist() == [t for _, t in expected]
    assert summary.names == TAGS and summary.codes is None
    assert summary.rows == 5 and summary.counts["B-PER"] == 5


def upload(client, content: bytes, filename: str):
    return client.post("/datasets", files={"file": (filename, io.BytesIO(content), "application/octet-stream")})


def submit(client, training: str, validation: str | None = None, **fields):
    body = {
        "base_model": TINY_MODEL,
        "task": "token_classification",
        "training_dataset": training,
        "hyperparameters": {
            "epochs": 3,
            "batch_size": 8,
            "max_length": 32,
            "learning_rate": 3e-3,
            "metric_for_best_model": "entity_f1",
        },
        **fields,
    }
    if validation:
        body["validation_dataset"] = validation
    return client.post("/jobs", json=body)


def test_uploads_in_conll_jsonl_and_parquet_plan_alike(stack):
    client = stack.client
    frame = pd.DataFrame([{"tokens": w, "tags": t} for w, t in sentences(30)])
    buffer = io.BytesIO()
    frame.to_parquet(buffer)
    ids = []
    for content, name, fmt in [
        (conll(30), "train.conll", "conll"),
        (tagged_jsonl(30), "train.jsonl", "jsonl"),
        (buffer.getvalue(), "train.parquet", "parquet"),
    ]:
        r = upload(client, content, name)
        assert r.status_code == 201, r.text
        assert r.json()["rows"] == 30 and r.json()["format"] == fmt and r.json()["columns"] == ["tokens", "tags"]
        ids.append(r.json()["id"])
    plans = []
    for dataset in ids:
        r = client.post(
            "/jobs",
            params={"dry_run": "true"},
            json={
                "base_model": TINY_MODEL,
                "task": "token_classification",
                "training_dataset": dataset,
                "hyperparameters": {"max_length": 8},
            },
        )
        assert r.status_code == 200, r.text
        plans.append(r.json()["plan"])
    assert plans[0]["token_lengths"] == plans[1]["token_lengths"] == plans[2]["token_lengths"]
    assert plans[0]["examples"] == 27 and plans[0]["truncated_examples"] > 0  # max_length 8 cuts sentences
    assert plans[0]["truncated_fraction"] == pytest.approx(plans[0]["truncated_examples"] / 27)


# ----------------------------------------------------------------------------- end to end


def test_training_end_to_end_and_the_artifact_in_a_pipeline(stack):
    from transformers import AutoModelForTokenClassification, pipeline

    client = stack.client
    train = upload(client, conll(160, seed=1), "train.conll").json()["id"]
    validation = upload(client, tagged_jsonl(40, seed=2), "dev.jsonl").json()["id"]
    r = submit(client, train, validation)
    assert r.status_code == 201, r.text
    job = wait_for_status(client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["error"]
    assert job["label_names"] == TAGS and job["text_column"] == "tokens" and job["label_column"] == "tags"
    metrics = job["validation_metrics"]
    assert metrics["entity_f1"] > 0.8, metrics  # the entities are easy: a trained model finds them
    assert set(metrics["per_entity"]) == {"PER", "LOC"}
    names = {m["name"] for m in client.get(f"/jobs/{job['id']}/metrics").json()["data"]}
    assert {"eval_entity_f1", "eval_token_accuracy", "train_loss"} <= names

    model_dir = stack.data_dir / "artifacts" / job["id"] / "model"
    model = AutoModelForTokenClassification.from_pretrained(model_dir, use_safetensors=True)
    assert model.config.id2label == dict(enumerate(TAGS))
    ner = pipeline("token-classification", model=str(model_dir), aggregation_strategy="simple", device="cpu")
    entities = ner("carol went to the market and then paris")
    assert [(e["entity_group"], e["word"]) for e in entities] == [("PER", "carol"), ("LOC", "paris")]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "rows, row, column, message",
    [
        ([{"tokens": ["alice", "went"], "tags": ["B-PER"]}], 2, "tags", "has 1 tag(s) for 2 word(s)"),
        ([{"tokens": [], "tags": []}], 2, "tokens", "is an empty sentence"),
        ([{"tokens": "alice went", "tags": ["B-PER", "O"]}], 2, "tokens", "holds text, not a list of words"),
        ([{"tokens": ["alice", ""], "tags": ["B-PER", "O"]}], 2, "tokens", "word 2 is empty"),
        ([{"tokens": ["alice"], "tags": "B-PER"}], 2, "tags", "holds text, not a list of tags"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_column_and_value(stack, rows, row, column, message):
    good = [{"tokens": w, "tags": t} for w, t in sentences(1)]
    dataset = upload(stack.client, jsonl(good + rows), "bad.jsonl").json()["id"]
    jobs = stack.client.get("/jobs").json()["data"]
    r = submit(stack.client, dataset)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "'bad.jsonl' row 2" in error["message"] and message in error["message"]
    assert error["problems"][0]["row"] == row and error["problems"][0]["column"] == column
    assert stack.client.get("/jobs").json()["data"] == jobs  # nothing stored


def test_tags_unseen_in_training_are_refused_in_the_validation_set(stack):
    train = upload(stack.client, tagged_jsonl(10), "train.jsonl").json()["id"]
    dev = jsonl([{"tokens": w, "tags": t} for w, t in sentences(2)] + [{"tokens": ["x", "y"], "tags": ["O", "B-ORG"]}])
    validation = upload(stack.client, dev, "dev.jsonl").json()["id"]
    r = submit(stack.client, train, validation)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "unknown_label" and "'dev.jsonl'" in error["message"] and "B-ORG" in error["message"]
    assert error["problems"][0]["row"] == 3 and error["problems"][0]["column"] == "tags"


def test_a_conll_line_without_a_tag_is_refused_at_upload_with_its_line(stack):
    content = b"-DOCSTART- O\n\nalice B-PER\nwent O\n\nbob B-PER\nparis\n"
    r = upload(stack.client, content, "train.conll")
    assert r.status_code == 422, r.text
    problem = r.json()["error"]["problems"][0]
    assert problem["row"] == 2 and problem["column"] == "tags" and problem["value"] == "paris"
    assert "(line 7) has a token but no tag" in problem["message"]


def test_the_openai_facade_takes_the_task_and_its_column_defaults(stack):
    dataset = upload(stack.client, conll(20), "train.conll").json()["id"]
    r = stack.client.post(
        "/v1/fine_tuning/jobs",
        json={
            "model": TINY_MODEL,
            "training_file": dataset,
            "task": "token_classification",
            "hyperparameters": {"n_epochs": 1, "batch_size": 8},
        },
    )
    assert r.status_code == 200, r.text
    job = wait_for_status(stack.client, r.json()["id"], {"succeeded", "failed", "cancelled"})
    assert job["status"] == "succeeded", job["error"]
    assert (job["task"], job["text_column"], job["label_column"]) == ("token_classification", "tokens", "tags")
    assert "entity_f1" in job["validation_metrics"]


def test_accumulated_micro_batches_give_the_gradient_of_one_batch(engine_env):
    """The loss is the mean over the labelled tokens of the whole step (the model's own loss on
    one batch): two micro-batches of unequal token counts step as one batch of both."""
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job
    from tests.conftest import RecordingReporter, no_dropout
    from tests.test_training import capture_gradients, micro_batches
    from worker.data import JobData
    from worker.training.recipe import Recipe

    spec = JobCreate(
        base_model=TINY_MODEL,
        task="token_classification",
        training_dataset="ds_test",
        hyperparameters={"epochs": 1, "batch_size": 4, "max_length": 32, "precision": "fp32"},
    )
    job = Job(
        id="t", task="token_classification", base_model=TINY_MODEL, spec=spec.model_dump(mode="json"), label_names=TAGS
    )
    frame = pd.DataFrame([{"tokens": w, "tags": t} for w, t in sentences(8, seed=3)])
    run = Recipe(job, torch.device("cpu")).setup(JobData(frame, None), RecordingReporter())
    no_dropout(run.model)
    init = {k: v.clone() for k, v in run.model.state_dict().items()}
    grads = capture_gradients(run)
    batch = micro_batches(run, [4])
    with torch.no_grad():
        expected = run.model(**batch[0]).loss  # mean cross-entropy over labels != -100
    run.warm_up()
    values, _ = run.train_step(batch)
    assert values[0].item() == pytest.approx(expected.item(), rel=1e-5)
    run.model.load_state_dict(init)
    run.train_step(micro_batches(run, [1, 3]))
    for one, accumulated in zip(*grads):
        torch.testing.assert_close(accumulated, one, rtol=1e-4, atol=1e-6)


def token_job(job_id: str, **hyperparameters):
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job

    spec = JobCreate(
        base_model=TINY_MODEL,
        task="token_classification",
        training_dataset="ds_test",
        hyperparameters={
            "epochs": 2,
            "batch_size": 4,
            "max_length": 32,
            "precision": "fp32",
            "learning_rate": 1e-3,
            **hyperparameters,
        },
    )
    return Job(
        id=job_id,
        task="token_classification",
        base_model=TINY_MODEL,
        spec=spec.model_dump(mode="json"),
        label_names=TAGS,
    )


def test_a_resumed_job_continues_with_the_same_losses(engine_env):
    from tests.conftest import RecordingReporter
    from worker.data import JobData
    from worker.training.recipe import Recipe

    data = JobData(pd.DataFrame([{"tokens": w, "tags": t} for w, t in sentences(20, seed=4)]), None)
    cpu = torch.device("cpu")
    whole = RecordingReporter()
    run = Recipe(token_job("uninterrupted", save_every_steps=100), cpu).setup(data, whole)
    run.warm_up(whole)
    assert run.train(whole) == "completed"
    total = run.job_setup.total_steps

    job = token_job("resumed", save_every_steps=100)
    first = RecordingReporter(stop_after_step=3)  # a SIGTERM after step 3: checkpoint, then stop
    run = Recipe(job, cpu).setup(data, first)
    run.warm_up(first)
    assert run.train(first) == "shutdown"
    [(step, path)] = first.checkpoints
    second = RecordingReporter()
    run = Recipe(job, cpu).setup(data, second, path)
    run.warm_up(second)
    assert run.train(second) == "completed"
    expected, after = whole.series("train_loss"), second.series("train_loss")
    assert sorted(after) == list(range(step + 1, total + 1))
    for s in after:
        assert after[s] == pytest.approx(expected[s], rel=1e-5, abs=1e-6), s


def test_tags_without_a_prefix_are_scored_as_runs_of_one_type():
    """Plain tags (``PER``, ``LOC``, ``O``: the IO scheme) score as IOB's ``I-PER``: a run of
    one type is one entity, instead of seqeval reading ``PER`` as prefix ``P`` of type ``ER``."""
    gold, predicted = [["PER", "PER", "O", "LOC"]], [["PER", "PER", "O", "PER"]]
    metrics = tagging_metrics(gold, predicted, ["LOC", "O", "PER"])
    assert set(metrics["per_entity"]) == {"PER", "LOC"}
    assert metrics["entity_precision"] == pytest.approx(1 / 2) and metrics["entity_recall"] == pytest.approx(1 / 2)


def test_label_all_subwords_trains_on_later_subwords_and_scores_first_ones(engine_env):
    from tests.conftest import RecordingReporter
    from worker.data import JobData
    from worker.training.recipe import Recipe

    frame = pd.DataFrame(
        {"tokens": [["schwarzenegger", "went", "to", "paris"]], "tags": [["B-PER", "O", "O", "B-LOC"]]}
    )
    job = token_job("all-subwords")
    job.spec["label_all_subwords"] = True
    run = Recipe(job, torch.device("cpu")).setup(JobData(frame, frame), RecordingReporter())
    trained, scored = run.job_setup.train_set.labels[0], run.job_setup.val_set.labels[0]
    assert sum(label != IGNORE for label in scored) == 4  # one per word
    assert scored.count(1) == 1  # B-PER on the first subword only
    # every subword of schwarzenegger trained on: TAGS has no I-PER, so B-PER stays B-PER
    assert trained.count(1) == len(scored) - 2 - 3 > 1 and sum(label != IGNORE for label in trained) > 4
