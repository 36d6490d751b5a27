"""Batch prediction throughput: ``shared.inference.loop.predict_texts`` next to
``transformers.pipeline("text-classification", batch_size=32, truncation=True)`` on the same
fine-tuned model and texts (every text of the corpus, at the model's max_length), each
configuration in a fresh process (as ``bench.cold``: per-shape caches are process-wide),
round-robin over repeats.

    python -m bench.predict prepare --dataset rotten_tomatoes   # fine-tune all-MiniLM-L6-v2 (1 epoch) into .bench-predict/
    python -m bench.predict run --dataset rotten_tomatoes --repeats 2 --markdown docs/benchmarks.md
    python -m bench.predict latency --requests 50 --markdown docs/benchmarks.md   # POST /models/{id}/predict
    python -m bench.predict job --rows 2000 --repeats 3 --markdown docs/benchmarks.md   # whole jobs, tunejob serve
    python -m bench.predict job --model bbc --texts bbc --rows 2225 --max-length 512 --precisions fp32,int8 \
        --repeats 2 --restart --no-loop   # issue 40: a model's second job, and a restarted worker's first
    python -m bench.predict job --model tiny --texts short --rows 100000,1000000 --no-loop --section job-memory

Configurations (``--configs``): ``pipeline``, and ``tunejob[:<name>=<value>...]`` with
``precision`` (fp32, bf16) and ``max_tokens`` (the token budget per batch), e.g.
``tunejob:precision=bf16``. Labels are compared with the first ``pipeline`` run's; accuracy is on
the held-out 20% split, which the model was not trained on.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

BENCH_DIR = Path(".bench-predict")
OPTIONS = {"precision": str, "max_tokens": int}


def model_path(dataset: str) -> Path:
    """Where ``prepare`` saves the model fine-tuned on ``dataset``."""
    return BENCH_DIR / f"{dataset}-minilm"


def prepare(dataset: str, max_length: int, learning_rate: float, precision: str = "auto") -> Path:
    """Fine-tune all-MiniLM-L6-v2 on the training part of ``dataset`` (the issue's set: Rotten
    Tomatoes 4,000 texts, BBC News the whole 80% split) for one epoch with the engine's own recipe
    (``bench.engine``) at ``precision`` (``bf16`` trains faster on a CPU with AMX), under the CPU
    worker's allocator setting, and save it as a tunejob model folder (safetensors, config with
    id2label, tokenizer with ``model_max_length`` = ``max_length``). Returns the folder."""
    from bench.cold import RunSpec
    from bench.corpora import CORPORA, load_split
    from bench.engine import BenchReporter, make_job
    from bench.measure import Clock
    from worker.data import JobData
    from worker.device import resolve_device, reuse_freed_cpu_memory
    from worker.training.recipe import Recipe

    corpus = CORPORA[dataset]
    spec = RunSpec(
        dataset=dataset,
        config="smart",
        model="all-MiniLM-L6-v2",
        device="auto",
        precision=precision,
        batch_size=32,
        max_length=max_length,
        train_size=corpus.train_size,
        val_size=corpus.val_size,
        learning_rate=learning_rate,
    )
    train_df, _ = load_split(dataset, corpus.train_size, corpus.val_size)
    labels = sorted(str(v) for v in train_df["label"].unique())
    device, _ = resolve_device("auto")
    if device.type == "cpu":
        reuse_freed_cpu_memory()  # the CPU worker's allocator setting
    reporter = BenchReporter(Clock(device), epochs=1)
    with tempfile.TemporaryDirectory(prefix="tunejob-bench-") as data_dir:
        os.environ["TUNEJOB_DATA_DIR"] = data_dir
        run = Recipe(make_job("smart", spec, labels), device)
        reporter.run = run.setup(JobData(train_df, None), reporter)
        run.warm_up(reporter)
        if run.train(reporter) != "completed":
            raise RuntimeError("fine-tuning stopped before the end of its epoch")
    out = model_path(dataset)
    run.model.save_pretrained(out, safe_serialization=True)
    run.job_setup.tokenizer.save_pretrained(out)
    return out


def config_options(config: str) -> tuple[str, dict]:
    """(``pipeline`` or ``tunejob``, its options) from a configuration name.

    Raises:
        ValueError: an unknown configuration or a malformed option.
    """
    kind, *pairs = config.split(":")
    if kind not in ("pipeline", "tunejob") or (kind == "pipeline" and pairs):
        raise ValueError(f"{config!r}: expected pipeline or tunejob[:<name>=<value>...]")
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if name not in OPTIONS or not sep:
            raise ValueError(f"{config!r}: the options are precision=<fp32|bf16> and max_tokens=<int>")
        options[name] = OPTIONS[name](value)
    return kind, options


def corpus_texts(dataset: str) -> tuple[list[str], list[str], list[int]]:
    """Every text of ``dataset``, its labels, and the positions of the held-out 20% split."""
    from bench.corpora import CORPORA, SEED, stratified_split

    df = CORPORA[dataset].read()
    _, held_out = stratified_split(df, test_size=0.2, seed=SEED)
    return df["text"].tolist(), df["label"].astype(str).tolist(), sorted(held_out.index.tolist())


def predict_in_this_process(config: str, dataset: str) -> dict:
    """Load the model fine-tuned on ``dataset`` and predict all its texts with ``config``: load and
    prediction seconds, the labels, and (tunejob) token counts. Call it in a fresh process."""
    import torch
    from transformers import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        AutoConfig,
        pipeline,
    )

    kind, options = config_options(config)
    model_dir, (texts, _, _) = model_path(dataset), corpus_texts(dataset)
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(AutoConfig.from_pretrained(model_dir))]  # imported untimed
    began = time.perf_counter()
    if kind == "pipeline":
        pipe = pipeline("text-classification", model=str(model_dir), device="cpu", batch_size=32, truncation=True)
        loaded = time.perf_counter()
        labels, counts = [row["label"] for row in pipe(texts)], {}
    else:
        from shared.inference.loop import load_for_inference, predict_texts

        model = load_for_inference(model_dir, torch.device("cpu"), options.get("precision", "auto"))
        loaded = time.perf_counter()
        predictions = predict_texts(model, texts, max_tokens=options.get("max_tokens"))
        labels = [row["label"] for row in predictions.rows]
        counts = {
            "tokens": predictions.tokens,
            "padded_tokens": predictions.padded_tokens,
            "truncated": predictions.truncated,
            "max_length": model.model_max_length,
        }
    done = time.perf_counter()
    return {
        "config": config,
        "load_seconds": loaded - began,
        "predict_seconds": done - loaded,
        "rows_per_second": len(texts) / (done - loaded),
        "labels": labels,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **counts,
    }


def run_cold(config: str, dataset: str, scratch: Path) -> dict:
    """``bench.predict one`` in a fresh process: its row, with the 1-minute load average before it
    started and the whole process's seconds."""
    out = scratch / f"row-{time.monotonic_ns()}.json"
    load, began = os.getloadavg()[0], time.perf_counter()
    subprocess.run([sys.executable, "-m", "bench.predict", "one", config, dataset, str(out)], check=True)
    return {**json.loads(out.read_text()), "load_average": load, "process_seconds": time.perf_counter() - began}


