"""The official ``openai`` SDK drives a live ``tunejob serve`` (API + one worker, embedded
default) through the ``/v1`` facade: files, fine-tuning jobs with their events and checkpoints,
pagination, cancel, and errors the SDK raises as ``BadRequestError`` with the right code and param.
Where a value must agree with tunejob's own view of the job, the native API is asked too."""

import io
import json
import os
import random
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from openai import OpenAI

from tests.conftest import TINY_MODEL
from tests.faults_support import Process, free_port, wait_for
from tests.test_api_jobs import WORDS

# Marked alone (pyproject.toml): the jobs here train on `tunejob serve`'s workers, which run at nice 10;
# beside a parallel test process's training they get a tenth of a core (tests/test_server.py).
pytestmark = pytest.mark.alone

FINISHED = {"succeeded", "failed", "cancelled"}


def labelled_jsonl(rows: int = 40, seed: int = 0, pair: bool = False) -> bytes:
    """JSONL rows ``{"text", "label"}`` (and ``"text_pair"``), two classes told apart by their words."""
    rng = random.Random(seed)
    lines = []
    for i in range(rows):
        label = ["sports", "business"][i % 2]
        row = {"text": " ".join(rng.choices(WORDS[label], k=rng.randint(3, 20))), "label": label}
        if pair:
            row["text_pair"] = " ".join(rng.choices(WORDS[label], k=3))
        lines.append(json.dumps(row))
    return ("\n".join(lines) + "\n").encode()


@dataclass
class Service:
    client: OpenAI  # the SDK, at <url>/v1
    native: httpx.Client  # tunejob's own API, same key
    process: Process

    def upload(self, content: bytes, filename: str = "train.jsonl"):
        return self.client.files.create(file=(filename, io.BytesIO(content)), purpose="fine-tune")

    def wait_job(self, job_id: str, statuses: set[str], timeout: float = 180):
        return wait_for(
            f"job {job_id} to be {'/'.join(sorted(statuses))}",
            lambda: (j := self.client.fine_tuning.jobs.retrieve(job_id)).status in statuses and j,
            timeout,
            0.3,
            lambda: self.process.tail(),
        )


