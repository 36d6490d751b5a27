"""The client CLI as a user runs it: ``tunejob`` subprocesses against one real ``tunejob serve``
(API + worker processes, the embedded default) training the tiny BERT; plus the client's error
and key handling against a mock transport.

When the server writes ``<data dir>/api_key`` (API keys), the CLI sends it by itself (it reads
``TUNEJOB_DATA_DIR``), and the tests' own HTTP calls send it too (``Served.client``).
"""

import argparse
import csv
import io
import json
import os
import random
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pandas as pd
import pytest

from client import Client, TunejobError
from client.options import UsageError
from tests.conftest import TINY_MODEL
from tests.faults_support import ROOT, Process, free_port, wait_for

# Marked alone (pyproject.toml): the jobs here train on `tunejob serve`'s workers, which run at nice 10;
# beside a parallel test process's training they get a tenth of a core (tests/test_server.py).
pytestmark = pytest.mark.alone

WORDS = {"sports": ["match", "goal", "team", "coach", "league"], "business": ["shares", "market", "profit", "bank"]}


@dataclass
class Served:
    url: str
    data_dir: Path
    env: dict[str, str]
    process: Process

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``tunejob ARGS`` as a subprocess; its output is in ``.stdout`` and ``.stderr``."""
        return subprocess.run(
            [sys.executable, "-m", "tunejob", *args],
            env=self.env,
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=timeout,
        )

    def client(self) -> Client:
        key_file = self.data_dir / "api_key"
        return Client(self.url, api_key=key_file.read_text().strip() if key_file.is_file() else "")


@pytest.fixture(scope="module")
def served(tmp_path_factory, models_dir) -> Served:
    yield from serving(tmp_path_factory.mktemp("served"), models_dir)


def serving(work: Path, models_dir: Path, *options: str):
    """``tunejob serve OPTIONS`` on a free port with the tiny model, yielded once it answers, then stopped."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TUNEJOB_")}
    env = {
        **base,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TUNEJOB_DATA_DIR": str(work / "data"),
        "TUNEJOB_MODELS_DIR": str(models_dir),
        "TUNEJOB_DEVICE": "cpu",
        "TUNEJOB_METRICS_FLUSH_SECONDS": "0.2",
        "TUNEJOB_STREAM_POLL_SECONDS": "0.1",
        "TUNEJOB_URL": f"http://127.0.0.1:{port}",
        "COLUMNS": "200",
    }
    process = Process(
        "serve", [sys.executable, "-m", "tunejob", "serve", "--port", str(port), *options], env, work / "serve.log"
    )
    server = Served(f"http://127.0.0.1:{port}", work / "data", env, process)

    def up() -> bool:
        try:
            return httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for("tunejob serve", up, timeout=120, diagnostics=process.tail)
        yield server
    finally:
        process.stop(timeout=60)


