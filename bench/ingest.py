"""Ingestion at scale, as a user meets it: upload, submit-time validation and dry run through a real
``tunejob api`` process, with the API's resident memory sampled from outside (psutil), plus the
worker's loading and tokenization of the same data in a cold process of its own.

Files (short texts, 2 classes) are generated into a temporary directory and deleted afterwards:
CSV, JSONL and Parquet of each ``--rows`` size, one CSV of ``--gb`` GB, and a Parquet
decompression bomb (a few hundred KB that expand to ``--bomb-gb`` GB).

    python -m bench.ingest                                   # the full run (see docs/benchmarks.md)
    python -m bench.ingest --rows 10000 --gb 0 --formats csv,parquet --no-worker   # a smoke run

Each file goes to a fresh ``tunejob api`` (embedded default, no worker). Each row of the table:
upload (``POST /datasets``: streamed to disk, checked in batches), validate (``POST /jobs``:
``check_spec`` reads the text and label columns in batches; the job stays queued, then is
cancelled), dry run (``POST /jobs?dry_run=true``: tokenizes the training split in batches), the
API's peak RSS during each over its idle RSS (after start-up and a warm-up of each request on a
100-row file), and the worker's load + tokenize time and peak RSS.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = (
    "the a match goal team coach league shares market profit bank sales film plot actor scene great dull "
    "fine poor vote party minister bill court phone chip data cloud game"
).split()
MODEL = "all-MiniLM-L6-v2"


# ----------------------------------------------------------------------------- data


def sentences(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` short texts (5 to 15 words, about 60 bytes) drawn from a pool, and their labels."""
    rng = np.random.default_rng(seed)
    pool = np.array([" ".join(rng.choice(WORDS, rng.integers(5, 16))) for _ in range(10_000)], dtype=object)
    return pool[rng.integers(0, len(pool), n)], np.array(["pos", "neg"], dtype=object)[rng.integers(0, 2, n)]


def write_dataset(path: Path, fmt: str, rows: int) -> Path:
    """Write ``rows`` rows in ``fmt``, a million rows at a time."""
    with open(path, "wb") as out:
        writer = None
        for start in range(0, rows, 1_000_000):
            texts, labels = sentences(min(1_000_000, rows - start), seed=start)
            if fmt == "csv":
                out.write(b"text,label\n" if start == 0 else b"")
                out.write("".join(f"{t},{y}\n" for t, y in zip(texts, labels)).encode())
            elif fmt == "jsonl":
                out.write("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in zip(texts, labels)).encode())
            else:
                table = pa.table({"text": texts.tolist(), "label": labels.tolist()})
                writer = writer or pq.ParquetWriter(out, table.schema)
                writer.write_table(table)
        if writer:
            writer.close()
    return path


def write_csv_of_size(path: Path, gigabytes: float) -> Path:
    target = int(gigabytes * 1e9)
    with open(path, "wb") as out:
        out.write(b"text,label\n")
        seed = 0
        while out.tell() < target:
            texts, labels = sentences(100_000, seed=seed)
            out.write("".join(f"{t},{y}\n" for t, y in zip(texts, labels)).encode())
            seed += 1
    return path


def write_bomb(path: Path, gigabytes: float) -> Path:
    """One 1,000-byte text repeated: dictionary-encoded and zstd-compressed, a few hundred KB."""
    n = int(gigabytes * 1e9 / 1000)
    indices = pa.array(np.zeros(n, dtype=np.int32))
    table = pa.table(
        {
            "text": pa.DictionaryArray.from_arrays(indices, pa.array(["x" * 1000])),
            "label": pa.DictionaryArray.from_arrays(
                pa.array(np.arange(n, dtype=np.int32) % 2), pa.array(["pos", "neg"])
            ),
        }
    )
    pq.write_table(table, path, compression="zstd")
    return path


# ----------------------------------------------------------------------------- the API process


class PeakRSS:
    """Samples a process's resident memory every 20 ms in a thread; ``peak`` since ``reset``."""

    def __init__(self, pid: int):
        self.process, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.rss())

    def rss(self) -> int:
        return self.process.memory_info().rss

    def reset(self) -> None:
        self.peak = self.rss()

    def stop(self) -> None:
        self._stop.set()


