"""A tunejob sweep next to ``Trainer.hyperparameter_search(backend="optuna")`` (issue 25's "Done when"):
the same corpus split, search space, number of trials and seed, each side cold in its own process,
one after the other in one invocation (so the machine's load hits both alike).

- tunejob: a real ``tunejob serve --workers W`` (the embedded default, a fresh data directory), the
  training rows uploaded as the training dataset and the held-out rows as the validation dataset;
  ``POST /sweeps`` (TPE, median pruning), polled until it ends. Wall time: POST to the sweep's end.
- Trainer: ``Trainer(model_init=...)`` with an evaluation per epoch on the same held-out rows,
  ``hyperparameter_search(direction="maximize", backend="optuna", n_trials=N, hp_space=...)`` as
  its docs show it (Optuna's default study: TPE, median pruner), the objective held-out accuracy; its
  TPE sampler is seeded with ``--seed``, the seed tunejob's sweep gets, so that (the trials' training
  seeded too) each run asks the same trials and its wall time is comparable between runs: unseeded,
  one run took 1,550 s and another ran past 3,720 s. Wall time: the call.

Both report the optimizer steps all their trials ran and the best trial's held-out accuracy. With
``--default-job``, tunejob's side then runs one job with the default hyperparameters on the same
data and seed (outside the sweep's timer): the model a user gets without a sweep. Issue 38's targets,
on tunejob's side only, after that:

- ``--warm-start-trials N``: a second sweep, the first's body with ``warm_start_from`` the first
  sweep and N trials: its wall time, new trials, best (from a new trial or from the history) next
  to the first sweep's best ("a warm-started second sweep of 6 trials finds a best at least as good
  as the first sweep's 12").
- ``--multi-objective N``: a sweep of N trials on accuracy and ``latency_ms``, ``max_length`` searched
  too: its Pareto front, and whether the front holds a trial within 1 point of the best accuracy at
  under half its latency.

``--timeout`` applies to each sweep and job on its own (tunejob's start-up counted in the first
sweep's); a side run by ``--side both`` gets the sum of its parts' limits plus two minutes.

    python -m bench.sweeps --train-size 4000 --val-size 2000 --trials 12 --workers 2 --default-job   # issue 25's run
    python -m bench.sweeps --train-size 4000 --val-size 2000 --trials 12 --workers 2 --default-job \\
        --warm-start-trials 6 --multi-objective 6   # issue 38's run
    python -m bench.sweeps --train-size 400 --val-size 400 --trials 6 --max-epochs 2   # a bounded CPU run
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.corpora import load_split

MODEL = "all-MiniLM-L6-v2"


def space(max_epochs: int) -> dict:
    """The search space of both sides (Optuna distributions)."""
    return {
        "learning_rate": {"type": "float", "low": 1e-5, "high": 3e-4, "log": True},
        "batch_size": {"type": "categorical", "choices": [16, 32]},
        "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2},
        "epochs": {"type": "int", "low": 1, "high": max_epochs},
    }


def run_tunejob(args, work: Path) -> dict:
    """tunejob's sweeps on ``tunejob serve --workers``: the first (wall seconds, steps, best accuracy),
    then as asked the default job, the warm-started sweep and the multi-objective sweep."""
    train, val = load_split("rotten_tomatoes", args.train_size, args.val_size)
    train.to_csv(work / "train.csv", index=False)
    val.to_csv(work / "val.csv", index=False)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {
        **os.environ,
        "TUNEJOB_DATA_DIR": str(work / "data"),
        "TUNEJOB_DEVICE": "cpu",
        "OMP_NUM_THREADS": str(args.threads_per_worker),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    log = open(work / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "tunejob", "serve", "--port", str(port), "--workers", str(args.workers)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + args.timeout  # start-up counts against the first sweep's limit
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        while (work / "serve.log").read_text().count(" ready.") < args.workers:
            if time.monotonic() > deadline or serve.poll() is not None:
                raise RuntimeError("tunejob serve did not start:\n" + (work / "serve.log").read_text()[-3000:])
            time.sleep(0.5)
        http.headers["Authorization"] = f"Bearer {(work / 'data' / 'api_key').read_text().strip()}"

        def upload(name: str) -> str:
            with open(work / name, "rb") as f:
                r = http.post("/datasets", files={"file": (name, f, "text/csv")})
            r.raise_for_status()
            return r.json()["id"]

        body = {
            "base_model": MODEL,
            "task": "classification",
            "training_dataset": upload("train.csv"),
            "validation_dataset": upload("val.csv"),
            "text_column": "text",
            "label_column": "label",
            "hyperparameters": {"max_length": 128, "seed": args.seed},
            "search_space": space(args.max_epochs),
            "objective": {"metric": "accuracy"},
            "algorithm": "tpe",
            "seed": args.seed,
            "early_stopping": {"type": "median"},
            "max_trials": args.trials,
            "max_parallel_trials": args.workers,
        }
        sweep, trials, wall = run_sweep(http, body, deadline)
        result = {
            "finished": sweep["finished_at"] is not None,
            "status": sweep["status"],
            "wall_seconds": wall,
            "optimizer_steps": sum(t["steps"] for t in trials),
            "counts": sweep["trials"],
            "best_accuracy": sweep["best_trial"]["value"] if sweep["best_trial"] else None,
            "best_params": sweep["best_trial"]["params"] if sweep["best_trial"] else None,
            "trials": trials,
        }
        if args.default_job:
            result["default_job"] = run_default_job(http, body, time.monotonic() + args.timeout)
        if args.warm_start_trials:
            result["warm_start"] = warm_start(
                http, body, sweep, args.warm_start_trials, time.monotonic() + args.timeout
            )
        if args.multi_objective:
            result["multi_objective"] = multi_objective(
                http, body, args.multi_objective, time.monotonic() + args.timeout
            )
        return result
    finally:
        serve.terminate()
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()


def run_sweep(http: httpx.Client, body: dict, deadline: float) -> tuple[dict, list[dict], float]:
    """``POST /sweeps`` with ``body``, polled until it ends or ``deadline`` (``time.monotonic()``
    seconds) passes, when it is cancelled (its ``finished_at`` stays None in the view returned).

    Returns: the sweep's view (``GET /sweeps/{id}``), its trials, wall seconds from the POST.
    Raises: RuntimeError with the API's answer if the POST is refused."""
    began = time.monotonic()
    r = http.post("/sweeps", json=body)
    if r.is_error:
        raise RuntimeError(f"POST /sweeps: {r.status_code} {r.text}")
    sweep_id = r.json()["id"]
    while (sweep := http.get(f"/sweeps/{sweep_id}").json())["finished_at"] is None:
        if time.monotonic() > deadline:
            http.post(f"/sweeps/{sweep_id}/cancel")
            break
        time.sleep(1)
    return sweep, http.get(f"/sweeps/{sweep_id}/trials").json()["data"], time.monotonic() - began


