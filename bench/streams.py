"""What open ``GET /jobs/{id}/stream`` connections cost the API and the job store while a job trains.

Starts ``tunejob serve`` (the API, which here also counts the SQL statements and transactions it
sends to the job store, and its worker process) on a fresh embedded-default data directory,
fine-tunes all-MiniLM-L6-v2 on BBC News, and once the job trains measures three windows of
``--seconds`` each:

- no client at all (the API's own recovery loop);
- ``--streams`` server-sent event streams of the job, opened and caught up before the window;
- as many clients polling ``GET /jobs/{id}`` every second, as followers did before the stream.

For each: the API process's CPU time over the window (psutil; % of one core), SQL statements and
transactions per second, and what each client received. Each stream must receive every metric row
written during the window exactly once. Then the job is cancelled and everything stops.

    python -m bench.streams                                   # 100 streams, 30 s windows (~3 min)
    python -m bench.streams --markdown docs/benchmarks.md     # ... and fill its "streams" section
    python -m bench.streams --streams 10 --seconds 5 --rows 400   # smoke run (~1 min)
"""

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
from httpx_sse import aconnect_sse

from bench.corpora import bbc_news, stratified_split
from bench.measure import host
from bench.tables import update_markdown

WORK_DIR = Path(".bench-streams")


# ----------------------------------------------------------------------------- the API process


def serve_counting(port: int, counts_file: Path) -> None:
    """``tunejob serve``, its API counting every SQL statement and transaction it sends to the job
    store (the worker is another process); the counts are written to ``counts_file`` (JSON) every 0.1 s."""
    from sqlalchemy import Engine, event

    from tunejob.cli import serve

    counts, lock = {"statements": 0, "transactions": 0}, threading.Lock()

    def count(name: str) -> None:
        with lock:
            counts[name] += 1

    event.listen(Engine, "before_cursor_execute", lambda *_: count("statements"))
    event.listen(Engine, "commit", lambda *_: count("transactions"))
    event.listen(Engine, "rollback", lambda *_: count("transactions"))

    def write() -> None:
        while True:
            with lock:
                text = json.dumps(counts)
            tmp = counts_file.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, counts_file)
            time.sleep(0.1)

    threading.Thread(target=write, daemon=True).start()
    serve("127.0.0.1", port)