def write_csv(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    labels = [["sports", "business"][i % 2] for i in range(rows)]
    pd.DataFrame(
        {"text": [" ".join(rng.choices(WORDS[label], k=rng.randint(3, 24))) for label in labels], "label": labels}
    ).to_csv(path, index=False)
    return path


def upload(served: Served, path: Path) -> str:
    result = served.cli("datasets", "upload", str(path), "--quiet")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_create_watch_download_and_the_pictures_of_the_run(served, tmp_path):
    from matplotlib.image import imread
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import pipeline

    dataset = upload(served, write_csv(tmp_path / "train.csv", 64))
    created = served.cli(
        "jobs",
        "create",
        "--model",
        TINY_MODEL,
        "--dataset",
        dataset,
        "--text-column",
        "text",
        "--label-column",
        "label",
        "--set",
        "epochs=2",
        "--set",
        "batch_size=8",
        "--set",
        "learning_rate=1e-3",
        "--set",
        "eval_every_steps=4",
        "--watch",
    )
    assert created.returncode == 0, created.stdout + created.stderr
    assert "succeeded" in created.stdout
    assert "validation accuracy" in created.stdout and "train tokens_per_second" in created.stdout
    job_id = created.stdout.split()[1]
    job = served.client().get_job(job_id)
    assert job.status == "succeeded" and job.progress.step == job.progress.total_steps > 0
    steps = job.progress.total_steps
    shown = served.cli("jobs", "get", job_id).stdout
    assert "epochs=2" in shown and "epochs=2.0" not in shown, shown  # as given (epochs is a float)

    model_dir = tmp_path / "model"
    downloaded = served.cli("jobs", "download", job_id, "-o", str(model_dir))
    assert downloaded.returncode == 0, downloaded.stderr
    prediction = pipeline("text-classification", model=str(model_dir), device="cpu")("goal match team")
    assert prediction[0]["label"] in WORDS

    curves = imread(model_dir / "training_curves.png")
    assert curves.ndim == 3 and curves.shape[0] > 500 and curves.shape[1] > 500
    runs = EventAccumulator(str(model_dir / "runs"))
    runs.Reload()
    assert {"train/loss", "train/learning_rate", "train/tokens_per_second", "eval/accuracy"} <= set(
        runs.Tags()["scalars"]
    )
    assert [e.step for e in runs.Scalars("train/loss")] == list(range(1, steps + 1))
    assert [e.step for e in runs.Scalars("eval/accuracy")] == [*range(4, steps, 4), steps]

    plotted = served.cli("jobs", "plot", job_id, "-o", str(tmp_path / "live.png"))
    assert plotted.returncode == 0, plotted.stderr
    assert imread(tmp_path / "live.png").shape == curves.shape

    table = served.cli("jobs", "metrics", job_id, "--csv")
    rows = list(csv.DictReader(io.StringIO(table.stdout)))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    assert all(float(r["train_loss"]) > 0 for r in rows)

    listed = json.loads(served.cli("jobs", "list", "--json").stdout)
    assert job_id in [j["id"] for j in listed["data"]]
    events = json.loads(served.cli("jobs", "events", job_id, "--json").stdout)
    assert [e["code"] for e in events][-1] == "succeeded"


def test_predict_a_dataset_and_a_few_texts_from_the_command_line(served, tmp_path):
    dataset = upload(served, write_csv(tmp_path / "train.csv", 48))
    trained = served.cli(
        "jobs",
        "create",
        "--model",
        TINY_MODEL,
        "--dataset",
        dataset,
        "--set",
        "epochs=1",
        "--set",
        "batch_size=8",
        "--set",
        "learning_rate=1e-3",
        "--quiet",
    )
    assert trained.returncode == 0, trained.stderr
    job_id = trained.stdout.strip()
    assert served.cli("jobs", "watch", job_id).returncode == 0

    texts = pd.DataFrame(
        {
            "doc": [f"d{i}" for i in range(30)],
            "text": ["goal match team" if i % 2 else "shares market profit" for i in range(30)],
        }
    )
    texts.to_csv(tmp_path / "score.csv", index=False)
    to_score = upload(served, tmp_path / "score.csv")
    planned = served.cli("predict", "create", "--model", job_id, "--dataset", to_score, "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["rows"] == 30
    table = served.cli("predict", "create", "--model", job_id, "--dataset", to_score, "--dry-run")
    assert table.returncode == 0 and "30 (0 cut at max_length" in table.stdout, table.stdout + table.stderr

    created = served.cli("predict", "create", "--model", job_id, "--dataset", to_score, "--id-column", "doc", "--watch")
    assert created.returncode == 0, created.stdout + created.stderr
    assert "succeeded" in created.stdout and "tunejob predict download" in created.stdout
    prediction_id = created.stdout.split()[1]
    listed = json.loads(served.cli("predict", "list", "--json").stdout)
    assert prediction_id in [p["id"] for p in listed["data"]]
    assert prediction_id not in [j["id"] for j in json.loads(served.cli("jobs", "list", "--json").stdout)["data"]]

    downloaded = served.cli("predict", "download", prediction_id, "--format", "csv", "-o", str(tmp_path / "out.csv"))
    assert downloaded.returncode == 0, downloaded.stderr
    results = pd.read_csv(tmp_path / "out.csv")
    assert results["id"].tolist() == texts["doc"].tolist()
    assert set(results["label"]) <= set(WORDS)

    answer = json.loads(
        served.cli("predict", "texts", job_id, "goal match team", "shares market profit", "--json").stdout
    )
    assert [p["label"] for p in answer["predictions"]] == results["label"].tolist()[:2][::-1]

    missing = served.cli("predict", "get", "job_0000000000000000")
    assert missing.returncode == 1 and "not_found" in missing.stderr


def test_predict_embed_prints_a_summary_or_the_whole_vectors(served):
    """``tunejob predict embed`` with a base model's name (mean pooling): ``--json`` prints the API's
    answer, unit vectors one per text; without it, a table of each text's vector size and first values."""
    answer = served.cli("predict", "embed", TINY_MODEL, "goal match team", "shares market profit", "--json")
    assert answer.returncode == 0, answer.stderr
    vectors = json.loads(answer.stdout)["embeddings"]
    assert len(vectors) == 2 and len(vectors[0]) == json.loads(answer.stdout)["dimensions"]
    assert sum(v * v for v in vectors[0]) == pytest.approx(1.0, abs=1e-5)
    table = served.cli("predict", "embed", TINY_MODEL, "goal match team")
    assert table.returncode == 0, table.stderr
    assert "dimensions" in table.stdout and f"{vectors[0][0]:.4f}" in table.stdout
    assert "goal match team" in table.stdout


def test_a_failing_job_makes_watch_exit_non_zero(served, tmp_path):
    # Targets of 1e30 (allowed by the spec's allow_large_targets): the squared error overflows fp32,
    # and one non-finite step fails the job.
    path = tmp_path / "huge.csv"
    pd.DataFrame({"text": [f"some words {i}" for i in range(24)], "score": [1e30] * 24}).to_csv(path, index=False)
    dataset = upload(served, path)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"allow_large_targets": True}))
    created = served.cli(
        "jobs",
        "create",
        "--spec",
        str(spec),
        "--model",
        TINY_MODEL,
        "--dataset",
        dataset,
        "--task",
        "regression",
        "--label-column",
        "score",
        "--set",
        "max_nonfinite_steps=1",
        "--watch",
    )
    assert created.returncode == 3, created.stdout + created.stderr
    assert "failed" in created.stdout and "nonfinite_loss" in created.stdout