def summarize(rows: list[dict], dataset: str) -> list[dict]:
    """One line per configuration: medians over its runs, the share of labels equal to the
    pipeline's, and held-out accuracy."""
    _, gold, held_out = corpus_texts(dataset)
    reference = next(r["labels"] for r in rows if r["config"] == "pipeline")
    baseline = statistics.median(r["rows_per_second"] for r in rows if r["config"] == "pipeline")
    lines = []
    for config in dict.fromkeys(r["config"] for r in rows):
        runs = [r for r in rows if r["config"] == config]
        labels, speed = runs[0]["labels"], statistics.median(r["rows_per_second"] for r in runs)
        lines.append(
            {
                "config": config,
                "runs": len(runs),
                "load_s": statistics.median(r["load_seconds"] for r in runs),
                "predict_s": statistics.median(r["predict_seconds"] for r in runs),
                "rows_per_s": speed,
                "speedup": speed / baseline,
                "same_labels": sum(map(str.__eq__, labels, reference)) / len(reference),
                "accuracy": sum(labels[i] == gold[i] for i in held_out) / len(held_out),
                "real_per_computed": f"{runs[0]['tokens'] / runs[0]['padded_tokens']:.2f}"
                if "tokens" in runs[0]
                else "",
                "load_averages": ", ".join(f"{r['load_average']:.1f}" for r in runs),
            }
        )
    return lines


