"""Opt-in int8 CPU prediction (``precision: "int8"``, ``shared.inference.int8``): the model really
is quantized, compiled on a CPU with AMX and eager elsewhere or when compiling fails (an event
says so), a prediction job runs with it on every stack, and the dry run estimates an int8
prediction from past int8 predictions only. Its speed and label agreement on BBC News @512 are
measured by bench/predict.py (docs/benchmarks.md)."""

import random
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from shared.errors import UserError
from shared.inference.loop import load_for_inference, predict_texts
from tests.conftest import TINY_MODEL
from tests.test_api_jobs import upload
from tests.test_predictions import predict, scoring_csv, wait_prediction


def texts_of_many_widths() -> list[str]:
    rng = random.Random(0)
    return [
        " ".join(rng.choices(["goal", "market", "team", "bank", "profit"], k=rng.randint(2, 30))) for _ in range(40)
    ]


def largest_gap(a, b) -> float:
    """The largest difference of a class probability between two predictions of the same texts."""
    return max(
        abs(x["probabilities"][k] - y["probabilities"][k]) for x, y in zip(a.rows, b.rows) for k in x["probabilities"]
    )


@pytest.mark.parametrize("amx", [False, True])
def test_int8_quantizes_every_linear_layer_and_predicts(models_dir, monkeypatch, amx):
    """Without AMX the eager way; with it (forced here: inductor's int8 kernels run on any x86 CPU,
    slower without AMX) the compiled way, one compile for batches of many widths."""
    if amx and not (shutil.which("g++") or shutil.which("clang++")):
        pytest.skip("no C++ compiler: inductor cannot compile here (the fallback is tested below)")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    fp32 = load_for_inference(models_dir / TINY_MODEL, torch.device("cpu"), "fp32")
    int8 = load_for_inference(models_dir / TINY_MODEL, torch.device("cpu"), "int8")
    assert int8.precision == "int8"
    assert (int8.model.way, int8.model.fallback) == ("compiled" if amx else "eager", None)
    layers = [
        type(m)
        for m in int8.model.eager.modules()
        if isinstance(m, torch.nn.Linear) or isinstance(m, torch.ao.nn.quantized.dynamic.Linear)
    ]
    assert layers and all(t is torch.ao.nn.quantized.dynamic.Linear for t in layers), set(layers)
    texts = texts_of_many_widths()
    compiled_at_load = counters["stats"]["unique_graphs"]
    a, b = predict_texts(fp32, texts), predict_texts(int8, texts, max_tokens=256)  # batches of several widths
    assert len(b.rows) == 40 and (a.tokens, a.truncated) == (b.tokens, b.truncated)
    assert int8.model.way == ("compiled" if amx else "eager")  # no batch fell back
    assert counters["stats"]["unique_graphs"] == compiled_at_load  # the load's one compile served every batch
    # the same model: probabilities close (tiny-bert's random head separates classes barely, so labels may flip)
    assert largest_gap(a, b) < 0.05, largest_gap(a, b)


def test_int8_falls_back_to_eager_when_compiling_fails(models_dir, monkeypatch):
    """No C++ compiler, an op the exporter cannot take: the model is quantized eagerly instead, and
    says why; a compiled model that fails on a later batch does the same, and the batch is answered."""
    import shared.inference.int8 as int8_module

    def no_compiler(*args):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(int8_module, "compiled_int8", no_compiler)
    int8 = load_for_inference(models_dir / TINY_MODEL, torch.device("cpu"), "int8")
    assert int8.model.way == "eager" and "No working C++ compiler" in int8.model.fallback
    assert len(predict_texts(int8, texts_of_many_widths()).rows) == 40

    calls = []

    def fails_later(*args):
        def run(**batch):
            calls.append(batch["input_ids"].shape)
            if len(calls) > 1:
                raise RuntimeError("a guard failed")
            return int8_module.eager_int8(args[0])(**batch).logits

        return run

    monkeypatch.setattr(int8_module, "compiled_int8", fails_later)
    int8 = load_for_inference(models_dir / TINY_MODEL, torch.device("cpu"), "int8")
    assert int8.model.way == "compiled"
    assert len(predict_texts(int8, texts_of_many_widths()).rows) == 40
    assert int8.model.way == "eager" and "a guard failed" in int8.model.fallback


def test_int8_is_refused_on_a_gpu(models_dir):
    with pytest.raises(UserError) as refused:
        load_for_inference(models_dir / TINY_MODEL, torch.device("cuda"), "int8")
    assert (refused.value.code, refused.value.param) == ("unsupported_precision", "precision")


def test_an_int8_prediction_job_and_its_plan(stack):
    from worker.predict import release_models

    release_models()  # this worker's first int8 job of the model: loaded (and quantized) now
    client = stack.client
    dataset = upload(client, scoring_csv(), "score.csv")
    body = {"model": TINY_MODEL, "dataset": dataset["id"], "text_column": "body", "max_length": 16, "precision": "int8"}
    done = wait_prediction(client, predict(client, body)["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["precision"] == "int8" and done["result"]["rows"] == 29
    said = [e for e in client.get(f"/predictions/{done['id']}/events").json()["data"] if e["code"] == "int8"]
    assert len(said) == 1 and said[0]["message"].startswith("int8: "), said
    assert "not compiled again" not in said[0]["message"]
    again = wait_prediction(client, predict(client, body)["id"])  # the worker kept the quantized model
    said = [
        e["message"] for e in client.get(f"/predictions/{again['id']}/events").json()["data"] if e["code"] == "int8"
    ]
    assert again["result"] == {**done["result"], **{k: again["result"][k] for k in again["result"] if "second" in k}}
    assert said and "kept loaded by this worker since an earlier job: not compiled again" in said[0], said
    int8_plan = predict(client, body, expect=200, dry_run="true")["plan"]
    assert again["id"] in int8_plan["estimate_basis"] and int8_plan["estimated_seconds"] > 0
    fp32_plan = predict(client, {**body, "precision": "fp32"}, expect=200, dry_run="true")["plan"]
    assert fp32_plan["estimated_seconds"] is None  # no fp32 prediction on the model yet
    refused = client.post("/predictions", json={**body, "precision": "int4"})
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "precision"
