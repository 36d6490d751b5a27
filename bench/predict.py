"""Batch prediction throughput: ``shared.inference.predict_texts`` next to
``transformers.pipeline("text-classification", batch_size=32, truncation=True)`` on the same
fine-tuned model and texts, each configuration in a fresh process.

    python -m bench.predict prepare --dataset rotten_tomatoes   # fine-tune all-MiniLM-L6-v2 (1 epoch) into .bench-predict/
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(".bench-predict")


def model_path(dataset: str) -> Path:
    """Where ``prepare`` saves the model fine-tuned on ``dataset``."""
    return BENCH_DIR / f"{dataset}-minilm"


def prepare(dataset: str, max_length: int, learning_rate: float) -> Path:
    """Fine-tune all-MiniLM-L6-v2 on the training part of ``dataset`` (the issue's set: Rotten
    Tomatoes 4,000 texts, BBC News the whole 80% split) for one epoch with the engine's own recipe
    (``bench.engine``) and save it as a tunejob model folder (safetensors, config with id2label,
    tokenizer). Returns the folder."""
    from bench.cold import RunSpec
    from bench.corpora import CORPORA, load_split
    from bench.engine import BenchReporter, make_job
    from bench.measure import Clock
    from worker.data import JobData
    from worker.device import resolve_device
    from worker.train import setup, train, warm_up

    corpus = CORPORA[dataset]
    spec = RunSpec(dataset=dataset, config="smart", model="all-MiniLM-L6-v2", device="auto", precision="auto",
                   batch_size=32, max_length=max_length, train_size=corpus.train_size, val_size=corpus.val_size,
                   learning_rate=learning_rate)
    train_df, _ = load_split(dataset, corpus.train_size, corpus.val_size)
    labels = sorted(str(v) for v in train_df["label"].unique())
    device, _ = resolve_device("auto")
    reporter = BenchReporter(Clock(device), epochs=1)
    with tempfile.TemporaryDirectory(prefix="tunejob-bench-") as data_dir:
        os.environ["TUNEJOB_DATA_DIR"] = data_dir
        run = setup(make_job("smart", spec, labels), JobData(train_df, None), device, reporter)
        reporter.run = run
        warm_up(run, reporter)
        if train(run, reporter) != "completed":
            raise RuntimeError("fine-tuning stopped before the end of its epoch")
    out = model_path(dataset)
    run.model.save_pretrained(out, safe_serialization=True)
    run.tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="fine-tune the model the benchmark predicts with")
    prep.add_argument("--dataset", choices=["rotten_tomatoes", "bbc"], required=True)
    prep.add_argument("--max-length", type=int, default=None, help="default: the corpus's (128 / 512)")
    prep.add_argument("--learning-rate", type=float, default=1e-4)
    args = p.parse_args(argv)
    if args.command == "prepare":
        from bench.corpora import CORPORA

        os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
        print(prepare(args.dataset, args.max_length or CORPORA[args.dataset].max_length, args.learning_rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