def test_the_stream_delivers_each_metric_row_once_across_a_reconnect(served, tmp_path):
    client = served.client()
    dataset = client.upload_dataset(write_csv(tmp_path / "long.csv", 160, seed=1))
    job = client.create_job(
        {
            "base_model": TINY_MODEL,
            "training_dataset": dataset.id,
            "text_column": "text",
            "label_column": "label",
            "hyperparameters": {"epochs": 2, "batch_size": 4, "eval_every_steps": 20},
        }
    )
    received, events = [], []

    def take(message) -> None:
        if message.event == "metrics":
            received.extend((m.step, m.name, m.value) for m in message.data)
        elif message.event == "events":
            events.extend(e.code for e in message.data)

    first = client.stream(job.id)
    for message in first:  # the first connection drops after its first metric rows
        take(message)
        last_id = message.id
        if received:
            break
    first.close()
    assert received
    ended = None
    for message in client.stream(job.id, last_event_id=last_id):
        take(message)
        ended = message
    assert ended.event == "end" and ended.data.status == "succeeded"

    stored = [(m.step, m.name, m.value) for m in client.job_metrics(job.id)]
    assert sorted(received) == sorted(stored)  # every row, none twice
    losses = [step for step, name, _ in received if name == "train_loss"]
    assert sorted(losses) == list(range(1, ended.data.progress.total_steps + 1))
    assert events.count("created") == events.count("succeeded") == 1


def test_errors_carry_the_api_error_and_the_status(served, tmp_path):
    result = served.cli("jobs", "get", "job_nope")
    assert result.returncode == 1 and "not_found" in result.stderr and "job_nope" in result.stderr
    client = served.client()
    with pytest.raises(TunejobError) as error:
        list(client.stream("job_nope"))
    assert (error.value.status, error.value.code) == (404, "not_found")
    dataset = client.upload_dataset(write_csv(tmp_path / "train.csv", 16))  # a job of its own: runs alone too
    job = client.create_job(
        {
            "base_model": TINY_MODEL,
            "training_dataset": dataset.id,
            "text_column": "text",
            "label_column": "label",
            "hyperparameters": {"epochs": 1, "batch_size": 8},
        }
    )
    client.cancel_job(job.id)
    with pytest.raises(TunejobError) as error:
        list(client.stream(job.id, last_event_id="42"))
    assert (error.value.status, error.value.code, error.value.param) == (422, "invalid_last_event_id", "Last-Event-ID")


def test_an_error_with_problems_and_the_key_from_the_data_dir(tmp_path, monkeypatch):
    """No server: a mock transport answers as the API does (a data validation report)."""
    monkeypatch.delenv("TUNEJOB_API_KEY", raising=False)
    monkeypatch.setenv("TUNEJOB_DATA_DIR", str(tmp_path))
    (tmp_path / "api_key").write_text("tj_secret\n")
    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(
            422,
            json={
                "error": {
                    "code": "invalid_label",
                    "message": "'train.csv' row 3: label 'x' is not a number",
                    "param": "label_column",
                    "problems": [{"row": 3, "column": "score", "value": "x", "message": "not a number"}],
                }
            },
        )

    with (
        Client("http://tunejob.test", transport=httpx.MockTransport(answer)) as client,
        pytest.raises(TunejobError) as error,
    ):
        client.create_job({"base_model": TINY_MODEL, "training_dataset": "ds_x"})
    assert seen == ["Bearer tj_secret"]
    e = error.value
    assert (e.status, e.code, e.param) == (422, "invalid_label", "label_column")
    assert e.problems == [{"row": 3, "column": "score", "value": "x", "message": "not a number"}]

    monkeypatch.setenv("TUNEJOB_API_KEY", "tj_from_env")
    with Client("http://tunejob.test", transport=httpx.MockTransport(answer)) as client, pytest.raises(TunejobError):
        client.get_job("job_x")
    assert seen[-1] == "Bearer tj_from_env"


def test_a_few_texts_show_each_task_s_prediction():
    from client.display import prediction_text

    text = "carol flew to New York"
    entities = [
        {"entity_group": "PER", "score": 0.9, "word": "carol", "start": 0, "end": 5},
        {"entity_group": "LOC", "score": 0.8, "word": "new york", "start": 14, "end": 22},
    ]
    assert prediction_text(text, {"entities": entities}) == "PER carol, LOC New York"
    assert prediction_text(text, {"entities": []}) == "no entity"
    assert prediction_text(text, {"labels": ["comedy", "drama"], "probabilities": {}}) == "comedy, drama"
    assert prediction_text(text, {"labels": [], "probabilities": {}}) == "no label"
    assert prediction_text(text, {"label": "sport", "score": 0.91234, "probabilities": {}}) == "sport (0.912)"
    assert prediction_text(text, {"value": 2.5}) == "2.5"


