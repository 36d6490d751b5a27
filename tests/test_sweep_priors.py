"""Issue 38's sweep set-up, on every stack, without a worker (nothing here needs a trial to train):
the default trial (``include_defaults``), the search space's priors per model size, warm starts
from earlier sweeps, and the sweep's time budget, with their bad input (a 4xx, nothing queued)."""

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
    space = {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
             "batch_size": {"type": "categorical", "choices": [4, 8, 16]},
             "warmup_ratio": {"type": "float", "low": 0.2, "high": 0.5}}  # the default 0.1 lies below
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
    from shared.schemas.sweeps import TrialOut

    out = Console(record=True, width=200)
    out.print(trials_table([TrialOut.model_validate(t) for t in (first, second)]))
    rows = [line for line in out.export_text().splitlines() if "job_" in line]
    assert "0 default" in rows[0] and "default" not in rows[1], rows


def test_include_defaults_false_asks_the_sampler_from_trial_0(client, dataset):  # noqa: F811
    space = {"learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True}}
    sweep = created(client, body(dataset["id"], search_space=space, include_defaults=False, seed=3))
    (first,) = trials(client, sweep["id"])
    assert first["default"] is False and first["params"]["learning_rate"] != 5e-5
    assert client.get(f"/sweeps/{sweep['id']}").json()["default_trial"] is None


def test_a_grid_holds_its_points_and_the_default_trial(client, dataset):  # noqa: F811
    space = {"batch_size": {"type": "categorical", "choices": [4, 8]}}
    r = client.post("/sweeps", json=body(dataset["id"], algorithm="grid", search_space=space, max_trials=3),
                    params={"dry_run": "true"})
    assert r.status_code == 200, r.text
    refused(client, body(dataset["id"], algorithm="grid", search_space=space, max_trials=3, include_defaults=False),
            422, "grid_too_small", "max_trials")


@pytest.mark.parametrize("fixed,space,expected", [
    ({}, {"epochs": {"type": "int", "low": 1, "high": 2}}, {"epochs": 2}),  # default 3.0, above the range
    ({}, {"epochs": {"type": "categorical", "choices": [2, 3, 4]}}, {"epochs": 3}),
    ({}, {"warmup_ratio": {"type": "float", "low": 0.0, "high": 0.32, "step": 0.04}}, {"warmup_ratio": 0.08}),
    ({}, {"eval_every_steps": {"type": "int", "low": 5, "high": 50}}, {"eval_every_steps": 5}),  # default null
    ({"gradient_checkpointing": False}, {"gradient_checkpointing": {"type": "categorical", "choices": [True, False]}},
     {"gradient_checkpointing": False}),
])
def test_default_params_lie_in_their_ranges(fixed, space, expected):
    from shared.jobs.search import default_params
    from shared.jobs.search_space import distributions
    from shared.schemas.sweeps import SweepCreate

    spec = SweepCreate.model_validate(body("ds_x", search_space=space, hyperparameters=fixed))
    params = default_params(spec, distributions(spec))
    assert params == expected and [type(v) for v in params.values()] == [type(v) for v in expected.values()]


# ----------------------------------------------------------------------------- 2: priors


def test_ranges_left_out_take_the_prior_of_the_models_size(client, dataset):  # noqa: F811
    space = {"learning_rate": {}, "batch_size": {}, "warmup_ratio": {"type": "float"}, "weight_decay": {},
             "epochs": {}, "max_length": {"type": "categorical", "choices": [16, 32]}}
    fixed = {"max_length": 32}  # tunejob's defaults for the rest: every prior holds them
    r = client.post("/sweeps", json=body(dataset["id"], search_space=space, hyperparameters=fixed),
                    params={"dry_run": "true"})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["search_space"]["learning_rate"] == repr(optuna.distributions.FloatDistribution(3e-5, 3e-4, log=True))
    assert plan["search_space"]["batch_size"] == repr(optuna.distributions.CategoricalDistribution([16, 32]))
    assert plan["search_space"]["epochs"] == repr(optuna.distributions.IntDistribution(2, 5))
    # The default trial is tunejob's default job exactly.
    assert plan["first_trials"][0] == {"learning_rate": 5e-5, "batch_size": 16, "warmup_ratio": 0.1,
                                       "weight_decay": 0.01, "epochs": 3, "max_length": 32}
    sweep = created(client, body(dataset["id"], search_space=space, hyperparameters=fixed))
    assert trials(client, sweep["id"])[0]["params"] == plan["first_trials"][0]


@pytest.mark.parametrize("count,size,lr", [(22_713_728, "small", (3e-5, 3e-4)), (110e6, "base", (1e-5, 1e-4)),
                                           (355e6, "large", (5e-6, 5e-5))])
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


@pytest.mark.parametrize("space,param", BAD_PRIORS, ids=[p for _, p in BAD_PRIORS])
def test_a_range_tunejob_cannot_fill_is_refused(client, dataset, space, param):  # noqa: F811
    refused(client, body(dataset["id"], search_space=space), 422, "invalid_search_space", param)


def test_tpe_start_up_trials_scale_with_max_trials():
    from shared.jobs.search import sampler
    from shared.schemas.sweeps import SweepCreate

    for max_trials, startup in [(1, 2), (12, 3), (20, 5), (200, 10)]:
        spec = SweepCreate.model_validate(body("ds_x", algorithm="tpe", max_trials=max_trials))
        assert sampler(spec, 0)._n_startup_trials == startup  # no public accessor