def render(lines: list[dict], meta: dict) -> str:
    """The Markdown section: provenance, then a table row per configuration."""
    head = (
        f"{meta['date']}, `{meta['command']}`: all {meta['texts']:,} texts of {meta['dataset']} "
        f"@{meta['max_length']} ({meta['truncated']:,} truncated), all-MiniLM-L6-v2 fine-tuned one epoch "
        f"(`bench.predict prepare`); {meta['machine']}; torch {meta['torch']}, {meta['threads']} threads. "
        f"Held-out accuracy: on the {meta['held_out']:,} texts of the 20% split, not trained on. Same labels: "
        "rows labelled as the pipeline labelled them. Load average: 1-minute, before each run.\n\n"
        "| configuration | runs | load s | predict s | rows/s | vs pipeline | same labels | held-out accuracy "
        "| real/computed tokens | load average |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    return head + "\n".join(
        f"| {r['config']} | {r['runs']} | {r['load_s']:.1f} | {r['predict_s']:.1f} | {r['rows_per_s']:,.0f} "
        f"| {r['speedup']:.2f}x | {100 * r['same_labels']:.2f}% | {100 * r['accuracy']:.2f}% "
        f"| {r['real_per_computed']} | {r['load_averages']} |"
        for r in lines
    )


def run(args: argparse.Namespace, command: str) -> None:
    """Every configuration ``args.repeats`` times, each in a fresh process, the first configuration
    rotating per repeat; print the table and write it into ``args.markdown``'s section."""
    from bench.measure import host
    from bench.tables import update_markdown

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for config in configs:
        config_options(config)
    if "pipeline" not in configs:
        sys.exit("--configs must include pipeline: the other configurations are compared with it")
    machine, rows = host(), []
    with tempfile.TemporaryDirectory(prefix="tunejob-bench-") as scratch:
        for repeat in range(args.repeats):
            for config in configs[repeat % len(configs) :] + configs[: repeat % len(configs)]:
                rows.append(run_cold(config, args.dataset, Path(scratch)))
                r = rows[-1]
                print(
                    f"{config} (repeat {repeat + 1}): load {r['load_seconds']:.1f} s, predict {r['predict_seconds']:.1f} s, "
                    f"{r['rows_per_second']:,.0f} rows/s, load average {r['load_average']:.1f}",
                    flush=True,
                )
    texts, _, held_out = corpus_texts(args.dataset)
    ours = next(r for r in rows if "tokens" in r)
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "dataset": args.dataset,
        "texts": len(texts),
        "max_length": ours["max_length"],
        "truncated": ours["truncated"],
        "machine": machine,
        "torch": ours["torch"],
        "threads": ours["threads"],
        "held_out": len(held_out),
    }
    section = render(summarize(rows, args.dataset), meta)
    print("\n" + section)
    if args.markdown:
        update_markdown(args.markdown, {f"predict-{args.dataset}": section})
        print(f"\nupdated {args.markdown}: section predict-{args.dataset}")


