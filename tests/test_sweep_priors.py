"""Issue 38's sweep set-up, on every stack, without a worker (nothing here needs a trial to train):
the default trial (``include_defaults``), the search space's priors per model size, warm starts
from earlier sweeps, and the sweep's time budget, with their bad input (a 4xx, nothing queued)."""

import argparse
import json
import re

import optuna
import pytest
from rich.console import Console

from tests.test_sweep_hardening import body, client, dataset, refused  # noqa: F401 (fixtures)


def trials(api, sweep_id: str) -> list[dict]:
    r = api.get(f"/sweeps/{sweep_id}/trials")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def created(api, sweep: dict) -> dict:
    r = api.post("/sweeps", json=sweep)
    assert r.status_code == 201, r.text
    return r.json()


# ----------------------------------------------------------------------------- 1: the default trial


def test_trial_0_runs_the_fixed_hyperparameters_and_is_marked(client, dataset):  # noqa: F811
    space = {
        "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
        "batch_size": {"type": "categorical", "choices": [4, 8, 16]},
        "warmup_ratio": {"type": "float", "low": 0.2, "high": 0.5},
    }  # the default 0.1 lies below
    sweep = created(client, body(dataset["id"], search_space=space, max_trials=3, max_parallel_trials=2, seed=3))
    first, second = trials(client, sweep["id"])
    # The spec's batch_size (8), tunejob's default learning rate (5e-5); warmup_ratio taken into its range.
    assert first["params"] == {"learning_rate": 5e-5, "batch_size": 8, "warmup_ratio": 0.2}, first
    assert first["default"] is True and second["default"] is False
    assert second["params"] != first["params"]
    job = client.get(f"/jobs/{first['job_id']}").json()
    assert (job["hyperparameters"]["learning_rate"], job["hyperparameters"]["batch_size"]) == (5e-5, 8)
    shown = client.get(f"/sweeps/{sweep['id']}").json()
    assert shown["default_trial"]["number"] == 0 and shown["default_trial"]["job_id"] == first["job_id"], shown

    # The dry run shows it first too.
    plan = client.post("/sweeps", json=body(dataset["id"], search_space=space), params={"dry_run": "true"}).json()
    assert plan["first_trials"][0] == first["params"]

    # The CLI marks it.
    from client.sweeps import trials_table
    from shared.schemas.sweeps import SweepOut, TrialOut

    out = Console(record=True, width=200)
    out.print(trials_table([TrialOut.model_validate(t) for t in (first, second)], SweepOut.model_validate(shown)))
    text = out.export_text()
    rows = [line for line in text.splitlines() if "job_" in line]
    assert rows[0].startswith("│ 0 ") and "#0: the default hyperparameters" in text, rows


def test_include_defaults_false_asks_the_sampler_from_trial_0(client, dataset):  # noqa: F811
    space = {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True}}
    sweep = created(client, body(dataset["id"], search_space=space, include_defaults=False, seed=3))
    (first,) = trials(client, sweep["id"])
    assert first["default"] is False and first["params"]["learning_rate"] != 5e-5
    assert client.get(f"/sweeps/{sweep['id']}").json()["default_trial"] is None


def test_a_grid_holds_its_points_and_the_default_trial(client, dataset):  # noqa: F811
    space = {"batch_size": {"type": "categorical", "choices": [4, 8]}}
    r = client.post(
        "/sweeps",
        json=body(dataset["id"], algorithm="grid", search_space=space, max_trials=3),
        params={"dry_run": "true"},
    )
    assert r.status_code == 200, r.text
    refused(
        client,
        body(dataset["id"], algorithm="grid", search_space=space, max_trials=3, include_defaults=False),
        422,
        "grid_too_small",
        "max_trials",
    )


@pytest.mark.parametrize(
    "fixed,space,expected",
    [
        ({}, {"epochs": {"type": "int", "low": 1, "high": 2}}, {"epochs": 2}),  # default 3.0, above the range
        ({}, {"epochs": {"type": "categorical", "choices": [2, 3, 4]}}, {"epochs": 3}),
        ({}, {"warmup_ratio": {"type": "float", "low": 0.0, "high": 0.32, "step": 0.04}}, {"warmup_ratio": 0.08}),
        ({}, {"eval_every_steps": {"type": "int", "low": 5, "high": 50}}, {"eval_every_steps": 5}),  # default null
        (
            {"gradient_checkpointing": False},
            {"gradient_checkpointing": {"type": "categorical", "choices": [True, False]}},
            {"gradient_checkpointing": False},
        ),
    ],
)
def test_default_params_lie_in_their_ranges(fixed, space, expected):
    from shared.jobs.search import default_params
    from shared.jobs.search_space import distributions
    from shared.schemas.sweeps import SweepCreate

    spec = SweepCreate.model_validate(body("ds_x", search_space=space, hyperparameters=fixed))
    params = default_params(spec, distributions(spec))
    assert params == expected and [type(v) for v in params.values()] == [type(v) for v in expected.values()]


