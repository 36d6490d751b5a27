"""What a job's run is given and never changes while it trains (``JobSetup``), and the loaders of
its tokenizer and model."""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    set_seed,
)
from transformers import logging as hf_logging

from shared.data.batching import BatchPlan
from shared.data.columns import JobColumns
from shared.errors import UserError
from shared.inference.precision import PRECISION_NAMES, auto_precision, compute_dtype
from shared.jobs.base_models import resolve_model
from shared.schemas.hyperparameters import Hyperparameters, contrastive_hyperparameters
from shared.store import artifacts
from shared.store.rows import Job
from worker import embedding, reranking
from worker.data import BucketCollator, JobData, TokenizedDataset, make_collator, tokenize
from worker.device import padding_ladder
from worker.reporter import PhaseTimer, Reporter
from worker.tagging import tokenize_words

hf_logging.set_verbosity_error()
PROBLEM_TYPES = {"classification": "single_label_classification", "multi_label": "multi_label_classification"}


@dataclass(frozen=True)
class JobSetup:
    """What one job's run is given and keeps for its whole life: the job, its hyperparameters and
    base model directory, the device and compute dtype (None: fp32; ``compute_dtype``), the tokenized sets, their
    batch plan and collator, the number of optimizer steps, and its checkpoint directory. The parts that change as it trains
    (model, optimizer, schedule, steps, position) belong to the recipe (``worker.training.recipe``)."""

    job: Job
    hp: Hyperparameters
    model_dir: Path  # the base model's files
    device: torch.device
    dtype: torch.dtype | None  # compute dtype (``compute_dtype``), None for fp32
    tokenizer: PreTrainedTokenizerBase
    train_set: TokenizedDataset | embedding.PairsDataset
    val_set: TokenizedDataset | embedding.PairsDataset | None
    plan: BatchPlan
    collator: BucketCollator | embedding.PairsCollator
    total_steps: int
    out_dir: Path  # this job's checkpoint directory
    data: JobData | None = None  # its tables: the validation rows are the evaluation report's (worker.evaluation)
    pos_weight: float | None = None  # reranking: its positive pairs' weight in the loss (reranking.positive_weight)

    @property
    def text_columns(self) -> int:
        """Texts laid side by side in a micro-batch's row: an embedding job's columns (anchor,
        positive, negatives: ``embedding.PairsCollator``), else 1."""
        return len(self.train_set.columns) if isinstance(self.train_set, embedding.PairsDataset) else 1


def prepare_job(job: Job, data: JobData, device: torch.device, reporter: Reporter, timer: PhaseTimer) -> JobSetup:
    """Seed every RNG with the job's seed (``transformers.set_seed``), tokenize the job's data
    (timed as ``tokenize``; read from the tokenization cache where it was tokenized before, with an
    event saying which) and plan its batches.

    ``job`` needs only ``id``, ``task``, ``base_model``, ``label_names`` and ``spec``; it may be a
    transient ``Job`` that is not in the store (the benchmark does this).

    Raises:
        UserError: ``model_load_failed`` (the tokenizer), or bad data (``worker.data.tokenize``).
    """
    hp, spec = contrastive_hyperparameters(Hyperparameters(**job.spec["hyperparameters"]), job.task), job.spec
    set_seed(hp.seed)
    model_dir = resolve_model(job.base_model)
    dtype = compute_dtype(hp.precision, device)
    if hp.precision == "auto":  # what auto chose on this worker's device, and why
        reporter.event("precision", f"precision auto: {PRECISION_NAMES[dtype]} ({auto_precision(device)[1]})")

    def encode(df, sha256, training=True):
        if job.task == "embedding":
            return embedding.tokenize_pairs(tokenizer, df, spec, hp.max_length, sha256)
        if job.task == "token_classification":  # validation scores words: first subwords only
            return tokenize_words(
                tokenizer,
                df,
                spec["text_column"],
                spec["label_column"],
                job.label_names,
                hp.max_length,
                training and spec.get("label_all_subwords", False),
                reporter.interrupted,
            )
        cols = JobColumns.of(spec)  # reranking: its query and passage columns as text and text pair
        encoded = tokenize(
            tokenizer,
            df,
            cols.text,
            cols.text_pair,
            cols.label,
            job.label_names,
            hp.max_length,
            sha256,
            reporter.interrupted,
        )
        encoded.queries = df[cols.text].tolist() if job.task == "reranking" else None  # reranking.evaluate groups
        return encoded

    with timer.phase("tokenize"):
        tokenizer = load_tokenizer(model_dir, job.base_model, hp.max_length)
        train_set = encode(data.train, data.train_sha256)
        val_set = (
            encode(data.validation, data.validation_sha256, training=False) if data.validation is not None else None
        )
    cached = [part.from_cache for part in (train_set, val_set) if part is not None]
    reporter.event(
        "tokenized",
        f"{len(train_set)} training and {len(val_set) if val_set else 0} validation texts at "
        f"max_length {hp.max_length}: "
        + (
            "read from the tokenization cache"
            if all(cached)
            else "tokenized" + (" and cached" if data.train_sha256 else "")
        ),
    )
    plan = (
        embedding.make_plan(train_set, hp)
        if job.task == "embedding"
        else BatchPlan(train_set.lengths, hp.batch_size, hp.batching, hp.seed, hp.max_tokens_per_batch)
    )
    collator = make_collator(
        tokenizer,
        hp.batching,
        hp.max_length,
        padding_ladder(hp, device),
        labels_per_token=job.task == "token_classification",
    )
    if job.task == "embedding":  # each text column padded on its own, the columns side by side
        collator = embedding.PairsCollator(tokenizer, collator.ladder)
    pos_weight = None
    if job.task == "reranking":
        pos_weight = reranking.positive_weight(hp.pos_weight, train_set.labels)
        source = (
            "hyperparameters.pos_weight" if hp.pos_weight is not None else "the training labels' negatives per positive"
        )
        reporter.event("pos_weight", f"positive pairs weighted {pos_weight:.3g} in binary cross-entropy ({source})")
    return JobSetup(
        job,
        hp,
        model_dir,
        device,
        dtype,
        tokenizer,
        train_set,
        val_set,
        plan,
        collator,
        plan.count_steps(hp.epochs, hp.gradient_accumulation_steps),
        artifacts.checkpoints_dir(job.id),
        data,
        pos_weight,
    )


