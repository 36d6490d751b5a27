"""Where a job's wall time goes, through the real service: POST to the first optimizer step, the
phases, the last step to ``succeeded``, the download, and the disk a finished job keeps.

Starts ``tunejob serve`` on the CPU with a fresh data directory (the embedded default), uploads a
stratified slice of BBC News as CSV, and runs the same job several times in a row: the first on a
worker that has just started (cold: its first job), the others on the same worker (warm: a
second job on the same data also reads the tokenization cache). Each figure comes from the job
itself: its ``timings``, the time of its first and last ``train_loss`` (logged right after each
optimizer step) and its ``finished_at``, against the wall time at which this script sent POST (one
clock: same machine). The model is built before the service starts and is not measured:

- ``bert-base-rand``: a BERT-base-shape classifier (12 layers, hidden 768, 110M parameters,
  438 MB of fp32 safetensors) with random weights from ``BertConfig()``, and the all-MiniLM-L6-v2
  tokenizer (the same 30,522-token WordPiece vocabulary);
- ``tiny-rand``: 2 layers, hidden 32 (a smoke run in seconds);
- any other name: a model the service already offers (e.g. ``all-MiniLM-L6-v2``).

Sends ``Authorization: Bearer <data dir>/api_key`` when the service wrote that file.

    python -m bench.latency [--model bert-base-rand] [--texts 120] [--max-length 128] \\
        [--warm-jobs 2] [--json out.json] [--markdown docs/benchmarks.md]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

from bench.corpora import bbc_news, stratified_split
from bench.measure import host
from bench.tables import table, update_markdown
from shared.store import artifacts

SEED = 42
RANDOM_MODELS = {  # BertConfig overrides; BertConfig() itself is the bert-base shape
    "bert-base-rand": {},
    "tiny-rand": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
}
PHASES = ["queued", "load", "tokenize", "warmup", "train", "evaluate", "save", "total"]


def build_random_model(name: str, models_dir: Path) -> None:
    """A BertForSequenceClassification with random weights and the all-MiniLM-L6-v2 tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from shared.jobs.base_models import available_models

    tokenizer = AutoTokenizer.from_pretrained(available_models()["all-MiniLM-L6-v2"][0])
    torch.manual_seed(SEED)
    config = BertConfig(vocab_size=tokenizer.vocab_size, **RANDOM_MODELS[name])
    BertForSequenceClassification(config).save_pretrained(models_dir / name, safe_serialization=True)
    tokenizer.save_pretrained(models_dir / name)


def start_service(work: Path, port: int, models_dir: Path) -> tuple[subprocess.Popen, Path]:
    env = {
        **os.environ,
        "TUNEJOB_DATA_DIR": str(work / "data"),
        "TUNEJOB_MODELS_DIR": str(models_dir),
        "TUNEJOB_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
    }
    for name in ("TUNEJOB_DATABASE_URL", "TUNEJOB_BROKER_URL"):  # the embedded default
        env.pop(name, None)
    log = work / "service.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tunejob", "serve", "--port", str(port)],
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    return proc, log


def wait_ready(client: httpx.Client, log: Path, started: float, timeout: float = 300) -> dict:
    """Seconds from starting the service to the API answering and to the worker taking jobs
    (Celery's ``ready.`` line, logged after the worker's preload)."""
    up = None
    while time.monotonic() - started < timeout:
        if up is None:
            try:
                if client.get("/healthz").status_code == 200:
                    up = time.monotonic() - started
            except httpx.HTTPError:
                pass
        if up is not None and " ready." in log.read_text(errors="replace"):
            return {"api_up": up, "worker_ready": time.monotonic() - started}
        time.sleep(0.1)
    raise SystemExit(f"the service did not start within {timeout}s; see {log}")


def auth_headers(data_dir: Path) -> dict:
    key = data_dir / "api_key"
    return {"Authorization": f"Bearer {key.read_text().strip()}"} if key.is_file() else {}


def seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def run_job(client: httpx.Client, spec: dict, data_dir: Path) -> dict:
    """POST one job, poll it every 50 ms until it ends, download ``model.tar``; its figures."""
    posted = time.time()
    job = client.post("/jobs", json=spec).raise_for_status().json()
    seen_first = None
    while job["status"] not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.05)
        job = client.get(f"/jobs/{job['id']}").raise_for_status().json()
        if seen_first is None and job["progress"]["step"] >= 1:
            seen_first = time.time() - posted
    if job["status"] != "succeeded":
        raise SystemExit(f"job {job['id']} ended {job['status']}: {job['error']}")
    metrics = client.get(f"/jobs/{job['id']}/metrics", params={"limit": 100_000}).raise_for_status().json()["data"]
    steps = sorted((m["step"], seconds(m["time"])) for m in metrics if m["name"] == "train_loss")
    finished = seconds(job["finished_at"])
    events = {e["code"]: e["message"] for e in client.get(f"/jobs/{job['id']}/events").json()["data"]}

    started = time.perf_counter()
    with client.stream("GET", f"/jobs/{job['id']}/artifacts/model.tar") as r:
        tar_bytes = sum(len(chunk) for chunk in r.raise_for_status().iter_bytes())
    download = time.perf_counter() - started

    checkpoints = data_dir / "checkpoints" / job["id"]
    deadline = time.monotonic() + 10
    while checkpoints.exists() and time.monotonic() < deadline:  # deleted just after `succeeded`
        time.sleep(0.05)
    model_dir = data_dir / "artifacts" / job["id"] / "model"
    return {
        "job": job["id"],
        "steps": job["progress"]["total_steps"],
        "timings": job["timings"],
        "post_to_first_step": steps[0][1] - posted,
        "post_to_first_step_polled": seen_first,
        "last_step_to_succeeded": finished - steps[-1][1],
        "post_to_succeeded": finished - posted,
        "download_model_tar": download,
        "model_tar_bytes": tar_bytes,
        "footprint_bytes": artifacts.disk_bytes(data_dir / "artifacts" / job["id"], checkpoints),
        "weights_bytes": (model_dir / "model.safetensors").stat().st_size,
        "tokenization": events.get("tokenized", ""),
    }