class Stack:
    """``tunejob serve`` (its API counting), on a fresh embedded-default data directory."""

    def __init__(self, work: Path, port: int):
        work.mkdir(parents=True)
        self.counts = work / "counts.json"
        base = {k: v for k, v in os.environ.items() if not k.startswith("TUNEJOB_")}
        env = {**base, "TUNEJOB_DATA_DIR": str(work / "data"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.api = subprocess.Popen(
            [sys.executable, "-m", "bench.streams", "--serve", str(port), str(self.counts)],
            env=env,
            stdout=open(work / "serve.log", "w"),
            stderr=subprocess.STDOUT,
        )
        # Connection retries (with httpcore's backoff) cover the API's start-up.
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=120, transport=httpx.HTTPTransport(retries=8)
        )
        self.http.get("/healthz").raise_for_status()
        self.http.headers.update(auth_headers(work / "data"))  # the key exists once the API is up

    def sample(self) -> tuple[float, dict[str, int]]:
        """The API process's CPU seconds so far (not its worker's), and its store counts."""
        cpu = psutil.Process(self.api.pid).cpu_times()
        return cpu.user + cpu.system, json.loads(self.counts.read_text())

    def close(self) -> None:
        self.http.close()
        self.api.terminate()  # tunejob serve stops its worker too
        self.api.wait(timeout=120)


def auth_headers(data_dir: Path) -> dict[str, str]:
    """``Authorization: Bearer <data dir>/api_key`` where the server wrote a key."""
    key_file = data_dir / "api_key"
    return {"Authorization": f"Bearer {key_file.read_text().strip()}"} if key_file.is_file() else {}


# ----------------------------------------------------------------------------- the clients


async def stream_client(
    http: httpx.AsyncClient, job_id: str, caught_up: asyncio.Event, rows: Counter, stats: dict
) -> None:
    """One stream of the job: counts its messages, and each metric row (step, name) received after
    ``caught_up`` is set."""
    async with aconnect_sse(http, "GET", f"/jobs/{job_id}/stream") as source:
        async for sse in source.aiter_sse():
            if not sse.data:
                continue
            stats["first"] = stats.get("first") or time.monotonic()
            if caught_up.is_set():
                stats["messages"] = stats.get("messages", 0) + 1
                if sse.event == "metrics":
                    rows.update((m["step"], m["name"]) for m in json.loads(sse.data)["data"])


async def poll_client(http: httpx.AsyncClient, job_id: str, stop: asyncio.Event, stats: dict) -> None:
    """One follower polling ``GET /jobs/{id}`` every second."""
    while not stop.is_set():
        (await http.get(f"/jobs/{job_id}")).raise_for_status()
        stats["messages"] = stats.get("messages", 0) + 1
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def measure(stack: Stack, job_id: str, kind: str, clients: int, seconds: float) -> dict:
    """One window with ``clients`` clients of ``kind`` (``none``, ``streams`` or ``polling``)."""
    limits = httpx.Limits(max_connections=clients + 10)
    async with httpx.AsyncClient(
        base_url=str(stack.http.base_url),
        headers=dict(stack.http.headers),
        limits=limits,
        timeout=httpx.Timeout(60, read=120),
    ) as http:
        caught_up, stop = asyncio.Event(), asyncio.Event()
        stats = [{} for _ in range(clients if kind != "none" else 0)]
        rows = [Counter() for _ in stats]
        if kind == "streams":
            tasks = [asyncio.create_task(stream_client(http, job_id, caught_up, r, s)) for r, s in zip(rows, stats)]
            while not all(s.get("first") for s in stats):  # every stream connected and read the past
                await asyncio.sleep(0.1)
        else:
            tasks = [asyncio.create_task(poll_client(http, job_id, stop, s)) for s in stats]
        await asyncio.sleep(1.0)
        cpu0, counts0, t0 = *stack.sample(), time.monotonic()
        caught_up.set()
        await asyncio.sleep(seconds)
        cpu1, counts1, t1 = *stack.sample(), time.monotonic()
        caught_up.clear()
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = t1 - t0
    result = {
        "clients": f"{clients} {kind}" if clients else "none",
        "seconds": round(wall, 1),
        "api_cpu_percent": round(100 * (cpu1 - cpu0) / wall, 1),
        "statements_per_s": round((counts1["statements"] - counts0["statements"]) / wall, 1),
        "transactions_per_s": round((counts1["transactions"] - counts0["transactions"]) / wall, 1),
        "messages_per_client": min((s.get("messages", 0) for s in stats), default=0),
    }
    if kind == "streams":
        result["metric_rows_per_stream"] = sorted({sum(r.values()) for r in rows})
        result["duplicate_rows"] = sum(n - 1 for r in rows for n in r.values() if n > 1)
    return result


# ----------------------------------------------------------------------------- driver


def start_job(stack: Stack, work: Path, rows: int | None, epochs: float) -> str:
    train, _ = stratified_split(bbc_news(), test_size=0.2, seed=42)
    if rows:
        train = train.head(rows)
    csv = work / "bbc_news_train.csv"
    train.to_csv(csv, index=False)
    with open(csv, "rb") as f:
        dataset = stack.http.post("/datasets", files={"file": (csv.name, f, "text/csv")}).raise_for_status().json()
    job = (
        stack.http.post(
            "/jobs",
            json={
                "base_model": "all-MiniLM-L6-v2",
                "training_dataset": dataset["id"],
                "text_column": "text",
                "label_column": "label",
                "hyperparameters": {"epochs": epochs, "max_length": 128, "batch_size": 16, "learning_rate": 1e-4},
            },
        )
        .raise_for_status()
        .json()
    )
    while (state := stack.http.get(f"/jobs/{job['id']}").raise_for_status().json())["progress"]["step"] < 2:
        if state["status"] in ("succeeded", "failed", "cancelled"):
            raise SystemExit(f"the job ended {state['status']} before the measurement: {state['error']}")
        time.sleep(0.5)
    return job["id"]


def markdown(results: list[dict], args, machine: str) -> str:
    lines = [
        f"{machine}; `python -m bench.streams --streams {args.streams} --seconds {args.seconds}"
        + (f" --rows {args.rows}" if args.rows else "")
        + "`, all-MiniLM-L6-v2 training on BBC News "
        "in the worker process of `tunejob serve`, metrics flushed every 2 s, the stream's reader polling "
        "every 0.5 s (the defaults).",
        "",
        "| clients | API CPU (% of one core) | SQL statements/s | transactions/s | messages per client "
        "| metric rows per stream (duplicates) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows = (
            f"{', '.join(map(str, r['metric_rows_per_stream']))} ({r['duplicate_rows']})"
            if "metric_rows_per_stream" in r
            else ""
        )
        lines.append(
            f"| {r['clients']} | {r['api_cpu_percent']} | {r['statements_per_s']} | "
            f"{r['transactions_per_s']} | {r['messages_per_client']} | {rows} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=100, help="clients in the stream and polling windows")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each window")
    parser.add_argument("--rows", type=int, help="train on only this many BBC News articles (smoke runs)")
    parser.add_argument("--epochs", type=float, default=3.0, help="long enough to outlast the windows; cancelled after")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--markdown", type=Path, help="fill the `streams` section of this file (docs/benchmarks.md)")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "COUNTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_counting(int(args.serve[0]), Path(args.serve[1]))
        return 0

    described = host()
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    stack = Stack(WORK_DIR, args.port)
    try:
        job_id = start_job(stack, WORK_DIR, args.rows, args.epochs)
        results = [
            asyncio.run(measure(stack, job_id, kind, clients, args.seconds))
            for kind, clients in [("none", 0), ("streams", args.streams), ("polling", args.streams)]
        ]
        still = stack.http.get(f"/jobs/{job_id}").raise_for_status().json()["status"]
        stack.http.post(f"/jobs/{job_id}/cancel").raise_for_status()
    finally:
        stack.close()
    for r in results:
        print(json.dumps(r))
    if still != "running":
        print(
            f"warning: the job was {still} by the end: the last windows did not all see training; raise --epochs",
            file=sys.stderr,
        )
    table = markdown(results, args, described)
    print(table)
    if args.markdown:
        update_markdown(args.markdown, {"streams": table})
    return 0 if all(r.get("duplicate_rows", 0) == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
