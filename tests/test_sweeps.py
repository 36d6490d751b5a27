"""Hyperparameter sweeps (issue 25) through HTTP on every stack (SQLite + the filesystem broker;
PostgreSQL + Redis): trials are jobs, pruning decided by Optuna from the stored evaluations, the
best trial kept, cancel, delete, bad input, tenants.

Where a test needs to know which trial is better, ``controlled_metrics`` replaces the worker's
evaluation with a fixed accuracy sequence per trial number and step: the pruner's decisions then
follow from those numbers, never from how the tiny model happens to train.
"""

import csv
import io
import json
import os

import pytest

from tests.conftest import wait_for_status, wait_until
from tests.test_api_jobs import labelled_csv, upload
from tests.test_cancel import LONG
from tests.test_faults import stacks  # noqa: F401 (the fixture of real API and worker processes)

ENDED = {"succeeded", "failed", "cancelled"}
TRIAL_ENDED = {"succeeded", "failed", "cancelled", "pruned"}


@pytest.fixture(scope="module")
def dataset(stack) -> dict:
    return upload(stack.client, labelled_csv(rows=48, seed=5))


def sweep_body(dataset_id: str, **fields) -> dict:
    """A sweep of the tiny model: 48 rows, 43 for training (batch 8: 6 optimizer steps an epoch)."""
    from tests.conftest import TINY_MODEL

    return {
        "base_model": TINY_MODEL,
        "task": "classification",
        "training_dataset": dataset_id,
        "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32, "eval_every_steps": 2},
        "search_space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}},
        "objective": {"metric": "accuracy"},
        "algorithm": "random",
        "seed": 7,
        "early_stopping": {"type": "none"},
        "max_trials": 2,
        "max_parallel_trials": 1,
        **fields,
    }


def ids(client, path: str) -> set[str]:
    """The ids of the caller's newest 100 rows at ``path`` (``/jobs``, ``/sweeps``): whether
    something was queued, whatever the rows' progress meanwhile."""
    return {row["id"] for row in client.get(path, params={"limit": 100}).json()["data"]}


def create(client, body: dict, **kwargs) -> dict:
    r = client.post("/sweeps", json=body, **kwargs)
    assert r.status_code == 201, r.text
    return r.json()


def wait_for_sweep(client, sweep_id: str, timeout: float = 240) -> dict:
    return wait_for_status(client, sweep_id, ENDED, timeout=timeout, path="/sweeps")


def trials_of(client, sweep_id: str) -> list[dict]:
    r = client.get(f"/sweeps/{sweep_id}/trials")
    assert r.status_code == 200, r.text
    return r.json()["data"]


@pytest.fixture
def controlled_metrics(monkeypatch):
    """Replace the worker's evaluation: trial ``n`` at optimizer step ``s`` scores
    ``sequences[n][s]`` accuracy (the last listed value after that). Returns ``sequences`` to fill."""
    from worker.training.recipe import Recipe

    sequences: dict[int, dict[int, float]] = {}

    def evaluate(run, reporter=None):
        sequence = sequences[run.job.trial_number]
        accuracy = sequence.get(run.state.step, sequence[max(sequence)])
        return {"loss": 1.0 - accuracy, "accuracy": accuracy, "f1_macro": accuracy}

    monkeypatch.setattr(Recipe, "evaluate", evaluate)
    return sequences


