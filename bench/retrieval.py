"""BBC News as title -> article retrieval (issue 36): each article's first line is its title, the rest
its body. The articles are split at random (by article) into training and validation pairs; an
``embedding`` job fine-tunes a base model on the training pairs through the worker's own recipe
(``worker.training.recipe.fine_tune``, a transient ``Job``) and reports the validation ``ndcg@10`` of the
base model (zero-shot, before the first step) and after each epoch.

    python -m bench.retrieval --train 400 --validation 200 --epochs 1 --max-length 128

Prints one JSON object: the sizes, the zero-shot and fine-tuned retrieval metrics and the seconds.
"""

import argparse
import json
import os
import tempfile
import time
import uuid

import pandas as pd
import torch

from bench.corpora import bbc_news


def title_pairs() -> pd.DataFrame:
    """Columns ``anchor`` (the title) and ``positive`` (the body) of every BBC News article."""
    parts = bbc_news()["text"].str.strip().str.split("\n", n=1, expand=True)
    return pd.DataFrame({"anchor": parts[0].str.strip(), "positive": parts[1].fillna("").str.strip()}).query(
        "anchor != '' and positive != ''").reset_index(drop=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--validation", type=int, default=200)
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.environ.setdefault("TUNEJOB_DATA_DIR", tempfile.mkdtemp(prefix="bench-retrieval-"))

    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job
    from worker.data import JobData
    from worker.reporter import MemoryReporter
    from worker.training.recipe import fine_tune

    pairs = title_pairs().sample(frac=1.0, random_state=args.seed).reset_index(drop=True)
    train = pairs.iloc[:args.train].reset_index(drop=True)
    validation = pairs.iloc[args.train:args.train + args.validation].reset_index(drop=True)
    spec = JobCreate(base_model=args.model, task="embedding", training_dataset="ds_bench", hyperparameters={
        "epochs": args.epochs, "batch_size": args.batch_size, "max_length": args.max_length,
        "learning_rate": args.learning_rate, "seed": args.seed})
    job = Job(id=f"bench-{uuid.uuid4().hex[:12]}", task="embedding", base_model=args.model,
              spec=spec.model_dump(mode="json"))
    reporter, start = MemoryReporter(), time.perf_counter()
    outcome = fine_tune(job, JobData(train, validation), torch.device("cpu"), reporter)
    names = ("ndcg@10", "mrr@10", "recall@1", "recall@10", "map@100")
    series = {name: reporter.series(f"eval_{name}") for name in names}
    result = {"outcome": outcome, "train_pairs": len(train), "validation_pairs": len(validation),
              "zero_shot": {n: round(s[0], 4) for n, s in series.items()},
              "fine_tuned": {n: round(s[max(s)], 4) for n, s in series.items()},
              "train_seconds": round(reporter.fields["train_metrics"]["train_seconds"], 1),
              "seconds": round(time.perf_counter() - start, 1), "torch_threads": torch.get_num_threads()}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