@pytest.fixture(scope="module")
def service(tmp_path_factory, models_dir) -> Service:
    """``tunejob serve`` on a free port with a fresh data directory, and clients that send the API
    key the auth contract gives (the contents of <data dir>/api_key when it exists)."""
    workdir = tmp_path_factory.mktemp("serve")
    data_dir = workdir / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEJOB_")}
    env.update(
        TUNEJOB_DATA_DIR=str(data_dir),
        TUNEJOB_MODELS_DIR=str(models_dir),
        TUNEJOB_DEVICE="cpu",
        TUNEJOB_METRICS_FLUSH_SECONDS="0.2",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    port = free_port()
    process = Process(
        "serve", [sys.executable, "-m", "tunejob", "serve", "--port", str(port)], env, workdir / "serve.log"
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.alive(), f"tunejob serve exited\n{process.tail()}"
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for("tunejob serve to answer /healthz", healthy, 120, 0.3, process.tail)
        key_file = data_dir / "api_key"
        key = key_file.read_text().strip() if key_file.exists() else "no-key-needed"
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as native:
            yield Service(OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30), native, process)
    finally:
        process.stop(timeout=60)


def test_files(service):
    client = service.client
    uploaded = service.upload(labelled_jsonl(), "train.jsonl")
    assert uploaded.object == "file" and uploaded.purpose == "fine-tune" and uploaded.status == "processed"
    assert uploaded.filename == "train.jsonl" and uploaded.bytes == len(labelled_jsonl())
    assert abs(uploaded.created_at - time.time()) < 120
    assert client.files.retrieve(uploaded.id) == uploaded
    native = service.native.get(f"/datasets/{uploaded.id}").json()  # a file is a tunejob dataset
    assert native["rows"] == 40 and native["columns"] == ["text", "label"] and native["format"] == "jsonl"

    csv = service.upload(b"text,label\ngood match,sports\nbank profit,business\n", "extra.csv")
    assert [f.id for f in client.files.list()][:2] == [csv.id, uploaded.id]  # newest first
    page = client.files.list(limit=1)
    assert [f.id for f in page.data] == [csv.id] and page.has_more
    assert [f.id for f in page.get_next_page().data] == [uploaded.id]

    deleted = client.files.delete(csv.id)
    assert deleted.deleted and deleted.id == csv.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(csv.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", io.BytesIO(labelled_jsonl())), purpose="batch")
    assert e.value.param == "purpose"
    with pytest.raises(openai.BadRequestError) as e:
        service.upload(b'{"text": "unterminated', "broken.jsonl")
    assert e.value.code == "invalid_file" and e.value.param == "file" and "broken.jsonl" in e.value.message


def test_fine_tune_retrieve_events_checkpoints(service):
    client = service.client
    train = service.upload(labelled_jsonl(40, seed=1, pair=True))
    validation = service.upload(labelled_jsonl(12, seed=2, pair=True), "validation.jsonl")
    job = client.fine_tuning.jobs.create(
        model=TINY_MODEL,
        training_file=train.id,
        validation_file=validation.id,
        suffix="news",
        seed=7,
        hyperparameters={"n_epochs": 2, "batch_size": 8, "learning_rate_multiplier": 20, "max_length": 32},
        metadata={"team": "search"},
    )
    assert job.object == "fine_tuning.job" and job.status in {"queued", "running"}
    assert job.model == TINY_MODEL and job.training_file == train.id and job.validation_file == validation.id
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 8
    assert job.hyperparameters.learning_rate_multiplier == 20 and job.seed == 7
    assert job.metadata == {"team": "search"} and job.fine_tuned_model is None and job.trained_tokens is None
    assert job.method.type == "supervised" and job.result_files == [] and job.error is None

    # The same job, as tunejob sees it: OpenAI's names mapped onto tunejob's, its own passed through.
    spec = service.native.get(f"/jobs/{job.id}").json()
    assert spec["hyperparameters"]["epochs"] == 2 and spec["hyperparameters"]["max_length"] == 32
    assert spec["hyperparameters"]["learning_rate"] == pytest.approx(20 * 5e-5)
    assert spec["hyperparameters"]["seed"] == 7 and spec["text_pair_column"] == "text_pair"

    done = service.wait_job(job.id, FINISHED)
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:{TINY_MODEL}:news:{job.id}"
    assert done.trained_tokens > 40 * 2 * 3  # every example, both epochs, at least [CLS] x [SEP] [SEP]
    assert done.finished_at >= done.created_at and done.estimated_finish is None

    events = client.fine_tuning.jobs.list_events(job.id, limit=2)
    assert len(events.data) == 2 and events.has_more
    every = list(client.fine_tuning.jobs.list_events(job.id, limit=2))  # the SDK follows `after`
    codes = [e.data["code"] for e in every]
    assert codes[0] == "succeeded" and codes[-1] == "created" and "started" in codes  # newest first
    assert len({e.id for e in every}) == len(every) and all(e.level in {"info", "warn", "error"} for e in every)
    assert all(e.object == "fine_tuning.job.event" for e in every)

    # A succeeded job's step checkpoints are deleted (its model is the artifact), on both APIs.
    assert client.fine_tuning.jobs.checkpoints.list(job.id).data == []
    assert service.native.get(f"/jobs/{job.id}/checkpoints").json()["data"] == []


def test_list_pages_and_cancel(service):
    client = service.client
    train = service.upload(labelled_jsonl(40, seed=3))
    quick_body = {
        "model": TINY_MODEL,
        "training_file": train.id,
        "hyperparameters": {"n_epochs": 1, "batch_size": 8, "max_length": 32},
        "metadata": {"team": "ranking", "stage": "try"},
    }
    quick = client.fine_tuning.jobs.create(**quick_body, extra_headers={"Idempotency-Key": "quick-1"})
    # the SDK retries a create that timed out: with the same key it gets the same job, not a second
    again = client.fine_tuning.jobs.create(**quick_body, extra_headers={"Idempotency-Key": "quick-1"})
    assert (again.id, again.object) == (quick.id, "fine_tuning.job")
    validation = service.upload(labelled_jsonl(12, seed=5), "validation.jsonl")
    slow = client.fine_tuning.jobs.create(
        model=TINY_MODEL,
        training_file=train.id,
        validation_file=validation.id,
        suffix="slow",
        hyperparameters={"n_epochs": 1000, "batch_size": 2, "max_length": 32},
    )
    with pytest.raises(openai.ConflictError) as in_use:
        client.files.delete(train.id)
    assert in_use.value.code == "dataset_in_use" and quick.id in in_use.value.message
    native_ids = [j["id"] for j in service.native.get("/jobs", params={"limit": 100}).json()["data"]]
    assert native_ids[:2] == [slow.id, quick.id]

    # OpenAI's metadata filter (the SDK sends metadata[team]=ranking): it was ignored (the module's
    # other jobs have other metadata, or none)
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "ranking"})] == [quick.id]
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "ranking", "stage": "done"})] == []
    first = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in first.data] == [slow.id] and first.has_more
    assert [j.id for j in first.get_next_page().data] == [quick.id]
    assert [j.id for j in client.fine_tuning.jobs.list(limit=1)] == native_ids  # auto-pagination, every page
    last = client.fine_tuning.jobs.list(limit=100)
    assert not last.has_more and len(last.data) == len(native_ids)

    wait_for(
        f"a checkpoint of {slow.id}",
        lambda: service.native.get(f"/jobs/{slow.id}/checkpoints").json()["data"],
        120,
        0.3,
        service.process.tail,
    )
    cancelling = client.fine_tuning.jobs.cancel(slow.id)
    assert cancelling.id == slow.id and cancelling.status in {"running", "cancelled"}
    cancelled = service.wait_job(slow.id, FINISHED, timeout=60)
    assert cancelled.status == "cancelled" and cancelled.fine_tuned_model is None
    assert "cancel_requested" in [e.data["code"] for e in client.fine_tuning.jobs.list_events(slow.id)]

    # A cancelled job keeps its checkpoints: the same ones on both APIs, newest first on /v1.
    checkpoints = client.fine_tuning.jobs.checkpoints.list(slow.id).data
    native = service.native.get(f"/jobs/{slow.id}/checkpoints").json()["data"]
    assert checkpoints and [c.step_number for c in checkpoints] == [c["step"] for c in reversed(native)]
    newest = checkpoints[0]
    assert newest.fine_tuning_job_id == slow.id and newest.metrics.step == newest.step_number
    assert newest.fine_tuned_model_checkpoint == f"ft:{TINY_MODEL}:slow:{slow.id}:ckpt-step-{newest.step_number}"
    assert newest.metrics.valid_loss == pytest.approx(native[-1]["metrics"]["loss"])
    assert service.wait_job(quick.id, FINISHED).status == "succeeded"