# ----------------------------------------------------------------------------- 2: priors


@pytest.mark.parametrize(
    "task,given,tuned",
    [
        ("multi_label", {}, True),  # at the fixed 0.5 short trials all scored micro-F1 0
        ("multi_label", {"tune_threshold": False}, False),
        ("multi_label", {"decision_threshold": 0.3}, False),
        ("multi_label", {"validation_split": 0}, False),  # no validation set to tune it on (it was a 500)
        ("classification", {}, False),
    ],
)
def test_a_multi_label_sweep_tunes_its_trials_threshold_unless_the_spec_sets_one(task, given, tuned):
    from shared.jobs.search import trial_template
    from shared.schemas.sweeps import SweepCreate

    objective = {"metric": "f1_micro" if task == "multi_label" else "accuracy"}
    spec = SweepCreate.model_validate(body("ds_x", task=task, objective=objective, **given))
    assert spec.tune_threshold is tuned and trial_template(spec).tune_threshold is tuned
    stored = SweepCreate.model_validate(spec.model_dump(mode="json"), strict=False)  # as spec_of reads it back
    assert stored.tune_threshold is tuned


def test_a_searched_base_models_hugging_face_id_is_stored_by_tunejobs_name():
    """A trial of ``sentence-transformers/all-MiniLM-L6-v2`` stored the id, where a job stores
    ``all-MiniLM-L6-v2``: a warm start naming the model by its name dropped that history."""
    from shared.schemas.sweeps import SweepCreate

    space = {
        "base_model": {
            "type": "categorical",
            "choices": ["sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2", "x"],
        }
    }
    spec = SweepCreate.model_validate(
        body("ds_x", base_model="sentence-transformers/all-MiniLM-L6-v2", search_space=space)
    )
    assert spec.base_model == "all-MiniLM-L6-v2" and spec.search_space["base_model"].choices == [
        "all-MiniLM-L6-v2",
        "x",
    ]


def test_ranges_left_out_take_the_prior_of_the_models_size(client, dataset):  # noqa: F811
    space = {
        "learning_rate": {},
        "batch_size": {},
        "warmup_ratio": {"type": "float"},
        "weight_decay": {},
        "epochs": {},
        "max_length": {"type": "categorical", "choices": [16, 32]},
    }
    fixed = {"max_length": 32}  # tunejob's defaults for the rest: every prior holds them
    r = client.post(
        "/sweeps", json=body(dataset["id"], search_space=space, hyperparameters=fixed), params={"dry_run": "true"}
    )
    assert r.status_code == 200, r.text
    plan = r.json()

    # The ranges as understood, in a request's form (they were Optuna's reprs, "FloatDistribution(high=...)"):
    def d(kind: str, low=None, high=None, log=False, step=None, choices=None) -> dict:
        return {"type": kind, "low": low, "high": high, "log": log, "step": step, "choices": choices}

    assert plan["search_space"] == {
        "learning_rate": d("float", 3e-5, 3e-4, log=True),
        "batch_size": d("categorical", choices=[16, 32]),
        "warmup_ratio": d("float", 0.0, 0.1),
        "weight_decay": d("float", 0.0, 0.1),
        "epochs": d("int", 2, 5, step=1),
        "max_length": d("categorical", choices=[16, 32]),
    }
    # a request takes them back as they are;
    again = client.post(
        "/sweeps",
        json=body(dataset["id"], search_space=plan["search_space"], hyperparameters=fixed),
        params={"dry_run": "true"},
    )
    assert again.status_code == 200 and again.json()["search_space"] == plan["search_space"], again.text
    # the CLI prints them one a line, readably.
    from client.display import show_plan
    from client.sweeps import sweep_plan_table

    out = Console(record=True, width=200)
    show_plan(out, argparse.Namespace(json=False), plan, sweep_plan_table("smart"))
    lines = [line.strip() for line in out.export_text().splitlines()]
    for shown in (
        "learning_rate  3e-05 .. 0.0003 (log)",
        "batch_size     one of 16, 32",
        "warmup_ratio   0 .. 0.1",
        "epochs         2 .. 5 (int)",
    ):
        assert any(line.endswith(shown) for line in lines), (shown, lines)
    # The default trial is tunejob's default job exactly.
    assert plan["first_trials"][0] == {
        "learning_rate": 5e-5,
        "batch_size": 16,
        "warmup_ratio": 0.1,
        "weight_decay": 0.01,
        "epochs": 3,
        "max_length": 32,
    }
    sweep = created(client, body(dataset["id"], search_space=space, hyperparameters=fixed))
    assert trials(client, sweep["id"])[0]["params"] == plan["first_trials"][0]
    # GET /sweeps/{id} says what the sweep searches: the ranges stored, priors filled in, as the dry run's.
    assert sweep["search_space"] == client.get(f"/sweeps/{sweep['id']}").json()["search_space"] == plan["search_space"]