def start_api(data_dir: Path, port: int) -> subprocess.Popen:
    env = {
        **os.environ,
        "TUNEJOB_DATA_DIR": str(data_dir),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TUNEJOB_MAX_UPLOAD_BYTES": str(4 * 1024**3),
    }
    for name in ("TUNEJOB_DATABASE_URL", "TUNEJOB_BROKER_URL"):  # the embedded default
        env.pop(name, None)
    api = subprocess.Popen(
        [sys.executable, "-m", "tunejob", "api", "--port", str(port)],
        env=env,
        stdout=open(data_dir / "api.log", "w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return api
        except httpx.TransportError:
            time.sleep(0.2)
    api.kill()
    raise SystemExit(f"tunejob api did not start; see {data_dir / 'api.log'}")


def auth_headers(data_dir: Path) -> dict:
    """Authorization for a service that writes a local API key to <data dir>/api_key."""
    key = data_dir / "api_key"
    return {"Authorization": f"Bearer {key.read_text().strip()}"} if key.exists() else {}


def job_spec(dataset_id: str) -> dict:
    return {
        "base_model": MODEL,
        "task": "classification",
        "training_dataset": dataset_id,
        "text_column": "text",
        "label_column": "label",
        "hyperparameters": {"epochs": 1, "batch_size": 32, "max_length": 128},
    }


def timed(rss: PeakRSS, call) -> tuple[httpx.Response, float, int]:
    """(response, seconds, peak RSS in bytes) of one request."""
    rss.reset()
    start = time.perf_counter()
    response = call()
    return response, time.perf_counter() - start, rss.peak


def measure_file(client: httpx.Client, rss: PeakRSS, path: Path, max_dry_run_rows: int | None = None) -> dict:
    with open(path, "rb") as f:
        r, upload_s, upload_peak = timed(rss, lambda: client.post("/datasets", files={"file": (path.name, f)}))
    row = {
        "file": path.name,
        "bytes": path.stat().st_size,
        "upload_status": r.status_code,
        "upload_s": upload_s,
        "upload_peak": upload_peak,
    }
    if r.status_code != 201:
        row["error"] = r.json()["error"]["code"]
        return row
    dataset = r.json()
    row["rows"] = dataset["rows"]
    r, row["validate_s"], row["validate_peak"] = timed(rss, lambda: client.post("/jobs", json=job_spec(dataset["id"])))
    assert r.status_code == 201, r.text
    client.post(f"/jobs/{r.json()['id']}/cancel")
    if max_dry_run_rows is None or dataset["rows"] <= max_dry_run_rows:
        r, row["dry_run_s"], row["dry_run_peak"] = timed(
            rss, lambda: client.post("/jobs", params={"dry_run": "true"}, json=job_spec(dataset["id"]))
        )
        assert r.status_code == 200, r.text
    row["dataset_id"] = dataset["id"]
    return row


# ----------------------------------------------------------------------------- the worker's side


def worker_tokenize(dataset_id: str) -> None:
    """In a cold process: the worker's own loading (``worker.data.load_job_data``) and tokenization
    (``worker.data.tokenize``) of a dataset; prints seconds and peak RSS as JSON."""
    from transformers import AutoTokenizer

    from shared.jobs.base_models import resolve_model
    from shared.store.engine import session_scope
    from shared.store.rows import Dataset
    from worker.data import load_job_data, tokenize

    spec = {**job_spec(dataset_id), "validation_split": 0.1}
    spec["hyperparameters"]["seed"] = 42
    with session_scope() as s:
        dataset = s.get(Dataset, dataset_id)
    start = time.perf_counter()
    data = load_job_data(spec, dataset, None)
    loaded = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    names = sorted(set(data.train["label"]))
    tokenize(tokenizer, data.train, "text", None, "label", names, 128)
    print(
        json.dumps(
            {
                "load_s": loaded - start,
                "tokenize_s": time.perf_counter() - loaded,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


def measure_worker(data_dir: Path, dataset_id: str) -> dict:
    env = {**os.environ, "TUNEJOB_DATA_DIR": str(data_dir), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "bench.ingest", "--worker-tokenize", dataset_id],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- report


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def markdown(rows: list[dict], command: str) -> str:
    machine = f"{psutil.cpu_count()} CPU cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    idle = ", ".join(sorted({mib(r["idle_rss"]) for r in rows}))
    lines = [
        f"_Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine} with `{command}`; "
        f"each file in a fresh `tunejob api` process, idle RSS {idle} MiB (after start-up and a warm-up of each "
        "request on 100 rows)._",
        "",
        "| file | size (MB) | rows | upload (s) | validate (s) | upload + validate (s) | dry run (s) | "
        "API RSS growth (MiB): upload / validate / dry run | worker load + tokenize (s) | worker peak RSS (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        idle = r["idle_rss"]
        if r["upload_status"] != 201:
            lines.append(
                f"| {r['file']} | {r['bytes'] / 1e6:,.1f} | | refused: {r['upload_status']} {r['error']} "
                f"in {r['upload_s']:.2f} s | | | | {mib(r['upload_peak'] - idle)} / - / - | | |"
            )
            continue
        growth = " / ".join(
            mib(r[k] - idle) if k in r else "-" for k in ("upload_peak", "validate_peak", "dry_run_peak")
        )
        worker = r.get("worker", {})
        lines.append(
            f"| {r['file']} | {r['bytes'] / 1e6:,.1f} | {r['rows']:,} | {r['upload_s']:.2f} | {r['validate_s']:.2f} | "
            f"{r['upload_s'] + r['validate_s']:.2f} | {r.get('dry_run_s', float('nan')):.2f} | {growth} | "
            + (
                f"{worker['load_s']:.1f} + {worker['tokenize_s']:.1f} | {mib(worker['peak_rss'])} |"
                if worker
                else "| |"
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10000,100000,1000000", help="row counts, comma-separated")
    parser.add_argument("--formats", default="csv,jsonl,parquet")
    parser.add_argument("--gb", type=float, default=1.0, help="size of the one big CSV in GB (0: none)")
    parser.add_argument("--bomb-gb", type=float, default=4.0, help="expanded size of the Parquet bomb (0: none)")
    parser.add_argument("--no-dry-run-over", type=int, default=None, help="skip dry runs of files with more rows")
    parser.add_argument("--no-worker", action="store_true", help="skip the worker's load + tokenize")
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--worker-tokenize", metavar="DATASET_ID", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_tokenize:
        return worker_tokenize(args.worker_tokenize)

    with tempfile.TemporaryDirectory(prefix="tunejob-ingest-") as tmp:
        tmp = Path(tmp)
        files = [
            write_dataset(tmp / f"rows{n}.{fmt}", fmt, n)
            for n in map(int, args.rows.split(","))
            for fmt in args.formats.split(",")
        ]
        if args.gb:
            files.append(write_csv_of_size(tmp / f"big{args.gb:g}GB.csv", args.gb))
        if args.bomb_gb:
            files.append(write_bomb(tmp / f"bomb{args.bomb_gb:g}GB.parquet", args.bomb_gb))
        warmup, rows = write_dataset(tmp / "warmup.csv", "csv", 100), []
        for i, path in enumerate(files):
            data_dir = tmp / f"data{i}"
            data_dir.mkdir()
            api = start_api(data_dir, args.port)  # a fresh API per file: no memory kept from the last one
            rss = PeakRSS(api.pid)
            try:
                with httpx.Client(
                    base_url=f"http://127.0.0.1:{args.port}", headers=auth_headers(data_dir), timeout=3600
                ) as client:
                    measure_file(client, rss, warmup)
                    time.sleep(1)
                    row = {"idle_rss": rss.rss(), **measure_file(client, rss, path, args.no_dry_run_over)}
            finally:
                rss.stop()
                api.terminate()
                api.wait(timeout=60)
            if "dataset_id" in row and not args.no_worker:
                row["worker"] = measure_worker(data_dir, row["dataset_id"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    command = "python -m bench.ingest " + " ".join(argv if argv is not None else sys.argv[1:])
    print(markdown(rows, command.strip()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
