"""Issue 34's sweep findings, on every stack: no search space makes the API build something huge
(a grid's points are counted from its ranges first; int ranges and float steps are bounded), a
float range over an integer hyperparameter is refused, one broken job row never fails a list,
no body or ``Last-Event-ID`` gets anything but a 2xx or a 4xx (Hypothesis property tests), and
the report's pictures are drawn without pyplot.

The app runs without a worker: nothing here needs a trial to train.
"""

import json
import subprocess
import sys
from pathlib import Path

import hypothesis
import optuna
import pytest
from fastapi.testclient import TestClient
from hypothesis import strategies as st

from tests.conftest import BASE_URL, TINY_MODEL, auth_header, configure_stack
from tests.test_api_jobs import labelled_csv, upload

PROPERTY_EXAMPLES = 40  # per property and stack: a few seconds each on a 2-core CPU


@pytest.fixture(scope="module", params=["embedded", "postgres+redis"])
def client(request, tmp_path_factory, models_dir):
    drop = configure_stack(
        request.param, {"TUNEJOB_DATA_DIR": str(tmp_path_factory.mktemp("data")), "TUNEJOB_MODELS_DIR": str(models_dir)}
    )
    from api.main import create_app

    try:
        with TestClient(create_app(), base_url=BASE_URL) as client:
            client.headers.update(auth_header("tenant-a"))
            yield client
    finally:
        drop()


@pytest.fixture(scope="module")
def dataset(client) -> dict:
    return upload(client, labelled_csv(rows=48, seed=5))


def body(dataset_id: str, **fields) -> dict:
    return {
        "base_model": TINY_MODEL,
        "task": "classification",
        "training_dataset": dataset_id,
        "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
        "search_space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        "objective": {"metric": "accuracy"},
        "algorithm": "random",
        "early_stopping": {"type": "none"},
        "max_trials": 2,
        "max_parallel_trials": 1,
        **fields,
    }


def refused(client, sweep: dict, status: int, code: str, param: str) -> dict:
    """``sweep`` is refused (dry run and for real) with ``status``, ``code`` and ``param``, and nothing is stored."""
    before = client.get("/sweeps", params={"limit": 100}).json()["data"]
    for params in ({"dry_run": "true"}, {}):
        r = client.post("/sweeps", json=sweep, params=params)
        assert r.status_code == status, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param), r.text
    assert client.get("/sweeps", params={"limit": 100}).json()["data"] == before
    return r.json()["error"]


@pytest.fixture
def grid_points(monkeypatch) -> list[int]:
    """The number of points of every ``GridSampler`` built (the grid is not built past 200,000:
    on the code before the cap, a 10**9-point grid would otherwise take the test's memory)."""
    built, real = [], optuna.samplers.GridSampler

    def counting(search_space, seed=None):
        import math

        built.append(math.prod(len(v) for v in search_space.values()))
        assert built[-1] <= 200_000, f"a GridSampler of {built[-1]} points was built"
        return real(search_space, seed=seed)

    monkeypatch.setattr(optuna.samplers, "GridSampler", counting)
    return built


# ----------------------------------------------------------------------------- High 1: the grid's size


def test_a_grid_over_the_cap_is_refused_before_anything_is_built(client, dataset, grid_points):
    choices = {"type": "categorical", "choices": list(range(1, 1001))}
    sweep = body(
        dataset["id"],
        algorithm="grid",
        search_space={"eval_every_steps": choices, "save_every_steps": choices, "max_nonfinite_steps": choices},
    )
    error = refused(client, sweep, 422, "grid_too_large", "search_space")
    assert "1e+09 points" in error["message"] and "TUNEJOB_MAX_GRID_POINTS" in error["message"], error
    assert grid_points == []


def test_a_grid_at_the_cap_passes_and_one_point_more_does_not(client, dataset, grid_points):
    space = {
        "eval_every_steps": {"type": "int", "low": 1, "high": 100},
        "save_every_steps": {"type": "int", "low": 1, "high": 1000},
    }
    r = client.post(
        "/sweeps", json=body(dataset["id"], algorithm="grid", search_space=space), params={"dry_run": "true"}
    )
    assert r.status_code == 200, r.text
    assert grid_points == [100_000]  # built once, for the first trials
    space["save_every_steps"]["high"] = 1001
    refused(client, body(dataset["id"], algorithm="grid", search_space=space), 422, "grid_too_large", "search_space")