def render(results: list[dict], meta: dict) -> str:
    """A markdown table: one column per job (cold first), one row per figure."""

    def row(label, fn, spec=".2f"):
        return [label] + [format(fn(r), spec) if fn(r) is not None else "n/a" for r in results]

    names = ["cold (1st job of the worker)"] + [f"warm {i}" for i in range(1, len(results))]
    rows = [
        row("POST to first optimizer step (s)", lambda r: r["post_to_first_step"]),
        row("... seen by polling GET /jobs/{id} every 50 ms (s)", lambda r: r["post_to_first_step_polled"]),
        row(
            "... minus `load` (dataset read + model load) (s)", lambda r: r["post_to_first_step"] - r["timings"]["load"]
        ),
        *[row(f"`timings.{p}` (s)", lambda r, p=p: r["timings"][p]) for p in PHASES],
        row("last optimizer step to `succeeded` (s)", lambda r: r["last_step_to_succeeded"]),
        row("POST to `succeeded` (s)", lambda r: r["post_to_succeeded"]),
        row("download `model.tar` (s)", lambda r: r["download_model_tar"]),
        row("job's files on disk (MB)", lambda r: r["footprint_bytes"] / 1e6, ".1f"),
        row("... / model.safetensors", lambda r: r["footprint_bytes"] / r["weights_bytes"], ".3f"),
        ["tokenization"] + [r["tokenization"].rsplit(": ", 1)[-1] for r in results],
    ]
    start = meta["service_start"]
    return "\n".join(
        [
            f"_Measured {meta['date']} on {meta['machine']} (CPU, torch {meta['torch']}, transformers "
            f"{meta['transformers']}) with `{meta['command']}`; machine state: {meta['machine_state']}._",
            "",
            f"{meta['model']}, {meta['texts']} BBC News texts (10% held out for validation), max_length "
            f"{meta['max_length']}, batch {meta['batch_size']}, {meta['epochs']:g} epoch(s), {results[0]['steps']} steps. "
            f"Service start to API up {start['api_up']:.1f} s, to worker ready {start['worker_ready']:.1f} s.",
            "",
            table(["figure"] + names, rows),
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-base-rand", help=f"{', '.join(RANDOM_MODELS)}, or an offered model")
    p.add_argument(
        "--texts",
        type=int,
        default=120,
        help="BBC News texts uploaded: a stratified sample (seed 42) of the 1,780 of the 80%% training split",
    )
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--warm-jobs", type=int, default=2, help="jobs after the first, on the same worker")
    p.add_argument("--port", type=int, default=8799)
    p.add_argument("--machine-state", default="not stated", help="e.g. 'quiet' or 'shared with test runs'")
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("--markdown", type=Path, help="fill the <!-- bench:latency-MODEL --> section of this file")
    p.add_argument("--keep", action="store_true", help="keep the work directory (data, service log)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tunejob-latency-"))
    models_dir = work / "models"
    models_dir.mkdir()
    if args.model in RANDOM_MODELS:
        build_random_model(args.model, models_dir)
    train, _ = stratified_split(bbc_news(), test_size=0.2, seed=SEED)
    sample = (
        stratified_split(train, test_size=1 - args.texts / len(train), seed=SEED)[0]
        if args.texts < len(train)
        else train
    )
    csv = work / "bbc_slice.csv"
    sample.to_csv(csv, index=False)
    spec = {
        "base_model": args.model,
        "task": "classification",
        "text_column": "text",
        "label_column": "label",
        "hyperparameters": {
            "epochs": args.epochs,
            "max_length": args.max_length,
            "batch_size": args.batch_size,
            "learning_rate": 5e-5,
        },
    }

    started = time.monotonic()
    service, log = start_service(work, args.port, models_dir)
    results = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=300) as client:
            service_start = wait_ready(client, log, started)
            client.headers.update(auth_headers(work / "data"))
            with open(csv, "rb") as f:
                dataset = client.post("/datasets", files={"file": (csv.name, f, "text/csv")}).raise_for_status().json()
            spec["training_dataset"] = dataset["id"]
            for i in range(1 + args.warm_jobs):
                results.append(run_job(client, spec, work / "data"))
                print(
                    f"job {i + 1}: " + json.dumps({k: v for k, v in results[-1].items() if k != "tokenization"}),
                    flush=True,
                )
    finally:
        service.terminate()
        service.wait(timeout=120)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": host(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model,
        "command": "python -m bench.latency " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine_state": args.machine_state,
        "texts": len(sample),
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "service_start": service_start,
    }
    text = render(results, meta)
    print("\n" + text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "jobs": results}, indent=1))
    if args.markdown:
        update_markdown(args.markdown, {f"latency-{args.model}": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