def test_client_commands_load_no_server_stack():
    """The client commands must start fast: no torch, worker, pandas, job store or settings."""
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "tunejob",
            "jobs",
            "list",
            "--url",
            f"http://127.0.0.1:{free_port()}",
        ],
        cwd=ROOT,
        text=True,
        capture_output=True,
    )
    assert result.returncode == 1 and "connection_error" in result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "httpx" in imported and "client.api" in imported
    heavy = {
        "torch",
        "pandas",
        "numpy",
        "sqlalchemy",
        "fastapi",
        "transformers",
        "celery",
        "pydantic_settings",
        "matplotlib",
        "worker",
        "api",
    }
    assert not heavy & imported


def test_a_downloaded_model_is_checked_against_its_manifest(tmp_path, monkeypatch):
    """No server: a mock transport serves a model.tar whose manifest.json matches its files, then
    one whose weights changed after the manifest was written (a corrupt transfer or disk)."""
    from shared.store.artifacts import write_manifest

    monkeypatch.setenv("TUNEJOB_API_KEY", "tj_test")
    model = tmp_path / "served"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\x00" * 4096)
    write_manifest(model)

    def archive() -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for path in sorted(model.iterdir()):
                tar.add(path, arcname=path.name)
        return buffer.getvalue()

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/jobs/job_x/artifacts/model.tar"
        return httpx.Response(200, content=archive())

    with Client("http://tunejob.test", transport=httpx.MockTransport(answer)) as client:
        good = client.download_model("job_x", tmp_path / "good")
        assert (good / "model.safetensors").read_bytes() == b"\x00" * 4096

        (model / "model.safetensors").write_bytes(b"\x01" * 4096)  # same size, other bytes
        with pytest.raises(TunejobError) as error:
            client.download_model("job_x", tmp_path / "bad")
    assert error.value.code == "download_corrupt" and "model.safetensors" in error.value.message
    assert not (tmp_path / "bad").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "served"]  # no temporary directory left


def test_every_client_command_runs_as_a_client_command():
    """``COMMANDS`` (what ``tunejob`` hands to the client) lists every command the client adds: one
    left out (``webhooks`` was, issue 34) parsed as a server command, did nothing and exited 0."""
    import argparse

    from client import cli

    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    cli.add_commands(commands)
    assert set(commands.choices) == set(cli.COMMANDS)


def run_tunejob(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # COLUMNS: usage errors unwrapped (a long tmp_path, e.g. under pytest-xdist, split the message)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TUNEJOB_")},
        "TUNEJOB_DATA_DIR": str(cwd),
        "COLUMNS": "1000",
    }
    return subprocess.run(
        [sys.executable, "-m", "tunejob", *args], env=env, cwd=ROOT, text=True, capture_output=True, timeout=60
    )


