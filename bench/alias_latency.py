"""Sync predict through a model alias against the job id (issue 37's target: no measurable
latency), through the whole app in this process.

Builds the app (``api.main.create_app``) on a fresh data directory with the embedded default
(SQLite), trains one short job on a slice of BBC News in this process (``worker.tasks.run_job``;
``tiny-rand`` by default: the figure is the route's overhead, not the model's), points an alias at
it, then sends ``POST /models/{ref}/predict`` with one text ``--requests`` times for each ref
through Starlette's ``TestClient`` (no sockets: what is left is the route, the store reads and the
model), interleaved (job id, alias, alias, job id, ...) so that both see the same machine load,
after ``--warmup`` requests each (the first loads the model). It reports each ref's p50, p90 and
mean in milliseconds, and the difference of the medians with a bootstrap 95% interval
(``scipy.stats.bootstrap``).

    python -m bench.alias_latency [--model tiny-rand] [--requests 400] [--markdown docs/benchmarks-archive.md]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.corpora import bbc_news, stratified_split
from bench.latency import RANDOM_MODELS, SEED, build_random_model
from bench.measure import host
from bench.tables import table, update_markdown

TEXT = "Shares in the bank fell sharply after the profit warning"


def timed(client, ref: str) -> float:
    """Seconds of one sync predict of ``TEXT`` with model ``ref``."""
    started = time.perf_counter()
    client.post(f"/models/{ref}/predict", json={"inputs": [TEXT]}).raise_for_status()
    return time.perf_counter() - started


def median_difference(alias: np.ndarray, job: np.ndarray) -> tuple[float, float, float]:
    """Median(alias) - median(job) in ms, with a bootstrap 95% confidence interval."""
    from scipy.stats import bootstrap

    result = bootstrap(
        (alias, job), lambda a, b: np.median(a) - np.median(b), n_resamples=2000, vectorized=False, random_state=SEED
    )
    interval = result.confidence_interval
    return (float(np.median(alias) - np.median(job)) * 1e3, float(interval.low) * 1e3, float(interval.high) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-rand")
    parser.add_argument("--requests", type=int, default=400, help="per ref, after the warm-up")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)

    machine = host()
    work = Path(tempfile.mkdtemp(prefix="tunejob-alias-"))
    models_dir = work / "models"
    models_dir.mkdir()
    if args.model in RANDOM_MODELS:
        build_random_model(args.model, models_dir)
    train, _ = stratified_split(bbc_news(), test_size=0.2, seed=SEED)
    csv = work / "bbc_slice.csv"
    stratified_split(train, test_size=1 - 100 / len(train), seed=SEED)[0].to_csv(csv, index=False)
    for name in [k for k in os.environ if k.startswith("TUNEJOB_")]:
        del os.environ[name]
    os.environ.update(
        TUNEJOB_DATA_DIR=str(work / "data"),
        TUNEJOB_MODELS_DIR=str(models_dir),
        TUNEJOB_DEVICE="cpu",
        TUNEJOB_RATE_LIMIT="1000000/second",
        HF_HUB_OFFLINE="1",
    )
    from fastapi.testclient import TestClient

    from api.main import create_app
    from shared.jobs import aliases
    from shared.settings import get_settings
    from shared.store.keys import authenticate, create_key
    from worker import tasks

    get_settings.cache_clear()  # build_random_model read the settings before the variables above

    try:
        with TestClient(create_app(), base_url="http://localhost") as client:
            client.headers["Authorization"] = f"Bearer {create_key('bench')[0]}"
            with open(csv, "rb") as f:
                dataset = client.post("/datasets", files={"file": (csv.name, f, "text/csv")}).raise_for_status().json()
            job = (
                client.post(
                    "/jobs",
                    json={
                        "base_model": args.model,
                        "training_dataset": dataset["id"],
                        "hyperparameters": {"epochs": 1, "max_length": 64},
                    },
                )
                .raise_for_status()
                .json()
            )
            if tasks.run_job(job["id"]) != "succeeded":
                raise SystemExit(f"job {job['id']} did not succeed: {client.get('/jobs/' + job['id']).json()}")
            client.put("/models/aliases/production", json={"job_id": job["id"]}).raise_for_status()
            refs = {"job id": job["id"], "alias": "production"}
            times: dict[str, list[float]] = {name: [] for name in refs}
            for i in range(args.warmup + args.requests):
                for name, ref in refs.items() if i % 2 else reversed(refs.items()):  # alternate which goes first
                    elapsed = timed(client, ref)
                    if i >= args.warmup:
                        times[name].append(elapsed)
            caller = authenticate(client.headers["Authorization"].removeprefix("Bearer "))
            started = time.perf_counter()
            for _ in range(args.requests):
                aliases.resolve("production", caller)
            resolve_ms = (time.perf_counter() - started) / args.requests * 1e3
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ms = {name: np.array(values) * 1e3 for name, values in times.items()}
    difference, low, high = median_difference(np.array(times["alias"]), np.array(times["job id"]))
    rows = [[name, f"{np.median(v):.2f}", f"{np.percentile(v, 90):.2f}", f"{v.mean():.2f}"] for name, v in ms.items()]
    text = (
        f"Sync predict (`POST /models/{{ref}}/predict`, one text, {args.model}), {args.requests} requests per "
        f"ref, interleaved, after {args.warmup} each; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{machine}; the embedded default (SQLite), in process (TestClient).\n"
        f"Command: `python -m bench.alias_latency {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n"
        + table(["ref", "p50 ms", "p90 ms", "mean ms"], rows)
        + f"\n\nMedian difference, alias - job id: {difference:+.2f} ms (bootstrap 95% interval "
        f"{low:+.2f} to {high:+.2f} ms). The alias's own cost, `shared.jobs.aliases.resolve` alone "
        f"(one primary-key read in its own session), {args.requests} calls: {resolve_ms:.3f} ms each.\n"
    )
    print(text)
    if args.markdown:
        update_markdown(args.markdown, {"alias-latency": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