@pytest.mark.parametrize(
    "count,size,lr",
    [(22_713_728, "small", (3e-5, 3e-4)), (110e6, "base", (1e-5, 1e-4)), (355e6, "large", (5e-6, 5e-5))],
)
def test_the_size_is_the_models_parameter_count(monkeypatch, models_dir, count, size, lr):
    from shared.jobs import priors
    from shared.schemas.sweeps import SweepCreate

    monkeypatch.setenv("TUNEJOB_MODELS_DIR", str(models_dir))
    if size == "small":  # the built-in MiniLM-L6, counted from its file
        assert priors.parameter_count("all-MiniLM-L6-v2") == count
    monkeypatch.setattr(priors, "parameter_count", lambda name: count)
    spec = priors.fill(SweepCreate.model_validate(body("ds_x", search_space={"learning_rate": {}})))
    assert priors.model_size("x") == size
    assert (spec.search_space["learning_rate"].low, spec.search_space["learning_rate"].high) == lr


BAD_PRIORS = [
    ({"seed": {}}, "search_space.seed.type"),  # no prior for it
    ({"learning_rate": {"low": 1e-5}}, "search_space.learning_rate.type"),  # a bound given: not filled
    ({"batch_size": {"type": "int"}}, "search_space.batch_size"),  # not the prior's type: low and high needed
]


def test_a_sweep_without_ranges_or_objective_searches_the_priors_the_spec_leaves_out(client, dataset):  # noqa: F811
    """``tunejob sweeps create --model M --dataset D`` was a 422 ("search_space: Field required",
    then "objective (or objectives) is required"): with neither, tunejob searches its priors'
    hyperparameters that ``hyperparameters`` does not fix, for the jobs' own best metric (as
    ``Trainer.hyperparameter_search`` searches a default space)."""
    sweep = body(dataset["id"], hyperparameters={"epochs": 1, "max_length": 32})
    del sweep["search_space"], sweep["objective"]
    r = client.post("/sweeps", json=sweep, params={"dry_run": "true"})
    assert r.status_code == 200, r.text
    assert list(r.json()["search_space"]) == ["learning_rate", "batch_size", "warmup_ratio", "weight_decay"]
    assert r.json()["objective"] == {"metric": "loss", "direction": "minimize"}
    assert client.post("/sweeps", json={**sweep, "search_space": {}}, params={"dry_run": "true"}).json() == r.json()
    every = {"learning_rate": 1e-4, "batch_size": 8, "warmup_ratio": 0.0, "weight_decay": 0.0, "epochs": 1}
    error = refused(client, {**sweep, "hyperparameters": every}, 422, "invalid_search_space", "search_space")
    assert "name the ranges to search" in error["message"]


@pytest.mark.parametrize("space,param", BAD_PRIORS, ids=[p for _, p in BAD_PRIORS])
def test_a_range_tunejob_cannot_fill_is_refused(client, dataset, space, param):  # noqa: F811
    refused(client, body(dataset["id"], search_space=space), 422, "invalid_search_space", param)


def test_tpe_start_up_trials_scale_with_max_trials():
    from shared.jobs.search import sampler
    from shared.schemas.sweeps import SweepCreate

    for max_trials, startup in [(1, 2), (12, 3), (20, 5), (200, 10)]:
        spec = SweepCreate.model_validate(body("ds_x", algorithm="tpe", max_trials=max_trials))
        assert sampler(spec, 0)._n_startup_trials == startup  # no public accessor


