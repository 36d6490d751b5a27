"""Does a change to the training step change training? The engine of two checkouts (e.g. the
previous main in a ``git worktree`` and this one) trains the same job on the same rows, each in its
own process, and their per-step losses, gradient norms and held-out accuracies are compared.

On the CPU the engine is deterministic, so two checkouts whose steps compute the same thing give
the same losses up to float rounding (a relative difference near 1e-7); a change that alters what
a step computes shows at once, long before it would show in an accuracy averaged over seeds.

Each side runs the recipe's ``setup``, ``warm_up`` and ``train`` (``worker.training.recipe``;
``worker.train`` in checkouts before it; no evaluation inside), then scores the final
weights on the held-out rows; the job has no validation set, so nothing but the step differs. The
reporter is each checkout's own ``tests.conftest.RecordingReporter``.

    git worktree add /tmp/previous <commit>
    python -m bench.compare_checkouts /tmp/previous . --dataset rotten_tomatoes_longest --train-size 400 \\
        --test-size 200 --epochs 2 --batch-size 16 --max-length 512
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs inside each checkout (argv: checkout, data dir, hyperparameters as JSON); prints one JSON line.
SIDE = r"""
import inspect, json, os, sys
checkout, data, hp = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, checkout)
os.chdir(checkout)
import pandas as pd, torch
from shared.store.rows import Job
from shared.schemas.jobs import JobCreate
from tests.conftest import RecordingReporter
from worker.data import JobData

train, test = pd.read_pickle(f"{data}/train.pkl"), pd.read_pickle(f"{data}/test.pkl")
labels = sorted(train.label.unique())
spec = JobCreate(base_model="all-MiniLM-L6-v2", training_dataset="ds_x", validation_split=0.0, hyperparameters=hp)
job = Job(id="compare", task="classification", base_model="all-MiniLM-L6-v2", label_names=labels,
          spec=spec.model_dump(mode="json"))
names = ["t.csv", "t.csv"] if "train_name" in inspect.signature(JobData).parameters else []  # before the cache
reporter = RecordingReporter()
try:
    from worker.training.recipe import Recipe
except ImportError:  # a checkout before the recipe class: worker.train's functions
    from worker import train as engine
    run = engine.setup(job, JobData(train, None, *names), torch.device("cpu"), reporter)
    engine.train(run, reporter)
    tokenizer = run.tokenizer
else:
    run = Recipe(job, torch.device("cpu")).setup(JobData(train, None, *names), reporter)
    run.warm_up(reporter)
    run.train(reporter)
    tokenizer = run.job_setup.tokenizer
run.model.eval()
correct = 0
with torch.no_grad():
    for i in range(0, len(test), 64):
        chunk = test.iloc[i:i + 64]
        enc = tokenizer(list(chunk.text), truncation=True, max_length=hp["max_length"], padding=True,
                        return_tensors="pt")
        predicted = run.model(**enc).logits.argmax(-1).tolist()
        correct += sum(labels[p] == label for p, label in zip(predicted, chunk.label))
print("RESULT " + json.dumps({"loss": reporter.series("train_loss"), "grad_norm": reporter.series("grad_norm"),
                              "accuracy": correct / len(test)}))
"""


def run_side(checkout: Path, data: Path, hyperparameters: dict) -> dict:
    """Train in ``checkout`` (a fresh process, with this interpreter) and return its results."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "TUNEJOB_DEVICE": "cpu",
        "TUNEJOB_DATA_DIR": str(data / "store"),
        "PATH": "/usr/bin:/bin",
    }
    out = subprocess.run(
        [sys.executable, "-c", SIDE, str(checkout.resolve()), str(data), json.dumps(hyperparameters)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    result["loss"] = {int(k): v for k, v in result["loss"].items()}
    result["grad_norm"] = {int(k): v for k, v in result["grad_norm"].items()}
    return result


def largest_relative_difference(a: dict[int, float], b: dict[int, float]) -> float:
    """Over the steps both logged: max |a - b| / |b|."""
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-12) for s in a.keys() & b.keys())


def main() -> int:
    from bench.corpora import CORPORA, load_split

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path, help="a checkout (e.g. a git worktree of the previous main)")
    p.add_argument("after", type=Path, help="another checkout (e.g. .)")
    p.add_argument("--dataset", choices=list(CORPORA), default="rotten_tomatoes_longest")
    p.add_argument("--train-size", type=int, default=400)
    p.add_argument("--test-size", type=int, default=200)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    hyperparameters = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
    }
    train, test = load_split(args.dataset, args.train_size, args.test_size)
    with tempfile.TemporaryDirectory(prefix="tunejob-compare-") as tmp:
        data = Path(tmp)
        train.to_pickle(data / "train.pkl")
        test.to_pickle(data / "test.pkl")
        before, after = (run_side(checkout, data, hyperparameters) for checkout in (args.before, args.after))
    print(
        json.dumps(
            {
                "steps": [len(before["loss"]), len(after["loss"])],
                "largest_relative_difference": {
                    "train_loss": largest_relative_difference(after["loss"], before["loss"]),
                    "grad_norm": largest_relative_difference(after["grad_norm"], before["grad_norm"]),
                },
                "held_out_accuracy": [before["accuracy"], after["accuracy"]],
                "hyperparameters": hyperparameters,
                "dataset": args.dataset,
                "train_size": len(train),
                "test_size": len(test),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