def test_errors_are_sdk_errors(service):
    client = service.client
    train = service.upload(labelled_jsonl(20, seed=4))

    def refused(**body) -> openai.BadRequestError:
        body = {"model": TINY_MODEL, "training_file": train.id, **body}
        with pytest.raises(openai.BadRequestError) as e:
            client.fine_tuning.jobs.create(**body)
        return e.value

    e = refused(training_file="ds_0000000000000000")
    assert (e.code, e.param) == ("unknown_dataset", "training_file") and "ds_0000000000000000" in e.message
    e = refused(model="gpt-4o-mini")
    assert (e.code, e.param) == ("unknown_model", "model") and "gpt-4o-mini" in e.message
    e = refused(method={"type": "dpo", "dpo": {}})
    assert (e.code, e.param) == ("unsupported_method", "method.type")
    e = refused(hyperparameters={"n_epochs": 0})
    assert e.param == "hyperparameters.n_epochs" and "greater than 0" in e.message, e.message  # not "should be 'auto'"
    e = refused(method={"type": "supervised", "supervised": {"hyperparameters": {"max_length": 1024}}})
    assert (e.code, e.param) == ("max_length_too_long", "method.supervised.hyperparameters.max_length")
    e = refused(hyperparameters={"n_epochs": 1, "epochs": 2})
    assert (e.code, e.param) == ("conflicting_parameters", "hyperparameters.n_epochs")
    e = refused(extra_body={"label_column": "category"})  # tunejob's own spec fields pass through
    assert (e.code, e.param) == ("missing_column", "label_column") and "category" in e.message
    assert e.body["type"] == "invalid_request_error"

    with pytest.raises(openai.NotFoundError) as not_found:
        client.fine_tuning.jobs.retrieve("job_0000000000000000")
    assert not_found.value.code == "not_found"
    # every /v1 error carries OpenAI's type: no such route, no such method, a foreign Origin too
    for method, path, headers, status in (
        ("GET", "/v1/no-such-thing", {}, 404),
        ("DELETE", "/v1/fine_tuning/jobs/job_0000000000000000", {}, 405),
        ("POST", "/v1/embeddings", {"Origin": "http://evil.example"}, 403),
    ):
        r = service.native.request(method, path, headers=headers, json={})
        assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
    stored = service.native.get("/jobs", params={"limit": 100}).json()["data"]
    assert all(j["training_dataset"] != train.id for j in stored)  # nothing refused was stored


def test_models(service):
    models = {m.id: m for m in service.client.models.list()}
    assert models[TINY_MODEL].owned_by == "local" and models["all-MiniLM-L6-v2"].owned_by == "system"
    assert all(m.object == "model" and m.created > 0 for m in models.values())
