"""The main job end to end, on the embedded default (``make demo``).

Starts ``tunejob serve`` with a fresh data directory, uploads BBC News (a stratified 80% as CSV,
20% held out with a fixed seed), fine-tunes all-MiniLM-L6-v2 through ``POST /jobs``, shows the
progress polled over HTTP, downloads ``model.tar.gz`` and scores it on the held-out split with a
``transformers`` pipeline.

    python -m bench.demo [--port 8765] [--epochs 1] [--max-length 128]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
from sklearn.metrics import accuracy_score
from tqdm import tqdm

from bench.corpora import bbc_news, stratified_split

SEED = 42
WORK_DIR = Path(".demo")


def start_service(port: int, data_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "TUNEJOB_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    for name in ("TUNEJOB_DATABASE_URL", "TUNEJOB_BROKER_URL"):  # the embedded default
        env.pop(name, None)
    log = open(data_dir.parent / "service.log", "w")
    return subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def follow(client: httpx.Client, job_id: str) -> dict:
    """Poll the job and draw a progress bar (step, loss, ETA) until it finishes."""
    with tqdm(total=None, unit="step", desc="fine-tuning", dynamic_ncols=True, mininterval=2.0) as bar:
        while True:
            job = client.get(f"/jobs/{job_id}").raise_for_status().json()
            progress = job["progress"]
            bar.total = progress["total_steps"]
            bar.n = progress["step"]
            loss = (job["train_metrics"] or {}).get("loss")
            eta = progress["eta_seconds"]
            bar.set_postfix_str(f"{job['status']} loss={loss:.3f} eta={eta:.0f}s" if loss is not None and eta is not None
                                else job["status"], refresh=False)
            bar.update(0)
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            time.sleep(1.0)


def evaluate(model_dir: Path, texts: list[str], labels: list[str], max_length: int) -> float:
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(model_dir), device="cpu")
    predictions = classify(texts, batch_size=32, truncation=True, max_length=max_length)
    return accuracy_score(labels, [p["label"] for p in predictions])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    args = parser.parse_args()

    started = time.perf_counter()
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    data_dir = WORK_DIR / "data"
    data_dir.mkdir(parents=True)
    train, test = stratified_split(bbc_news(), test_size=0.2, seed=SEED)
    train_csv = WORK_DIR / "bbc_news_train.csv"
    train.to_csv(train_csv, index=False)

    service = start_service(args.port, data_dir)
    # Connection retries (with httpcore's backoff) cover the service's start-up.
    transport = httpx.HTTPTransport(retries=8)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", transport=transport, timeout=120) as client:
            client.get("/healthz").raise_for_status()
            with open(train_csv, "rb") as f:
                dataset = client.post("/datasets", files={"file": (train_csv.name, f, "text/csv")}).raise_for_status().json()
            print(f"uploaded {dataset['filename']}: {dataset['rows']} rows ({dataset['id']}); {len(test)} held out")
            job = client.post("/jobs", json={
                "base_model": "all-MiniLM-L6-v2",
                "task": "classification",
                "training_dataset": dataset["id"],
                "text_column": "text",
                "label_column": "label",
                "hyperparameters": {"epochs": args.epochs, "max_length": args.max_length,
                                    "batch_size": args.batch_size, "learning_rate": args.learning_rate},
            }).raise_for_status().json()
            print(f"job {job['id']} queued")
            job = follow(client, job["id"])
            if job["status"] != "succeeded":
                print(f"job ended {job['status']}: {job['error']}", file=sys.stderr)
                return 1
            model_dir = WORK_DIR / "model"
            archive = WORK_DIR / "model.tar.gz"
            with client.stream("GET", f"/jobs/{job['id']}/artifacts/model.tar.gz") as r, open(archive, "wb") as f:
                for chunk in r.raise_for_status().iter_bytes():
                    f.write(chunk)
            with tarfile.open(archive) as tar:
                tar.extractall(model_dir, filter="data")
    finally:
        service.terminate()
        service.wait(timeout=120)

    accuracy = evaluate(model_dir, test["text"].tolist(), test["label"].tolist(), args.max_length)
    train_metrics, val = job["train_metrics"], job["validation_metrics"] or {}
    print(f"\nheld-out test accuracy     {accuracy:.4f}  ({len(test)} BBC News articles)")
    print(f"validation accuracy        {val.get('accuracy', float('nan')):.4f}")
    print(f"padding efficiency         {train_metrics['padding_efficiency']:.3f} "
          f"(before the pad_to_multiple_of rounding: {train_metrics['padding_efficiency_unrounded']:.3f})")
    print(f"training throughput        {train_metrics['tokens_per_second']:.0f} real tokens/s on {job['device']}")
    print(f"training time              {train_metrics['train_seconds']:.0f} s for {job['progress']['step']} steps")
    print(f"demo wall time             {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