def load_tokenizer(model_dir: Path, name: str, max_length: int):
    """The base model's tokenizer, its ``model_max_length`` set to the job's ``max_length``: saved
    with the model, it makes ``truncation=True`` (without ``max_length``) cut where training did.

    Raises:
        UserError: ``model_load_failed``.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise UserError("model_load_failed", f"tokenizer of {name!r} could not be loaded: {e}", "base_model") from e
    tokenizer.model_max_length = max_length
    return tokenizer


def load_model(path: Path, job: Job, device: torch.device | None = None) -> torch.nn.Module:
    """A sequence-classification model (``problem_type`` single- or multi-label in its config;
    ``AutoModelForTokenClassification`` for token_classification,
    one logit per token and tag) from a base model or checkpoint directory: safetensors only,
    no remote code, SDPA attention where the architecture supports it, its weights read straight
    onto ``device`` (``device_map``; no copy through host memory first). Its config names the
    labels (``id2label``, ``label2id``), which pipelines read. embedding: ``worker.embedding.load_objective``.

    Raises:
        UserError: ``model_load_failed`` (missing or unreadable files, an unknown architecture).
    """
    if job.task == "embedding":
        return embedding.load_objective(path, job, device)
    if job.task in ("regression", "reranking"):  # reranking: one logit, a sigmoid score (CrossEncoder's)
        labels = {"num_labels": 1, "problem_type": "regression"} if job.task == "regression" else {"num_labels": 1}
    else:
        names = job.label_names
        labels = {
            "num_labels": len(names),
            "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)},
        }
        if problem := PROBLEM_TYPES.get(job.task):  # token_classification has none
            labels["problem_type"] = problem
    model_class = (
        AutoModelForTokenClassification if job.task == "token_classification" else AutoModelForSequenceClassification
    )
    kwargs = dict(
        use_safetensors=True,
        ignore_mismatched_sizes=True,
        trust_remote_code=False,
        device_map=device or "cpu",
        **labels,
    )
    try:
        try:
            return model_class.from_pretrained(path, attn_implementation="sdpa", **kwargs)
        except (ValueError, ImportError):  # the architecture has no SDPA implementation
            return model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:  # the same files fail the same way: no retry
        raise UserError("model_load_failed", f"model {job.base_model!r} could not be loaded: {e}", "base_model") from e


def setup_model(js: JobSetup, job: Job, device: torch.device, checkpoint: Path | None) -> torch.nn.Module:
    """The model to train, from ``checkpoint`` or the base model (``load_model``), its embeddings
    frozen and activation checkpointing on where the job asks for them."""
    model = load_model(checkpoint or js.model_dir, job, device)
    if js.hp.freeze_embeddings:
        model.base_model.embeddings.requires_grad_(False)
    if js.hp.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model
