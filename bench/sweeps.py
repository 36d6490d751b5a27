"""A tunejob sweep next to ``Trainer.hyperparameter_search(backend="optuna")`` (issue 25's "Done when"):
the same corpus split, search space, number of trials and seed, each side cold in its own process,
one after the other in one invocation (so the machine's load hits both alike).

- tunejob: a real ``tunejob serve --workers W`` (the embedded default, a fresh data directory), the
  training rows uploaded as the training dataset and the held-out rows as the validation dataset;
  ``POST /sweeps`` (TPE, median pruning), polled until it ends. Wall time: POST to the sweep's end.
- Trainer: ``Trainer(model_init=...)`` with an evaluation per epoch on the same held-out rows,
  ``hyperparameter_search(direction="maximize", backend="optuna", n_trials=N, hp_space=...)`` as
  its docs show it (its default Optuna study: TPE, median pruner), the objective held-out accuracy.
  Wall time: the call.

Both report the optimizer steps all their trials ran and the best trial's held-out accuracy. With
``--default-job``, tunejob's side then runs one job with the default hyperparameters on the same
data and seed (outside the sweep's timer): the model a user gets without a sweep.

    python -m bench.sweeps --train-size 4000 --val-size 2000 --trials 12 --workers 2 --default-job   # the issue's run
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
    """One sweep on ``tunejob serve --workers``; returns wall seconds, steps, best accuracy."""
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
    deadline = time.monotonic() + args.timeout  # start-up included: this side never outlives its limit
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
        began = time.monotonic()
        r = http.post("/sweeps", json=body)
        r.raise_for_status()
        sweep_id = r.json()["id"]
        while (sweep := http.get(f"/sweeps/{sweep_id}").json())["finished_at"] is None:
            if time.monotonic() > deadline:
                http.post(f"/sweeps/{sweep_id}/cancel")
                return {
                    "finished": False,
                    "wall_seconds": time.monotonic() - began,
                    "trials": http.get(f"/sweeps/{sweep_id}/trials").json()["data"],
                }
            time.sleep(1)
        wall = time.monotonic() - began
        trials = http.get(f"/sweeps/{sweep_id}/trials").json()["data"]
        result = {
            "finished": True,
            "status": sweep["status"],
            "wall_seconds": wall,
            "optimizer_steps": sum(t["steps"] for t in trials),
            "counts": sweep["trials"],
            "best_accuracy": sweep["best_trial"]["value"] if sweep["best_trial"] else None,
            "best_params": sweep["best_trial"]["params"] if sweep["best_trial"] else None,
            "trials": trials,
        }
        if args.default_job:  # after the sweep's timer: the job a user gets without a sweep, same data and seed
            job = {
                key: body[key]
                for key in (
                    "base_model",
                    "task",
                    "training_dataset",
                    "validation_dataset",
                    "text_column",
                    "label_column",
                    "hyperparameters",
                )
            }
            began = time.monotonic()
            job_id = http.post("/jobs", json=job).raise_for_status().json()["id"]
            while (view := http.get(f"/jobs/{job_id}").json())["finished_at"] is None:
                time.sleep(1)
            rows = http.get(f"/jobs/{job_id}/metrics", params={"limit": 10000}).json()["data"]
            result["default_job"] = {
                "status": view["status"],
                "wall_seconds": time.monotonic() - began,
                "hyperparameters": view["hyperparameters"],
                "best_accuracy": max(
                    (r["value"] for r in rows if r["name"] == "eval_accuracy" and r["value"] is not None), default=None
                ),
            }
        return result
    finally:
        serve.terminate()
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()


def run_trainer(args, work: Path) -> dict:
    """``Trainer.hyperparameter_search`` (run in its own process: ``--side trainer``)."""
    import numpy as np
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
        default=1200,
        help="seconds per side, start-up included; tunejob's sweep still running then is cancelled",
    )
    p.add_argument(
        "--default-job",
        action="store_true",
        help="after tunejob's sweep, one job with the default hyperparameters on the same data and seed "
        "(held-out accuracy at its best evaluation, as a trial's value)",
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
        }
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
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 120)
            results[side] = (
                json.loads(done.stdout.strip().splitlines()[-1])
                if done.returncode == 0
                else {"finished": False, "error": done.stderr[-2000:]}
            )
        except subprocess.TimeoutExpired:
            results[side] = {"finished": False, "error": f"ran past {args.timeout + 120} s"}
        print(side, json.dumps({k: v for k, v in results[side].items() if k != "trials"}, default=str), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