# ----------------------------------------------------------------------------- 3: warm starts


def start(job_id: str, total_steps: int) -> None:
    """Trial ``job_id`` running, its schedule ``total_steps`` optimizer steps (as the worker reports
    before its first step)."""
    from shared.store.engine import session_scope
    from shared.store.rows import Job

    with session_scope() as s:
        job = s.get(Job, job_id)
        job.status, job.total_steps = "running", total_steps


def finish(
    job_id: str, status: str, curve: dict[int, float], latency: float | None = None, total_steps: int | None = None
) -> None:
    """End trial ``job_id`` with ``status`` and ``eval_accuracy`` ``curve`` (step -> value), as a
    worker would; with ``latency``, its ``eval_latency_ms`` at the last step (``worker.latency``).
    Its schedule: ``total_steps`` (default: the curve's last step)."""
    from shared.store.engine import session_scope
    from shared.store.rows import Job, JobMetric, utcnow

    points = [("eval_accuracy", step, value) for step, value in curve.items()]
    points += [("eval_latency_ms", max(curve), latency)] if latency is not None else []
    with session_scope() as s:
        job = s.get(Job, job_id)
        job.status, job.finished_at, job.total_steps = status, utcnow(), total_steps or max(curve)
        s.add_all(
            JobMetric(job_id=job_id, step=step, epoch=0.0, name=name, value=value) for name, step, value in points
        )


def edit_sweep(sweep_id: str, tenant: str | None = None, **spec) -> None:
    from shared.store.engine import session_scope
    from shared.store.rows import Sweep

    with session_scope() as s:
        sweep = s.get(Sweep, sweep_id)
        sweep.spec = {**sweep.spec, **spec}
        sweep.tenant = tenant or sweep.tenant


def test_a_warm_start_brings_finished_trials_as_history_for_the_pruner(client, dataset):  # noqa: F811
    from shared.jobs.sweeps import should_prune

    source = created(client, body(dataset["id"], max_trials=3, max_parallel_trials=3))
    done, pruned, cancelled = trials(client, source["id"])
    finish(done["job_id"], "succeeded", {2: 0.6, 4: 0.8})
    finish(pruned["job_id"], "pruned", {2: 0.3}, total_steps=4)
    finish(cancelled["job_id"], "cancelled", {2: 0.9})  # not finished well: no history
    median = {"early_stopping": {"type": "median", "min_trials": 1}}

    sweep = created(client, body(dataset["id"], warm_start_from=[source["id"]], max_trials=1, **median))
    assert sweep["history"] == {
        "sweeps": [source["id"]],
        "trials": 2,
        "best": {"job_id": done["job_id"], "trial_number": 0, "params": done["params"], "value": 0.8},
    }, sweep
    assert sweep["trials"]["queued"] == 1 and sweep["max_trials"] == 1  # history is no trial of this sweep
    (first,) = trials(client, sweep["id"])
    assert first["number"] == 0 and first["default"] is True
    # The pruner compares with the history's curves: 0.1 at step 2 of 4 is below the median there
    # (0.6); the default trial is never pruned.
    start(first["job_id"], 4)
    assert should_prune(first["job_id"], 2, {"accuracy": 0.1}) is False
    searched = created(client, body(dataset["id"], warm_start_from=[source["id"]], include_defaults=False, **median))
    (asked,) = trials(client, searched["id"])
    start(asked["job_id"], 4)
    assert should_prune(asked["job_id"], 2, {"accuracy": 0.1}) is True
    alone = created(client, body(dataset["id"], max_trials=1, include_defaults=False, **median))
    start(trials(client, alone["id"])[0]["job_id"], 4)
    assert should_prune(trials(client, alone["id"])[0]["job_id"], 2, {"accuracy": 0.1}) is False

    # The CLI shows the history, greyed.
    from client.sweeps import sweep_table
    from shared.schemas.sweeps import SweepOut

    out = Console(record=True, width=200)
    out.print(sweep_table(SweepOut.model_validate(sweep)))
    assert f"2 trials of {source['id']}, best 0.8 ({done['job_id']})" in out.export_text()
    # A history trial outside the new space is left out.
    narrow = {"learning_rate": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}}
    outside = done["params"]["learning_rate"] < 1e-3
    r = client.post("/sweeps", json=body(dataset["id"], warm_start_from=[source["id"]], search_space=narrow))
    assert r.status_code == 201 and r.json()["history"]["trials"] == 2 - outside, r.text


