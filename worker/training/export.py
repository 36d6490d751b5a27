"""The job's artifact: its weights as saved during training (the best and the final ones) and the
model directory a user downloads (``save_model``): Hugging Face files, the training curves, its
metrics and a manifest of every file, with the multi_label decision threshold in its config."""

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from shared.jobs.curves import MetricRow
from shared.schemas.jobs import json_safe
from shared.store import artifacts, objects
from shared.store.manifest import manifest_entries
from worker.device import describe
from worker.evaluation import write_evaluation
from worker.model_card import write_model_card
from worker.reporter import PhaseTimer
from worker.run_logs import write_run_logs
from worker.training.files import save_tokenizer, write_atomically
from worker.training.setup import JobSetup
from worker.training.state import TrainState


def save_weights(model: torch.nn.Module, directory: Path) -> None:
    """Write ``model``'s weights (safetensors) and config to ``directory``, atomically.

    Raises:
        OSError: the files cannot be written.
    """
    write_atomically(directory, lambda tmp: model.save_pretrained(tmp, safe_serialization=True))


def save_final_weights(model: torch.nn.Module, directory: Path) -> dict[str, dict]:
    """``save_weights``, returning the files' manifest entries (``manifest_entries``: size in
    bytes, sha256), hashed right after the write, while the file's pages are still in memory, and
    before the fsync.

    Raises:
        OSError: the files cannot be written.
    """
    entries = {}

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        entries.update(manifest_entries(artifacts.files_of(tmp)))

    write_atomically(directory, write)
    return entries


def save_model(
    job_setup: JobSetup,
    state: TrainState,
    weights: Path,
    timings: Callable[[], dict],
    metric_rows: list[MetricRow],
    hashed: dict[str, dict] | None = None,
) -> Path:
    """Write the job's model to ``artifacts/<job>/model`` in Hugging Face format: the files of
    ``weights`` (safetensors and config with id2label, hard-linked: written once), tokenizer files
    (``model_max_length`` = the job's ``max_length``), ``training_args.json``,
    ``training_curves.png`` and TensorBoard event files under ``runs/`` (``worker.run_logs``, from
    ``metric_rows``: the run's, ``Reporter.metric_rows``),
    ``evaluation.json`` and its pictures (``worker.evaluation``: the saved model on the validation rows),
    the model card ``README.md`` (``worker.model_card``),
    ``metrics.json`` (the best and final evaluations of ``state``, training totals and
    ``timings()``, the phase timings so far) and ``manifest.json`` (each file's size and sha256;
    the entries in ``hashed``, from ``manifest_entries``, are taken as they are instead of reading
    those files again). multi_label: config.json gets the best evaluation's ``decision_threshold``
    (``write_decision_threshold``).

    Written under a temporary name, fsynced, then renamed into place and published
    (``shared.store.objects``). Returns the model directory (with a bucket: its copy in this host's cache).

    Raises:
        OSError: the files cannot be written.
    """
    job, st = job_setup.job, state
    best = st.best or {"step": st.step, "value": None, "metrics": st.last_eval or {}}
    metrics = {
        "best_step": best["step"],
        "final_step": st.step,
        "metric_for_best_model": job_setup.hp.metric_for_best_model,
        "best_value": best["value"],
        "validation": best["metrics"],
        "final_validation": st.last_eval,
        "train": st.throughput(),
    }

    threshold = None
    if job.task == "multi_label":
        threshold = best["metrics"].get("threshold", job.spec.get("decision_threshold", 0.5))
        hashed = {name: entry for name, entry in (hashed or {}).items() if name != "config.json"}

    def write(tmp: Path) -> None:
        nonlocal hashed
        artifacts.link_or_copy_files(weights, tmp)
        if threshold is not None:
            write_decision_threshold(tmp, threshold)
        written = save_tokenizer(job_setup.tokenizer, tmp)
        hashed = {name: entry for name, entry in (hashed or {}).items() if name not in written}
        (tmp / "training_args.json").write_text(json.dumps(job.spec, indent=2))
        write_run_logs(tmp, job, metric_rows)  # training_curves.png and runs/ (TensorBoard)
        data = job_setup.data
        report = write_evaluation(tmp, job.task, data and data.validation, job.spec, job_setup.device)
        write_model_card(tmp, job, data, report, describe(job_setup.device), timings())  # README.md
        metrics_json = json.dumps(json_safe({**metrics, "timings": timings()}), indent=2, allow_nan=False)
        (tmp / artifacts.METRICS).write_text(metrics_json)
        artifacts.write_manifest(tmp, hashed)

    model_dir = artifacts.model_dir(job.id)
    write_atomically(model_dir, write)
    store = objects.store()  # with TUNEJOB_STORAGE_URL: into the bucket, then this host's cache
    return store.local(store.publish(model_dir)) or model_dir


def write_decision_threshold(model_dir: Path, threshold: float) -> None:
    """Add ``decision_threshold`` (a multi_label score at or above it predicts the label) to the
    model's config.json, as a new file: the one there may be hard-linked to a checkpoint's.
    ``transformers.PretrainedConfig`` keeps unknown keys, so ``model.config.decision_threshold`` reads it."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    path.unlink()
    path.write_text(json.dumps({**config, "decision_threshold": threshold}, indent=2, sort_keys=True) + "\n")


def timings_so_far(timer: PhaseTimer, created_at: datetime | None) -> dict[str, float | None]:
    """The run's phase timings, with ``total`` = POST (``created_at``) to now when the job is in the store."""
    timings = timer.timings()
    if created_at is not None:
        timings["total"] = round((datetime.now(UTC) - created_at).total_seconds(), 3)
    return timings