def register_model(model_dir: Path, tenant: str, label_names: list[str] | None, task: str = "classification") -> str:
    """A succeeded training job of ``tenant`` and ``task`` in the configured store whose model is a
    copy of ``model_dir`` (no training: the benchmark measures prediction). Returns its id."""
    import shutil

    from shared.store import artifacts
    from shared.store.engine import session_scope
    from shared.store.rows import Dataset, Job, JobStatus

    with session_scope() as s:
        dataset = Dataset(
            tenant=tenant, filename="bench.csv", format="csv", path="", rows=0, columns=[], bytes=0, sha256="0" * 64
        )
        s.add(dataset)
        s.flush()
        job = Job(
            tenant=tenant,
            status=JobStatus.SUCCEEDED,
            base_model="all-MiniLM-L6-v2",
            task=task,
            training_dataset_id=dataset.id,
            spec={},
            label_names=label_names,
        )
        s.add(job)
        s.flush()
        job_id = job.id
    shutil.copytree(model_dir, artifacts.model_dir(job_id))
    return job_id


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0-1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def measure_latency(dataset: str, requests: int, sizes: list[int]) -> dict:
    """Milliseconds per ``POST /models/{id}/predict`` through the app (``TestClient``, in this
    process) with a fresh embedded store: the first call (loads torch and the model), then per
    batch size a warm-up call and ``requests`` timed calls; p50 and p99. The texts are the
    held-out texts of ``dataset`` from its median-length one on."""
    from fastapi.testclient import TestClient

    from shared.settings import get_settings
    from shared.store.engine import upgrade_database
    from shared.store.keys import create_key

    texts, _, held_out = corpus_texts(dataset)
    held_out_texts = sorted((texts[i] for i in held_out), key=len)
    sample = held_out_texts[len(held_out_texts) // 2 :]
    with tempfile.TemporaryDirectory(prefix="tunejob-bench-") as data_dir:
        os.environ["TUNEJOB_DATA_DIR"] = data_dir
        get_settings.cache_clear()
        upgrade_database()
        key, _ = create_key("bench")
        config = json.loads((model_path(dataset) / "config.json").read_text())
        job_id = register_model(
            model_path(dataset), "bench", [config["id2label"][str(i)] for i in range(len(config["id2label"]))]
        )
        from api.main import create_app

        with TestClient(
            create_app(), base_url="http://localhost", headers={"Authorization": f"Bearer {key}"}
        ) as client:

            def call(size: int) -> float:
                began = time.perf_counter()
                r = client.post(f"/models/{job_id}/predict", json={"inputs": sample[:size]})
                elapsed = time.perf_counter() - began
                r.raise_for_status()
                return 1000 * elapsed

            result = {"first_ms": call(1), "sizes": {}}
            for size in sizes:
                call(size)
                times = [call(size) for _ in range(requests)]
                result["sizes"][size] = {
                    "p50": percentile(times, 0.5),
                    "p99": percentile(times, 0.99),
                    "mean": statistics.mean(times),
                }
        import torch

        result["threads"] = torch.get_num_threads()
    return result


def latency(args: argparse.Namespace, command: str) -> None:
    """Measure and print the endpoint's latency; write it into ``args.markdown``'s section."""
    from bench.measure import host
    from bench.tables import update_markdown

    machine = host()
    result = measure_latency(args.dataset, args.requests, [1, 64])
    lines = "\n".join(
        f"| {size} | {r['p50']:.1f} | {r['p99']:.1f} | {r['mean']:.1f} |" for size, r in result["sizes"].items()
    )
    section = (
        f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}, `{command}`: `POST /models/{{job_id}}/predict` through the "
        f"app in process (FastAPI TestClient, embedded store), the all-MiniLM-L6-v2 fine-tuned on {args.dataset} "
        f"(`bench.predict prepare`), held-out texts from the median length up; {args.requests} timed requests "
        f"per size after one warm-up; {result['threads']} torch thread(s) (`sync_predict_threads` default); "
        f"{machine}, load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end. "
        f"First call (imports torch, loads the model): {result['first_ms']:,.0f} ms.\n\n"
        "| texts per request | p50 ms | p99 ms | mean ms |\n|---|---|---|---|\n" + lines
    )
    print(section)
    if args.markdown:
        update_markdown(args.markdown, {"predict-latency": section})


# ----------------------------------------------------------------------------- the whole job

SHORT_WORDS = (
    "good bad great awful fine dull fun slow sharp warm cold film plot cast story scene ending "
    "music acting script pace twist hero villain laugh tears moving boring clever silly"
).split()