def test_trials_are_compared_at_the_same_point_of_their_schedules(client, dataset):  # noqa: F811
    """Each trial's learning rate decays over its own schedule, so the pruner compares trials at the
    same fraction of their ``total_steps``, not at the same optimizer step (issue 38's sweep, step
    251: a 3-epoch trial's first epoch 0.764, a 1-epoch trial's last 0.8085; the 3-epoch defaults
    ended best). A trial of 18 steps at step 6 meets the other 18-step trial's first third (0.6),
    not the 6-step trial's end (0.8, which made the median at step 6 0.7). Its last evaluation is
    never pruned; ``min_steps`` counts its own optimizer steps."""
    from shared.jobs.sweeps import should_prune

    median = {"early_stopping": {"type": "median", "min_trials": 1}}
    sweep = created(client, body(dataset["id"], max_trials=3, max_parallel_trials=3, include_defaults=False, **median))
    short, long, new = trials(client, sweep["id"])
    finish(short["job_id"], "succeeded", {6: 0.8})
    finish(long["job_id"], "succeeded", {6: 0.6, 12: 0.75, 18: 0.85})
    start(new["job_id"], 18)
    assert should_prune(new["job_id"], 6, {"accuracy": 0.65}) is False
    assert should_prune(new["job_id"], 6, {"accuracy": 0.55}) is True
    assert should_prune(new["job_id"], 12, {"accuracy": 0.7}) is True  # below 0.75 at two thirds
    assert should_prune(new["job_id"], 18, {"accuracy": 0.1}) is False  # the end: stopping saves nothing

    edit_sweep(sweep["id"], early_stopping={**median["early_stopping"], "min_steps": 7})
    assert should_prune(new["job_id"], 6, {"accuracy": 0.55}) is False
    assert should_prune(new["job_id"], 12, {"accuracy": 0.7}) is True


def test_a_trials_value_leaves_out_the_zero_shot_evaluation(client, dataset):  # noqa: F811
    """An embedding job scores its base model at step 0 (``eval_*`` rows, the zero-shot figures),
    weights it never keeps: every embedding trial was worth at least the base model, and a
    sweep's best could be a figure no trial's model reached (0.9562 for models at 0.9558, 0.9482)."""
    sweep = created(client, body(dataset["id"], max_trials=2, max_parallel_trials=2, include_defaults=False))
    worse, better = trials(client, sweep["id"])
    finish(worse["job_id"], "succeeded", {0: 0.95, 5: 0.60, 10: 0.70})
    finish(better["job_id"], "succeeded", {0: 0.95, 5: 0.80, 10: 0.90})
    values = {t["job_id"]: t["value"] for t in trials(client, sweep["id"])}
    assert values == {worse["job_id"]: 0.70, better["job_id"]: 0.90}, values
    best = client.get(f"/sweeps/{sweep['id']}").json()["best_trial"]
    assert (best["job_id"], best["value"]) == (better["job_id"], 0.90), best


def test_the_report_draws_a_warm_starts_history_grey_and_off_the_best_line(client, dataset, monkeypatch):  # noqa: F811
    """``optimization_history.png`` draws the history's completed trials grey as "earlier sweeps",
    before trial 0; the best-so-far line is this sweep's own, as ``GET /sweeps/{id}``'s
    ``best_trial`` is, though the history holds a better value."""
    from shared.jobs import sweep_report

    source = created(client, body(dataset["id"], max_trials=2, max_parallel_trials=2))
    done, pruned = trials(client, source["id"])
    finish(done["job_id"], "succeeded", {2: 0.9})
    finish(pruned["job_id"], "pruned", {2: 0.3})  # no value: not drawn, as this sweep's pruned trials are not
    sweep = created(client, body(dataset["id"], warm_start_from=[source["id"]], max_trials=1))
    (own,) = trials(client, sweep["id"])
    finish(own["job_id"], "succeeded", {2: 0.6})
    drawn, real = [], sweep_report.drawing
    monkeypatch.setattr(sweep_report, "drawing", lambda *a: drawn.append(real(*a)) or drawn[-1])

    r = client.get(f"/sweeps/{sweep['id']}/report/optimization_history.png")
    assert r.status_code == 200 and r.content.startswith(b"\x89PNG"), r.text
    (axes,) = drawn[0].axes
    assert [t.get_text() for t in axes.get_legend().get_texts()] == ["earlier sweeps", "objective value", "best value"]
    grey, mine = axes.collections
    assert grey.get_offsets().tolist() == [[-1, 0.9]] and mine.get_offsets().tolist() == [[0, 0.6]]
    (best,) = axes.get_lines()
    assert list(best.get_ydata()) == [client.get(f"/sweeps/{sweep['id']}").json()["best_trial"]["value"]] == [0.6]


