"""The main job end to end, on the embedded default (``make demo``).

Starts ``tunejob serve`` with a fresh data directory (it writes a local API key there, which the
client sends), and through the REST API, with tunejob's own client (``client.Client``): uploads
BBC News (a stratified 80% as CSV, 20% held out with a fixed seed), fine-tunes all-MiniLM-L6-v2
through ``POST /jobs``, follows it with the live progress bar of ``tunejob jobs watch`` (the
server-sent event stream), downloads ``model.tar`` and scores it on the held-out split with a
``transformers`` pipeline.

    python -m bench.demo [--port 8765] [--epochs 1] [--max-length 128] [--model all-MiniLM-L6-v2]

On a GPU machine (``TUNEJOB_DEVICE=cuda``), ``--model`` names any model under ``TUNEJOB_MODELS_DIR``
(the GPU kit's randomly initialised ``bert-base-rand``: its accuracy means nothing, its timings do).
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from sklearn.metrics import accuracy_score

from bench.corpora import bbc_news, stratified_split
from client.api import Client
from client.watch import watch
from shared.logs import drop_known_noise

SEED = 42
WORK_DIR = Path(".demo")

drop_known_noise()  # before transformers imports torchao in score (shared.logs.KNOWN_NOISE)


def start_service(port: int, data_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "TUNEJOB_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    for name in ("TUNEJOB_DATABASE_URL", "TUNEJOB_BROKER_URL"):  # the embedded default
        env.pop(name, None)
    log = open(data_dir.parent / "service.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "tunejob", "serve", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def evaluate(model_dir: Path, texts: list[str], labels: list[str]) -> float:
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(model_dir), device="cpu")
    # The model's tokenizer carries the job's max_length (model_max_length): truncation=True cuts there.
    predictions = classify(texts, batch_size=32, truncation=True)
    return accuracy_score(labels, [p["label"] for p in predictions])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="a built-in model or one under TUNEJOB_MODELS_DIR")
    args = parser.parse_args()

    started = time.perf_counter()
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    data_dir = WORK_DIR / "data"
    data_dir.mkdir(parents=True)
    train, test = stratified_split(bbc_news(), test_size=0.2, seed=SEED)
    train_csv = WORK_DIR / "bbc_news_train.csv"
    train.to_csv(train_csv, index=False)

    service = start_service(args.port, data_dir)
    try:
        url = f"http://127.0.0.1:{args.port}"
        with Client(url, api_key="") as probe:
            probe.wait_until_up(timeout=120)
        # `tunejob serve` on loopback wrote a local API key before it answered /healthz.
        with Client(url, api_key=(data_dir / "api_key").read_text().strip(), timeout=120) as client:
            dataset = client.upload_dataset(train_csv)
            print(f"uploaded {dataset.filename}: {dataset.rows} rows ({dataset.id}); {len(test)} held out")
            job = client.create_job(
                {
                    "base_model": args.model,
                    "task": "classification",
                    "training_dataset": dataset.id,
                    "text_column": "text",
                    "label_column": "label",
                    "hyperparameters": {
                        "epochs": args.epochs,
                        "max_length": args.max_length,
                        "batch_size": args.batch_size,
                        "learning_rate": args.learning_rate,
                    },
                }
            )
            print(f"job {job.id} queued")
            if watch(client, job.id, Console()) != 0:
                return 1
            job = client.get_job(job.id)
            model_dir = client.download_model(job.id, WORK_DIR / "model")
    finally:
        service.terminate()
        service.wait(timeout=120)

    accuracy = evaluate(model_dir, test["text"].tolist(), test["label"].tolist())
    train_metrics, val = job.train_metrics, job.validation_metrics or {}
    print(f"\nheld-out test accuracy     {accuracy:.4f}  ({len(test)} BBC News articles)")
    print(f"validation accuracy        {val.get('accuracy', float('nan')):.4f}")
    print(
        f"padding efficiency         {train_metrics['padding_efficiency']:.3f} "
        f"(smart batching's own, before any bucket padding: {train_metrics['padding_efficiency_unrounded']:.3f})"
    )
    print(f"training throughput        {train_metrics['tokens_per_second']:.0f} real tokens/s on {job.device}")
    print(f"training time              {train_metrics['train_seconds']:.0f} s for {job.progress.step} steps")
    print(
        "job timings (s)            "
        + ", ".join(f"{k} {v:.1f}" for k, v in job.timings.model_dump().items() if v is not None)
    )
    print(f"demo wall time             {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