def test_webhooks_reach_the_server_and_bad_files_are_a_usage_error(tmp_path):
    r = run_tunejob("webhooks", "list", "--url", "http://127.0.0.1:9", cwd=tmp_path)  # nothing listens there
    assert r.returncode == 1 and "cannot reach tunejob" in r.stderr, (r.returncode, r.stderr)
    (tmp_path / "bad.yaml").write_text("learning_rate: {type: float, low: [\n")
    r = run_tunejob(
        "sweeps",
        "create",
        "--model",
        TINY_MODEL,
        "--dataset",
        "ds_x",
        "--objective",
        "accuracy",
        "--space",
        str(tmp_path / "bad.yaml"),
        "--url",
        "http://127.0.0.1:9",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and "usage: --space" in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    (tmp_path / "list.json").write_text("[1, 2]")
    r = run_tunejob(
        "jobs", "create", "--spec", str(tmp_path / "list.json"), "--url", "http://127.0.0.1:9", cwd=tmp_path
    )
    assert r.returncode == 2 and "expected a JSON object" in r.stderr and "Traceback" not in r.stderr, r.stderr
    for command in (("datasets", "upload", str(tmp_path / "missing.csv")), ("datasets", "upload", str(tmp_path))):
        r = run_tunejob(*command, "--url", "http://127.0.0.1:9", cwd=tmp_path)  # a traceback before
        assert r.returncode == 1 and r.stderr.startswith("error: [Errno") and "Traceback" not in r.stderr, r.stderr


def test_version():
    from importlib.metadata import version

    r = subprocess.run(
        [sys.executable, "-m", "tunejob", "--version"], cwd=ROOT, text=True, capture_output=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == f"tunejob {version('tunejob')}", (r.stdout, r.stderr)


def complete(line: str, tmp_path: Path) -> list[str]:
    """What the shell code of ``tunejob completion`` gets for the words typed so far, ``line``: the
    CLI run under argcomplete's protocol (its environment variables; the answer in a file)."""
    answer = tmp_path / "completions"
    env = {
        **os.environ,
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_IFS": "\n",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "_ARGCOMPLETE_STDOUT_FILENAME": str(answer),
    }
    r = subprocess.run([sys.executable, "-m", "tunejob"], env=env, cwd=ROOT, text=True, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return sorted(answer.read_text().split())


def test_shell_completion(tmp_path):
    """``tunejob completion bash|zsh|fish`` prints argcomplete's shell code, and the completions it
    asks for cover the server commands, the client's, their subcommands and options."""
    r = subprocess.run(
        [sys.executable, "-m", "tunejob", "completion", "bash"], cwd=ROOT, text=True, capture_output=True, timeout=60
    )
    assert r.returncode == 0 and "complete " in r.stdout and "tunejob" in r.stdout, (r.stdout, r.stderr)
    assert complete("tunejob d", tmp_path) == ["datasets", "db", "doctor"]
    assert complete("tunejob jobs cr", tmp_path) == ["create"]
    assert "--tenant" in complete("tunejob keys create --", tmp_path)
    assert {"bash", "fish", "zsh"} <= set(complete("tunejob completion ", tmp_path))
    # `tunejob completion bash | head`: a reader that leaves early (a BrokenPipeError traceback before)
    reader_gone = subprocess.Popen(
        [sys.executable, "-m", "tunejob", "completion", "bash"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    reader_gone.stdout.close()
    assert "Traceback" not in reader_gone.communicate(timeout=60)[1].decode()


def test_a_job_shows_the_columns_its_task_reads():
    """``tunejob jobs get`` names the columns by their role in the job's task: a reranking job its
    query, passage and label columns, an embedding job its anchor, positive and negative columns
    (not the text_column default they never read)."""
    from rich.console import Console

    from client.display import job_table
    from shared.schemas.jobs import JobOut

    example = JobOut.model_config["json_schema_extra"]["examples"][0]
    reranking = JobOut.model_validate(
        {
            **example,
            "task": "reranking",
            "query_column": "question",
            "passage_column": "doc",
            "label_column": "relevant",
        }
    )
    embedding = JobOut.model_validate(
        {**example, "task": "embedding", "anchor_column": "title", "positive_column": "body", "negative_columns": ["x"]}
    )
    assert reranking.column_fields() == {
        "query_column": "question",
        "passage_column": "doc",
        "label_column": "relevant",
    }
    assert embedding.column_fields() == {"anchor_column": "title", "positive_column": "body", "negative_columns": ["x"]}
    assert JobOut.model_validate(example).column_fields() == {"text_column": "text", "label_column": "label"}
    console = Console(width=200, record=True)
    console.print(job_table(reranking), job_table(embedding))
    shown = console.export_text()
    assert "query 'question', passage 'doc', label 'relevant'" in shown
    assert "anchor 'title', positive 'body', negative ['x']" in shown and "text 'text'" not in shown


def test_a_dry_run_prints_the_plan_s_main_figures():
    """``jobs create`` and ``predict create`` with ``--dry-run``: the plan's main figures in a
    table (examples and truncation, steps, the chosen batching's padding efficiency, the estimate),
    drawn from the API reference's own examples of the plans."""
    from rich.console import Console

    from client.display import job_plan_table, prediction_plan_table
    from shared.schemas.plans import DryRunOut
    from shared.schemas.predictions import PredictionDryRunOut

    console = Console(width=200, record=True)
    console.print(job_plan_table("smart")(DryRunOut.model_config["json_schema_extra"]["examples"][0]["plan"]))
    console.print(prediction_plan_table(PredictionDryRunOut.model_config["json_schema_extra"]["examples"][0]["plan"]))
    shown = console.export_text()
    assert "1,602 (742 cut at max_length)" in shown and "0.993 (smart; on a CUDA worker's buckets 0.947)" in shown
    assert "token_budget 0.991, dynamic 0.912, fixed 0.878" in shown
    assert "445 (203 cut at max_length 128)" in shown and "7 s (job job_1c7e9a40d2b35f86" in shown


def test_no_command_option_shares_a_name_with_another():
    """Each argument of each client command has a name of its own: ``webhooks create URL`` once
    stored the endpoint's URL under ``url``, the server option's name, so the CLI sent the request,
    with the API key, to the endpoint instead of the server."""
    import argparse

    from client import cli

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())

    def leaves(p: argparse.ArgumentParser):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield p
        for sub in subs:
            for child in sub.choices.values():
                yield from leaves(child)

    for command in leaves(parser):
        names = [a.dest for a in command._actions if a.dest != "help"]
        assert len(names) == len(set(names)), (command.prog, sorted(names))
    args = parser.parse_args(
        ["webhooks", "create", "https://hooks.example.com/h", "job.succeeded", "--url", "http://tunejob:8000"]
    )
    assert (args.url, args.endpoint) == ("http://tunejob:8000", "https://hooks.example.com/h")


def test_metrics_show_the_columns_a_window_holds():
    """``jobs metrics`` in an 80-column window: rich cut all 13 columns to three letters; the
    table holds the loss and validation columns that fit and names the rest, ``--metric`` chooses."""
    from rich.console import Console

    from client.cli import job_metrics

    names = ["train_loss", "learning_rate", "grad_norm", "tokens_per_second", "padding_efficiency"]
    names += ["padding_efficiency_unrounded", "peak_memory_mb", "skipped_steps", "eval_loss", "eval_accuracy"]
    rows = [
        {"step": step, "epoch": step / 4, "name": name, "value": 0.123456789, "time": "2026-11-21T09:13:05Z"}
        for step in (1, 2, 3, 4)
        for name in names
        if step == 4 or not name.startswith("eval_")
    ]

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": rows})

    def shown(*metrics: str) -> str:
        console = Console(width=80, record=True)
        args = argparse.Namespace(job_id="job_x", json=False, csv=False, metric=list(metrics) or None)
        with Client("http://tunejob.test", api_key="k", transport=httpx.MockTransport(answer)) as client:
            job_metrics(client, args, console)
        return console.export_text()

    table, _, note = shown().partition("more metric(s)")
    header = table.splitlines()[1]
    assert "train_loss" in header and "eval_loss" in header and "eval_accuracy" in header and "…" not in header
    assert "0.1235" in table and "peak_memory_mb" in note and "--metric NAME" in note
    assert all(len(line) <= 80 for line in table.splitlines())
    chosen = shown("grad_norm", "skipped_steps")
    assert "grad_norm" in chosen and "skipped_steps" in chosen and "train_loss" not in chosen
    assert "more metric(s)" not in chosen
    with pytest.raises(UsageError, match="no such metric"):
        shown("accuracy")


def test_a_sweep_s_trials_and_plan_read_whole_in_80_columns():
    """``sweeps trials`` at 80 columns showed ``succe…`` and ``6.824…``: every status and value is
    whole now, the default trial named in the caption; ``sweeps create --dry-run`` prints the
    plan's main figures and its trial's (it printed the whole plan as JSON)."""
    from datetime import datetime

    from rich.console import Console

    from client.display import show_plan
    from client.sweeps import sweep_plan_table, trials_table
    from shared.schemas.plans import DryRunOut
    from shared.schemas.sweeps import SEARCH_SPACE_EXAMPLE, SweepOut, TrialOut

    sweep = SweepOut.model_validate(SweepOut.model_config["json_schema_extra"]["examples"][0])
    now = datetime(2026, 11, 29)

    def trial(number: int, job_id: str, params: dict, value: float, steps: int) -> TrialOut:
        return TrialOut(
            number=number,
            job_id=job_id,
            status="succeeded",
            params=params,
            default=number == 0,
            value=value,
            values=[value],
            steps=steps,
            started_at=now,
            finished_at=now,
        )

    trials = [
        trial(0, "job_2e6b4c745afa73f6", {"batch_size": 16, "learning_rate": 5e-5}, 0.25, 12),
        trial(1, "job_18662859e9969f96", {"batch_size": 8, "learning_rate": 6.8244e-5}, 0.4, 23),
    ]
    console = Console(width=80, record=True)
    console.print(trials_table(trials, sweep, 80))
    shown = console.export_text()
    assert "succeeded" in shown and "6.824e-05" in shown and "…" not in shown, shown
    assert all(
        len(line) <= 80 and line.rstrip().endswith(("┓", "┃", "┩", "│", "┘")) for line in shown.splitlines()[:-1]
    )
    assert "#0: the default hyperparameters" in shown and "not shown" not in shown
    # four parameters (the priors' default search): the window cut the objective's value and the
    # steps off the right edge; they come first now, and the parameters that do not fit are named
    for t, (warmup, decay) in zip(trials, [(0.1, 0.01), (0.05449, 0.04237)]):
        t.params.update(warmup_ratio=warmup, weight_decay=decay)
    console = Console(width=80, record=True)
    console.print(trials_table(trials, sweep, 80))
    shown = console.export_text()
    table = shown.split("#0:")[0]
    assert all(len(line) <= 80 and line.rstrip().endswith(("┓", "┃", "┩", "│", "┘")) for line in table.splitlines())
    assert "0.25" in table and "23" in table and "6.824e-05" in table, shown
    assert "not shown: warmup_ratio, weight_decay" in " ".join(shown.split()), shown

    from client.sweeps import list_sweeps

    listed = {"data": [SweepOut.model_config["json_schema_extra"]["examples"][0]], "next_cursor": None}
    console = Console(width=80, record=True)
    with Client("http://tunejob.test", api_key="k", transport=httpx.MockTransport(lambda _: httpx.Response(200, json=listed))) as client:  # fmt: skip
        list_sweeps(client, argparse.Namespace(limit=20, cursor=None, json=False, quiet=False), console)
    shown = console.export_text()  # "succeed…", "(job_d1…" and "3 succeed…" once
    assert "running" in shown and "9/12" in shown and "#4 0.871" in shown and "…" not in shown, shown

    plan = {
        "dry_run": True,
        "max_trials": 12,
        "max_parallel_trials": 2,
        "search_space": {
            **SEARCH_SPACE_EXAMPLE,
            "epochs": {"type": "int", "low": 2.0, "high": 10.0, "log": False, "step": 2.0, "choices": None},
        },
        "first_trials": [{"learning_rate": 5e-05}],
        "objective": {"metric": "accuracy", "direction": "maximize"},
        "trial_plan": DryRunOut.model_config["json_schema_extra"]["examples"][0]["plan"],
    }
    console = Console(width=200, record=True)
    show_plan(console, argparse.Namespace(json=False), plan, sweep_plan_table("smart"))
    shown = console.export_text()
    assert "12 (2 at a time)" in shown and "maximize accuracy" in shown and "learning_rate=5e-05" in shown
    assert "1,602 (742 cut at max_length)" in shown and "nothing was queued" in shown
    # The search space one range a line, as a reader writes it (it was Optuna's reprs).
    assert "learning_rate  1e-05 .. 0.001 (log)" in shown and "batch_size     one of 16, 32" in shown, shown
    assert "epochs         2 .. 10 (int, step 2)" in shown and "Distribution" not in shown, shown


def test_sweeps_get_prints_the_search_space_in_80_columns():
    """``sweeps get`` did not say what the sweep searches: it prints the ranges of ``GET
    /sweeps/{id}``'s ``search_space`` one a line, as ``--dry-run`` does, each whole in 80 columns."""
    from rich.console import Console

    from client.sweeps import sweep_table
    from shared.schemas.sweeps import SweepOut

    sweep = SweepOut.model_validate(SweepOut.model_config["json_schema_extra"]["examples"][0])
    console = Console(width=80, record=True)
    console.print(sweep_table(sweep))
    shown = console.export_text()
    assert all(len(line) <= 80 for line in shown.splitlines()), shown
    lines = [line.strip() for line in shown.splitlines()]
    assert "search space  learning_rate  1e-05 .. 0.001 (log)" in lines, shown
    for line in ("batch_size     one of 16, 32", "warmup_ratio   0 .. 0.2", "epochs         1 .. 3 (int)"):
        assert line in lines, (line, shown)


def test_age_reads_past_and_future_times():
    """``age`` says how long ago, or (a webhook delivery's next attempt) how long until."""
    from datetime import UTC, datetime, timedelta

    from client.display import age

    now = datetime.now(UTC)
    assert age(now - timedelta(minutes=3, seconds=5)) == "3m ago"
    assert age(now + timedelta(minutes=19, seconds=30)) == "in 19m"
    assert age(now + timedelta(seconds=40.4)) in ("in 40s", "in 39s")


def test_a_misspelt_hyperparameter_is_refused_with_the_names_near_it():
    """``--set checkpoint_every_steps=20`` reached the server, whose 422 said only "Extra inputs
    are not permitted"; the command line refuses it itself and names the close names."""
    from client.options import setting

    with pytest.raises(argparse.ArgumentTypeError, match="did you mean save_every_steps"):
        setting("checkpoint_every_steps=20")
    with pytest.raises(argparse.ArgumentTypeError, match="one of epochs, learning_rate"):
        setting("lr=1e-4")
    assert setting("learning_rate=1e-4") == ("learning_rate", 1e-4)


def test_datasets_and_a_job_read_whole_in_80_columns():
    """``datasets list`` at 80 columns was 84 wide, and the terminal cut its last column ("3s "); a
    long file name folds within the room the window leaves. ``jobs get`` wrapped its
    hyperparameters' JSON inside a number (``"max_length":12`` / ``8``) and showed ``train
    train_seconds 99.6268``; ``jobs list`` cut the model's name."""
    from datetime import UTC, datetime

    from rich.console import Console

    from client.cli import list_datasets
    from client.display import job_table
    from shared.schemas.jobs import DatasetOut, JobOut

    example = DatasetOut.model_config["json_schema_extra"]["examples"][0]
    now = datetime.now(UTC).isoformat()
    datasets = [
        {**example, "id": "ds_b0711c0f4740a77e", "filename": "bbc_news_train.csv", "rows": 1780, "created_at": now},
        {**example, "id": "ds_e5dd989293bad7d9", "filename": "a_" + "very_" * 9 + "long.csv", "created_at": now},
    ]
    console = Console(width=80, record=True)
    answer = httpx.Response(200, json={"data": datasets, "next_cursor": None})
    with Client("http://tunejob.test", api_key="k", transport=httpx.MockTransport(lambda _: answer)) as client:
        list_datasets(client, argparse.Namespace(json=False, quiet=False), console)
    shown = console.export_text()
    assert all(len(line) <= 80 and line.rstrip().endswith(("┓", "┃", "┩", "│", "┘")) for line in shown.splitlines())
    assert "ds_b0711c0f4740a77e" in shown and "1,780" in shown and "ago" in shown, shown

    job = JobOut.model_validate(JobOut.model_config["json_schema_extra"]["examples"][0])
    job = job.model_copy(
        update={
            "hyperparameters": job.hyperparameters.model_copy(
                update={"epochs": 1.0, "learning_rate": 1e-4, "max_length": 128, "save_every_steps": 20}
            ),
            "train_metrics": {"train_seconds": 99.6268, "skipped_steps": 0, "tokens_per_second": 2058.3},
        }
    )
    console = Console(width=80, record=True)
    console.print(job_table(job))
    shown = console.export_text()
    assert "max_length=128" in shown and "save_every_steps=20" in shown, shown
    assert "train seconds" in shown and "train_seconds" not in shown and "2,058" in shown
    assert "99.6" in shown and "99.6268" not in shown and "epochs=1," in shown, shown  # as a user reads them

    from client.cli import list_jobs

    listed = {"data": [job.model_dump(mode="json")], "next_cursor": None}
    console = Console(width=80, record=True)
    answer = httpx.Response(200, json=listed)
    with Client("http://tunejob.test", api_key="k", transport=httpx.MockTransport(lambda _: answer)) as client:
        list_jobs(client, argparse.Namespace(status=None, limit=20, cursor=None, json=False, quiet=False), console)
    shown = console.export_text()  # the model was 'all-MiniLM-L6…'
    assert job.base_model in shown and "…" not in shown, shown


@pytest.mark.parametrize(
    "task,loader",
    [
        ("classification", 'transformers.pipeline("text-classification", model="m")'),
        ("token_classification", 'transformers.pipeline("token-classification", model="m"'),
        ("embedding", 'sentence_transformers.SentenceTransformer("m")'),
        ("reranking", 'sentence_transformers.CrossEncoder("m")'),
    ],
)
def test_a_downloaded_model_is_loaded_as_its_task_loads(task, loader):
    """``jobs download`` told every job's user to load the model with ``pipeline("text-classification")``,
    an embedding model's and a reranker's too."""
    from rich.console import Console

    from client.cli import download_model

    class Fake:
        def get_job(self, job_id):
            return argparse.Namespace(task=task)

        def download_model(self, job_id, directory):
            return Path(directory)

    console = Console(width=400, record=True)
    download_model(Fake(), argparse.Namespace(job_id="job_x", output=Path("m")), console)
    assert loader in console.export_text(), console.export_text()


def test_models_list_and_alias_list_read_as_the_other_lists():
    """``tunejob models list`` was "invalid choice: 'list'" (every other noun lists with ``list``);
    ``models alias list`` printed ``updated`` as ISO 8601, cut to ``2026-11-30T00:22:2…`` at 80 columns."""
    from datetime import UTC, datetime, timedelta

    from rich.console import Console

    from client import cli

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    assert parser.parse_args(["models", "list"]).handler is cli.list_models
    assert parser.parse_args(["models"]).handler is cli.list_models

    updated = (datetime.now(UTC) - timedelta(minutes=3, seconds=2)).isoformat()
    alias = {"alias": "prod-emb", "job_id": "job_edd5dc0ffe9f3987", "updated_by": "key_880a6c1574b3b860"}
    aliases = [{**alias, "updated_at": updated}]

    class Fake:
        def list_aliases(self):
            return aliases

    console = Console(width=80, record=True)
    cli.list_aliases(Fake(), argparse.Namespace(json=False, quiet=False), console)
    assert "3m ago" in console.export_text() and "…" not in console.export_text(), console.export_text()


def test_a_token_job_s_per_entity_figures_point_to_the_evaluation():
    """``jobs get`` of a token_classification job printed per_entity as a dict's repr, cut at the
    window's edge (``company {'precision': 0.0, 'recall': 0.0, 'f1':``)."""
    from rich.console import Console

    from client.display import job_table
    from shared.schemas.jobs import JobOut

    job = JobOut.model_validate(JobOut.model_config["json_schema_extra"]["examples"][0])
    per_entity = {"company": {"precision": 0.5, "recall": 0.25, "f1": 0.3333, "support": 2}}
    job = job.model_copy(update={"validation_metrics": {"entity_f1": 0.3333, "per_entity": per_entity}})
    console = Console(width=80, record=True)
    console.print(job_table(job))
    shown = console.export_text()
    assert f"tunejob jobs evaluation {job.id}" in shown and "{'precision'" not in shown, shown


def test_get_says_when_a_job_s_files_were_deleted():
    """``jobs get`` and ``predict get`` of a job whose files retention deleted say so (nothing
    did: the download's 409 was the first a user heard of it)."""
    from rich.console import Console

    from client.display import job_table, prediction_table
    from shared.schemas.jobs import JobOut
    from shared.schemas.predictions import PredictionOut

    deleted = {"files_deleted_at": datetime(2026, 11, 30, 12, tzinfo=UTC)}
    for schema, table in ((JobOut, job_table), (PredictionOut, prediction_table)):
        example = schema.model_validate(schema.model_config["json_schema_extra"]["examples"][0])
        console = Console(width=100, record=True)
        console.print(table(example), table(example.model_copy(update=deleted)))
        shown = console.export_text()
        assert shown.count(" files ") == 1 and "deleted 2026-11-30" in shown, shown
        rows = [line for line in shown.splitlines() if line.split()[:1] == ["rows"] and "per second" not in line]
        assert len(rows) == (2 if schema is PredictionOut else 0), shown  # once a table, not twice


def test_a_running_job_before_its_first_step_says_what_it_is_doing():
    """Tokenizing 1.35 million rows took two minutes during which ``jobs get`` showed an empty
    progress; it says which phase the job is in until its first step."""
    from client.display import progress
    from shared.schemas.jobs import JobOut

    job = JobOut.model_validate(JobOut.model_config["json_schema_extra"]["examples"][0])
    running = job.model_copy(
        update={"status": "running", "progress": job.progress.model_copy(update={"total_steps": None})}
    )

    def at(**timings) -> str:
        return progress(running.model_copy(update={"timings": job.timings.model_copy(update=timings)}))

    assert at(load=0.0, tokenize=0.0) == "loading the data and the model"
    assert at(load=7.5, tokenize=0.0) == "tokenizing"
    assert at(load=7.5, tokenize=120.7) == "starting to train"
    assert progress(running.model_copy(update={"status": "failed"})) == ""
