"""The API under polling load while a job trains: requests/s, latency, and what the load costs.

Starts ``tunejob serve`` (API + one worker) on a fresh data directory (the embedded default) or on
the PostgreSQL + Redis given with ``--database-url``/``--broker-url`` (use an empty database),
uploads BBC News, starts a real fine-tuning job, and then, while it trains, measures windows of
``--seconds`` each:

1. **unloaded**: nothing but training;
2. **loaded**, one window per ``--rates`` entry: ``--clients`` connections of ``wrk`` alternate
   ``GET /jobs/{id}`` and ``GET /jobs/{id}/metrics?after_step=<last step seen>``, sending each
   request with the next of ``--clients`` API keys of one tenant (as separate users polling, each
   under its own rate limit). A number paces the requests at that many per second in all (the k-th
   request goes out no earlier than k / rate seconds after the start, on whichever connection is
   free: latency then excludes waiting for a free connection); ``max`` sends each connection's next
   request as soon as its answer is in (closed loop: the API's capacity, and latency is Little's
   law, clients / rate). Each window follows ``--warmup`` seconds of the same load.

With ``--job short-epochs`` the job is a tiny BERT (``worker.doctor.build_tiny_bert``) on 200 rows
that evaluates and checkpoints every 2 steps: the job store gets several commits a second (as a
small dataset on a GPU does), each of which empties the API's read cache (``shared.store.cache``)
while the clients poll.

With ``--idle-worker`` the job is cancelled once it has trained a few steps, and the windows run
with the worker idle (the same requests, the job's metrics in place). With ``--api-workers N``
(N > 1, PostgreSQL + Redis) the API runs in N processes (``tunejob serve --api-workers N``), with
its rate limits in the broker's Redis.

Reported per window: requests/s, latency p50/p99/max (wrk's), the count of 5xx and of other
non-2xx answers, socket errors and timeouts, the job's real tokens/s (median of its per-step
``tokens_per_second``) and steps/s, and the CPU of the API process, the worker and the load
generator (wrk: its user + system time), in % of one core, with the API's CPU ms per request.
On a 2-core machine all of them share the cores.

``wrk`` is a benchmark tool, not a dependency of the service: ``apt-get install wrk`` (Debian,
Ubuntu; it is built with LuaJIT, whose FFI reads the clock for pacing).

    python -m bench.load                                      # embedded default, 50 clients, 30 s windows
    python -m bench.load --idle-worker                        # the same with the worker idle
    python -m bench.load --database-url postgresql+psycopg://postgres@127.0.0.1:5432/tunejob_load \\
                         --broker-url redis://127.0.0.1:6379/9
    python -m bench.load --database-url … --broker-url … --api-workers 2  # two API processes
    python -m bench.load --clients 10 --seconds 5 --warmup 1  # smoke run
    python -m bench.load --job short-epochs --rates 500 --database-url … --broker-url …  # a job that commits often
"""

import argparse
import io
import json
import os
import platform
import resource
import shutil
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

