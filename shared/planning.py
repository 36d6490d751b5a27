"""Checking a job spec against its model and data, and planning it before it runs
(``POST /jobs?dry_run=true``). Needs the tokenizer, not torch."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from sqlalchemy import select

from shared.base_models import resolve_model
from shared.batching import STRATEGIES, BatchPlan
from shared.datasets import read_table, split_train_validation, validate_job_data
from shared.db import session_scope
from shared.errors import UserError
from shared.models import Dataset, Job, JobStatus
from shared.schemas import JobCreate


@dataclass
class CheckedSpec:
    """A job spec that passed ``check_spec``, with what was loaded to check it."""

    spec: JobCreate
    model_dir: Path
    train: Dataset
    validation: Dataset | None
    train_part: pd.DataFrame  # the rows the job trains on (after any validation_split)
    label_names: list[str] | None


def _dataset(s, dataset_id: str, param: str) -> Dataset:
    dataset = s.get(Dataset, dataset_id)
    if dataset is None:
        raise UserError("unknown_dataset", f"{param} {dataset_id!r} does not exist; upload it with POST /datasets",
                        param)
    return dataset


def max_input_length(model_dir: Path) -> int | None:
    """Longest input the model takes, in tokens: the tokenizer's ``model_max_length`` when it is
    real (some tokenizers store a huge sentinel), else the config's ``max_position_embeddings``."""
    def read(name: str) -> dict:
        try:
            return json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            return {}

    tokenizer_limit = read("tokenizer_config.json").get("model_max_length")
    if isinstance(tokenizer_limit, int) and tokenizer_limit < 1_000_000:
        return tokenizer_limit
    return read("config.json").get("max_position_embeddings")


def check_spec(spec: JobCreate) -> CheckedSpec:
    """Check a spec against its model and data before anything is stored or queued.

    Raises:
        UserError: unknown model or dataset, ``max_length`` beyond the model's, missing column,
            unusable labels (see ``shared.datasets.validate_job_data``), a ``validation_split`` that
            leaves no training row.
    """
    model_dir = resolve_model(spec.base_model)
    limit = max_input_length(model_dir)
    if limit and spec.hyperparameters.max_length > limit:
        raise UserError("max_length_too_long", f"hyperparameters.max_length {spec.hyperparameters.max_length} is "
                        f"longer than {spec.base_model!r} accepts ({limit} tokens)", "hyperparameters.max_length")
    with session_scope() as s:
        train = _dataset(s, spec.training_dataset, "training_dataset")
        val = _dataset(s, spec.validation_dataset, "validation_dataset") if spec.validation_dataset else None
    train_table = read_table(Path(train.path), train.format, train.filename)
    names = validate_job_data(
        spec.task, spec.text_column, spec.text_pair_column, spec.label_column, (train_table, train.filename),
        (read_table(Path(val.path), val.format, val.filename), val.filename) if val else None,
    )
    train_part, _ = split_train_validation(train_table, spec.label_column, spec.validation_split or 0.0,
                                           spec.hyperparameters.seed, spec.task == "classification")
    return CheckedSpec(spec, model_dir, train, val, train_part, names)


def plan_job(checked: CheckedSpec) -> dict:
    """What a job will do, computed from its tokenized training split without training.

    Returns a dict with: ``examples``; ``token_lengths`` (histogram of real tokens per example,
    after truncation: ``bin_edges``, ``counts``, ``mean``, ``max``); ``truncated_fraction`` (share of
    examples longer than ``max_length``); ``padding_efficiency`` (real / padded tokens) of each
    batching strategy, before rounding and rounded to multiples of 8; ``micro_batches_per_epoch``,
    ``steps_per_epoch`` and ``total_steps`` for the chosen batching; ``estimated_seconds`` from the
    throughput of the newest succeeded job on the same base model (None when there is none).
    """
    from transformers import AutoTokenizer
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()  # no warning for texts longer than max_length: we count them
    spec, hp, train = checked.spec, checked.spec.hyperparameters, checked.train_part
    tokenizer = AutoTokenizer.from_pretrained(checked.model_dir)
    texts = train[spec.text_column].astype(str).tolist()
    pairs = train[spec.text_pair_column].astype(str).tolist() if spec.text_pair_column else None
    full = np.array([len(ids) for ids in tokenizer(texts, pairs, truncation=False)["input_ids"]])
    lengths = np.minimum(full, hp.max_length)

    def plan_for(strategy: str) -> BatchPlan:
        return BatchPlan(lengths, hp.batch_size, strategy, hp.seed, hp.max_tokens_per_batch)

    efficiency = {}
    for strategy in STRATEGIES:
        plan = plan_for(strategy)
        fixed_width = hp.max_length if strategy == "fixed" else None
        efficiency[strategy] = {"unrounded": plan.padding_efficiency(0, fixed_width, 1),
                                "multiple_of_8": plan.padding_efficiency(0, fixed_width, 8)}
    plan = plan_for(hp.batching)
    micro_batches = len(plan.batches)
    total_steps = plan.count_steps(hp.epochs, hp.gradient_accumulation_steps)
    counts, edges = np.histogram(lengths, bins=min(16, max(1, int(lengths.max()) // 8)))
    return {
        "examples": len(lengths),
        "token_lengths": {"bin_edges": [round(float(e), 1) for e in edges], "counts": counts.tolist(),
                          "mean": float(lengths.mean()), "max": int(lengths.max())},
        "truncated_fraction": float((full > hp.max_length).mean()),
        "padding_efficiency": efficiency,
        "micro_batches_per_epoch": micro_batches,
        "steps_per_epoch": math.ceil(micro_batches / hp.gradient_accumulation_steps),
        "total_steps": total_steps,
        **estimate_seconds(spec.base_model, int(lengths.sum()) * hp.epochs / efficiency[hp.batching]["unrounded"]),
    }


def estimate_seconds(base_model: str, padded_tokens: float) -> dict:
    """Training time for ``padded_tokens`` at the padded-token throughput of the newest succeeded
    job on ``base_model`` (throughput depends on the worker's device, so this is a guide)."""
    with session_scope() as s:
        job = s.scalars(select(Job).where(Job.status == JobStatus.SUCCEEDED, Job.base_model == base_model)
                        .order_by(Job.finished_at.desc()).limit(1)).first()
    metrics = (job.train_metrics or {}) if job else {}
    if not metrics.get("tokens_per_second"):
        return {"estimated_seconds": None, "estimate_basis": f"no succeeded job on {base_model} yet"}
    padded_per_second = metrics["tokens_per_second"] / metrics["padding_efficiency_unrounded"]
    return {"estimated_seconds": padded_tokens / padded_per_second,
            "estimate_basis": f"job {job.id}: {padded_per_second:.0f} padded tokens/s on {job.device}"}
