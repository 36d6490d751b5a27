"""Checking a job spec against its model and data, and planning it before it runs
(``POST /jobs?dry_run=true``). Needs the tokenizer, not torch."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import select

from shared.data.batching import STRATEGIES, BatchPlan, DistinctBatchPlan, job_ladder
from shared.data.columns import JobColumns, job_batches
from shared.data.labels import ClassIndex, LabelSummary, scan_job_data
from shared.data.problems import Problems
from shared.data.split import split_train_validation, text_groups, validation_size
from shared.data.texts import head_words
from shared.errors import UserError
from shared.jobs.base_models import TRANSFORMERS_IMPORT, resolve_model
from shared.schemas.hyperparameters import contrastive_hyperparameters
from shared.schemas.jobs import JobCreate
from shared.settings import get_settings
from shared.store import objects, quotas
from shared.store.engine import read_session
from shared.store.rows import Dataset, Job, JobStatus
from shared.store.tenancy import Caller, by_id, scoped


@dataclass
class CheckedSpec:
    """A job spec that passed ``check_spec``, with what was loaded to check it."""

    spec: JobCreate
    model_dir: Path
    train: Dataset
    validation: Dataset | None
    label_names: list[str] | None
    caller: Caller
    rows_without_labels: int = 0  # multi_label: training rows whose label list is empty

    @property
    def columns(self) -> JobColumns:
        return JobColumns.of(self.spec)


def visible_dataset(s, dataset_id: str, param: str, caller: Caller) -> Dataset:
    """The dataset ``dataset_id`` if ``caller`` may see it.

    Raises:
        UserError: ``unknown_dataset`` (422, naming ``param``): no such dataset, another tenant's,
            or deleted.
    """
    dataset = by_id(s, Dataset, dataset_id)
    if dataset is None or not caller.sees(dataset.tenant) or dataset.deleted_at is not None:
        deleted = dataset is not None and caller.sees(dataset.tenant)
        raise UserError(
            "unknown_dataset",
            f"{param} {dataset_id!r} does not exist"
            f"{' any more (it was deleted)' if deleted else ''}; upload it with POST /datasets",
            param,
        )
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


def _require_columns(dataset: Dataset, cols: JobColumns) -> None:
    for column, param in cols.texts + ([(cols.label, cols.label_param)] if cols.label else []):
        if column not in dataset.columns:
            raise UserError(
                "missing_column",
                f"column {column!r} ({param}) not found in {dataset.filename!r}; its columns are {dataset.columns}",
                param,
            )


def check_spec(spec: JobCreate, caller: Caller) -> CheckedSpec:
    """Check a spec against its model and data (datasets that ``caller`` may see) before anything
    is stored or queued, reading the data in batches (``shared.data.labels.scan_job_data``) and keeping only row counts and classes.

    Raises:
        UserError: unknown model or dataset, ``max_length`` beyond the model's, missing column,
            a validation report of unusable cells (``missing_value``, ``invalid_text``,
            ``invalid_label``, ...), ``single_class``, more classes than ``max_classes``,
            ``unknown_label``, a ``validation_split`` that leaves no training row.
    """
    quotas.check_metadata(spec.metadata)
    model_dir = resolve_model(spec.base_model)
    limit = max_input_length(model_dir)
    if limit and spec.hyperparameters.max_length > limit:
        raise UserError(
            "max_length_too_long",
            f"hyperparameters.max_length {spec.hyperparameters.max_length} is "
            f"longer than {spec.base_model!r} accepts ({limit} tokens)",
            "hyperparameters.max_length",
        )
    with read_session() as s:
        train = visible_dataset(s, spec.training_dataset, "training_dataset", caller)
        val = (
            visible_dataset(s, spec.validation_dataset, "validation_dataset", caller)
            if spec.validation_dataset
            else None
        )
    cols = JobColumns.of(spec)
    for dataset in [train] + ([val] if val else []):
        _require_columns(dataset, cols)
    summary = scan_job_data(objects.dataset_file(train), train.format, train.filename, cols)
    if spec.task in ("classification", "token_classification") and summary.names is not None and len(summary.names) < 2:
        raise UserError(
            "single_class",
            f"label column {cols.label!r} in {train.filename!r} has a single class "
            f"({summary.names[0]!r}); {spec.task} needs at least 2",
            "label_column",
        )
    if spec.task == "multi_label" and not summary.names:
        raise UserError(
            "no_labels",
            f"label column {cols.label!r} in {train.filename!r} has no label in any row; "
            "multi_label needs at least one",
            "label_column",
        )
    if val:
        val_summary = scan_job_data(objects.dataset_file(val), val.format, val.filename, cols)
        _check_validation_labels(summary.names, val_summary, val.filename, cols.label)
    if summary.groups is None:
        validation_size(summary.rows, spec.validation_split or 0.0)
    else:  # whole queries or anchors are held out (shared.data.split)
        validation_size(summary.groups, spec.validation_split or 0.0, "distinct query or anchor text(s)")
    return CheckedSpec(spec, model_dir, train, val, summary.names, caller, summary.empty_rows)


def _check_validation_labels(names: list[str] | None, val: LabelSummary, filename: str, column: str | None) -> None:
    """A validation set may only hold classes the training set has; the report gives the first row
    of each unseen class."""
    if names is None:
        return
    unseen = sorted(set(val.names or ()) - set(names), key=lambda n: val.first_row[n])
    if unseen:
        problems = Problems(filename)
        for name in unseen:
            problems.add(
                val.first_row[name],
                column,
                name,
                "is a class the training set lacks",
                "unknown_label",
                "validation_dataset",
            )
        error = problems.error(f"{filename!r} has labels the training set lacks: {sorted(unseen)[:10]}")
        assert error is not None  # a problem per unseen class
        raise error


def length_bins(lengths: np.ndarray, most: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """The histogram of token ``lengths`` (``[n]``, n >= 1) in at most ``most`` bins of whole tokens,
    all as wide: ``(counts [bins], edges [bins + 1])``, bin i holding ``edges[i] <= length <
    edges[i + 1]``. Whole tokens, since lengths are: NumPy's own bins split the range evenly and,
    when every example has the same length (all truncated at ``max_length``), drew 16 fractional bins
    around it."""
    lo, hi = int(lengths.min()), int(lengths.max())
    width = max(1, math.ceil((hi + 1 - lo) / most))
    edges = lo + width * np.arange(math.ceil((hi + 1 - lo) / width) + 1)
    counts, _ = np.histogram(lengths, bins=edges)
    return counts, edges


def plan_job(checked: CheckedSpec) -> dict:
    """What a job will do, computed from its tokenized training split without training.

    Returns a dict with: ``examples``; ``token_lengths`` (histogram of real tokens per example,
    after truncation: ``bin_edges``, ``counts``, ``mean``, ``max``); ``truncated_fraction`` (share of
    examples longer than ``max_length``) and ``truncated_examples`` (how many: their tokens past
    ``max_length`` are not trained on; token_classification: nor are their words' tags scored);
    ``padding_efficiency`` (real / padded tokens; embedding: each text padded in its own column,
    in micro-batches that hold no text twice, as the job plans them) of each batching strategy,
    ``unrounded`` (each micro-batch padded to its longest member: smart batching's own, and what
    a CPU worker computes by default) and ``bucketed`` (padded up to the CUDA workers' bucket
    widths); ``buckets`` for the chosen batching on a CUDA worker: the
    ``ladder`` of widths, the ``widths`` its micro-batches use (width, micro-batches over the
    job's epochs), and their ``padding_efficiency``; ``micro_batches_per_epoch``,
    ``steps_per_epoch`` and ``total_steps`` for the chosen batching; ``estimated_seconds`` from the
    throughput of the newest succeeded job on the same base model (None when there is none);
    multi_label only: ``labels`` (their number) and ``rows_without_labels`` (rows of the training
    file with an empty label list: they train every label towards 0), with a ``notes`` line when
    there are any. A file of more than ``TUNEJOB_DRY_RUN_ROWS`` rows is planned from a random sample
    of them (``RowSample``): ``sampled_rows`` says how many, the counts (histogram, truncated
    examples, micro-batches, steps, the estimate's tokens) are scaled to ``examples``, and a
    ``notes`` line says so.
    """
    with TRANSFORMERS_IMPORT:
        from transformers import AutoTokenizer
        from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()  # no warning for texts longer than max_length: we count them
    spec, hp = checked.spec, contrastive_hyperparameters(checked.spec.hyperparameters, checked.spec.task)
    tokenizer = AutoTokenizer.from_pretrained(checked.model_dir)
    # embedding: [rows, texts] (each text is encoded alone); of a sample of the rows if there are many
    full, keys, examples = training_lengths(tokenizer, checked)
    scale = examples / len(full)  # 1.0 unless sampled

    def scaled(count: float) -> int:
        return round(float(count) * scale)

    texts = np.minimum(full, hp.max_length)
    lengths = texts.max(axis=1) if texts.ndim == 2 else texts  # a row is planned as long as its longest text
    columns = texts if texts.ndim == 2 else None  # embedding: each text padded in its own column
    if full.ndim == 2:
        full = full.max(axis=1)
    ladder = job_ladder(hp.max_length, hp.pad_to_multiple_of, hp.torch_compile, cuda=True)

    def plan_for(strategy: str) -> BatchPlan:
        if keys is not None:  # embedding: as the job plans it, no text twice in a micro-batch
            return DistinctBatchPlan(lengths, keys, hp.batch_size, strategy, hp.seed, hp.max_tokens_per_batch)
        return BatchPlan(lengths, hp.batch_size, strategy, hp.seed, hp.max_tokens_per_batch)

    efficiency = {}
    for strategy in STRATEGIES:
        plan = plan_for(strategy)
        fixed_width = hp.max_length if strategy == "fixed" else None
        efficiency[strategy] = {
            "unrounded": plan.padding_efficiency(0, fixed_width, 1, columns=columns),
            "bucketed": plan.padding_efficiency(0, fixed_width, ladder=ladder, columns=columns),
        }
    plan = plan_for(hp.batching)
    micro_batches = scaled(len(plan.batches))
    used = plan.width_counts([hp.max_length] if hp.batching == "fixed" else ladder, hp.epochs)
    counts, edges = length_bins(lengths)
    notes = multi_label_notes(checked) if spec.task == "multi_label" else []
    if scale != 1:
        notes.append(sample_note(len(full), examples, "training examples"))
    return {
        "examples": examples,
        "token_lengths": {
            "bin_edges": [int(e) for e in edges],
            "counts": [scaled(c) for c in counts],
            "mean": float(lengths.mean()),
            "max": int(lengths.max()),
        },
        "truncated_fraction": float((full > hp.max_length).mean()),
        "truncated_examples": scaled((full > hp.max_length).sum()),
        "padding_efficiency": efficiency,
        "buckets": {
            "ladder": ladder,
            "widths": [{"width": w, "micro_batches": scaled(n)} for w, n in used.items()],
            "padding_efficiency": efficiency[hp.batching]["bucketed"],
        },
        "micro_batches_per_epoch": micro_batches,
        "steps_per_epoch": math.ceil(micro_batches / hp.gradient_accumulation_steps),
        "total_steps": scaled(plan.count_steps(hp.epochs, hp.gradient_accumulation_steps)),
        # every text's tokens (an embedding row's texts each computed at their own length), padded as planned
        **estimate_seconds(
            spec.base_model, scaled(texts.sum()) * hp.epochs / efficiency[hp.batching]["unrounded"], checked.caller
        ),
        **(
            {"labels": len(checked.label_names or ()), "rows_without_labels": checked.rows_without_labels}
            if spec.task == "multi_label"
            else {}
        ),
        **({"sampled_rows": len(full)} if scale != 1 else {}),
        "notes": notes,
    }


def multi_label_notes(checked: CheckedSpec) -> list[str]:
    empty = checked.rows_without_labels
    return (
        [
            f"{empty} row(s) of {checked.train.filename!r} have no label: they are kept, as examples of "
            "none of the labels"
        ]
        if empty
        else []
    )


class RowSample:
    """The rows of a file of ``rows`` rows that a dry run tokenizes: every one up to
    ``TUNEJOB_DRY_RUN_ROWS``, else each with probability ``TUNEJOB_DRY_RUN_ROWS / rows``, drawn in
    file order from a generator of fixed seed (the same file, the same sample). A dry run then
    answers in seconds however large the file (20,000 short texts: under 2 s on a 2-core CPU; at
    the former 100,000, as many pairs of a title and a 2,300-character article took 39 s, and past a
    proxy's 60 s on a busy machine), and costs the API no more. Random, not every k-th row: a file laid out in a pattern (a reranking
    file's query with its positive, then nine negatives) would be sampled on one part of it."""

    SEED = 0

    def __init__(self, rows: int):
        self.p = min(1.0, get_settings().dry_run_rows / max(rows, 1))
        self.rng = np.random.default_rng(self.SEED)

    def take(self, n: int) -> np.ndarray:
        """Which of the file's next ``n`` rows to tokenize: indices into them, ascending."""
        return np.arange(n) if self.p >= 1 else np.flatnonzero(self.rng.random(n) < self.p)


def sample_note(sampled: int, total: int, what: str) -> str:
    return (
        f"planned from {sampled:,} of the {total:,} {what}, a random sample (TUNEJOB_DRY_RUN_ROWS): "
        "the counts and the estimate are scaled to the whole"
    )


TOKENIZE_ROWS = 4096  # texts per tokenizer call in a dry run


def training_lengths(tokenizer, checked: CheckedSpec) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Tokens per example (text pairs as the tokenizer's pair input, word lists as words, no
    truncation; embedding: ``[rows, texts]``, each text of a row alone) of the rows the job trains
    on, or of a random sample of them (``RowSample``) where the file has more than
    ``TUNEJOB_DRY_RUN_ROWS``: the file read a batch at a time, its rows tokenized
    ``TOKENIZE_ROWS`` texts at a time, then split as the worker splits it
    (``split_train_validation``); for embedding the ``[rows, 2]`` ids of each row's anchor and
    positive text (equal texts, equal ids: ``DistinctBatchPlan``'s keys), else None; and the
    number of rows the job trains on. Memory holds one batch of texts and, per row, its class and
    a uint64 group key (reranking, embedding; embedding: and its positive's), and per sampled row
    an int32 length (embedding: one per text)."""
    spec, train, parts, sampled, groups, positives = checked.spec, checked.train, [], [], [], []
    max_length = spec.hyperparameters.max_length
    cols, problems = checked.columns, Problems(train.filename)
    classes = ClassIndex.of(train.filename, cols)
    sample, start = RowSample(train.rows), 0
    for batch in job_batches(objects.dataset_file(train), train.format, train.filename, cols, problems):
        if classes is not None:
            classes.add(batch)
        if cols.grouped:
            groups.append(text_groups(batch.texts))
        if cols.task == "embedding":
            assert batch.pairs is not None
            positives.append(text_groups(batch.pairs))
        take = sample.take(len(batch.texts))
        sampled.append(take + start)
        start += len(batch.texts)
        texts: list = [batch.texts[i] for i in take]  # strings, or word lists (token_classification)
        pairs = [batch.pairs[i] for i in take] if batch.pairs is not None else None
        for a in range(0, len(texts), TOKENIZE_ROWS):
            if cols.task == "embedding":  # each text is encoded alone: a column of counts per text
                assert pairs is not None  # the positives
                columns = [texts, pairs, *([c[i] for i in take] for c in batch.negatives.values())]
                parts.append(
                    np.stack([token_counts(tokenizer, c[a : a + TOKENIZE_ROWS], None, max_length) for c in columns], 1)
                )
                continue
            part_pairs = pairs[a : a + TOKENIZE_ROWS] if pairs is not None else None
            parts.append(
                token_counts(
                    tokenizer, texts[a : a + TOKENIZE_ROWS], part_pairs, max_length, cols.task == "token_classification"
                )
            )
    problems.raise_if_any()  # the file changed since check_spec read it
    lengths, sampled_rows = np.concatenate(parts), np.concatenate(sampled)
    codes = classes.summary().codes if classes is not None else None
    train_rows, _ = split_train_validation(
        start,
        codes,
        spec.validation_split or 0.0,
        spec.hyperparameters.seed,
        np.concatenate(groups) if cols.grouped else None,
    )
    found = np.minimum(np.searchsorted(sampled_rows, train_rows), len(sampled_rows) - 1)
    trained = found[sampled_rows[found] == train_rows]  # the sampled training rows, in the split's order
    if cols.task != "embedding":
        return lengths[trained], None, len(train_rows)
    hashes = np.stack([np.concatenate(groups), np.concatenate(positives)], 1)[sampled_rows[trained]]
    # one id space for anchors and positives, as worker.embedding.text_keys
    keys = np.unique(hashes, return_inverse=True)[1].reshape(hashes.shape)
    return lengths[trained], keys, len(train_rows)


def token_counts(tokenizer, texts: list, pairs: list[str] | None, max_length: int, words: bool = False) -> np.ndarray:
    """Tokens of each text (with its pair; ``words``: lists of words), as int32 ``[len(texts)]``:
    exact where they fit ``max_length``, above it where a job truncates. Texts are cut first
    (``head_words``: a 100 KB passage cost the dry run as much as a whole one), so a count above
    ``max_length`` may be below the text's own."""
    if not words:
        texts, pairs = head_words(texts, max_length), head_words(pairs, max_length) if pairs is not None else None
    ids = tokenizer(
        texts,
        pairs,
        truncation=False,
        return_attention_mask=False,
        return_token_type_ids=False,
        is_split_into_words=words,
    )["input_ids"]
    return np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))


def estimate_seconds(
    base_model: str, padded_tokens: float, caller: Caller, kind: str = "train", precision: str | None = None
) -> dict:
    """Time for ``padded_tokens`` at the padded-token throughput of the newest succeeded job of
    ``kind`` (training, or prediction: a forward pass only) of ``caller``'s tenant on
    ``base_model`` (throughput depends on the worker's device, so this is a guide); with
    ``precision``, of the newest among the last 20 whose spec asked for that precision (a
    prediction's ``int8`` runs at its own speed)."""
    with read_session() as s:
        query = select(Job).where(Job.status == JobStatus.SUCCEEDED, Job.base_model == base_model, Job.kind == kind)
        recent = s.scalars(scoped(query, Job, caller).order_by(Job.finished_at.desc()).limit(20 if precision else 1))
        job = next(
            (j for j in recent if precision is None or (j.spec or {}).get("precision", "auto") == precision), None
        )
    metrics = (job.train_metrics or {}) if job else {}
    if job is None or not metrics.get("tokens_per_second"):
        return {"estimated_seconds": None, "estimate_basis": f"no succeeded job on {base_model} yet"}
    # Training records the efficiency of its unrounded padding apart; a prediction records what it computed.
    padded_per_second = metrics["tokens_per_second"] / metrics.get(
        "padding_efficiency_unrounded", metrics.get("padding_efficiency")
    )
    return {
        "estimated_seconds": padded_tokens / padded_per_second,
        "estimate_basis": f"job {job.id}: {padded_per_second:.0f} padded tokens/s on {job.device}",
    }