def run_default_job(http: httpx.Client, body: dict, deadline: float) -> dict:
    """The job a user gets without a sweep (the sweep's fixed spec: same data and seed), outside the
    sweep's timer; its held-out accuracy at its best evaluation, as a trial's value. Cancelled at
    ``deadline``."""
    fields = ("base_model", "task", "training_dataset", "validation_dataset", "text_column", "label_column")
    job = {key: body[key] for key in (*fields, "hyperparameters")}
    began = time.monotonic()
    job_id = http.post("/jobs", json=job).raise_for_status().json()["id"]
    while (view := http.get(f"/jobs/{job_id}").json())["finished_at"] is None:
        if time.monotonic() > deadline:
            http.post(f"/jobs/{job_id}/cancel")
            break
        time.sleep(1)
    rows = http.get(f"/jobs/{job_id}/metrics", params={"limit": 10000}).json()["data"]
    return {
        "status": view["status"],
        "wall_seconds": time.monotonic() - began,
        "hyperparameters": view["hyperparameters"],
        "best_accuracy": max(
            (r["value"] for r in rows if r["name"] == "eval_accuracy" and r["value"] is not None), default=None
        ),
    }


def warm_start(http: httpx.Client, body: dict, first: dict, n: int, deadline: float) -> dict:
    """Issue 38's second sweep: ``body`` with ``warm_start_from: [first sweep]`` and ``n`` trials.
    ``include_defaults`` is off: the first sweep's default trial is in its history already, and
    rerunning it would spend one of the ``n`` trials on a known value.

    Returns its wall seconds, its new trials' count, the best of its new trials and of its history,
    which of the two is its best, and ``at_least_first``: whether its new trials' best is at least
    the first sweep's best (a best from the history equals that one by construction)."""
    sweep, trials, wall = run_sweep(
        http, body | {"warm_start_from": [first["id"]], "max_trials": n, "include_defaults": False}, deadline
    )
    new = sweep["best_trial"]["value"] if sweep["best_trial"] else None
    past = sweep["history"]["best"]["value"] if sweep["history"] and sweep["history"]["best"] else None
    first_best = first["best_trial"]["value"] if first["best_trial"] else None
    best_from = None  # a tie goes to the history: it was there first
    if past is not None and (new is None or past >= new):
        best_from = "history"
    elif new is not None:
        best_from = "new trial"
    return {
        "finished": sweep["finished_at"] is not None,
        "status": sweep["status"],
        "wall_seconds": wall,
        "new_trials": len(trials),
        "counts": sweep["trials"],
        "history_trials": sweep["history"]["trials"] if sweep["history"] else 0,
        "new_best_accuracy": new,
        "new_best_params": sweep["best_trial"]["params"] if sweep["best_trial"] else None,
        "history_best_accuracy": past,
        "best_accuracy": max((v for v in (new, past) if v is not None), default=None),
        "best_from": best_from,
        "first_sweep_best_accuracy": first_best,
        "at_least_first": new is not None and first_best is not None and new >= first_best,
    }