def test_the_pareto_picture_draws_a_warm_starts_history_grey_and_off_the_front():
    """The front (``Study.best_trials`` of this sweep's trials) stays this sweep's when an earlier
    sweep's trial beats them all; that trial is drawn grey as "earlier sweeps"."""
    from optuna.distributions import FloatDistribution

    from shared.jobs.sweep_report import drawing

    space = {"learning_rate": FloatDistribution(1e-5, 1e-2, log=True)}

    def trial(accuracy: float, latency: float) -> optuna.trial.FrozenTrial:
        return optuna.trial.create_trial(
            params={"learning_rate": 1e-3}, distributions=space, values=[accuracy, latency]
        )

    study = optuna.create_study(directions=["maximize", "minimize"])
    study.add_trials([trial(0.7, 10.0), trial(0.8, 20.0), trial(0.6, 30.0)])
    (axes,) = drawing(study, "pareto_front.png", ("accuracy", "latency_ms"), [trial(0.9, 5.0)]).axes
    legend = [t.get_text() for t in axes.get_legend().get_texts()]
    assert legend == ["earlier sweeps", "trial", "best trial (the front)"]
    grey, others, front = (c.get_offsets().tolist() for c in axes.collections)
    assert (grey, others, front) == ([[0.9, 5.0]], [[0.6, 30.0]], [[0.7, 10.0], [0.8, 20.0]])


def test_the_sweep_page_draws_a_warm_starts_succeeded_trials_apart(client, dataset, monkeypatch):  # noqa: F811
    """The sweep page's chart data holds the warm start's succeeded trials that its study holds
    (``history``: each one's sweep, number there, value, every objective's values and its
    parameters, for the parameter charts; not one
    without a latency, which the multi-objective study leaves out), in the history's order, at
    most TUNEJOB_MAX_TRIALS_PER_SWEEP of them; the front stays the sweep's own, though a history
    trial beats it on both objectives."""
    from fastapi.testclient import TestClient

    from shared.settings import get_settings
    from shared.store.keys import create_key
    from tests.conftest import BASE_URL
    from tests.test_ui import csrf_of

    both = {"objectives": [{"metric": "accuracy"}, {"metric": "latency_ms"}]}
    source = created(client, body(dataset["id"], max_trials=4, max_parallel_trials=4, **both))
    fast, pruned, unmeasured, slow = trials(client, source["id"])
    finish(fast["job_id"], "succeeded", {2: 0.9}, latency=5.0)
    finish(pruned["job_id"], "pruned", {2: 0.3})  # no value: not drawn, as the report leaves it
    finish(unmeasured["job_id"], "succeeded", {2: 0.7})  # no latency: not in the study's history
    finish(slow["job_id"], "succeeded", {2: 0.8}, latency=50.0)
    sweep = created(client, body(dataset["id"], warm_start_from=[source["id"]], max_trials=1, **both))
    (own,) = trials(client, sweep["id"])
    finish(own["job_id"], "succeeded", {2: 0.6}, latency=10.0)
    browser = TestClient(client.app, base_url=BASE_URL)
    key, _ = create_key("tenant-a")
    assert csrf_of(browser.post("/ui/login", data={"key": key}).text)  # signed in: the jobs page

    def chart() -> dict:
        page = browser.get(f"/ui/sweeps/{sweep['id']}").text
        return json.loads(re.search(r'<script type="application/json" id="chart-data">(.*?)</script>', page)[1])

    history = chart()["history"]
    assert [{k: v for k, v in h.items() if k != "params"} for h in history] == [
        {"sweep": source["id"], "number": 0, "value": 0.9, "values": [0.9, 5.0]},
        {"sweep": source["id"], "number": 3, "value": 0.8, "values": [0.8, 50.0]},
    ]
    assert [h["params"] for h in history] == [fast["params"], slow["params"]]
    assert chart()["front"] == [0]
    monkeypatch.setattr(get_settings(), "max_trials_per_sweep", 1)
    assert [h["number"] for h in chart()["history"]] == [0]