def short_texts(rows: int, seed: int = 0) -> list[str]:
    """``rows`` short texts (3 to 12 words of a small vocabulary), the same for the same seed."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choices(SHORT_WORDS, k=rng.randint(3, 12))) for _ in range(rows)]


def job_texts(source: str, rows: int) -> list[str]:
    """``rows`` texts: a corpus's texts in order (repeated when ``rows`` is larger), or ``short``."""
    if source == "short":
        return short_texts(rows)
    texts, _, _ = corpus_texts(source)
    return [texts[i % len(texts)] for i in range(rows)]


class RssSampler:
    """Samples the summed RSS of a process's descendants (the worker of ``tunejob serve``) every
    ``interval`` seconds in a thread; ``mark()`` starts a new window, ``peak`` is its highest."""

    def __init__(self, pid: int, interval: float = 0.2):
        import threading

        import psutil

        self.root, self.interval, self.peak, self.samples = psutil.Process(pid), interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        import psutil

        total = 0
        for p in self.root.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def mark(self) -> int:
        now = self.rss()
        self.peak, self.samples = now, 0
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak, self.samples = max(self.peak, self.rss()), self.samples + 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def job_ratio(job_seconds: float, loop_seconds: float) -> dict:
    """The issue's target for a whole prediction job: at most 1.3x the loop's own time plus 2 s."""
    limit = 1.3 * loop_seconds + 2
    return {"ratio": job_seconds / loop_seconds, "limit_s": limit, "met": job_seconds <= limit}