def test_trials_are_jobs_run_in_parallel_up_to_the_limit_and_the_best_is_kept(stack, dataset):
    client = stack.client
    sweep = create(
        client,
        sweep_body(
            dataset["id"],
            max_trials=3,
            max_parallel_trials=2,
            search_space={
                "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
                "batch_size": {"type": "categorical", "choices": [4, 8]},
            },
        ),
    )
    assert sweep["status"] in {"queued", "running"} and sweep["trials"]["queued"] + sweep["trials"]["running"] == 2
    sweep = wait_for_sweep(client, sweep["id"])
    assert sweep["status"] == "succeeded", sweep
    trials = trials_of(client, sweep["id"])
    assert [t["number"] for t in trials] == [0, 1, 2]
    assert all(t["status"] == "succeeded" and t["steps"] > 0 for t in trials), trials
    assert len({tuple(sorted(t["params"].items())) for t in trials}) == 3  # no two alike
    assert sweep["trials"]["succeeded"] == 3

    # Each trial is an ordinary job: listed, with its sweep and number, its parameters applied.
    listed = {j["id"]: j for j in client.get("/jobs", params={"limit": 100}).json()["data"]}
    for t in trials:
        job = listed[t["job_id"]]
        assert (job["sweep_id"], job["trial_number"]) == (sweep["id"], t["number"])
        assert job["hyperparameters"]["learning_rate"] == t["params"]["learning_rate"]
        assert job["hyperparameters"]["batch_size"] == t["params"]["batch_size"]
        assert job["hyperparameters"]["metric_for_best_model"] == "accuracy"  # the weights kept are the best's
        # A trial's value is its best evaluation's, not its last.
        evals = [
            m["value"]
            for m in client.get(f"/jobs/{t['job_id']}/metrics").json()["data"]
            if m["name"] == "eval_accuracy"
        ]
        assert t["value"] == max(evals)

    # Never more than max_parallel_trials queued or running: when each trial was created, at most
    # one other had been created and not yet ended.
    jobs = [client.get(f"/jobs/{t['job_id']}").json() for t in trials]
    for job in jobs:
        active = [o for o in jobs if o["created_at"] <= job["created_at"] and o["finished_at"] > job["created_at"]]
        assert len(active) <= 2, jobs

    # The report: the trials table and Optuna's pictures of the study.
    table = client.get(f"/sweeps/{sweep['id']}/report/trials.csv")
    assert table.status_code == 200 and table.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(table.text)))
    assert [(int(r["number"]), r["job_id"], float(r["value"])) for r in rows] == [
        (t["number"], t["job_id"], t["value"]) for t in trials
    ]
    for picture in ("optimization_history.png", "param_importances.png"):
        r = client.get(f"/sweeps/{sweep['id']}/report/{picture}")
        if r.status_code == 409:  # importances need trials of different values
            assert picture == "param_importances.png" and len({t["value"] for t in trials}) == 1
            continue
        assert r.status_code == 200 and r.content.startswith(b"\x89PNG"), (picture, r.status_code, r.text[:200])
    assert client.get(f"/sweeps/{sweep['id']}/report/model.bin").status_code == 404

    best = max(trials, key=lambda t: t["value"])
    assert sweep["best_trial"]["value"] == best["value"]
    assert sweep["best_trial"]["job_id"] in {t["job_id"] for t in trials if t["value"] == best["value"]}
    artifacts = {a["name"] for a in client.get(f"/jobs/{sweep['best_trial']['job_id']}/artifacts").json()["data"]}
    assert "model.tar" in artifacts


@pytest.mark.parametrize(
    "early_stopping", [{"type": "median", "min_trials": 1}, {"type": "asha", "min_steps": 2, "reduction_factor": 2}]
)
def test_a_trial_worse_than_the_others_at_an_evaluation_is_pruned(stack, dataset, controlled_metrics, early_stopping):
    """Trial 0 scores 0.5, 0.9, 0.6 at steps 2, 4, 6: it completes with value 0.9 (its best, not
    its last). Trial 1 scores 0.1 at step 2, below trial 0 there: the median pruner (median of
    one trial: 0.5) and ASHA (rung 0 at step 2; the best half of {0.5, 0.1} goes on) stop it."""
    client = stack.client
    controlled_metrics.update({0: {2: 0.5, 4: 0.9, 6: 0.6}, 1: {2: 0.1, 4: 0.95}})
    sweep = create(client, sweep_body(dataset["id"], early_stopping=early_stopping))
    sweep = wait_for_sweep(client, sweep["id"])
    assert sweep["status"] == "succeeded", sweep
    first, second = trials_of(client, sweep["id"])
    assert (first["status"], first["value"], first["steps"]) == ("succeeded", 0.9, 6)
    assert (second["status"], second["value"], second["steps"]) == ("pruned", 0.1, 2)
    assert sweep["trials"]["pruned"] == 1
    assert sweep["best_trial"] == {
        "job_id": first["job_id"],
        "trial_number": 0,
        "params": first["params"],
        "value": 0.9,
    }
    # The pruned trial: its metrics kept, its checkpoints and weights gone, no model.
    pruned = second["job_id"]
    assert [
        m["step"] for m in client.get(f"/jobs/{pruned}/metrics").json()["data"] if m["name"] == "eval_accuracy"
    ] == [2]
    events = [e["code"] for e in client.get(f"/jobs/{pruned}/events").json()["data"]]
    assert "pruning" in events and events[-1] == "pruned"
    # The sweep's stream, read after its end: each trial's start and end, the best, then the end.
    with client.stream("GET", f"/sweeps/{sweep['id']}/stream") as r:
        names = [line.split(":", 1)[1].strip() for line in r.iter_lines() if line.startswith("event:")]
    assert names == ["trial_started", "trial_ended", "trial_started", "trial_pruned", "best", "end"], names
    assert client.get(f"/jobs/{pruned}/artifacts").json()["data"] == []
    wait_until(lambda: not (stack.data_dir / "checkpoints" / pruned).exists(), "the pruned trial's checkpoints deleted")


