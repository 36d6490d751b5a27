"""Accuracy against serving cost (issue 38, item 5) through HTTP on every stack: a sweep of several
objectives (``objectives``), ``latency_ms`` measured by the worker after each finished trial, the
base model and ``max_length`` in the search space, pruning on the first objective only, and the
Pareto front (``pareto_trials``, ``pareto_front.png``); bad input is a 4xx with nothing queued.

Accuracy comes from ``controlled_metrics`` (fixed per trial and step), so which trial is pruned
follows from those numbers; latency is really measured, so the test checks the front against the
values the API reports, never a particular trial's latency.
"""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import optuna
import pytest

from tests.conftest import TINY_MODEL
from tests.test_sweep_hardening import pyplot_imported_by
from tests.test_sweeps import controlled_metrics, create, dataset, ids, sweep_body, trials_of, wait_for_sweep  # noqa: F401
from tests.test_ui_browser import chromium, server, watched  # noqa: F401 (the browser fixtures)

SECOND_MODEL = "tiny-bert-wide"
OBJECTIVES = [{"metric": "accuracy", "direction": "maximize"}, {"metric": "latency_ms", "direction": "minimize"}]


@pytest.fixture(scope="module", autouse=True)
def second_model(models_dir):
    """A second base model for the task (a wider tiny BERT) beside ``tiny-bert``, for this module only."""
    from worker.doctor import build_tiny_bert

    path = build_tiny_bert(models_dir / SECOND_MODEL, hidden_size=64, seed=1)
    yield SECOND_MODEL
    shutil.rmtree(path)


def multi_body(dataset_id: str, **fields) -> dict:
    """``sweep_body`` with ``objectives`` (and without its one ``objective``) unless ``fields`` say otherwise."""
    body = sweep_body(dataset_id, **{"objective": None, "objectives": OBJECTIVES, **fields})
    return {k: v for k, v in body.items() if v is not None}


def dominated(a: list[float], b: list[float]) -> bool:
    """Whether (accuracy, latency) ``a`` is dominated by ``b``: b at least as good on both, better on one."""
    return b[0] >= a[0] and b[1] <= a[1] and (b[0] > a[0] or b[1] < a[1])


def test_a_sweep_of_accuracy_and_latency_searches_models_and_lengths_prunes_on_accuracy_and_reports_its_front(
    stack,
    dataset,  # noqa: F811
    controlled_metrics,  # noqa: F811
):
    client = stack.client
    # Trial 1 is worse than trial 0 at step 2: the median pruner (first objective only) stops it.
    # Trials 2 and 3 tie on accuracy (0.9): the best is the one of them the other does not beat.
    controlled_metrics.update({0: {2: 0.6, 4: 0.7}, 1: {2: 0.2}, 2: {2: 0.8, 4: 0.9}, 3: {2: 0.7, 4: 0.9}})
    sweep = create(
        client,
        multi_body(
            dataset["id"],
            serving_precision="fp32",
            max_trials=4,
            search_space={
                "base_model": {"type": "categorical", "choices": [TINY_MODEL, SECOND_MODEL]},
                "max_length": {"type": "categorical", "choices": [16, 32]},
                "learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
            },
            early_stopping={"type": "median", "min_trials": 1},
        ),
    )
    assert sweep["objectives"] == OBJECTIVES and sweep["objective"] == OBJECTIVES[0]
    sweep = wait_for_sweep(client, sweep["id"], timeout=400)
    assert sweep["status"] == "succeeded", sweep
    trials = trials_of(client, sweep["id"])
    assert [t["status"] for t in trials] == ["succeeded", "pruned", "succeeded", "succeeded"], trials

    for t in trials:  # each trial a job of its searched model and length, its latency measured once saved
        job = client.get(f"/jobs/{t['job_id']}").json()
        assert job["base_model"] == t["params"]["base_model"]
        assert job["hyperparameters"]["max_length"] == t["params"]["max_length"]
        latency = [
            m["value"]
            for m in client.get(f"/jobs/{t['job_id']}/metrics").json()["data"]
            if m["name"] == "eval_latency_ms"
        ]
        if t["status"] == "succeeded":
            assert len(latency) == 1 and latency[0] > 0, latency
            assert t["values"] == [t["value"], latency[0]] and t["value"] == max(
                controlled_metrics[t["number"]].values()
            )
        else:
            assert latency == [] and t["values"][1] is None

    # The front: exactly the succeeded trials no other succeeded trial dominates.
    done = {t["number"]: t["values"] for t in trials if t["status"] == "succeeded"}
    front = [p["trial_number"] for p in sweep["pareto_trials"]]
    assert front == sorted(n for n, v in done.items() if not any(dominated(v, w) for m, w in done.items() if m != n))
    assert all(p["values"] == done[p["trial_number"]] and p["value"] == p["values"][0] for p in sweep["pareto_trials"])
    # Best on the first objective, and of the tied trials the faster: a trial another beats at no
    # loss is never named best (the earlier of equals was named before, whatever its latency).
    tied = sorted((2, 3), key=lambda n: (done[n][1], n))
    assert sweep["best_trial"]["trial_number"] == tied[0] and tied[0] in front and sweep["best_trial"]["value"] == 0.9

    picture = client.get(f"/sweeps/{sweep['id']}/report/pareto_front.png")
    assert picture.status_code == 200 and picture.content.startswith(b"\x89PNG"), picture.text
    table = client.get(f"/sweeps/{sweep['id']}/report/trials.csv").text.splitlines()
    assert "latency_ms" in table[0].split(",")


