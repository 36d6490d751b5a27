"""Opt-in int8 CPU prediction (``precision: "int8"``, PyTorch dynamic quantization of the Linear
layers): the model really is quantized, a prediction job runs with it on every stack, and the dry
run estimates an int8 prediction from past int8 predictions only. Its speed and label agreement on
BBC News @512 belong in bench/predict.py (not measured yet)."""

import random

import pytest
import torch

from shared.errors import UserError
from shared.inference.loop import load_for_inference, predict_texts
from tests.conftest import TINY_MODEL
from tests.test_api_jobs import upload
from tests.test_predictions import predict, scoring_csv, wait_prediction


def test_int8_quantizes_every_linear_layer_and_predicts(models_dir):
    fp32 = load_for_inference(models_dir / TINY_MODEL, torch.device("cpu"), "fp32")
    int8 = load_for_inference(models_dir / TINY_MODEL, torch.device("cpu"), "int8")
    assert int8.precision == "int8"
    layers = [type(m) for m in int8.model.modules() if isinstance(m, torch.nn.Linear)
              or isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert layers and all(t is torch.ao.nn.quantized.dynamic.Linear for t in layers), set(layers)
    rng = random.Random(0)
    texts = [" ".join(rng.choices(["goal", "market", "team", "bank", "profit"], k=rng.randint(2, 30)))
             for _ in range(40)]
    a, b = predict_texts(fp32, texts), predict_texts(int8, texts)
    assert len(b.rows) == 40 and (a.tokens, a.truncated) == (b.tokens, b.truncated)
    # the same model: probabilities close (tiny-bert's random head separates classes barely, so labels may flip)
    gap = max(abs(x["probabilities"][k] - y["probabilities"][k]) for x, y in zip(a.rows, b.rows)
              for k in x["probabilities"])
    assert gap < 0.05, gap


def test_int8_is_refused_on_a_gpu(models_dir):
    with pytest.raises(UserError) as refused:
        load_for_inference(models_dir / TINY_MODEL, torch.device("cuda"), "int8")
    assert (refused.value.code, refused.value.param) == ("unsupported_precision", "precision")


def test_an_int8_prediction_job_and_its_plan(stack):
    client = stack.client
    dataset = upload(client, scoring_csv(), "score.csv")
    body = {"model": TINY_MODEL, "dataset": dataset["id"], "text_column": "body", "max_length": 16,
            "precision": "int8"}
    done = wait_prediction(client, predict(client, body)["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["precision"] == "int8" and done["result"]["rows"] == 29
    int8_plan = predict(client, body, expect=200, dry_run="true")["plan"]
    assert done["id"] in int8_plan["estimate_basis"] and int8_plan["estimated_seconds"] > 0
    fp32_plan = predict(client, {**body, "precision": "fp32"}, expect=200, dry_run="true")["plan"]
    assert fp32_plan["estimated_seconds"] is None  # no fp32 prediction on the model yet
    refused = client.post("/predictions", json={**body, "precision": "int4"})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "precision"
