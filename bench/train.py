"""Training throughput as a user waits for it: whole epochs of the engine (through the worker's own
recipe, ``bench.engine``) next to the Hugging Face Trainer and its tuned variants (``bench.peers``),
on the same examples, model initialisation, precision, batch size and seed, each configuration
started cold in its own process (``bench.cold``), round-robin over repeats. Tables: ``bench.tables``.

    python -m bench.train                                   # CPU default: subsets, about 9 minutes
    python -m bench.train --train-size all --accuracy       # the issue's sets, held-out accuracy
    python -m bench.train --dataset rotten_tomatoes --train-size all --accuracy --configs smart,trainer \
        --seeds 1,2,3                                       # accuracy parity: mean and spread over seeds
    python -m bench.train --device cuda --precision bf16 --model bert-base-rand   # a GPU: full sets
    python -m bench.train --dataset imdb_movies --configs smart,trainer --accuracy --epochs 2   # multi_label

Configurations (``--configs``): engine ``<batching>[:<hyperparameter>=<value>...]`` (``smart``,
``fixed``, ``smart:pad_to_multiple_of=8``) and the peers ``trainer``, ``trainer_cudnn_off``,
``trainer_compile``.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from bench.cold import RunSpec
from bench.corpora import CLASSIFICATION, CORPORA
from bench.engine import make_job
from bench.peers import PEERS
from bench.tables import render, summarize, update_markdown

DEFAULT_CONFIGS = {"cpu": "fixed,smart,trainer", "cuda": "fixed,smart,trainer,trainer_cudnn_off"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dataset",
        choices=[*CORPORA, "both"],
        default="both",
        help="both: every single-label corpus (imdb_movies, multi_label, only when named)",
    )
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma list (default: {DEFAULT_CONFIGS['cpu']} on the CPU, {DEFAULT_CONFIGS['cuda']} on CUDA)",
    )
    p.add_argument(
        "--model", default="all-MiniLM-L6-v2", help="a built-in model or a directory under TUNEJOB_MODELS_DIR"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "fp16"],
        default="auto",
        help="as the engine: auto is bf16 (or fp16) on a GPU, bf16 on a CPU with AMX, else fp32; the peers get the same",
    )
    p.add_argument("--batch-sizes", default="32", help="comma list")
    p.add_argument("--max-length", type=int, default=None, help="default: 128 for rotten_tomatoes, 512 for bbc")
    p.add_argument(
        "--train-size",
        default="auto",
        help="training texts: a number, 'all' (the issue's sets: Rotten Tomatoes 4,000, BBC News 1,780) "
        "or 'auto' ('all' on a GPU; on the CPU Rotten Tomatoes 1,000 and BBC News 256)",
    )
    p.add_argument(
        "--val-size",
        type=int,
        default=None,
        help="held-out texts for --accuracy (default: Rotten Tomatoes 2,000, BBC News all 445)",
    )
    p.add_argument(
        "--epochs", type=int, default=1, help="whole epochs per job; with 2 or more, steady state is the last"
    )
    p.add_argument("--jobs", type=int, default=1, help="jobs one after another in each process (2: a warm worker)")
    p.add_argument("--repeats", type=int, default=1, help="cold processes per configuration, round-robin; medians")
    p.add_argument(
        "--seeds",
        default="42",
        help="comma list: each configuration runs once per seed (model head, dropout, batch order); "
        "timings are medians over seeds and repeats, held-out accuracy their mean and range",
    )
    p.add_argument("--accuracy", action="store_true", help="held-out accuracy of every job after its epochs")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument(
        "--cpu-memory",
        choices=["reuse", "default"],
        default="reuse",
        help="on the CPU, for every configuration alike: reuse = the worker's allocator setting "
        "(worker.device.reuse_freed_cpu_memory), default = glibc's",
    )
    p.add_argument(
        "--peak-flops",
        type=float,
        default=989e12,
        help="peak FLOP/s for MFU on a GPU (default: H100 SXM dense bf16, 989e12)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--markdown", type=Path, default=None, help="write the table into this file's section")
    p.add_argument("--section", default=None, help="the Markdown section's name (default: epochs-cpu or epochs-cuda)")
    args = p.parse_args(argv)
    args.datasets = CLASSIFICATION if args.dataset == "both" else [args.dataset]
    args.batch_size_list = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.train_size not in ("auto", "all") and not args.train_size.isdigit():
        p.error("--train-size must be a number, 'all' or 'auto'")
    if min(args.epochs, args.jobs, args.repeats) < 1:
        p.error("--epochs, --jobs and --repeats must be at least 1")
    return args


def check_config(name: str, spec: RunSpec) -> str | None:
    """Why ``name`` is not a configuration, or None."""
    if name in PEERS:
        return None
    try:
        make_job(name, spec, ["a", "b"])
    except ValueError as e:  # pydantic's ValidationError included
        return str(e)
    return None


def plan_runs(args, device_type: str) -> list[RunSpec]:
    """Every cold process to start, round-robin: each repeat runs every (data set, batch size, seed,
    configuration), the first configuration rotating so that drift hits all alike."""
    configs = [c.strip() for c in (args.configs or DEFAULT_CONFIGS[device_type]).split(",") if c.strip()]
    blocks = []
    for name in args.datasets:
        corpus = CORPORA[name]
        if args.train_size == "auto":
            train_size = corpus.train_size if device_type == "cuda" else corpus.cpu_train_size
        else:
            train_size = corpus.train_size if args.train_size == "all" else int(args.train_size)
        for bs in args.batch_size_list:
            blocks.append(
                dict(
                    dataset=name,
                    batch_size=bs,
                    max_length=args.max_length or corpus.max_length,
                    train_size=train_size,
                    val_size=args.val_size or corpus.val_size,
                )
            )
    runs = []
    for repeat in range(args.repeats):
        order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
        for block in blocks:
            for seed in args.seed_list:
                runs += [
                    RunSpec(
                        config=c,
                        model=args.model,
                        device=device_type,
                        precision=args.precision,
                        epochs=args.epochs,
                        jobs=args.jobs,
                        evaluate=args.accuracy,
                        learning_rate=args.learning_rate,
                        seed=seed,
                        cpu_memory=args.cpu_memory,
                        peak_flops=args.peak_flops if device_type == "cuda" else None,
                        repeat=repeat + 1,
                        **block,
                    )
                    for c in order
                ]
    return runs


def run_cold(spec: RunSpec, scratch: Path) -> list[dict]:
    """Start ``bench.cold`` for ``spec`` and collect its rows; a failed process gives one row with
    ``error`` (its output is on the terminal)."""
    out = scratch / f"rows-{time.monotonic_ns()}.json"
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "bench.cold", json.dumps(asdict(spec)), str(out)])
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        return [{**asdict(spec), "error": f"exit status {done.returncode}", "process_seconds": seconds}]
    return [{**row, "process_seconds": seconds} for row in json.loads(out.read_text())]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from worker.device import resolve_device

    device, note = resolve_device(args.device)
    if note:
        print(note, flush=True)
    runs = plan_runs(args, device.type)
    problems = {r.config: check_config(r.config, r) for r in runs}
    if any(problems.values()):
        sys.exit(
            "unknown or invalid configurations: " + "; ".join(f"{name}: {why}" for name, why in problems.items() if why)
        )
    command = "python -m bench.train " + " ".join(sys.argv[1:] if argv is None else argv)
    started, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="tunejob-bench-") as scratch:
        for i, spec in enumerate(runs, 1):
            print(
                f"[{i}/{len(runs)}, {(time.perf_counter() - started) / 60:.1f} min] {spec.dataset} @{spec.max_length}, "
                f"batch {spec.batch_size}, {spec.config}, seed {spec.seed}, repeat {spec.repeat}: fresh process",
                flush=True,
            )
            rows += run_cold(spec, Path(scratch))
            if args.json:  # the rows so far, in case the run is cut short (a GPU lease's time limit)
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(
                    json.dumps({"meta": {"command": command, "partial": True}, "rows": rows}, indent=1)
                )
    failed = [r for r in rows if "error" in r]
    good = [r for r in rows if "error" not in r]
    meta = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "model": args.model,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "seeds": args.seed_list,
        "cpu_memory": args.cpu_memory,
    }
    if good:
        meta.update({k: good[0][k] for k in ("device", "device_type", "torch", "transformers", "dtype")})
        section = render(summarize(good), meta)
        print("\n" + section)
        if args.markdown:
            name = args.section or f"epochs-{device.type}"
            update_markdown(args.markdown, {name: section})
            print(f"\nupdated {args.markdown}: section {name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    for r in failed:
        print(
            f"FAILED: {r['dataset']} batch {r['batch_size']} {r['config']} seed {r['seed']} repeat {r['repeat']}: "
            f"{r['error']}"
        )
    print(f"wall time {(time.perf_counter() - started) / 60:.1f} min")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