def test_pruning_and_reports_build_no_grid(grid_points):
    """The worker's pruning check (every evaluation) and the report rebuild the study without the
    sweep's sampler: only asking for trials builds a grid."""
    from shared.jobs import search
    from shared.jobs.search_space import distributions
    from shared.schemas.sweeps import SweepCreate

    spec = SweepCreate.model_validate(
        body("ds_x", algorithm="grid", search_space={"eval_every_steps": {"type": "int", "low": 1, "high": 100}})
    )
    space = distributions(spec)
    search.study_of(spec, space, [], {})
    assert grid_points == []
    search.study_of(spec, space, [], {}, asking=True)
    assert grid_points == [100]


# ----------------------------------------------------------------------------- Medium 6: bounded ranges


@pytest.mark.parametrize("algorithm", ["random", "tpe", "grid"])
@pytest.mark.parametrize(
    "distribution, param",
    [
        ({"type": "float", "low": 0.0, "high": 0.2, "step": 1e-300}, "search_space.warmup_ratio.step"),
        ({"type": "int", "low": 1, "high": 1e300}, "search_space.eval_every_steps.high"),
        ({"type": "int", "low": 1, "high": 1e300, "step": 1}, "search_space.eval_every_steps.high"),
        ({"type": "int", "low": -1e300, "high": 1}, "search_space.eval_every_steps.low"),
    ],
    ids=["tiny-float-step", "huge-int-range", "huge-int-range-step-1", "huge-negative-int"],
)
def test_ranges_too_large_to_search_are_a_422_naming_the_bound(
    client, dataset, algorithm, distribution, param, grid_points
):
    name = param.split(".")[1]
    refused(
        client,
        body(dataset["id"], algorithm=algorithm, search_space={name: distribution}),
        422,
        "invalid_search_space",
        param,
    )


def test_a_hyperparameter_of_another_task_is_a_422(client, dataset):
    space = {"pos_weight": {"type": "float", "low": 1.0, "high": 4.0}}  # reranking's only
    error = refused(
        client, body(dataset["id"], search_space=space), 422, "invalid_search_space", "search_space.pos_weight"
    )
    assert "applies to task 'reranking' only" in error["message"], error


def test_non_finite_bounds_are_a_422(client, dataset):
    r = client.post(
        "/sweeps",
        params={"dry_run": "true"},
        content=b'{"base_model": "%s", "training_dataset": "%s", '
        b'"search_space": {"warmup_ratio": {"type": "float", "low": 0, "high": Infinity}}, '
        b'"objective": {"metric": "accuracy"}}' % (TINY_MODEL.encode(), dataset["id"].encode()),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422 and r.json()["error"]["param"] == "search_space.warmup_ratio.high", r.text


# ----------------------------------------------------------------------------- High 2: trials' hyperparameters


@pytest.mark.parametrize("algorithm", ["random", "tpe"])
def test_a_float_range_over_an_integer_hyperparameter_is_refused(client, dataset, algorithm):
    sweep = body(
        dataset["id"], algorithm=algorithm, search_space={"batch_size": {"type": "float", "low": 16, "high": 32}}
    )
    error = refused(client, sweep, 422, "invalid_search_space", "search_space.batch_size.type")
    assert "use an int range" in error["message"], error


def test_every_trial_is_checked_whole_before_it_is_stored():
    from shared.errors import UserError
    from shared.jobs.search import trial_hyperparameters

    assert trial_hyperparameters({"batch_size": 8, "epochs": 1}, {"batch_size": 16})["batch_size"] == 16
    with pytest.raises(UserError) as e:
        trial_hyperparameters({"batch_size": 8, "epochs": 1}, {"batch_size": 24.78})
    assert (e.value.code, e.value.param) == ("invalid_trial", "search_space.batch_size")


def corrupt(job_id: str, **hyperparameters) -> None:
    """Store hyperparameters no longer valid on job ``job_id``, as the code before issue 34 did for trials."""
    from shared.store.engine import session_scope
    from shared.store.rows import Job

    with session_scope() as s:
        job = s.get(Job, job_id)
        job.spec = {**job.spec, "hyperparameters": {**job.spec["hyperparameters"], **hyperparameters}}


def test_one_broken_job_row_fails_no_list(client, dataset):
    r = client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "training_dataset": dataset["id"],
            "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
        },
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    corrupt(job_id, batch_size=24.78)
    admin = TestClient(client.app, base_url=BASE_URL, headers=auth_header("ops", admin=True))
    for c, path in [(client, "/jobs"), (admin, "/jobs"), (client, f"/jobs/{job_id}")]:
        r = c.get(path)
        assert r.status_code == 200, (path, r.text)
        job = r.json() if path.endswith(job_id) else next(j for j in r.json()["data"] if j["id"] == job_id)
        assert job["error"]["code"] == "invalid_stored_hyperparameters", job
        assert "batch_size=24.78" in job["error"]["message"] and job["hyperparameters"]["batch_size"] == 16, job
    r = client.get("/v1/fine_tuning/jobs")
    assert r.status_code == 200 and job_id in {j["id"] for j in r.json()["data"]}, r.text
    from shared.store.keys import create_key

    key, _ = create_key("tenant-a")
    browser = TestClient(client.app, base_url=BASE_URL, follow_redirects=False)
    assert browser.post("/ui/login", data={"key": key, "next": "/ui/jobs"}).status_code == 303
    r = browser.get("/ui/jobs")
    assert r.status_code == 200 and job_id in r.text