def measure_job(args: argparse.Namespace) -> dict:
    """Start ``tunejob serve`` (embedded store, a temporary data dir), register the model as a
    succeeded training job, warm the worker with a 64-row prediction, then per size in ``args.rows``
    time POST /predictions -> succeeded -> results (JSONL) downloaded, sampling the worker's RSS.
    With ``args.loop``, right after each job, at the worker's niceness, the loop's own time on the same texts."""
    import csv

    import httpx

    from shared.settings import get_settings
    from shared.store.engine import upgrade_database
    from shared.store.keys import create_key
    from tests.faults_support import Process, free_port, wait_for
    from tunejob.cli import SERVE_WORKER_NICENESS

    out: dict = {"sizes": []}
    with tempfile.TemporaryDirectory(prefix="tunejob-bench-job-") as work:
        work_dir = Path(work)
        data_dir = work_dir / "data"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEJOB_")}
        os.environ.update({"TUNEJOB_DATA_DIR": str(data_dir)})
        env.update(
            {
                "TUNEJOB_DATA_DIR": str(data_dir),
                "TUNEJOB_DEVICE": "cpu",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        get_settings.cache_clear()
        upgrade_database()
        key, _ = create_key("bench")
        if args.model == "embedding":  # the base sentence-transformers model as an embedding job's artifact
            from shared.jobs.base_models import resolve_model

            model_dir = resolve_model("all-MiniLM-L6-v2")
            job_id = register_model(model_dir, "bench", None, task="embedding")
        else:
            if args.model == "tiny":
                from worker.doctor import build_tiny_bert

                model_dir = build_tiny_bert(work_dir / "tiny-bert")
            else:
                model_dir = model_path(args.model)
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_dir)
            job_id = register_model(model_dir, "bench", [config.id2label[i] for i in range(config.num_labels)])
        port = free_port()
        env["TUNEJOB_URL"] = f"http://127.0.0.1:{port}"
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=600
        )
        server: Process | None = None
        sampler: RssSampler | None = None

        def up() -> bool:
            try:
                return client.get("/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        def upload(texts: list[str]) -> str:
            path = work_dir / f"rows-{len(texts)}.csv"
            with path.open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["text"])
                w.writerows([t] for t in texts)
            with path.open("rb") as f:
                r = client.post("/datasets", files={"file": (path.name, f, "text/csv")})
            r.raise_for_status()
            path.unlink()
            return r.json()["id"]

        def predict(dataset: str, precision: str = "auto") -> tuple[float, dict, int]:
            began = time.perf_counter()
            r = client.post(
                "/predictions",
                json={
                    "model": job_id,
                    "dataset": dataset,
                    "text_column": "text",
                    "max_length": args.max_length,
                    "precision": precision,
                },
            )
            r.raise_for_status()
            pid = r.json()["id"]
            while (p := client.get(f"/predictions/{pid}").json())["status"] not in ("succeeded", "failed", "cancelled"):
                time.sleep(args.poll)
            if p["status"] != "succeeded":
                raise RuntimeError(f"prediction {pid}: {p['status']}: {p.get('error')}\n{server and server.tail()}")
            lines = 0
            with client.stream("GET", f"/predictions/{pid}/results", params={"format": "jsonl"}) as r:
                r.raise_for_status()
                for _ in r.iter_lines():
                    lines += 1
            return time.perf_counter() - began, p, lines

        def start() -> tuple[Process, RssSampler, float]:
            """``tunejob serve`` on the data directory, up; its RSS sampler; a 64-row warm-up's seconds."""
            process = Process(
                "serve", [sys.executable, "-m", "tunejob", "serve", "--port", str(port)], env, work_dir / "serve.log"
            )
            wait_for("tunejob serve", up, timeout=180, diagnostics=process.tail)
            return process, RssSampler(process.popen.pid), predict(upload(job_texts(args.texts, 64)))[0]

        try:
            server, sampler, out["warm_seconds"] = start()
            if args.loop:
                import torch

                from shared.inference.loop import load_for_inference, predict_texts
                from shared.jobs.predictions import max_tokens

                # The worker's niceness, before this process's first torch operation creates its
                # threads: the loop gets the worker's share of the shared CPU. The server started
                # before, at its own.
                os.nice(SERVE_WORKER_NICENESS)
                loaded = load_for_inference(model_dir, torch.device("cpu"))
                budget = max_tokens(64, args.max_length)
                predict_texts(loaded, job_texts(args.texts, 64), None, args.max_length, budget)
                out["threads"] = torch.get_num_threads()
            runs = [
                (r, precision, False) for precision in args.precisions for r in args.rows for _ in range(args.repeats)
            ]
            if args.restart:  # a new worker process on the same data directory (Inductor's disk cache)
                runs += [(args.rows[0], precision, True) for precision in args.precisions]
            for rows, precision, restarted in runs:
                if restarted and not any(size["restarted"] for size in out["sizes"]):
                    sampler.close()
                    server.stop(timeout=60)
                    server, sampler, out["restart_warm_seconds"] = start()
                texts = job_texts(args.texts, rows)
                dataset = upload(texts)
                time.sleep(1)
                load, start_rss = os.getloadavg()[0], sampler.mark()
                seconds, p, lines = predict(dataset, precision)
                if lines != rows:
                    raise RuntimeError(f"{lines} result rows for {rows} input rows")
                size = {
                    "rows": rows,
                    "precision": precision,
                    "restarted": restarted,
                    "job_seconds": seconds,
                    "rows_per_second": rows / seconds,
                    "start_rss": start_rss,
                    "peak_rss": sampler.peak,
                    "samples": sampler.samples,
                    "load_average": load,
                    "timings": p.get("timings"),
                    "worker_rows_per_second": (p.get("result") or {}).get("rows_per_second"),
                    "device": p.get("device"),
                }
                out["sizes"].append(size)
                print(
                    f"{rows:,} rows, {precision}{' (restarted)' if restarted else ''}: job {seconds:.1f} s ({rows / seconds:,.0f} rows/s), worker RSS "
                    f"{start_rss / 2**20:,.0f} -> peak {sampler.peak / 2**20:,.0f} MiB, load {load:.1f}",
                    flush=True,
                )
                if args.loop:  # right after the job, the worker idle: the same texts, model and budget
                    load, began = os.getloadavg()[0], time.perf_counter()
                    predict_texts(loaded, texts, None, args.max_length, budget)
                    loop = time.perf_counter() - began
                    size.update(loop_seconds=loop, loop_load_average=load, **job_ratio(seconds, loop))
                    print(
                        f"{rows:,} rows: loop {loop:.1f} s, job/loop {size['ratio']:.2f}x, target <= "
                        f"{size['limit_s']:.1f} s: {'met' if size['met'] else 'missed'}, load {load:.1f}",
                        flush=True,
                    )
        finally:
            if sampler:
                sampler.close()
            client.close()
            if server:
                server.stop(timeout=60)
    return out