def multi_objective(http: httpx.Client, body: dict, n: int, deadline: float) -> dict:
    """Issue 38's third sweep: accuracy (maximize) against ``latency_ms`` (minimize), ``n`` trials,
    the first sweep's space plus ``max_length``. The issue-size held-out snippets are 26 tokens at the
    median (90th percentile 42, longest 78): a max_length over 64 cuts nothing, so the choices go down to
    16, where latency falls and accuracy may too.

    Returns the Pareto front (``pareto_trials``: trial number, max_length, [accuracy, latency_ms])
    and ``check``: whether the front holds a trial within 1 point (0.01) of the best accuracy at
    under half that trial's latency, with the two trials named."""
    lengths = {"max_length": {"type": "categorical", "choices": [16, 24, 32, 64, 128]}}
    spec = {key: value for key, value in body.items() if key != "objective"}
    sweep, trials, wall = run_sweep(
        http,
        spec
        | {
            "objectives": [
                {"metric": "accuracy", "direction": "maximize"},
                {"metric": "latency_ms", "direction": "minimize"},
            ],
            "search_space": body["search_space"] | lengths,
            "max_trials": n,
        },
        deadline,
    )
    front = [
        {"trial_number": t["trial_number"], "max_length": t["params"].get("max_length"), "values": t["values"]}
        for t in sweep["pareto_trials"]
    ]
    check = None
    if front:
        best = max(front, key=lambda t: (t["values"][0], -t["values"][1]))
        cheap = [
            t for t in front if t["values"][0] >= best["values"][0] - 0.01 and t["values"][1] < best["values"][1] / 2
        ]
        fast = min(cheap, key=lambda t: t["values"][1], default=None)
        check = {"holds": fast is not None, "best_accuracy_trial": best, "cheaper_trial": fast}
    return {
        "finished": sweep["finished_at"] is not None,
        "status": sweep["status"],
        "wall_seconds": wall,
        "counts": sweep["trials"],
        "pareto_trials": front,
        "check": check,
        "trials": [
            {"number": t["number"], "status": t["status"], "params": t["params"], "values": t["values"]} for t in trials
        ],
    }


