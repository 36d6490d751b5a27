"""Smoke test of the training benchmark (``bench/train.py``): the plan section on ragged lengths,
then the whole harness for a couple of steps on a tiny BERT built at test time. It checks what the
harness computes and writes, never how fast anything ran."""

import json

import numpy as np
import pytest

from bench import train as bench
from shared.settings import get_settings


@pytest.fixture
def tiny_models(models_dir, monkeypatch):
    monkeypatch.setenv("TUNEJOB_MODELS_DIR", str(models_dir))
    get_settings.cache_clear()
    yield models_dir
    monkeypatch.undo()
    get_settings.cache_clear()


def test_plan_section_on_ragged_lengths():
    lengths = np.random.default_rng(0).integers(5, 120, size=300)
    rows = bench.plan_rows("ragged", lengths, 16, 128, epochs=3)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"fixed", "dynamic", "smart", "token_budget", "trainer"}
    for r in rows:
        assert 0 < r["efficiency_rounded"] <= r["efficiency_unrounded"] <= 1
    assert by["fixed"]["efficiency_unrounded"] == pytest.approx(lengths.mean() / 128)
    # Length grouping pads far less than a random permutation; the plan's strategies at least as
    # well as the Trainer's mega-batch sort.
    assert by["smart"]["efficiency_unrounded"] > by["dynamic"]["efficiency_unrounded"] + 0.2
    assert by["token_budget"]["efficiency_unrounded"] > by["dynamic"]["efficiency_unrounded"] + 0.2
    assert by["smart"]["efficiency_unrounded"] >= by["trainer"]["efficiency_unrounded"]
    # The composition of smart batches changes between epochs, and a token budget of
    # batch_size x mean length gives about batch_size examples per micro-batch.
    assert by["smart"]["changed_batches"] > 0 and by["smart"]["pairs_kept"] < 1
    assert by["token_budget"]["max_tokens_per_batch"] == round(16 * lengths.mean())
    assert by["token_budget"]["examples_per_batch"] == pytest.approx(16, rel=0.25)


def test_markdown_sections_are_replaced_in_place(tmp_path):
    md = tmp_path / "b.md"
    md.write_text("intro\n\n<!-- bench:plan -->\nold table\n<!-- /bench:plan -->\n\ntrailer\n")
    assert bench.update_markdown(md, {"plan": "new table", "timing": "timing table"}) == ["plan", "timing"]
    text = md.read_text()
    assert "old table" not in text and "new table" in text
    assert text.startswith("intro") and "trailer" in text
    assert "<!-- bench:timing -->\ntiming table\n<!-- /bench:timing -->" in text
    # Tagged runs (e.g. --tag bf16) only fill sections the document already has.
    assert bench.update_markdown(md, {"plan-bf16": "x", "timing": "again"}, append_missing=False) == ["timing"]
    assert "plan-bf16" not in md.read_text()


def test_harness_runs_engine_and_trainer(tiny_models, tmp_path):
    out, md = tmp_path / "results.json", tmp_path / "bench.md"
    rc = bench.main([
        "--model", "tiny-bert", "--dataset", "rotten_tomatoes", "--train-size", "64", "--val-size", "32",
        "--batch-sizes", "8", "--max-length", "64", "--steps", "2", "--warmup", "1", "--repeats", "1",
        "--configs", "fixed,smart,trainer", "--pad-to-multiple-of", "1", "--plan-epochs", "2", "--device", "cpu",
        "--accuracy", "--accuracy-batch-size", "8", "--json", str(out), "--markdown", str(md),
    ])
    assert rc == 0
    results = json.loads(out.read_text())

    plan = {r["strategy"]: r for r in results["plan"]}
    assert set(plan) == {"fixed", "dynamic", "smart", "token_budget", "trainer"}
    assert plan["smart"]["efficiency_unrounded"] > plan["dynamic"]["efficiency_unrounded"]

    timing = {r["config"]: r for r in results["timing"]}
    assert set(timing) == {"fixed", "smart", "trainer"}
    for r in timing.values():
        assert r["steps"] == 2 and r["tokens_per_second"] > 0 and r["seconds_per_step"] > 0
        assert r["epoch_seconds"] > 0 and r["vs_trainer"] > 0
        # Each window trained exactly the sampled batches (engine plan or Trainer sampler).
        assert r["counted_as_expected"]
    for name in ("fixed", "smart"):
        # The engine's own token accounting equals what the model was fed (counted by a hook).
        assert timing[name]["hook_matches_engine"]
    assert timing["fixed"]["efficiency_unrounded"] == timing["fixed"]["efficiency_rounded"] < 1
    assert timing["smart"]["efficiency_unrounded"] > timing["fixed"]["efficiency_unrounded"]
    assert timing["smart"]["token_bound"] > 1
    assert timing["trainer"]["efficiency_rounded"] <= timing["trainer"]["efficiency_unrounded"]
    # Every configuration's epoch holds each training text once: the same real tokens for all.
    raw = results["raw"]["rotten_tomatoes b8"]
    assert len({m["epoch_real_tokens"] for ms in raw.values() for m in ms}) == 1
    assert all(r["window_tokens_per_second"] > 0 for r in timing.values())
    trainer_windows = raw["trainer"]
    assert all(m["padded"] % 8 == 0 and m["real"] > 0 for m in trainer_windows)  # pad_to_multiple_of=8

    accuracy = {r["config"]: r for r in results["accuracy"]}
    assert set(accuracy) == {"fixed", "smart", "trainer"}
    for r in accuracy.values():
        assert 0 <= r["accuracy"] <= 1 and r["val_examples"] == 32 and r["steps"] >= 8

    text = md.read_text()
    for section in ("plan", "timing", "accuracy", "targets"):
        assert f"<!-- bench:{section} -->" in text and f"<!-- /bench:{section} -->" in text
    assert "| trainer |" in text and "| smart |" in text