def test_a_pruned_trial_is_a_cancelled_job_in_the_openai_facade(client, dataset):
    from shared.store.engine import session_scope
    from shared.store.rows import Job, JobStatus

    r = client.post(
        "/jobs",
        json={
            "base_model": TINY_MODEL,
            "training_dataset": dataset["id"],
            "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
        },
    )
    job_id = r.json()["id"]
    with session_scope() as s:
        s.get(Job, job_id).status = JobStatus.PRUNED
    for path in (f"/v1/fine_tuning/jobs/{job_id}", "/v1/fine_tuning/jobs"):
        r = client.get(path)
        assert r.status_code == 200, r.text
    assert client.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "cancelled"


# ----------------------------------------------------------------------------- Medium 6: Last-Event-ID


@pytest.fixture(scope="module")
def ended_sweep(client, dataset) -> dict:
    """A sweep cancelled at once: its streams end after what they have to say."""
    r = client.post("/sweeps", json=body(dataset["id"]))
    assert r.status_code == 201, r.text
    assert client.post(f"/sweeps/{r.json()['id']}/cancel").status_code == 200
    trials = client.get(f"/sweeps/{r.json()['id']}/trials").json()["data"]
    return {"id": r.json()["id"], "job_id": trials[0]["job_id"]}


@pytest.mark.parametrize(
    "value",
    [b"\xb2", "\u0663".encode(), b"9" * 30, b"9" * 5000, b"-1", b"1e3"],
    ids=["superscript-two", "arabic-indic-three", "30-digits", "5000-digits", "negative", "exponent"],
)
def test_a_last_event_id_that_is_no_event_id_is_a_422_on_the_sweep_stream(client, ended_sweep, value):
    r = client.get(f"/sweeps/{ended_sweep['id']}/stream", headers={"Last-Event-ID": value})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_last_event_id", r.text


@pytest.mark.parametrize(
    "value", [b"m" + b"9" * 30 + b"-e1", b"m" + b"9" * 5000 + b"-e1"], ids=["30-digits", "5000-digits"]
)
def test_a_cursor_past_any_row_id_is_a_422_on_the_job_stream(client, ended_sweep, value):
    r = client.get(f"/jobs/{ended_sweep['job_id']}/stream", headers={"Last-Event-ID": value})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_last_event_id", r.text


HEADER_BYTES = [9, *range(0x20, 0x7F), *range(0x80, 0x100)]  # an HTTP field value's bytes (RFC 9110 5.5)


@hypothesis.settings(
    max_examples=PROPERTY_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(hypothesis.HealthCheck)
)
@hypothesis.given(
    value=st.one_of(
        st.lists(st.sampled_from(HEADER_BYTES), max_size=40).map(bytes),
        st.from_regex(rb"\Am?[0-9]{1,25}(-e[0-9]{1,25})?\Z"),
    ),
    stream=st.sampled_from(["sweep", "job"]),
)
def test_any_last_event_id_gets_a_2xx_or_a_4xx(client, ended_sweep, value, stream):
    path = f"/sweeps/{ended_sweep['id']}/stream" if stream == "sweep" else f"/jobs/{ended_sweep['job_id']}/stream"
    r = client.get(path, headers={"Last-Event-ID": value.strip(b" \t")})
    assert 200 <= r.status_code < 500, (value, r.status_code, r.text)


