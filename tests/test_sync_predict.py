"""POST /models/{job_id}/predict on every stack: the labels a trained job's model gives when run
directly (multi_label: its sigmoid scores at its saved threshold; token_classification: the
entities of ``pipeline("token-classification", aggregation_strategy="simple")``), the input
limits, tenant scoping (404), unfinished jobs (409) and the model cache."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.conftest import wait_for_status
from tests.test_api_errors import assert_error
from tests.test_api_jobs import labelled_csv, submit, upload
from tests.test_cancel import LONG, cancel, wait_until_training
from tests.test_predictions import (
    assert_label_sets,
    model_dir,
    pipeline_entities,
    raw_sentences,
    train_multi_label,
    train_tagger,
)

TEXTS = ["shares market profit", "goal team coach league match", "bank", "coach " * 100]


@pytest.fixture(scope="module")
def trained(stack) -> list[str]:
    """Two succeeded jobs of the tiny model (max_length 64), trained on different seeds."""
    dataset = upload(stack.client, labelled_csv(rows=32, seed=5))
    ids = [submit(stack.client, dataset["id"], epochs=1, seed=seed)["id"] for seed in (1, 2)]
    for job_id in ids:
        assert wait_for_status(stack.client, job_id, {"succeeded", "failed", "cancelled"})["status"] == "succeeded"
    return ids


def predict(client, job_id: str, inputs, **fields):
    return client.post(f"/models/{job_id}/predict", json={"inputs": inputs, **fields})


def test_labels_match_the_model_run_directly(stack, trained):
    r = predict(stack.client, trained[0], TEXTS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == trained[0] and body["max_length"] == 64 and body["truncated"] == 1
    model_dir = stack.data_dir / "artifacts" / trained[0] / "model"
    model, tokenizer = (
        AutoModelForSequenceClassification.from_pretrained(model_dir),
        AutoTokenizer.from_pretrained(model_dir),
    )
    with torch.no_grad():
        logits = model(**tokenizer(TEXTS, truncation=True, padding=True, return_tensors="pt")).logits
    expected = torch.softmax(logits, dim=-1)
    assert [p["label"] for p in body["predictions"]] == [model.config.id2label[i] for i in expected.argmax(-1).tolist()]
    for got, probabilities in zip(body["predictions"], expected.tolist()):
        assert list(got["probabilities"].values()) == pytest.approx(probabilities, abs=1e-4)


def test_pairs_and_a_shorter_max_length(stack, trained):
    body = predict(stack.client, trained[0], [[t, "pair"] for t in TEXTS], max_length=8).json()
    assert len(body["predictions"]) == len(TEXTS) and body["max_length"] == 8 and body["truncated"] == 2


def test_a_multi_label_model_answers_label_sets_at_its_saved_threshold(stack):
    job = train_multi_label(stack.client)
    r = predict(stack.client, job["id"], TEXTS)
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] == 1 and r.json()["max_length"] == 32
    assert_label_sets(r.json()["predictions"], model_dir(stack, job), TEXTS, 32)


def test_a_token_classification_model_answers_the_pipeline_s_entities(stack):
    job = train_tagger(stack.client)
    texts = raw_sentences()
    r = predict(stack.client, job["id"], texts)
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] == 1
    assert [row["entities"] for row in r.json()["predictions"]] == pipeline_entities(model_dir(stack, job), texts)
    assert_error(
        predict(stack.client, job["id"], [["carol went home", "pair"]]),
        422,
        "invalid_inputs",
        "inputs",
        "token_classification",
    )


def test_input_limits_are_422_naming_the_field(stack, trained):
    client = stack.client
    assert predict(client, trained[0], ["short"] * 64).status_code == 200
    assert_error(predict(client, trained[0], ["short"] * 65), 422, "too_many_inputs", "inputs", "65")
    assert_error(predict(client, trained[0], []), 422, "invalid_request", "inputs")
    assert_error(predict(client, trained[0], [1, 2]), 422, "invalid_request")
    assert_error(predict(client, trained[0], ["a"], max_length=65), 422, "invalid_max_length", "max_length", "64")
    assert_error(client.post(f"/models/{trained[0]}/predict", json={"inputs": ["a"], "top_k": 2}), 422)


def test_unfinished_jobs_are_409(stack):
    dataset = upload(stack.client, labelled_csv(rows=48, seed=6))
    job_id = submit(stack.client, dataset["id"], **LONG)["id"]
    wait_until_training(stack.client, job_id)
    assert_error(predict(stack.client, job_id, ["a"]), 409, "model_not_ready", "model", "running")
    cancel(stack.client, job_id)
    assert wait_for_status(stack.client, job_id, {"cancelled"}, timeout=120)
    assert_error(predict(stack.client, job_id, ["a"]), 409, "model_not_ready", "model", "cancelled")


def test_the_least_recently_used_model_is_evicted(stack, trained, monkeypatch):
    from api.routers.inference import model_cache
    from shared.settings import get_settings

    monkeypatch.setenv("TUNEJOB_SYNC_MODEL_CACHE", "1")
    get_settings.cache_clear()
    model_cache.cache_clear()
    try:
        for job_id in trained:
            assert predict(stack.client, job_id, ["bank"]).status_code == 200
            assert model_cache().keys() == [job_id]
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
        model_cache.cache_clear()


def test_foreign_unknown_and_deleted_jobs_are_404(stack, trained):
    stranger = stack.client_for("tenant-b")
    assert_error(predict(stranger, trained[1], ["a"]), 404, "unknown_model", "model")
    assert_error(predict(stack.client, "job_nope", ["a"]), 404, "unknown_model", "model", "job_nope")
    assert predict(stack.client, trained[1], ["a"]).status_code == 200  # now cached: deletion must still win
    assert stack.client.delete(f"/jobs/{trained[1]}").status_code == 204
    assert_error(predict(stack.client, trained[1], ["a"]), 404, "model_deleted", "model")
