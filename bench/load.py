"""Job-store read load while a job trains: what 50 pollers cost the API and the training job.

Starts ``tunejob serve`` (API + one worker) on a fresh data directory (the embedded default) or
on the PostgreSQL + Redis given with ``--database-url``/``--broker-url`` (use an empty database),
uploads BBC News, starts a real fine-tuning job, and then, while it trains:

1. **unloaded**: ``--seconds`` of nothing but training;
2. **loaded**: ``--clients`` concurrent clients (httpx async, one API key each, as separate users
   would poll) alternate ``GET /jobs/{id}`` and ``GET /jobs/{id}/metrics?after_step=<last step
   seen>`` for ``--seconds`` after ``--warmup`` seconds of the same load.

Reports requests/s, latency p50/p99, the count of 5xx and other non-2xx answers, the job's real
tokens/s (median of its per-step ``tokens_per_second`` in each window), and the CPU each process
used in each window, in % of one core (psutil): the API (the ``serve`` process), the worker, and
this load generator. On a 2-core machine all three share the cores.

    python -m bench.load                                      # embedded default, 50 clients, 60 s windows
    python -m bench.load --database-url postgresql+psycopg://postgres@127.0.0.1:5432/tunejob_load \\
                         --broker-url redis://127.0.0.1:6379/9
    python -m bench.load --clients 10 --seconds 5 --warmup 1  # smoke run
"""