def test_cancel_ends_every_trial_and_delete_removes_them(stack, dataset):
    client = stack.client
    sweep = create(
        client,
        sweep_body(
            dataset["id"],
            hyperparameters={"batch_size": 8, "max_length": 32, **LONG},
            max_trials=5,
            max_parallel_trials=2,
        ),
    )
    assert client.delete(f"/sweeps/{sweep['id']}").status_code == 409  # running: cancel first
    r = client.post(f"/sweeps/{sweep['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    trials = trials_of(client, sweep["id"])
    assert len(trials) == 2  # none asked after the cancel
    for t in trials:
        wait_for_status(client, t["job_id"], TRIAL_ENDED, timeout=120)
    trials = trials_of(client, sweep["id"])
    assert {t["status"] for t in trials} == {"cancelled"}, trials
    assert client.get(f"/sweeps/{sweep['id']}").json()["status"] == "cancelled"

    assert client.delete(f"/sweeps/{sweep['id']}").status_code == 204
    r = client.get(f"/sweeps/{sweep['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "deleted"
    assert all(client.get(f"/jobs/{t['job_id']}").status_code == 404 for t in trials)


def test_failed_trials_fail_the_sweep_only_past_max_failed_trials(stack, dataset, monkeypatch):
    from shared.errors import UserError
    from worker.training.recipe import Recipe

    def evaluate(run, reporter=None):
        raise UserError("bad_evaluation", f"trial {run.job.trial_number} cannot be evaluated")

    monkeypatch.setattr(Recipe, "evaluate", evaluate)
    sweep = create(stack.client, sweep_body(dataset["id"], max_trials=3, max_failed_trials=1))
    sweep = wait_for_sweep(stack.client, sweep["id"])
    assert sweep["status"] == "failed" and sweep["error"]["code"] == "too_many_failed_trials", sweep
    assert [t["status"] for t in trials_of(stack.client, sweep["id"])] == ["failed", "failed"]  # the third never asked


def test_dry_run_and_idempotent_retry_queue_nothing_twice(stack, dataset):
    client = stack.client
    body = sweep_body(dataset["id"], max_trials=2, max_parallel_trials=2)
    before = {s["id"] for s in client.get("/sweeps", params={"limit": 100}).json()["data"]}
    jobs_before = ids(client, "/jobs")
    r = client.post("/sweeps", json=body, params={"dry_run": "true"})
    assert r.status_code == 200, r.text
    plan = r.json()
    assert plan["dry_run"] is True and len(plan["first_trials"]) == 2
    assert plan["search_space"]["learning_rate"] == {
        **body["search_space"]["learning_rate"],
        "step": None,
        "choices": None,
    }
    assert plan["trial_plan"]["steps_per_epoch"] == 6
    assert {s["id"] for s in client.get("/sweeps", params={"limit": 100}).json()["data"]} == before
    assert ids(client, "/jobs") == jobs_before

    first = create(client, body, headers={"Idempotency-Key": "sweep-1"})
    again = client.post("/sweeps", json=body, headers={"Idempotency-Key": "sweep-1"})
    assert again.status_code == 201 and again.json()["id"] == first["id"]
    after = {s["id"] for s in client.get("/sweeps", params={"limit": 100}).json()["data"]}
    assert after - before == {first["id"]}
    sweep = wait_for_sweep(client, first["id"])
    assert len(trials_of(client, first["id"])) == 2 and sweep["status"] == "succeeded"
    # The same seed asks the same first trials as the dry run showed.
    assert [t["params"] for t in trials_of(client, first["id"])] == plan["first_trials"]


BAD = [
    (
        {"search_space": {"learning_rate": {"type": "float", "low": 1e-2, "high": 1e-4}}},
        "search_space.learning_rate.low",
    ),
    (
        {"search_space": {"learning_rate": {"type": "float", "low": 0, "high": 1e-2, "log": True}}},
        "search_space.learning_rate.low",
    ),
    ({"search_space": {"dropout_rate": {"type": "float", "low": 0, "high": 0.5}}}, "search_space.dropout_rate"),
    ({"search_space": {"batch_size": {"type": "float", "low": 4.5, "high": 8}}}, "search_space.batch_size.type"),
    ({"search_space": {"batch_size": {"type": "int", "low": 4, "high": 8192}}}, "search_space.batch_size"),
    ({"objective": {"metric": "pearson_r"}}, "objective.metric"),
    ({"objective": {"metric": "loss", "direction": "maximize"}}, "objective.direction"),
    ({"max_trials": 10**6}, "max_trials"),
    (
        {
            "algorithm": "grid",
            "search_space": {"batch_size": {"type": "categorical", "choices": [4, 8]}},
            "max_trials": 4,
        },
        "max_trials",
    ),
]


@pytest.mark.parametrize("change,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_4xx_naming_the_field_and_queues_nothing(stack, dataset, change, param):
    client = stack.client
    jobs_before = ids(client, "/jobs")
    sweeps_before = ids(client, "/sweeps")
    r = client.post("/sweeps", json=sweep_body(dataset["id"], **change))
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert ids(client, "/jobs") == jobs_before
    assert ids(client, "/sweeps") == sweeps_before


def test_another_tenant_gets_404(stack, dataset):
    sweep = create(stack.client, sweep_body(dataset["id"], max_trials=1))
    other = stack.client_for("tenant-b")
    for method, path in [
        ("get", ""),
        ("get", "/trials"),
        ("post", "/cancel"),
        ("delete", ""),
        ("get", "/stream"),
        ("get", "/report/trials.csv"),
    ]:
        r = getattr(other, method)(f"/sweeps/{sweep['id']}{path}")
        assert r.status_code == 404, (method, path, r.text)
    assert other.get("/sweeps").json()["data"] == []
    assert wait_for_sweep(stack.client, sweep["id"])["status"] == "succeeded"  # untouched by the other tenant


@pytest.mark.parametrize("kind", ["embedded", "postgres+redis"])
def test_kill_9_of_the_whole_service_mid_sweep_then_a_restart_ends_with_exactly_max_trials(stacks, kind):  # noqa: F811
    """The API and its worker (what ``tunejob serve`` runs) killed with SIGKILL while a trial trains
    and another waits: after a restart on the same data the killed trial resumes from its checkpoint
    (a second attempt), the sweep asks for the rest and ends with trials 0..3, each once."""
    import signal

    c = stacks.make(kind)
    [worker] = c.start(workers=1)
    dataset = c.upload(labelled_csv(rows=48, seed=9))
    body = sweep_body(
        dataset["id"],
        max_trials=4,
        max_parallel_trials=2,
        hyperparameters={"epochs": 6, "batch_size": 4, "max_length": 32, "save_every_steps": 5},
    )
    sweep = c.request("POST", "/sweeps", 201, json=body).json()

    def training_past_a_checkpoint() -> dict | None:
        trials = c.request("GET", f"/sweeps/{sweep['id']}/trials").json()["data"]
        running = [t for t in trials if t["status"] == "running" and c.checkpoints(t["job_id"])]
        return running[0] if len(trials) >= 3 and running else None

    killed = c.wait_for(
        "a third trial asked and one training past a checkpoint", training_past_a_checkpoint, 180, interval=0.05
    )
    worker.signal(signal.SIGKILL)
    c.api.signal(signal.SIGKILL)
    assert worker.wait(10) == -signal.SIGKILL and c.api.wait(10) == -signal.SIGKILL

    c.start(workers=1)
    sweep = c.wait_for(
        "the sweep to end",
        lambda: (s := c.request("GET", f"/sweeps/{sweep['id']}").json())["status"] in ENDED and s,
        240,
    )
    trials = c.request("GET", f"/sweeps/{sweep['id']}/trials").json()["data"]
    assert sweep["status"] == "succeeded", (sweep, trials)
    assert [t["number"] for t in trials] == [0, 1, 2, 3] and len({t["job_id"] for t in trials}) == 4, trials
    assert {t["status"] for t in trials} == {"succeeded"}, trials
    # Resumed after the kill (its lease expired, the reaper re-queued it); on a CPU starved enough
    # to miss a 4 s lease renewal it may have been re-queued once more before, so at least 2 attempts.
    codes = c.codes(killed["job_id"])
    assert c.job(killed["job_id"])["attempts"] >= 2 and "job_restarted" in codes, codes
    assert codes.count("succeeded") == 1 and codes[-1] == "succeeded", codes


def test_serve_starts_one_worker_per_gpu_each_seeing_only_its_own(monkeypatch):
    import torch

    from tunejob.cli import worker_launches

    plain = worker_launches(3, None)
    assert len(plain) == 3 and all(
        args[-5:] == ["worker", "--nice", "10", "--parent", str(os.getpid())] for args, _ in plain
    )
    assert all(env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES") for _, env in plain)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [(args[-2:], env["CUDA_VISIBLE_DEVICES"]) for args, env in worker_launches(1, "0,2")] == [
        (["--gpu", "0"], "0"),
        (["--gpu", "2"], "2"),
    ]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in worker_launches(1, "all")] == ["0", "1", "2", "3"]
    with pytest.raises(SystemExit, match="no CUDA GPU 4 on this machine"):  # it trained on the CPU
        worker_launches(1, "0,4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for gpus in ("all", "0,x", "1,1", "0"):
        with pytest.raises(SystemExit):
            worker_launches(1, gpus)


def test_a_worker_pinned_to_a_gpu_it_cannot_see_refuses_to_start(monkeypatch):
    """``tunejob worker --gpu 1`` on a machine without that GPU trained on the CPU, saying so only in
    each job's events."""
    import torch

    from tunejob.cli import run_worker

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # run_worker sets it; monkeypatch restores it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--gpu 1: torch sees no such CUDA GPU here"):
        run_worker(1)


@pytest.fixture(scope="module")
def served_by_two(tmp_path_factory, models_dir):
    """``tunejob serve --workers 2`` (the embedded default), once both workers consume."""
    from tests.test_client_cli import serving

    for server in serving(tmp_path_factory.mktemp("served2"), models_dir, "--workers", "2"):
        wait_until(
            lambda: server.process.tail(400).count(" ready.") >= 2,  # noqa: B023 (called at once)
            "both workers ready",
            timeout=180,
        )
        yield server


def test_cli_sweep_runs_two_trials_at_once_on_serve_with_two_workers(served_by_two, tmp_path):
    from tests.conftest import TINY_MODEL
    from tests.test_client_cli import upload, write_csv

    served = served_by_two
    dataset = upload(served, write_csv(tmp_path / "train.csv", 48))
    (tmp_path / "space.yaml").write_text("learning_rate: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}\n")
    created = served.cli(
        "sweeps",
        "create",
        "--model",
        TINY_MODEL,
        "--dataset",
        dataset,
        "--set",
        "epochs=3",
        "--set",
        "batch_size=8",
        "--set",
        "max_length=32",
        "--space",
        str(tmp_path / "space.yaml"),
        "--objective",
        "accuracy",
        "--algorithm",
        "random",
        "--max-trials",
        "2",
        "--max-parallel-trials",
        "2",
        "--watch",
    )
    assert created.returncode == 0, created.stdout + created.stderr
    sweep_id = created.stdout.split()[1]
    assert "succeeded" in created.stdout and "best" in created.stdout
    # not a terminal: plain lines as the trials go (a redrawn table printed nothing until the end)
    assert f"sweep {sweep_id} running · " in created.stdout and " of 2 · best " in created.stdout, created.stdout

    trials = json.loads(served.cli("sweeps", "trials", sweep_id, "--json").stdout)
    assert [t["number"] for t in trials] == [0, 1] and {t["status"] for t in trials} == {"succeeded"}
    first, second = trials
    assert first["started_at"] < second["finished_at"] and second["started_at"] < first["finished_at"], trials
    sweep = json.loads(served.cli("sweeps", "get", sweep_id, "--json").stdout)
    assert sweep["best_trial"]["value"] == max(t["value"] for t in trials)
    assert [s["id"] for s in json.loads(served.cli("sweeps", "list", "--json").stdout)["data"]] == [sweep_id]

    assert served.cli("sweeps", "delete", sweep_id).returncode == 0
    gone = served.cli("sweeps", "get", sweep_id)
    assert gone.returncode == 1 and "deleted" in gone.stderr
