"""Building blocks of fast start and fast finish, without the service: the tokenization cache gives
exactly what tokenizing gives, the streamed tar is a standard tar of known size, the manifest
catches a changed file, and the phase timer never counts a second twice."""

import io
import itertools
import json
import shutil
import subprocess
import tarfile
import time

import pandas as pd
import pytest

from shared.store import artifacts
from shared.store.manifest import sha256_of, verify_manifest
from tests.conftest import RecordingReporter
from tests.test_engine import make_job
from tests.test_object_storage import collect
from worker.data import tokenize
from worker.reporter import PhaseTimer
from worker.training.recipe import Recipe


@pytest.fixture
def tokenizer(models_dir):
    from transformers import AutoTokenizer

    from tests.conftest import TINY_MODEL

    return AutoTokenizer.from_pretrained(models_dir / TINY_MODEL)


def frame(n: int = 30) -> pd.DataFrame:
    words = ["goal", "market", "team", "profit", "unbelievably", "coach", "!", "é"]
    return pd.DataFrame(
        {
            "text": [" ".join(words[(i + j) % len(words)] for j in range(i)) for i in range(n)],
            "pair": [words[i % len(words)] * (i % 5) for i in range(n)],
            "label": ["a", "b"] * (n // 2),
            "score": [i / 3 for i in range(n)],
        }
    )


@pytest.mark.parametrize("pair,labels,label_column", [(None, ["a", "b"], "label"), ("pair", None, "score")])
def test_the_tokenization_cache_returns_what_tokenizing_returns(engine_env, tokenizer, pair, labels, label_column):
    df, sha = frame(), "0" * 64

    def run(data=df, max_length=12, sha256=sha, tok=tokenizer):
        return tokenize(tok, data, "text", pair, label_column, labels, max_length, sha256)

    uncached = run(sha256=None)
    first, second = run(), run()
    assert not uncached.from_cache and not first.from_cache and second.from_cache
    for ds in (first, second):
        assert ds.encodings == uncached.encodings and ds.labels == uncached.labels
        assert ds.lengths.tolist() == uncached.lengths.tolist()
    assert len(list((engine_env / "cache" / "tokenized" / sha).glob("*.safetensors"))) == 1

    # Anything that changes the encodings misses the cache: the texts, max_length, the tokenizer.
    assert not run(data=df.iloc[1:]).from_cache
    assert not run(max_length=13).from_cache
    changed = tokenizer.__class__.from_pretrained(tokenizer.name_or_path, do_lower_case=False)
    assert not run(tok=changed).from_cache
    # A damaged cache file is ignored and replaced.
    for f in (engine_env / "cache" / "tokenized" / sha).glob("*.safetensors"):
        f.write_bytes(b"not safetensors")
    assert not run().from_cache and run().from_cache


def test_a_full_disk_costs_the_tokenization_cache_not_the_job(engine_env, tokenizer, monkeypatch):
    """safetensors raises its own ``SafetensorError`` for a full disk, not an ``OSError``: a full
    cache folder failed every training job (four attempts, then ``too_many_restarts``)."""
    from safetensors import SafetensorError

    from worker import data

    def full(arrays, path):
        path.write_bytes(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(data, "save_file", full)
    df = frame(n=12)
    tokenized = tokenize(tokenizer, df, "text", None, "label", ["a", "b"], 12, "1" * 64)
    assert len(tokenized.encodings["input_ids"]) == 12
    assert list((engine_env / "cache" / "tokenized").rglob("*")) == [engine_env / "cache" / "tokenized" / ("1" * 64)]


def test_a_directory_whose_write_fails_leaves_no_part_and_the_old_one_whole(tmp_path):
    """A full disk kept a failed job's half-written weights (42 MB) in ``.model.tmp``, and the disk
    full, until the job was deleted."""
    from worker.training.files import write_atomically

    final = tmp_path / "model"
    write_atomically(final, lambda d: (d / "weights").write_bytes(b"old"))

    def fails(d):
        (d / "weights").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(final, fails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and (final / "weights").read_bytes() == b"old"


@pytest.mark.parametrize("sizes", [[0, 1, 511, 512, 513], [10_000], [3 * 1024 * 1024 + 7]])
def test_tar_stream_is_a_standard_tar_of_the_announced_size(tmp_path, sizes):
    files = {}
    for i, size in enumerate(sizes):
        name = f"file-{i}" + ("-long" * 30 if i == 1 else "") + ".bin"  # one name past ustar's 100 bytes
        (tmp_path / name).write_bytes(bytes([i % 251]) * size)
        files[name] = tmp_path / name
    stream = artifacts.TarStream(files)
    data = b"".join(stream)
    assert len(data) == stream.size == artifacts.tar_size({n: p.stat().st_size for n, p in files.items()})
    assert artifacts.listing(files)["model.tar"] == stream.size
    assert collect(artifacts.TarStream(files)) == data  # the API's way (async, files read in a thread)

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == list(files)
        for name, path in files.items():
            assert tar.extractfile(name).read() == path.read_bytes()
    if shutil.which("tar"):  # GNU tar reads it too, without a warning
        (tmp_path / "out.tar").write_bytes(data)
        listed = subprocess.run(["tar", "-tf", str(tmp_path / "out.tar")], capture_output=True, text=True, check=True)
        assert listed.stdout.split() == list(files) and listed.stderr == ""


def test_tar_stream_sends_a_file_deleted_after_it_was_opened(tmp_path):
    (tmp_path / "weights").write_bytes(b"w" * 5000)
    stream = artifacts.TarStream({"weights": tmp_path / "weights"})
    (tmp_path / "weights").unlink()  # e.g. a checkpoint rotated away during the download
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        assert tar.extractfile("weights").read() == b"w" * 5000


def test_manifest_lists_every_file_and_catches_a_change(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 1000)
    manifest = artifacts.write_manifest(tmp_path)
    assert [f["name"] for f in manifest["files"]] == ["config.json", "model.safetensors"]
    assert manifest["files"][1]["bytes"] == 1000
    assert verify_manifest(tmp_path) == []
    (tmp_path / "model.safetensors").write_bytes(b"\x01" * 1000)  # same size, other content
    assert verify_manifest(tmp_path) == ["model.safetensors"]


def test_phase_timer_counts_nested_phases_once():
    class Reporter:
        def __init__(self):
            self.reports = []

        def progress(self, **fields):
            self.reports.append(fields["timings"])

    reporter = Reporter()
    timer = PhaseTimer(reporter, queued=1.5)
    started = time.perf_counter()
    with timer.phase("train"):
        time.sleep(0.05)
        with timer.phase("evaluate"):
            time.sleep(0.05)
            with timer.phase("save"):
                time.sleep(0.05)
        time.sleep(0.05)
    wall = time.perf_counter() - started
    t = timer.timings()
    assert t["queued"] == 1.5 and t["load"] == t["tokenize"] == t["warmup"] == 0
    assert t["evaluate"] >= 0.05 and t["save"] >= 0.05 and t["train"] >= 0.1
    assert t["train"] + t["evaluate"] + t["save"] == pytest.approx(wall, abs=0.003)  # each second counted once
    assert [r["save"] > 0 for r in reporter.reports] == [True, True, True]  # reported at each phase's end
    assert reporter.reports[-1] == t


def test_weights_are_written_once_per_step_and_the_artifact_links_the_best(engine_env, monkeypatch):
    import torch

    scripted = itertools.chain([1.0, 0.5], itertools.count(0.7, 0.1))  # every 2 steps and at the end: best at step 4
    monkeypatch.setattr(
        Recipe, "evaluate", lambda run, reporter=None: {"loss": next(scripted), "accuracy": 0.5, "f1_macro": 0.5}
    )
    job, data = make_job("linked", epochs=2, eval_every_steps=2, save_every_steps=2)
    reporter = RecordingReporter()
    run = Recipe(job, torch.device("cpu")).setup(data, reporter)
    run.warm_up(reporter)
    assert run.train(reporter) == "completed" and run.state.step == run.job_setup.total_steps >= 8
    model_dir = run.finish(reporter)

    best = inode(run.job_setup.out_dir / "best" / "model.safetensors")
    total = run.job_setup.total_steps
    assert [step for step, _ in reporter.checkpoints] == list(range(2, total, 2))  # none after the last
    assert inode(run.job_setup.out_dir / "step-00000004" / "model.safetensors") == best  # evaluated best at step 4
    assert inode(run.job_setup.out_dir / "step-00000002" / "model.safetensors") != best
    assert inode(model_dir / "model.safetensors") == best  # the artifact is the best model, not a copy
    assert verify_manifest(model_dir) == []
    assert json.loads((model_dir / "metrics.json").read_text())["best_step"] == 4


def test_a_transient_jobs_artifact_has_its_curves_without_a_database(engine_env, monkeypatch):
    """A job outside the store, as the benchmarks run one (``MemoryReporter``): the training curves
    and TensorBoard files are drawn from the metrics its reporter logged, and no database is opened
    (the store's ``job_metrics`` was read, and failed with no such table, where there was none)."""
    import torch

    from shared.store import engine

    def no_database():
        raise AssertionError("a transient job reached the job store")

    monkeypatch.setattr(engine, "get_engine", no_database)
    job, data = make_job("transient", epochs=1)
    reporter = RecordingReporter()
    run = Recipe(job, torch.device("cpu")).setup(data, reporter)
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    model_dir = run.finish(reporter)

    assert (model_dir / "training_curves.png").read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in (model_dir / "runs").iterdir()][0].startswith("events.out.tfevents.")
    assert not list(engine_env.glob("*.db"))


def inode(path) -> int:
    return path.stat().st_ino


@pytest.mark.parametrize("validation", [True, False])
def test_the_final_weights_are_written_and_hashed_beside_the_final_evaluation(engine_env, monkeypatch, validation):
    """When the final evaluation is the best (or there is none), the artifact links the final
    weights that a thread wrote and hashed while the evaluation ran: written once, read for hashing
    once and off the main thread, each manifest hash the file's; the model loads with transformers."""
    import threading

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from shared.store import manifest

    losses = itertools.count(1.0, -0.1)  # every evaluation is the best so far
    monkeypatch.setattr(
        Recipe, "evaluate", lambda run, reporter=None: {"loss": next(losses), "accuracy": 0.5, "f1_macro": 0.5}
    )
    hashed = []
    monkeypatch.setattr(
        manifest,
        "sha256_of",
        lambda path: hashed.append((path.name, threading.current_thread().name)) or sha256_of(path),
    )
    job, data = make_job("final", epochs=2)
    data = data if validation else type(data)(data.train, None)
    reporter = RecordingReporter()
    run = Recipe(job, torch.device("cpu")).setup(data, reporter)
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    final_weights = {k: v.clone() for k, v in run.model.state_dict().items()}
    model_dir = run.finish(reporter)

    total = run.job_setup.total_steps
    assert list(reporter.series("eval_loss")) == ([total // 2, total] if validation else [])
    assert inode(model_dir / "model.safetensors") == inode(run.job_setup.out_dir / "final" / "model.safetensors")
    [(_, thread)] = [h for h in hashed if h[0] == "model.safetensors"]
    assert thread.startswith("final-weights")
    assert verify_manifest(model_dir) == []  # each hash in the manifest is the file's on disk
    saved = load_file(model_dir / "model.safetensors")
    assert saved.keys() == final_weights.keys() and all(torch.equal(saved[k], final_weights[k]) for k in saved)
    assert AutoModelForSequenceClassification.from_pretrained(model_dir).num_labels == 2