import argparse
import asyncio
import io
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from bench.corpora import bbc_news, stratified_split

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configure_store(args, data_dir: Path) -> dict[str, str]:
    """The service's environment (other ``TUNEJOB_*`` settings pass through); this process uses it
    too, to migrate and make the API keys."""
    for name, value in [("TUNEJOB_DATABASE_URL", args.database_url), ("TUNEJOB_BROKER_URL", args.broker_url),
                        ("TUNEJOB_API_KEY", None)]:
        os.environ.pop(name, None)
        if value:
            os.environ[name] = value
    os.environ.update(TUNEJOB_DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return dict(os.environ)


def make_keys(count: int) -> list[str]:
    """``count`` API keys of one tenant (before the service starts: it then creates no local key)."""
    from shared.db import upgrade_database
    from shared.keys import create_key

    upgrade_database()
    return [create_key("bench", name=f"load client {i}")[0] for i in range(count)]


class CpuMeter:
    """CPU seconds (user + system) of processes between ``start`` and ``stop``, in % of one core."""

    def __init__(self, processes: dict[str, psutil.Process]):
        self.processes = processes

    def _times(self) -> dict[str, float]:
        out = {}
        for name, p in self.processes.items():
            t = p.cpu_times()
            out[name] = t.user + t.system
        return out

    def start(self) -> None:
        self.t0, self.before = time.perf_counter(), self._times()

    def stop(self) -> dict[str, float]:
        wall, after = time.perf_counter() - self.t0, self._times()
        return {name: round(100 * (after[name] - self.before[name]) / wall, 1) for name in after}


def tokens_per_second(client: httpx.Client, job_id: str, t0: float, t1: float, step0: int) -> float | None:
    """Median per-step real tokens/s the job logged between steps seen at wall times ``t0``..``t1``."""
    rows = client.get(f"/jobs/{job_id}/metrics", params={"after_step": step0, "limit": 100_000}).json()["data"]
    values = [m["value"] for m in rows if m["name"] == "tokens_per_second"
              and t0 <= datetime.fromisoformat(m["time"]).timestamp() <= t1]
    return round(statistics.median(values)) if values else None


async def poll(base_url: str, key: str, job_id: str, first_step: int, stop_at: float, record_from: float,
               latencies: list[float], statuses: list[int]) -> None:
    """One client: alternate the job and its new metrics until ``stop_at``; record after ``record_from``."""
    after_step = first_step
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        n = 0
        while (now := time.perf_counter()) < stop_at:
            if n % 2:
                r = await client.get(f"/jobs/{job_id}/metrics", params={"after_step": after_step})
                if r.status_code == 200 and r.json()["data"]:
                    after_step = r.json()["data"][-1]["step"]
            else:
                r = await client.get(f"/jobs/{job_id}")
            n += 1
            if now >= record_from:
                latencies.append(time.perf_counter() - now)
                statuses.append(r.status_code)


async def load(base_url: str, keys: list[str], job_id: str, first_step: int, warmup: float, seconds: float):
    latencies, statuses = [], []
    start = time.perf_counter()
    await asyncio.gather(*(poll(base_url, key, job_id, first_step, start + warmup + seconds, start + warmup,
                                latencies, statuses) for key in keys))
    return latencies, statuses


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each measured window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the loaded window")
    parser.add_argument("--database-url", help="PostgreSQL job store (default: the embedded SQLite)")
    parser.add_argument("--broker-url", help="Redis broker (default: the embedded filesystem broker)")
    parser.add_argument("--base-model", default="all-MiniLM-L6-v2")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tunejob-load-"))
    env = configure_store(args, work / "data")
    keys = make_keys(args.clients + 1)
    port = free_port()
    log = open(work / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    driver = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {keys[-1]}"}, timeout=120,
                          transport=httpx.HTTPTransport(retries=10))
    try:
        for _ in range(240):
            try:
                if driver.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        train, _ = stratified_split(bbc_news(), test_size=0.2, seed=42)
        csv = io.BytesIO(train.to_csv(index=False).encode())
        dataset = driver.post("/datasets", files={"file": ("bbc.csv", csv, "text/csv")}).raise_for_status().json()
        job = driver.post("/jobs", json={
            "base_model": args.base_model, "training_dataset": dataset["id"],
            "hyperparameters": {"epochs": 50, "max_length": args.max_length, "batch_size": args.batch_size,
                                "eval_every_steps": 100_000, "save_every_steps": 100_000}}).raise_for_status().json()
        while (state := driver.get(f"/jobs/{job['id']}").json())["progress"]["step"] < 5:
            assert state["status"] in ("queued", "running"), state
            time.sleep(1)
        api = psutil.Process(serve.pid)
        worker = next(p for p in api.children() if "worker" in " ".join(p.cmdline()))
        meter = CpuMeter({"api": api, "worker": worker, "load_generator": psutil.Process()})

        step0, t0 = driver.get(f"/jobs/{job['id']}").json()["progress"]["step"], time.time()
        meter.start()
        time.sleep(args.seconds)
        unloaded_cpu, t1 = meter.stop(), time.time()

        step1 = driver.get(f"/jobs/{job['id']}").json()["progress"]["step"]
        meter.start()
        t2 = time.time() + args.warmup
        latencies, statuses = asyncio.run(load(base_url, keys[:-1], job["id"], step1, args.warmup, args.seconds))
        loaded_cpu, t3 = meter.stop(), time.time()
        driver.post(f"/jobs/{job['id']}/cancel")

        result = {
            "stack": "postgres+redis" if args.database_url else "embedded",
            "machine": f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs",
            "clients": args.clients, "seconds": args.seconds,
            "requests_per_second": round(len(statuses) / args.seconds, 1),
            "p50_ms": round(1000 * percentile(latencies, 50), 1),
            "p99_ms": round(1000 * percentile(latencies, 99), 1),
            "responses_5xx": sum(s >= 500 for s in statuses),
            "responses_other_non_2xx": sum(s < 200 or 300 <= s < 500 for s in statuses),
            "tokens_per_second_unloaded": tokens_per_second(driver, job["id"], t0, t1, step0),
            "tokens_per_second_loaded": tokens_per_second(driver, job["id"], t2, t3, step1),
            "cpu_percent_of_one_core_unloaded": unloaded_cpu,
            "cpu_percent_of_one_core_loaded": loaded_cpu,
        }
    finally:
        driver.close()
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            serve.kill()
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