# ----------------------------------------------------------------------------- Medium 6: any body


NAMES = [
    "learning_rate",
    "batch_size",
    "epochs",
    "warmup_ratio",
    "eval_every_steps",
    "max_length",
    "precision",
    "seed",
    "gradient_checkpointing",
    "metric_for_best_model",
    "no_such_field",
]
NUMBERS = st.one_of(
    st.integers(-(10**20), 10**20), st.integers(), st.floats(), st.sampled_from([0, 1, 16, 1e300, -1e300])
)
WILD = st.tuples(
    st.sampled_from(NAMES),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["float", "int", "categorical", "other"])},
        optional={
            "low": NUMBERS,
            "high": NUMBERS,
            "step": st.one_of(NUMBERS, st.sampled_from([1e-300, 1e-9, 0.5])),
            "log": st.booleans(),
            "choices": st.lists(st.one_of(NUMBERS, st.text(max_size=5), st.none(), st.booleans()), max_size=5),
        },
    ),
)
SANE = st.one_of(  # ranges a user would send: most dry runs with these alone pass
    st.builds(
        lambda low, times, log: ("learning_rate", {"type": "float", "low": low, "high": low * times, "log": log}),
        st.floats(1e-6, 1e-3),
        st.floats(1, 100),
        st.booleans(),
    ),
    st.builds(
        lambda high, step: ("warmup_ratio", {"type": "float", "low": 0.0, "high": high, "step": step}),
        st.floats(0, 0.5),
        st.floats(1e-12, 0.5),
    ),
    st.builds(
        lambda low, n, step: ("eval_every_steps", {"type": "int", "low": low, "high": low + n, "step": step}),
        st.integers(1, 100),
        st.integers(0, 10**7),
        st.integers(1, 1000),
    ),
    st.builds(
        lambda choices: ("batch_size", {"type": "categorical", "choices": choices}),
        st.lists(st.integers(1, 64), min_size=1, max_size=4),
    ),
)
SPACES = st.lists(st.one_of(SANE, SANE, WILD), min_size=1, max_size=3).map(dict)


@hypothesis.settings(
    max_examples=PROPERTY_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(hypothesis.HealthCheck)
)
@hypothesis.given(
    space=SPACES,
    algorithm=st.sampled_from(["tpe", "random", "grid"]),
    max_trials=st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers()),
    max_parallel_trials=st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers()),
)
def test_any_sweep_body_gets_a_2xx_or_a_4xx_from_a_dry_run(
    client, dataset, space, algorithm, max_trials, max_parallel_trials
):
    sweep = body(
        dataset["id"],
        search_space=space,
        algorithm=algorithm,
        max_trials=max_trials,
        max_parallel_trials=max_parallel_trials,
    )
    r = client.post(
        "/sweeps",
        content=json.dumps(sweep),
        params={"dry_run": "true"},  # NaN too, as Python's json
        headers={"Content-Type": "application/json"},
    )
    assert 200 <= r.status_code < 500, (sweep, r.status_code, r.text)


# ----------------------------------------------------------------------------- Low 13: the report's pictures


def test_report_pictures_are_drawn_in_threads_without_pyplot():
    """The API draws a sweep's pictures in its threads: each drawn on its own ``Figure``, never
    through pyplot's global state (issue 34); 16 at once all come out whole."""
    from concurrent.futures import ThreadPoolExecutor

    from optuna.distributions import FloatDistribution, IntDistribution

    from shared.jobs.sweep_report import picture

    space = {"learning_rate": FloatDistribution(1e-5, 1e-2, log=True), "epochs": IntDistribution(1, 3)}
    study = optuna.create_study(direction="maximize")
    for i in range(6):
        study.add_trial(
            optuna.trial.create_trial(
                params={"learning_rate": 10 ** -(2 + i % 3), "epochs": 1 + i % 3},
                distributions=space,
                value=0.5 + 0.07 * i * (-1) ** i,
            )
        )
    names = ["optimization_history.png", "param_importances.png"] * 8
    with ThreadPoolExecutor(8) as pool:
        pngs = list(pool.map(lambda name: picture(study, name), names))
    assert all(p.startswith(b"\x89PNG\r\n\x1a\n") and len(p) > 5000 for p in pngs)
    assert len(set(pngs[::2])) == 1  # the same history each time, whatever was drawn beside it
    assert not pyplot_imported_by(
        "s = optuna.create_study(); s.enqueue_trial({'x': 1.0}); s.optimize(lambda t: t.suggest_float('x', 0, 2), 3)\n"
        "picture(s, 'optimization_history.png')"
    )