def run_trainer(args, work: Path) -> dict:
    """``Trainer.hyperparameter_search`` (run in its own process: ``--side trainer``)."""
    import numpy as np
    import optuna
    import torch
    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer, TrainerCallback, TrainingArguments

    from bench.peers import encode, load_model
    from shared.jobs.base_models import resolve_model

    torch.set_num_threads(args.workers * args.threads_per_worker)
    train, val = load_split("rotten_tomatoes", args.train_size, args.val_size)
    labels = sorted({str(v) for v in train["label"]} | {str(v) for v in val["label"]})
    model_dir = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_set, val_set = encode(tokenizer, train, labels, 128), encode(tokenizer, val, labels, 128)
    steps = []

    class CountSteps(TrainerCallback):  # every trial's steps, a pruned one's too (it ends without on_train_end)
        def on_train_begin(self, a, state, control, **kw):
            steps.append(0)

        def on_step_end(self, a, state, control, **kw):
            steps[-1] += 1

    def accuracy(p):
        return {"accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())}

    def hp_space(trial):
        return {
            "learning_rate": trial.suggest_float("learning_rate", 1e-5, 3e-4, log=True),
            "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [16, 32]),
            # transformers 5 dropped TrainingArguments.warmup_ratio: a float warmup_steps in
            # [0, 1) is the ratio of total steps (the Trainer ignored "warmup_ratio" here before)
            "warmup_steps": trial.suggest_float("warmup_ratio", 0.0, 0.2),
            "num_train_epochs": trial.suggest_int("num_train_epochs", 1, args.max_epochs),
        }

    arguments = TrainingArguments(
        output_dir=str(work / "trainer"),
        eval_strategy="epoch",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
        logging_strategy="no",
        per_device_eval_batch_size=64,
        weight_decay=0.01,
    )
    trainer = Trainer(
        model_init=lambda: load_model(model_dir, labels, args.seed),
        args=arguments,
        train_dataset=train_set,
        eval_dataset=val_set,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
        callbacks=[CountSteps()],
    )
    began = time.monotonic()
    best = trainer.hyperparameter_search(
        direction="maximize",
        backend="optuna",
        hp_space=hp_space,
        n_trials=args.trials,
        compute_objective=lambda m: m["eval_accuracy"],
        sampler=optuna.samplers.TPESampler(seed=args.seed),  # passed on to optuna.create_study (pruner: its default)
    )
    return {
        "finished": True,
        "wall_seconds": time.monotonic() - began,
        "optimizer_steps": sum(steps),
        "trials_trained": len(steps),
        "best_accuracy": best.objective,
        "best_params": best.hyperparameters,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-size", type=int, default=4000)
    p.add_argument("--val-size", type=int, default=2000)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--max-epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds per sweep (tunejob's start-up counted in its first), per default job, and for the "
        "Trainer's search; a tunejob sweep or job still running then is cancelled",
    )
    p.add_argument(
        "--default-job",
        action="store_true",
        help="after tunejob's sweep, one job with the default hyperparameters on the same data and seed "
        "(held-out accuracy at its best evaluation, as a trial's value)",
    )
    p.add_argument(
        "--warm-start-trials",
        type=int,
        default=0,
        help="then a second tunejob sweep of this many trials, warm-started from the first (0: none)",
    )
    p.add_argument(
        "--multi-objective",
        type=int,
        default=0,
        help="then a tunejob sweep of this many trials on accuracy and latency_ms, max_length searched too (0: none)",
    )
    p.add_argument("--side", choices=["both", "tunejob", "trainer"], default="both")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.side != "both":
        with tempfile.TemporaryDirectory() as work:
            run = run_tunejob if args.side == "tunejob" else run_trainer
            print(json.dumps(run(args, Path(work)), default=str))
        return 0
    results = {"args": vars(args) | {"out": str(args.out)}}
    for side in ("tunejob", "trainer"):  # each cold, in its own process
        options = {
            "train-size": args.train_size,
            "val-size": args.val_size,
            "trials": args.trials,
            "max-epochs": args.max_epochs,
            "workers": args.workers,
            "seed": args.seed,
            "timeout": args.timeout,
            "threads-per-worker": args.threads_per_worker,
            "warm-start-trials": args.warm_start_trials,
            "multi-objective": args.multi_objective,
        }
        later = [args.default_job, args.warm_start_trials > 0, args.multi_objective > 0] if side == "tunejob" else []
        limit = args.timeout * (1 + sum(later)) + 120  # --timeout is per sweep or job: the side gets their sum
        cmd = [
            sys.executable,
            "-m",
            "bench.sweeps",
            "--side",
            side,
            *[part for name, value in options.items() for part in (f"--{name}", str(value))],
            *(["--default-job"] if args.default_job else []),
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
            results[side] = (
                json.loads(done.stdout.strip().splitlines()[-1])
                if done.returncode == 0
                else {"finished": False, "error": done.stderr[-2000:]}
            )
        except subprocess.TimeoutExpired:
            results[side] = {"finished": False, "error": f"ran past {limit} s"}
        print(side, json.dumps(without_trials(results[side]), default=str), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    return 0


def without_trials(result: dict) -> dict:
    """A side's result without its (and its later sweeps') per-trial rows: the line printed."""
    return {k: without_trials(v) if isinstance(v, dict) else v for k, v in result.items() if k != "trials"}


if __name__ == "__main__":
    sys.exit(main())