@pytest.mark.parametrize("mismatch", ["tenant", "task", "base_model", "missing"])
def test_a_warm_start_from_another_tenant_task_or_model_is_refused(client, dataset, mismatch):  # noqa: F811
    source = created(client, body(dataset["id"], max_trials=1))["id"]
    if mismatch == "tenant":
        edit_sweep(source, tenant="tenant-b")
    elif mismatch == "task":
        edit_sweep(source, task="multi_label")
    elif mismatch == "base_model":
        edit_sweep(source, base_model="all-MiniLM-L6-v2")
    else:
        source = "sweep_0000000000000000"
    error = refused(
        client, body(dataset["id"], warm_start_from=[source]), 422, "invalid_warm_start", "warm_start_from[0]"
    )
    assert source in error["message"] and (mismatch in ("tenant", "missing") or mismatch in error["message"]), error


# ----------------------------------------------------------------------------- 4: the budget


def backdate(sweep_id: str, seconds: float) -> None:
    """Move the sweep's creation ``seconds`` back: its budget is spent without waiting for it."""
    from datetime import timedelta

    from shared.store.engine import session_scope
    from shared.store.rows import Sweep

    with session_scope() as s:
        sweep = s.get(Sweep, sweep_id)
        sweep.created_at -= timedelta(seconds=seconds)


@pytest.mark.parametrize("succeeded", [True, False])
def test_a_spent_budget_ends_the_sweep_and_stops_its_trials(client, dataset, succeeded):  # noqa: F811
    from shared.jobs.sweeps import top_up_all
    from shared.store.engine import session_scope
    from shared.store.rows import Job

    sweep = created(client, body(dataset["id"], max_trials=4, max_parallel_trials=2, max_duration_seconds=60))
    first, second = trials(client, sweep["id"])
    if succeeded:
        finish(first["job_id"], "succeeded", {2: 0.7})
    with session_scope() as s:
        s.get(Job, second["job_id"]).status = "running"
    top_up_all()  # the recovery loop's chore, within the budget: the sweep goes on
    assert client.get(f"/sweeps/{sweep['id']}").json()["status"] in ("queued", "running")

    backdate(sweep["id"], 61)
    before = len(trials(client, sweep["id"]))
    top_up_all()  # the budget spent: the sweep ends, nothing more is asked
    ended = client.get(f"/sweeps/{sweep['id']}").json()
    assert ended["status"] == ("succeeded" if succeeded else "failed"), ended
    assert ended["error"]["code"] == "budget_spent" and "ended on its budget" in ended["error"]["message"], ended
    assert ended["best_trial"] == (
        {"job_id": first["job_id"], "trial_number": 0, "params": first["params"], "value": 0.7} if succeeded else None
    )
    assert len(trials(client, sweep["id"])) == before
    # The running trial is stopped as on cancel, and its event says why.
    running = client.get(f"/jobs/{second['job_id']}").json()
    events = client.get(f"/jobs/{second['job_id']}/events").json()["data"]
    assert running["status"] == "running" and any(
        e["code"] == "cancel_requested" and "ended on its budget" in e["message"] for e in events
    ), events


def test_a_budget_under_one_evaluations_time_is_refused(client, dataset):  # noqa: F811
    refused(client, body(dataset["id"], max_duration_seconds=59), 422, "budget_too_small", "max_duration_seconds")


def test_the_cli_sends_the_default_trial_warm_start_and_budget_options():
    import argparse

    from client import cli
    from client.sweeps import create_sweep

    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    args = parser.parse_args(
        [
            "sweeps",
            "create",
            "--model",
            "m",
            "--dataset",
            "ds_1",
            "--dry-run",
            "--json",
            "--warm-start",
            "sweep_a",
            "--warm-start",
            "sweep_b",
            "--no-defaults",
            "--max-duration",
            "120",
        ]
    )
    sent = []

    class Planner:
        def plan_sweep(self, spec):
            sent.append(spec)
            return {}

    create_sweep(Planner(), args, Console())
    assert sent and (sent[0]["warm_start_from"], sent[0]["include_defaults"], sent[0]["max_duration_seconds"]) == (
        ["sweep_a", "sweep_b"],
        False,
        120,
    ), sent