def test_a_single_objective_sweep_has_no_front(stack, dataset):  # noqa: F811
    sweep = wait_for_sweep(
        stack.client, create(stack.client, sweep_body(dataset["id"], max_trials=1))["id"], timeout=400
    )
    assert sweep["pareto_trials"] == [] and sweep["objectives"] == [{"metric": "accuracy", "direction": "maximize"}]
    r = stack.client.get(f"/sweeps/{sweep['id']}/report/pareto_front.png")
    assert r.status_code == 409 and r.json()["error"]["code"] == "single_objective", r.text


BAD = [
    ({"objectives": [OBJECTIVES[0], {"metric": "latency_ms", "direction": "maximize"}]}, "objectives.1.direction"),
    ({"objectives": [OBJECTIVES[1], OBJECTIVES[0]]}, "objectives.0.metric"),  # latency cannot pick the weights
    ({"objectives": [{"metric": "pearson_r"}, OBJECTIVES[1]]}, "objectives.0.metric"),  # not a classification metric
    ({"objectives": [OBJECTIVES[0], {"metric": "ndcg@10"}]}, "objectives.1.metric"),
    ({"objectives": [OBJECTIVES[0], OBJECTIVES[0]]}, "objectives"),
    ({"objective": OBJECTIVES[1], "objectives": None}, "objective.metric"),
    ({"objective": {"metric": "loss"}, "objectives": OBJECTIVES}, None),  # one or the other
    (
        {"search_space": {"base_model": {"type": "categorical", "choices": [TINY_MODEL, "no-such-model"]}}},
        "search_space.base_model.choices",
    ),
    ({"search_space": {"base_model": {"type": "int", "low": 1, "high": 2}}}, "search_space.base_model"),
    ({"search_space": {"max_length": {"type": "int", "low": 16, "high": 1024}}}, "search_space.max_length"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[str(p) for _, p in BAD])
def test_bad_objectives_and_model_choices_are_a_4xx_and_queue_nothing(stack, dataset, change, param):  # noqa: F811
    client = stack.client
    jobs_before, sweeps_before = ids(client, "/jobs"), ids(client, "/sweeps")
    r = client.post("/sweeps", json=multi_body(dataset["id"], **change))
    assert 400 <= r.status_code < 500, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text
    if "choices" in (param or ""):
        assert "no-such-model" in r.json()["error"]["message"]
    assert ids(client, "/jobs") == jobs_before and ids(client, "/sweeps") == sweeps_before


def test_the_latency_task_check_refuses_a_task_without_the_predict_path():
    """``latency_ms`` is measured through sync predict's code, which embedding and reranking jobs do not use."""
    from shared.errors import UserError
    from shared.jobs.search import check_objectives
    from shared.schemas.sweeps import SweepCreate

    spec = SweepCreate.model_validate(
        {
            "base_model": TINY_MODEL,
            "task": "reranking",
            "training_dataset": "ds_x",
            "search_space": {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-3}},
            "objectives": [{"metric": "ndcg@10"}, {"metric": "latency_ms"}],
        },
        strict=False,
    )
    with pytest.raises(UserError) as e:
        check_objectives(spec)
    assert e.value.param == "objectives.1.metric" and "reranking" in e.value.message