def job(args: argparse.Namespace, command: str) -> None:
    """Measure whole prediction jobs; print the table and write it into ``args.markdown``'s section."""
    from bench.measure import host
    from bench.tables import update_markdown

    machine = host()
    result = measure_job(args)
    model = {
        "tiny": "a 2-layer, 32-wide BERT with random weights (`worker.doctor.build_tiny_bert`)",
        "embedding": "all-MiniLM-L6-v2 as an embedding model (384-dimensional vectors)",
    }.get(args.model, f"the all-MiniLM-L6-v2 fine-tuned on {args.model} (`bench.predict prepare`)")
    texts = "short synthetic texts (3-12 words)" if args.texts == "short" else f"{args.texts} texts in order"
    loop_note = (
        " Loop: `predict_texts` on the same texts and model with the job's budget (batch_size 64 x "
        "max_length tokens), in the benchmark process right after each job (the worker idle), at the "
        "worker's niceness (10), after a 64-row warm-up; target: job <= 1.3 x loop + 2 s."
        if args.loop
        else ""
    )
    restart_note = (
        f" A restarted worker: `tunejob serve` stopped and started again on the same data directory "
        f"(Inductor's on-disk cache kept, the worker's model cache empty), warmed by a 64-row prediction "
        f"({result['restart_warm_seconds']:.1f} s), then one job per precision."
        if args.restart
        else ""
    )
    head = (
        f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}, `{command}`: a real `tunejob serve` (embedded SQLite store, "
        f"filesystem broker, temporary data dir), the model registered as a succeeded training job of the "
        f"store (no training), {model}; {texts} @{args.max_length}. Job: `POST /predictions` -> polled "
        f"`GET /predictions/{{id}}` (every {args.poll:g} s) until succeeded -> every row of `GET .../results?format=jsonl` read; "
        f"the worker warmed by one 64-row prediction ({result['warm_seconds']:.1f} s, cold). Worker RSS: the "
        f"summed RSS of `tunejob serve`'s child processes (psutil, every 0.2 s), at the POST and its peak "
        f"until the results were read.{loop_note}{restart_note} {machine}; load average: 1-minute, before each timing; "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end.\n\n"
    )
    if args.loop:
        head += (
            "| rows | job s | rows/s | loop s | job / loop | target s (1.3 x loop + 2) | met | worker RSS start "
            "-> peak MiB | load average (job, loop) |\n|---|---|---|---|---|---|---|---|---|\n"
        )
        lines = [
            f"| {r['rows']:,} | {r['job_seconds']:.1f} | {r['rows_per_second']:,.0f} | {r['loop_seconds']:.1f} "
            f"| {r['ratio']:.2f}x | {r['limit_s']:.1f} | {'yes' if r['met'] else 'no'} "
            f"| {r['start_rss'] / 2**20:,.0f} -> {r['peak_rss'] / 2**20:,.0f} "
            f"| {r['load_average']:.1f}, {r['loop_load_average']:.1f} |"
            for r in result["sizes"]
        ]
    else:
        head += (
            "| rows | precision | job s | rows/s | worker rows/s | worker RSS at start MiB | peak MiB "
            "| peak - start MiB | RSS samples | load average |\n|---|---|---|---|---|---|---|---|---|---|\n"
        )
        lines = [
            f"| {r['rows']:,} | {r['precision']}{' (a restarted worker)' if r['restarted'] else ''} "
            f"| {r['job_seconds']:.1f} | {r['rows_per_second']:,.0f} "
            f"| {r['worker_rows_per_second'] or 0:,.0f} | {r['start_rss'] / 2**20:,.0f} "
            f"| {r['peak_rss'] / 2**20:,.0f} | {(r['peak_rss'] - r['start_rss']) / 2**20:,.0f} | {r['samples']} "
            f"| {r['load_average']:.1f} |"
            for r in result["sizes"]
        ]
    section = head + "\n".join(lines)
    print("\n" + section)
    BENCH_DIR.mkdir(exist_ok=True)
    (BENCH_DIR / f"job-{args.section}.json").write_text(json.dumps(result, indent=1))
    if args.markdown:
        update_markdown(args.markdown, {f"predict-{args.section}": section})
        print(f"\nupdated {args.markdown}: section predict-{args.section}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="fine-tune the model the benchmark predicts with")
    prep.add_argument("--dataset", choices=["rotten_tomatoes", "bbc"], required=True)
    prep.add_argument("--max-length", type=int, default=None, help="default: the corpus's (128 / 512)")
    prep.add_argument("--learning-rate", type=float, default=1e-4)
    prep.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    bench = sub.add_parser("run", help="measure every configuration, each in a fresh process")
    bench.add_argument("--dataset", choices=["rotten_tomatoes", "bbc"], required=True)
    bench.add_argument("--configs", default="pipeline,tunejob,tunejob:precision=bf16")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--markdown", type=Path, default=None, help="write the table into this file's section")
    lat = sub.add_parser("latency", help="POST /models/{job_id}/predict latency, 1 and 64 texts")
    lat.add_argument("--dataset", choices=["rotten_tomatoes", "bbc"], default="rotten_tomatoes")
    lat.add_argument("--requests", type=int, default=50, help="timed requests per size")
    lat.add_argument("--markdown", type=Path, default=None, help="write the table into this file's section")
    whole = sub.add_parser("job", help="whole prediction jobs through a real `tunejob serve`: time, worker RSS")
    whole.add_argument(
        "--model",
        default="rotten_tomatoes",
        help="rotten_tomatoes or bbc (`prepare`'s model), tiny (a random 2-layer BERT), or embedding "
        "(all-MiniLM-L6-v2 as an embedding model: the job writes vectors; needs --no-loop)",
    )
    whole.add_argument("--texts", default="rotten_tomatoes", help="rotten_tomatoes, bbc, or short (synthetic)")
    whole.add_argument(
        "--rows",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[2000],
        help="comma-separated row counts, one job each",
    )
    whole.add_argument("--max-length", type=int, default=128)
    whole.add_argument("--repeats", type=int, default=1, help="jobs per row count (each a fresh dataset)")
    whole.add_argument(
        "--precisions",
        type=lambda v: v.split(","),
        default=["auto"],
        help="comma-separated prediction precisions (auto, fp32, bf16, int8): every row count and repeat "
        "at each, in this order, in the same worker (a model's second job at a precision reuses its compile)",
    )
    whole.add_argument("--poll", type=float, default=0.2, help="seconds between GET /predictions/{id}")
    whole.add_argument(
        "--loop",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time predict_texts on the same texts (the loop's own time)",
    )
    whole.add_argument(
        "--restart",
        action="store_true",
        help="then restart `tunejob serve` on the same data directory and run one job per precision "
        "(the first row count): what a new worker pays with Inductor's cache on disk",
    )
    whole.add_argument("--section", default="job", help="the Markdown section: predict-<section>")
    whole.add_argument("--markdown", type=Path, default=None, help="write the table into this file's section")
    one = sub.add_parser("one", help="(internal) one configuration in this process")
    one.add_argument("config")
    one.add_argument("dataset")
    one.add_argument("out", type=Path)
    args = p.parse_args(argv)
    if args.command == "job" and args.loop and args.precisions != ["auto"]:
        p.error("--precisions: add --no-loop (the loop timing is at the default precision)")
    if args.command == "job" and args.model == "embedding" and args.loop:
        p.error("--model embedding: add --no-loop (the loop timing is the classification head's)")
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    command = "python -m bench.predict " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.command == "prepare":
        from bench.corpora import CORPORA

        print(
            prepare(
                args.dataset, args.max_length or CORPORA[args.dataset].max_length, args.learning_rate, args.precision
            )
        )
    elif args.command == "run":
        run(args, command)
    elif args.command == "latency":
        latency(args, command)
    elif args.command == "job":
        job(args, command)
    else:
        args.out.write_text(json.dumps(predict_in_this_process(args.config, args.dataset)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
