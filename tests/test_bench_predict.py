"""The prediction benchmark's pieces (``bench.predict``): configuration names, and the summary the
table rests on (label agreement with the pipeline, held-out accuracy, medians). Never how fast
anything ran."""

import pytest

from bench.predict import (
    config_options,
    corpus_texts,
    job_ratio,
    job_texts,
    percentile,
    short_texts,
    summarize,
)


def test_configuration_names():
    assert config_options("pipeline") == ("pipeline", {})
    assert config_options("tunejob:precision=bf16:max_tokens=2048") == (
        "tunejob",
        {"precision": "bf16", "max_tokens": 2048},
    )
    for bad in ("trainer", "pipeline:max_tokens=1", "tunejob:batch_size=8", "tunejob:precision"):
        with pytest.raises(ValueError):
            config_options(bad)


def test_summary_compares_labels_with_the_pipeline_and_scores_the_held_out_split():
    _, gold, held_out = corpus_texts("rotten_tomatoes")
    flipped = list(gold)
    flipped[held_out[0]] = "fresh" if gold[held_out[0]] == "rotten" else "rotten"
    counts = {"tokens": 90, "padded_tokens": 100}
    rows = [
        {
            "config": "pipeline",
            "labels": gold,
            "rows_per_second": 10.0,
            "load_seconds": 1,
            "predict_seconds": 5,
            "load_average": 1.0,
        },
        {
            "config": "tunejob",
            "labels": flipped,
            "rows_per_second": 30.0,
            "load_seconds": 1,
            "predict_seconds": 2,
            "load_average": 1.0,
            **counts,
        },
        {
            "config": "tunejob",
            "labels": flipped,
            "rows_per_second": 20.0,
            "load_seconds": 1,
            "predict_seconds": 3,
            "load_average": 2.0,
            **counts,
        },
    ]
    pipeline, ours = summarize(rows, "rotten_tomatoes")
    assert pipeline["accuracy"] == pipeline["same_labels"] == 1.0 and pipeline["speedup"] == 1.0
    assert ours["runs"] == 2 and ours["rows_per_s"] == 25.0 and ours["speedup"] == 2.5
    assert ours["same_labels"] == pytest.approx(1 - 1 / len(gold))
    assert ours["accuracy"] == pytest.approx(1 - 1 / len(held_out))
    assert ours["real_per_computed"] == "0.90" and ours["load_averages"] == "1.0, 2.0"


def test_percentile_is_the_nearest_rank():
    values = list(range(1, 101))
    assert (percentile(values, 0.5), percentile(values, 0.99), percentile([7.0], 0.99)) == (50, 99, 7.0)


def test_short_texts_are_short_and_the_same_for_a_seed():
    texts = short_texts(500)
    assert texts == short_texts(500) and texts != short_texts(500, seed=1)
    assert all(3 <= len(t.split()) <= 12 for t in texts) and len(set(texts)) > 400


def test_job_texts_repeat_the_corpus_in_order():
    texts, _, _ = corpus_texts("rotten_tomatoes")
    rows = job_texts("rotten_tomatoes", len(texts) + 2)
    assert rows[: len(texts)] == texts and rows[-2:] == texts[:2]
    assert job_texts("short", 3) == short_texts(3)


def test_job_target_is_one_point_three_times_the_loop_plus_two_seconds():
    assert job_ratio(15.0, 10.0) == {"ratio": 1.5, "limit_s": 15.0, "met": True}
    assert job_ratio(15.1, 10.0)["met"] is False