# wrk's script (one generator thread): request() alternates the two routes and rotates the keys;
# response() keeps the last metric step seen; delay() paces; done() prints one JSON line.
WRK_SCRIPT = r"""
local ffi = require("ffi")
ffi.cdef[[ typedef struct { long tv_sec; long tv_nsec; } tj_timespec; int clock_gettime(int clock, tj_timespec *tp); ]]
local ts = ffi.new("tj_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts)  -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

local threads = {}
function setup(thread) table.insert(threads, thread) end

local job, interval_ms, after_step, keys = nil, 0, -1, {}
local sent, next_at = 0, nil
non_2xx, responses_5xx = 0, 0

function init(args)
  job, interval_ms, after_step = args[1], tonumber(args[2]), tonumber(args[3])
  for i = 4, #args do keys[#keys + 1] = args[i] end
end

function request()
  sent = sent + 1
  local path = "/jobs/" .. job
  if sent % 2 == 0 then path = path .. "/metrics?after_step=" .. after_step end
  return wrk.format("GET", path, {Authorization = "Bearer " .. keys[sent % #keys + 1]})
end

function delay()
  if interval_ms == 0 then return 0 end
  local now = now_ms()
  next_at = math.max((next_at or now) + interval_ms, now)
  return next_at - now
end

function response(status, headers, body)
  if status < 200 or status > 299 then non_2xx = non_2xx + 1 end
  if status >= 500 then responses_5xx = responses_5xx + 1 end
  if status == 200 and body:sub(1, 9) == '{"data":[' then
    local step = body:match('.*"step":(%d+)')
    if step then after_step = tonumber(step) end
  end
end

function done(summary, latency, requests)
  local n2, n5 = 0, 0
  for _, t in ipairs(threads) do n2 = n2 + t:get("non_2xx"); n5 = n5 + t:get("responses_5xx") end
  local e = summary.errors
  io.write(string.format('BENCH_LOAD {"requests": %d, "duration_s": %.3f, "p50_ms": %.2f, "p99_ms": %.2f, ' ..
    '"max_ms": %.2f, "non_2xx": %d, "responses_5xx": %d, "socket_errors": %d, "timeouts": %d}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50) / 1e3, latency:percentile(99) / 1e3,
    latency.max / 1e3, n2, n5, e.connect + e.read + e.write, e.timeout))
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configure_store(args, data_dir: Path) -> dict[str, str]:
    """The service's environment (other ``TUNEJOB_*`` settings pass through); this process uses it
    too, to migrate and make the API keys."""
    shared_limits = args.broker_url if args.api_workers > 1 else None  # several API processes: counts in Redis
    for name, value in [
        ("TUNEJOB_DATABASE_URL", args.database_url),
        ("TUNEJOB_BROKER_URL", args.broker_url),
        ("TUNEJOB_API_KEY", None),
        ("TUNEJOB_RATE_LIMIT_STORAGE_URL", shared_limits),
    ]:
        os.environ.pop(name, None)
        if value:
            os.environ[name] = value
    os.environ.update(TUNEJOB_DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return dict(os.environ)


def make_keys(count: int) -> list[str]:
    """``count`` API keys of one tenant (before the service starts: it then creates no local key)."""
    from shared.store.engine import upgrade_database
    from shared.store.keys import create_key

    upgrade_database()
    return [create_key("bench", name=f"load client {i}")[0] for i in range(count)]


class CpuMeter:
    """CPU seconds (user + system) of groups of processes between ``start`` and ``stop``."""

    def __init__(self, processes: dict[str, list[psutil.Process]]):
        self.processes = processes

    def _times(self) -> dict[str, float]:
        return {name: sum(sum(p.cpu_times()[:2]) for p in group) for name, group in self.processes.items()}

    def start(self) -> None:
        self.t0, self.before = time.perf_counter(), self._times()

    def stop(self) -> tuple[float, dict[str, float]]:
        """(wall seconds, CPU seconds of each process) since ``start``."""
        wall, after = time.perf_counter() - self.t0, self._times()
        return wall, {name: after[name] - self.before[name] for name in after}


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (waited-for) children: wrk's runs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_wrk(
    base_url: str,
    keys: list[str],
    job_id: str,
    after_step: int,
    clients: int,
    rate: float | None,
    seconds: float,
    script: Path,
) -> tuple[dict, float]:
    """One wrk run; returns (its BENCH_LOAD summary, its CPU seconds)."""
    interval_ms = 1000 / rate if rate else 0
    cpu0 = children_cpu_seconds()
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{clients}",
            f"-d{seconds:g}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            base_url,
            "--",
            job_id,
            str(interval_ms),
            str(after_step),
            *keys,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("BENCH_LOAD "))
    return json.loads(line.split(" ", 1)[1]), children_cpu_seconds() - cpu0


def training_window(driver: httpx.Client, job_id: str, step0: int, t0: float, t1: float) -> dict:
    """The job's median per-step real tokens/s logged between wall times ``t0`` and ``t1`` (steps
    after ``step0``), and its steps/s over the window."""
    rows = driver.get(f"/jobs/{job_id}/metrics", params={"after_step": step0, "limit": 100_000}).json()["data"]
    window = [m for m in rows if t0 <= datetime.fromisoformat(m["time"]).timestamp() <= t1]
    values = [m["value"] for m in window if m["name"] == "tokens_per_second"]
    steps = {m["step"] for m in window}
    return {
        "tokens_per_second": round(statistics.median(values)) if values else None,
        "steps_per_second": round(len(steps) / (t1 - t0), 2),
    }


def cpu_figures(wall: float, cpu: dict[str, float], requests: int | None = None) -> dict:
    figures = {f"cpu_percent_{name}": round(100 * seconds / wall, 1) for name, seconds in cpu.items()}
    if requests:
        figures["api_cpu_ms_per_request"] = round(1000 * cpu["api"] / requests, 3)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=50, help="concurrent connections, and API keys")
    parser.add_argument(
        "--rates",
        default="500,max",
        help="comma-separated: requests/s in all for each loaded window, or max (closed loop)",
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each measured window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of the same load before each window")
    parser.add_argument("--idle-worker", action="store_true", help="cancel the job first: the worker is idle")
    parser.add_argument("--database-url", help="PostgreSQL job store (default: the embedded SQLite)")
    parser.add_argument("--broker-url", help="Redis broker (default: the embedded filesystem broker)")
    parser.add_argument(
        "--api-workers",
        type=int,
        default=1,
        help="API processes (more than 1: their rate limits in the --broker-url Redis)",
    )
    parser.add_argument(
        "--job",
        choices=("minilm", "short-epochs"),
        default="minilm",
        help="minilm: the built-in model on BBC News (commits every ~2 s); short-epochs: a tiny "
        "BERT on 200 rows that evaluates and checkpoints every 2 steps (several commits a second)",
    )
    parser.add_argument("--base-model", default="all-MiniLM-L6-v2")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench.load: wrk is not installed (apt-get install wrk)")
    if args.api_workers > 1 and not (args.broker_url or "").startswith("redis"):
        parser.error("--api-workers above 1 needs --broker-url redis://… (the rate limits are shared there)")
    rates = [None if r.strip() == "max" else float(r) for r in args.rates.split(",")]

    work = Path(tempfile.mkdtemp(prefix="tunejob-load-"))
    script = work / "poll.lua"
    script.write_text(WRK_SCRIPT)
    env = configure_store(args, work / "data")
    keys = make_keys(args.clients + 1)
    if args.job == "short-epochs":
        from worker.doctor import build_tiny_bert

        env["TUNEJOB_MODELS_DIR"] = str(build_tiny_bert(work / "models" / "tiny-bert").parent)
    port = free_port()
    log = open(work / "serve.log", "w")
    serve = subprocess.Popen(
        [sys.executable, "-m", "tunejob", "serve", "--port", str(port), "--api-workers", str(args.api_workers)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    driver = httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {keys[-1]}"},
        timeout=120,
        transport=httpx.HTTPTransport(retries=10),
    )
    try:
        for _ in range(240):
            try:
                if driver.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        train, _ = stratified_split(bbc_news(), test_size=0.2, seed=42)
        hyperparameters = {
            "epochs": 50,
            "max_length": args.max_length,
            "batch_size": args.batch_size,
            "eval_every_steps": 100_000,
            "save_every_steps": 100_000,
        }
        base_model = args.base_model
        if args.job == "short-epochs":
            train = train.head(200)
            hyperparameters.update(epochs=1000, max_length=32, eval_every_steps=2, save_every_steps=2)
            base_model = "tiny-bert"
        csv = io.BytesIO(train.to_csv(index=False).encode())
        dataset = driver.post("/datasets", files={"file": ("bbc.csv", csv, "text/csv")}).raise_for_status().json()
        job = (
            driver.post(
                "/jobs",
                json={"base_model": base_model, "training_dataset": dataset["id"], "hyperparameters": hyperparameters},
            )
            .raise_for_status()
            .json()
        )
        job_url = f"/jobs/{job['id']}"
        while (state := driver.get(job_url).json())["progress"]["step"] < 5:
            assert state["status"] in ("queued", "running"), state
            time.sleep(1)
        if args.idle_worker:
            driver.post(f"{job_url}/cancel")
            while driver.get(job_url).json()["status"] != "cancelled":
                time.sleep(0.5)
        api = psutil.Process(serve.pid)
        worker = next(p for p in api.children() if "worker" in " ".join(p.cmdline()))
        # the API's processes: serve itself, and with --api-workers its uvicorn worker processes
        api_processes = [api, *(p for p in api.children() if "spawn_main" in " ".join(p.cmdline()))]
        meter = CpuMeter({"api": api_processes, "worker": [worker]})

        step0, t0 = driver.get(job_url).json()["progress"]["step"], time.time()
        meter.start()
        time.sleep(args.seconds)
        wall, cpu = meter.stop()
        windows = [
            {"load": "none", **training_window(driver, job["id"], step0, t0, time.time()), **cpu_figures(wall, cpu)}
        ]

        for rate in rates:
            step = driver.get(job_url).json()["progress"]["step"]
            run_wrk(base_url, keys[:-1], job["id"], step, args.clients, rate, args.warmup, script)
            t0 = time.time()
            meter.start()
            summary, wrk_cpu = run_wrk(base_url, keys[:-1], job["id"], step, args.clients, rate, args.seconds, script)
            wall, cpu = meter.stop()
            duration = summary.pop("duration_s")
            windows.append(
                {
                    "load": f"{rate:g}/s paced" if rate else "max (closed loop)",
                    "requests_per_second": round(summary["requests"] / duration, 1),
                    **summary,
                    **training_window(driver, job["id"], step, t0, time.time()),
                    **cpu_figures(wall, {**cpu, "load_generator": wrk_cpu}, summary["requests"]),
                }
            )
        driver.post(f"{job_url}/cancel")

        result = {
            "stack": "postgres+redis" if args.database_url else "embedded",
            "machine": f"{platform.processor() or platform.machine()}, {psutil.cpu_count()} CPUs",
            "load_average_at_end": [round(x, 1) for x in os.getloadavg()],
            "worker": "idle (job cancelled)" if args.idle_worker else "training",
            "job": args.job,
            "api_processes": args.api_workers,
            "clients": args.clients,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "windows": windows,
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