def test_the_pareto_picture_is_drawn_in_threads_without_pyplot():
    from optuna.distributions import FloatDistribution

    from shared.jobs.sweep_report import picture

    space = {"learning_rate": FloatDistribution(1e-5, 1e-2, log=True)}
    study = optuna.create_study(directions=["maximize", "minimize"])
    for i in range(6):
        study.add_trial(
            optuna.trial.create_trial(
                params={"learning_rate": 10 ** -(2 + i % 3)},
                distributions=space,
                values=[0.5 + 0.05 * i, 10.0 + (i % 3)],
            )
        )
    with ThreadPoolExecutor(4) as pool:
        pngs = list(pool.map(lambda _: picture(study, "pareto_front.png", ("accuracy", "latency_ms")), range(8)))
    assert len(set(pngs)) == 1 and pngs[0].startswith(b"\x89PNG")
    assert not pyplot_imported_by(
        "s = optuna.create_study(directions=['maximize', 'minimize'])\n"
        "s.optimize(lambda t: (t.suggest_float('x', 0, 2), t.params['x'] ** 2), 3)\n"
        "picture(s, 'pareto_front.png')"
    )


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_the_sweep_page_draws_the_front_and_a_warm_starts_history_narrow_and_wide(
    stack,
    server,  # noqa: F811
    watched,  # noqa: F811
    tmp_path,
):
    """The dashboard's sweep page in chromium: the front chart has a point per succeeded trial, the
    table marks the front's trials and the default trial, nothing is requested off-host. A sweep
    warm-started from it draws the earlier sweep's succeeded trials too, in both charts, as a grey
    series "earlier sweeps" listed first, while its front stays its own trials'. Screenshots at 390
    and 1280 pixels (``TUNEJOB_UI_SCREENSHOTS``, default tmp_path)."""
    from tests.test_api_jobs import labelled_csv, upload
    from tests.test_ui_browser import sign_in, wait_for_points

    client = stack.client_for("ui-sweeps")
    data = upload(client, labelled_csv(rows=48, seed=5))
    # Every trial at batch size 8: a parameter chart draws each trial, whatever x they share.
    space = {"learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    space["batch_size"] = {"type": "categorical", "choices": [8]}
    sweep = wait_for_sweep(
        client, create(client, multi_body(data["id"], max_trials=2, search_space=space))["id"], timeout=400
    )
    assert sweep["status"] == "succeeded", sweep
    warm = create(client, multi_body(data["id"], max_trials=1, search_space=space, warm_start_from=[sweep["id"]]))
    warm = wait_for_sweep(client, warm["id"], timeout=400)
    assert warm["status"] == "succeeded" and warm["history"]["trials"] == 2, warm
    earlier = [t for t in trials_of(client, sweep["id"]) if t["status"] == "succeeded"]
    own = trials_of(client, warm["id"])
    shots = Path(os.environ.get("TUNEJOB_UI_SCREENSHOTS", tmp_path))
    with watched("sweep-front") as w:
        sign_in(w.page, "ui-sweeps")
        for width, height in ((1280, 900), (390, 844)):
            w.page.set_viewport_size({"width": width, "height": height})
            size = "wide" if width > 800 else "narrow"
            w.page.goto(f"/ui/sweeps/{sweep['id']}")
            assert wait_for_points(w.page, "#chart-front", 0) == sweep["trials"]["succeeded"]
            scored = sum(t["value"] is not None for t in trials_of(client, sweep["id"]))
            assert wait_for_points(w.page, "#sweep-charts figure:has-text('batch_size') .chart", 0) == scored == 2
            # a parameter sampled on a log scale is drawn on a log axis
            scales = {
                name: w.page.locator(f"#sweep-charts figure:has-text('{name}') .chart").get_attribute("data-x-scale")
                for name in ("learning_rate", "batch_size")
            }
            assert scales == {"learning_rate": "log", "batch_size": "linear"}
            # a numeric categorical parameter is ticked at its choices (a linear axis ticked 20, 25, 30
            # labelled neither choice of 16 and 32), a range at uPlot's ticks
            ticks = {
                name: w.page.locator(f"#sweep-charts figure:has-text('{name}') .chart").get_attribute("data-x-ticks")
                for name in ("learning_rate", "batch_size")
            }
            assert ticks == {"learning_rate": None, "batch_size": "8"}, ticks
            # a log axis's labels keep apart: 5e-5 to 1e-3 on 400 px labelled all nine mantissas,
            # 8e-4 and 9e-4 15 px apart (a label takes about 34)
            gaps = w.page.evaluate(
                """() => {
                  const u = {scales: {x: {min: 5e-5, max: 1e-3}}, bbox: {width: 400 * devicePixelRatio}};
                  const splits = [5e-5, 6e-5, 7e-5, 8e-5, 9e-5, 1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7e-4, 8e-4, 9e-4, 1e-3];
                  const px = v => 400 * Math.log10(v / 5e-5) / Math.log10(1e-3 / 5e-5);
                  const shown = logTicks(u, splits).filter(v => v !== null);
                  return shown.slice(1).map((v, i) => px(v) - px(shown[i]));
                }"""
            )
            assert len(gaps) >= 2 and min(gaps) >= 34, gaps
            # a log axis's decades read as themselves: uPlot's step there (0.1) labelled 0.01 "0"
            labels = w.page.evaluate("() => tickLabels(null, [1e-4, 1e-3, 1e-2, 0.1, 1], 0, 0, 0.1)")
            assert labels == ["1e-4", "1e-3", "0.01", "0.1", "1"], labels
            colours = dict(legend(w.page, "#chart-front"))  # the report's picture's: the front red, the rest blue
            assert (
                colours["front"] == "rgb(220, 38, 38)"
                and colours.get("trials", "rgb(37, 99, 235)") == "rgb(37, 99, 235)"
            )
            assert w.page.locator("span.tag.front").count() == len(sweep["pareto_trials"]) >= 1
            assert w.page.locator("span.tag", has_text="default").count() == 1  # item 6: the default trial marked
            assert "earlier sweeps" not in [label for label, _ in legend(w.page, "#chart-front")]
            w.page.screenshot(path=str(shots / f"sweep-front-{size}.png"), full_page=True)

            w.page.goto(f"/ui/sweeps/{warm['id']}")
            points = wait_for_points(w.page, "#chart-front", 0)
            assert points == len(earlier) + sum(t["status"] == "succeeded" for t in own), (points, earlier, own)
            points = wait_for_points(w.page, "#chart-trials", 0)
            assert points == len(earlier) + sum(t["value"] is not None for t in own), (points, earlier, own)
            assert wait_for_points(w.page, "#sweep-charts figure:has-text('batch_size') .chart", 0) == points
            grey = w.page.locator(".legend-note").evaluate("e => getComputedStyle(e).color")  # --muted
            for chart in ("#chart-front", "#chart-trials", "#sweep-charts figure:has-text('batch_size') .chart"):
                assert legend(w.page, chart)[0] == ("earlier sweeps", grey), legend(w.page, chart)
            assert w.page.locator("span.tag.front").count() == len(warm["pareto_trials"]) == 1  # its own trial
            assert "not trials of this sweep" in w.page.locator(".legend-note").inner_text()
            w.page.screenshot(path=str(shots / f"sweep-warm-{size}.png"), full_page=True)


def legend(page, chart: str) -> list[tuple[str, str]]:
    """The series of ``chart``'s legend after its x: (label, the marker's colour as CSS writes it, ``rgb(...)``)."""
    labels = page.locator(f"{chart} .u-legend .u-series").evaluate_all(
        "rows => rows.slice(1).map(r => [r.querySelector('.u-label').textContent,"
        " getComputedStyle(r.querySelector('.u-marker')).borderColor])"
    )
    return [(label, color) for label, color in labels]


def test_the_cli_prints_the_front_and_marks_its_trials():
    from rich.console import Console

    from client.sweeps import sweep_table, trials_table
    from shared.schemas.sweeps import SweepOut, TrialOut

    example = SweepOut.model_json_schema()["examples"][0]
    front = [{"job_id": "job_b", "trial_number": 1, "params": {"max_length": 64}, "value": 0.8, "values": [0.8, 2.5]}]
    sweep = SweepOut.model_validate({**example, "objectives": OBJECTIVES, "pareto_trials": front})
    trials = [
        TrialOut.model_validate(
            {
                "number": n,
                "job_id": f"job_{c}",
                "status": "succeeded",
                "params": {"max_length": m},
                "value": a,
                "values": [a, ms],
                "steps": 6,
                "started_at": None,
                "finished_at": None,
            }
        )
        for n, c, m, a, ms in ((0, "a", 128, 0.79, 9.0), (1, "b", 64, 0.8, 2.5))
    ]
    console = Console(width=200, record=True)
    console.print(sweep_table(sweep), trials_table(trials, sweep))
    text = console.export_text()
    assert "#1 accuracy 0.8, latency_ms 2.5" in text and "maximize accuracy, minimize latency_ms" in text
    rows = {job: line for line in text.splitlines() for job in ("job_a", "job_b") if f" {job} " in line}
    assert "*" in rows["job_b"] and "*" not in rows["job_a"]  # the front's trial marked, the other not


def test_a_multi_objective_tpe_sweep_asks_on_after_a_pruned_trial():
    """Optuna's TPE scores a pruned trial by its last intermediate value in the study's one
    ``direction``, which a multi-objective study has not: once a trial was pruned, every ask raised
    ("A single direction cannot be retrieved from a multi-objective study") and the sweep stayed
    ``running`` with no trial to run. A multi-objective study holds pruned trials without their curves."""
    from optuna.distributions import FloatDistribution

    from shared.jobs.search import ask
    from shared.schemas.sweeps import SweepCreate
    from shared.store.rows import Job

    spec = SweepCreate.model_validate(
        multi_body("ds_x", algorithm="tpe", max_trials=12, early_stopping={"type": "median", "min_trials": 1})
    )
    space = {"learning_rate": FloatDistribution(1e-4, 1e-2, log=True)}
    jobs, curves, more = [], {}, {}
    for number, (status, curve) in enumerate(
        [("succeeded", {2: 0.6, 4: 0.7}), ("succeeded", {2: 0.7, 4: 0.8}), ("succeeded", {2: 0.5, 4: 0.9})]
        + [("succeeded", {2: 0.6, 4: 0.65}), ("pruned", {2: 0.2})]
    ):
        job = Job(
            id=f"job_{number}",
            status=status,
            trial_number=number,
            total_steps=4,
            base_model=TINY_MODEL,
            spec={"hyperparameters": {"learning_rate": 10 ** -(2 + number / 3)}},
        )
        jobs.append(job)
        curves[job.id] = curve
        more[job.id] = [{4: 100.0 + number}] if status == "succeeded" else [{}]
    ((params, _),) = ask(spec, space, jobs, curves, 1, more=more)
    assert 1e-4 <= params["learning_rate"] <= 1e-2