def pyplot_imported_by(drawing: str) -> bool:
    """Whether ``drawing`` (lines that build an Optuna study and call ``sweep_report.picture``),
    run in a fresh interpreter, imports ``matplotlib.pyplot`` (whose global state is not thread-safe)."""
    code = (
        "import sys, optuna; from shared.jobs.sweep_report import picture\n"
        f"{drawing}\nprint('matplotlib.pyplot' in sys.modules)"
    )
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    return run.stdout.strip() == "True"


# ----------------------------------------------------------------------------- Medium 7: trials pass admission


def test_later_trials_pass_admission_pause_and_resume(client, dataset, monkeypatch):
    """A sweep's later trials count against the tenant's active-jobs maximum like any job (before
    issue 34, ``top_up`` inserted them past it): with no room the sweep pauses and says why, and
    the recovery loop's ``top_up_all`` resumes it once room frees."""
    from shared.jobs import sweeps
    from shared.settings import get_settings

    r = client.post("/sweeps", json=body(dataset["id"], max_trials=4, max_parallel_trials=2))
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    first = client.get(f"/sweeps/{sweep_id}/trials").json()["data"][0]["job_id"]
    active = sum(
        j["status"] in ("queued", "running") for j in client.get("/jobs", params={"limit": 100}).json()["data"]
    )
    monkeypatch.setattr(get_settings(), "max_active_jobs_per_tenant", active - 1)  # one trial's end leaves no room
    assert client.post(f"/jobs/{first}/cancel").status_code == 200
    assert len(client.get(f"/sweeps/{sweep_id}/trials").json()["data"]) == 2  # no third trial
    sweep = client.get(f"/sweeps/{sweep_id}").json()
    assert sweep["status"] == "paused" and sweep["error"]["code"] == "trials_paused", sweep
    assert "TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT" in sweep["error"]["message"], sweep
    sweeps.top_up_all()  # still no room: still paused
    assert len(client.get(f"/sweeps/{sweep_id}/trials").json()["data"]) == 2

    monkeypatch.setattr(get_settings(), "max_active_jobs_per_tenant", 1000)
    sweeps.top_up_all()  # the recovery loop, once room freed
    trials = client.get(f"/sweeps/{sweep_id}/trials").json()["data"]
    assert [t["status"] for t in trials] == ["cancelled", "queued", "queued"], trials
    sweep = client.get(f"/sweeps/{sweep_id}").json()
    assert sweep["error"] is None and sweep["status"] in ("queued", "running"), sweep
    client.post(f"/sweeps/{sweep_id}/cancel")


def test_a_sweep_that_cannot_be_topped_up_holds_up_no_other(client, dataset, monkeypatch):
    """``top_up_all`` stopped at the first sweep whose top-up raised (a multi-objective TPE study did
    after a pruned trial), so the recovery loop topped up no sweep after it and sent none of the
    trials asked before it. Now every other sweep is topped up and its trials sent, and the failure
    still reaches the loop, which logs it."""
    from types import SimpleNamespace

    import shared.queue
    from shared.jobs import sweeps
    from shared.store.engine import session_scope
    from shared.store.rows import Sweep

    broken, fine = (client.post("/sweeps", json=body(dataset["id"])).json()["id"] for _ in range(2))
    with session_scope() as s:
        for sweep_id in (broken, fine):
            s.get(Sweep, sweep_id).status = "running"

    def top_up(s, sweep):
        if sweep.id == broken:
            raise RuntimeError("A single direction cannot be retrieved from a multi-objective study")
        return [SimpleNamespace(id=f"trial of {sweep.id}")] if sweep.id == fine else []

    sent = []
    monkeypatch.setattr(sweeps, "top_up", top_up)
    monkeypatch.setattr(shared.queue, "send", sent.append)
    with pytest.raises(sweeps.SweepsFailed, match=f"sweep {broken}: RuntimeError: A single direction"):
        shared.queue.top_up_sweeps()
    assert sent == [f"trial of {fine}"]
    for sweep_id in (broken, fine):
        client.post(f"/sweeps/{sweep_id}/cancel")
