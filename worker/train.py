"""The training recipe for one job, top to bottom: setup, warm_up, train, evaluate, save_checkpoint,
finish (the final evaluation and save_model).

Each phase is timed once, by ``worker.report.PhaseTimer`` (``run.timer``): ``setup`` times
``tokenize`` and ``load``, and ``@timed`` marks ``warm_up``, ``train``, ``run_evaluation`` and the saves.

Techniques and their sources:
- smart and token-budget batching: ``shared.data.batching`` (seed notebooks 002 and 003); dynamic
  padding per micro-batch up to a bucket width: ``worker.data``;
- the step without host synchronisation, bf16 with fp32 master weights: ``worker.steps``; the step
  as CUDA graphs, captured once per worker: ``worker.graphs`` (PyTorch docs, "CUDA Graphs");
- mixed precision with ``torch.autocast`` and a GradScaler for fp16, gradient accumulation,
  gradient checkpointing, frozen embeddings, DataLoader workers and pinned memory: seed notebooks
  000 and 001, PyTorch AMP docs;
- AdamW (fused kernel) with linear warmup and decay: ``transformers.get_linear_schedule_with_warmup``;
- best model and early stopping as in the Hugging Face Trainer (``metric_for_best_model``,
  ``EarlyStoppingCallback``).
"""

import itertools
import json
import logging
import math
import os
import random
import resource
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import psutil
import torch
from scipy.stats import pearsonr
from sklearn.metrics import accuracy_score, f1_score, mean_squared_error
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    set_seed,
)
from transformers import logging as hf_logging

from shared.data.batching import BatchPlan, bucket_width
from shared.errors import UserError
from shared.inference.precision import autocast_dtype
from shared.jobs.base_models import resolve_model
from shared.schemas.jobs import GREATER_IS_BETTER, Hyperparameters, json_safe
from shared.store import artifacts, objects
from shared.store.manifest import manifest_entries
from shared.store.rows import Job
from worker.data import BatchStats, JobData, TokenizedDataset, make_collator, tokenize
from worker.device import describe, padding_ladder
from worker.graphs import CHECK_STEPS, CapturedSteps, capture_steps, clear_cache, eager_reason
from worker.packing import padded_reason
from worker.report import PhaseTimer, Reporter, timed
from worker.run_logs import write_run_logs
from worker.steps import (
    Steps,
    StepValues,
    bf16_copy,
    example_losses,
    loss_terms,
    make_optimizer,
    make_scheduler,
    uses_bf16_copy,
)
from worker.tagging import tagging_metrics, tokenize_words, word_sequences

hf_logging.set_verbosity_error()
log = logging.getLogger(__name__)
PROBLEM_TYPES = {"classification": "single_label_classification", "multi_label": "multi_label_classification"}
THRESHOLDS = np.round(np.arange(0.05, 0.951, 0.05), 2)  # multi_label: the decision thresholds tune_threshold tries
READ_EVERY_SECONDS = 1.0  # CUDA: copy the per-step values to the host this often (``read_every_seconds``)


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint so that a run resumes exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0  # planned micro-batches of ``epoch`` already trained
    micro_split: int = 1  # each planned micro-batch runs as this many pieces (out-of-memory backoff)
    real_tokens: int = 0
    padded_tokens: int = 0
    unrounded_tokens: int = 0
    train_seconds: float = 0.0
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    nonfinite_run: int = 0  # consecutive skipped steps
    last_eval: dict | None = None  # latest validation metrics
    last_eval_step: int | None = None  # the optimizer step they were taken at
    best: dict | None = None  # {"step", "value", "metrics"} of the best evaluation so far
    evals_since_best: int = 0

    def add(self, micro_batches: int, stats: BatchStats) -> None:
        """Account for one optimizer step as it is queued (what the host knows without waiting)."""
        self.step += 1
        self.batch_in_epoch += micro_batches
        self.real_tokens += stats.real
        self.padded_tokens += stats.padded
        self.unrounded_tokens += stats.unrounded

    def count_skip(self, skipped: bool) -> None:
        """Account for whether a step was skipped, once its values reach the host."""
        self.skipped_steps += skipped
        self.nonfinite_run = self.nonfinite_run + 1 if skipped else 0

    def throughput(self) -> dict[str, float]:
        """Real tokens/s over training time and padding efficiency (real / padded tokens) so far."""
        return {
            "tokens_per_second": self.real_tokens / self.train_seconds,
            "padding_efficiency": self.real_tokens / self.padded_tokens,
            "padding_efficiency_unrounded": self.real_tokens / self.unrounded_tokens,
            "real_tokens": self.real_tokens,
            "train_seconds": self.train_seconds,
            "skipped_steps": self.skipped_steps,
        }


class StepTimer:
    """ETA from the mean wall time per optimizer step of this attempt (evaluation included), and
    the training time of each window of steps whose values are read back together (``lap``;
    evaluation and checkpoints are left out by ``restart``)."""

    def __init__(self, first_step: int):
        self.start, self.first_step = time.perf_counter(), first_step
        self.window_start = self.start

    def eta(self, step: int, total_steps: int) -> float:
        return (time.perf_counter() - self.start) / max(1, step - self.first_step) * (total_steps - step)

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.window_start = now - self.window_start, now
        return seconds

    def restart(self) -> None:
        self.window_start = time.perf_counter()


@dataclass
class StepRecord:
    """What the host knows about an optimizer step when it queues it."""

    step: int
    epoch: float
    learning_rate: float
    stats: BatchStats


@dataclass
class Run:
    """Everything ``setup`` builds for one job."""

    job: Job
    hp: Hyperparameters
    device: torch.device
    dtype: torch.dtype | None  # autocast dtype, None for fp32
    tokenizer: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_set: TokenizedDataset
    val_set: TokenizedDataset | None
    plan: BatchPlan
    collator: object
    total_steps: int
    out_dir: Path  # this job's checkpoint directory
    forward_model: torch.nn.Module  # what trains: ``model``, its bf16 copy, or a ``torch.compile`` wrapper
    state: TrainState = field(default_factory=TrainState)
    steps: Steps | None = None  # how optimizer steps run (eager or CUDA graphs); set by ``warm_up``
    timer: PhaseTimer = field(default_factory=PhaseTimer)


def fine_tune(job: Job, data: JobData, device: torch.device, reporter: Reporter, checkpoint: Path | None = None,
              timer: PhaseTimer | None = None) -> str:
    """Run one job to its end, resuming from ``checkpoint`` if given.

    ``timer`` times the phases and reports them as the job's ``timings`` (default: a new one
    reporting to ``reporter``; the worker passes its own, which has already timed ``load_job_data``).

    Returns ``"succeeded"``, or why it stopped early (``Reporter.should_stop``).

    Raises:
        shared.errors.UserError: bad data, an unknown model, out of memory at micro-batch 1, or
            ``max_nonfinite_steps`` non-finite steps in a row (the job fails without retry).
    """
    run = setup(job, data, device, reporter, checkpoint, timer or PhaseTimer(reporter))
    warm_up(run, reporter)
    outcome = train(run, reporter)
    if outcome != "completed":
        if outcome != "lease_lost":
            reporter.flush()  # the job's last steps and progress, before it ends or is re-queued
        return outcome
    finish(run, reporter)
    return "succeeded"


# ----------------------------------------------------------------------------- setup


def setup(job: Job, data: JobData, device: torch.device, reporter: Reporter, checkpoint: Path | None = None,
          timer: PhaseTimer | None = None) -> Run:
    """Tokenize the data, build the model, optimizer and schedule; restore ``checkpoint`` if given.

    ``job`` needs only ``id``, ``task``, ``base_model``, ``label_names`` and ``spec``; it may be a
    transient ``Job`` that is not in the store (the benchmark does this). ``timer`` (default: a new,
    silent one) times ``tokenize`` and ``load`` and goes on timing the run's phases.
    """
    timer = timer or PhaseTimer()
    hp = Hyperparameters(**job.spec["hyperparameters"])
    spec = job.spec
    set_seed(hp.seed)
    model_dir = resolve_model(job.base_model)

    def encode(df, sha256, training=True):
        if job.task == "token_classification":  # validation scores words: first subwords only
            return tokenize_words(tokenizer, df, spec["text_column"], spec["label_column"], job.label_names,
                                  hp.max_length, training and spec.get("label_all_subwords", False))
        return tokenize(tokenizer, df, spec["text_column"], spec.get("text_pair_column"), spec["label_column"],
                        job.label_names, hp.max_length, sha256)

    with timer.phase("tokenize"):
        tokenizer = load_tokenizer(model_dir, job.base_model, hp.max_length)
        train_set = encode(data.train, data.train_sha256)
        val_set = (encode(data.validation, data.validation_sha256, training=False)
                   if data.validation is not None else None)
    cached = [part.from_cache for part in (train_set, val_set) if part is not None]
    reporter.event("tokenized", f"{len(train_set)} training and {len(val_set) if val_set else 0} validation texts at "
                   f"max_length {hp.max_length}: " + ("read from the tokenization cache" if all(cached) else
                                                      "tokenized" + (" and cached" if data.train_sha256 else "")))

    with timer.phase("load"):
        model = load_model(checkpoint or model_dir, job, device)
        if hp.freeze_embeddings:
            model.base_model.embeddings.requires_grad_(False)
        if hp.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

        plan = BatchPlan(train_set.lengths, hp.batch_size, hp.batching, hp.seed, hp.max_tokens_per_batch)
        total_steps = plan.count_steps(hp.epochs, hp.gradient_accumulation_steps)
        optimizer = make_optimizer(model, hp, device)
        scheduler = make_scheduler(optimizer, hp, total_steps)
        dtype = autocast_dtype(hp.precision, device)
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        collator = make_collator(tokenizer, hp.batching, hp.max_length, padding_ladder(hp, device),
                                 labels_per_token=job.task == "token_classification")

        run = Run(job, hp, device, dtype, tokenizer, model, optimizer, scheduler, scaler, train_set, val_set, plan,
                  collator, total_steps, artifacts.checkpoints_dir(job.id),
                  torch.compile(model) if hp.torch_compile else model, timer=timer)
        if checkpoint:
            load_training_state(run, checkpoint)
            reporter.event("resumed", f"resumed from the checkpoint at step {run.state.step}")
    reporter.progress(total_steps=total_steps, device=describe(device), step=run.state.step)
    reporter.flush()
    return run


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
    labels (``id2label``, ``label2id``), which pipelines read."""
    if job.task == "regression":
        labels = {"num_labels": 1, "problem_type": "regression"}
    else:
        names = job.label_names
        labels = {"num_labels": len(names), "id2label": dict(enumerate(names)),
                  "label2id": {n: i for i, n in enumerate(names)}}
        if problem := PROBLEM_TYPES.get(job.task):  # token_classification has none
            labels["problem_type"] = problem
    model_class = (AutoModelForTokenClassification if job.task == "token_classification"
                   else AutoModelForSequenceClassification)
    kwargs = dict(use_safetensors=True, ignore_mismatched_sizes=True, trust_remote_code=False,
                  device_map=device or "cpu", **labels)
    try:
        try:
            return model_class.from_pretrained(path, attn_implementation="sdpa", **kwargs)
        except (ValueError, ImportError):  # the architecture has no SDPA implementation
            return model_class.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:  # the same files fail the same way: no retry
        raise UserError("model_load_failed", f"model {job.base_model!r} could not be loaded: {e}", "base_model") from e


def learning_rate(run: Run) -> float:
    """The learning rate of the next optimizer step, computed on the host (the optimizer's own may
    be a device tensor)."""
    scheduler = run.scheduler
    return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](scheduler.last_epoch)


def make_loader(run: Run, dataset: TokenizedDataset, plan: BatchPlan, epoch: int) -> DataLoader:
    """A DataLoader over ``plan``; it draws worker seeds from its own generator so that the global
    RNG (dropout) advances the same whether or not a run was resumed."""
    return DataLoader(dataset, batch_sampler=plan, collate_fn=run.collator, num_workers=run.hp.dataloader_num_workers,
                      pin_memory=run.device.type == "cuda", generator=torch.Generator().manual_seed(run.hp.seed + epoch))


# ----------------------------------------------------------------------------- warm_up


@timed("warmup")
def warm_up(run: Run, reporter: Reporter | None = None) -> None:
    """Prepare how the job's optimizer steps run (``run.steps``), before the first one, so that no
    shape is first seen mid-epoch.

    On CUDA: turn off the cuDNN attention backend, which plans every new shape (0.2-0.7 s each,
    also inside a capture; the memory-efficient SDPA kernel plans nothing: ../shared/gpu/README.md),
    then capture the step as CUDA graphs, one per bucket width the job's plan uses, or reuse those
    an earlier job of the same model shape captured in this worker (``worker.graphs``); a new
    capture is first checked against the eager step on the job's first micro-batches
    (``worker.graphs.check_against_eager``). Where the job cannot be captured, or capture or that
    check fails (a mismatch, an exception, out of memory), it trains eagerly, an event
    (``cuda_graphs_off``) says why, and the worker does not try graphs for that shape again.
    Elsewhere (the CPU) the steps run eagerly, with the same bodies. ``train`` calls this itself if
    it has not run. ``reporter``, if given, gets the events.
    """
    if run.device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    reason = eager_reason(run)
    if reason is None:
        widths = list(run.plan.width_counts(run.collator.ladder, run.hp.epochs))
        try:
            run.steps, message = capture_steps(run, micro_batch_size(run), widths, lambda: first_steps(run, CHECK_STEPS),
                                               lambda width: width_sample(run, width))
            notify(reporter, "cuda_graphs", message)
            return
        except Exception as e:  # capture or its check failed: train this job eagerly, with the same bodies
            log.exception("job %s: CUDA graphs not used; training eagerly", run.job.id)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
            notify(reporter, "cuda_graphs_off", f"training eagerly: CUDA graphs not used ({type(e).__name__}: "
                   f"{str(e)[:400]})", "warning")
    elif run.device.type == "cuda":
        notify(reporter, "cuda_graphs_off", f"training eagerly: {reason}", "info")
    run.steps = eager_steps(run, reporter)


def first_steps(run: Run, n: int) -> list[tuple[list[dict[str, torch.Tensor]], int]]:
    """The micro-batches of the job's next ``n`` optimizer steps (fewer if its epoch ends first),
    collated and split as ``train_step`` will have them, each step with its loss terms; read from
    the plan, with no RNG drawn."""
    batches = run.plan.epoch_batches(run.state.epoch)
    start = run.state.batch_in_epoch if run.state.batch_in_epoch < len(batches) else 0
    accumulation = run.hp.gradient_accumulation_steps
    return [step_inputs(run, batches[s:s + accumulation])
            for s in range(start, min(len(batches), start + n * accumulation), accumulation)]


def width_sample(run: Run, width: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """One micro-batch the job will train on at bucket ``width`` (the first in plan order over its
    epochs), collated and split as ``train_step`` will have it, with its loss terms.

    Raises:
        ValueError: no micro-batch of the job's plan has that width.
    """
    for epoch in range(max(1, math.ceil(run.hp.epochs))):
        for batch in run.plan.epoch_batches(epoch):
            if bucket_width(run.collator.ladder, int(run.plan.lengths[batch].max())) == width:
                pieces, _ = step_inputs(run, [batch])
                return pieces[:1], loss_terms(pieces[0]["labels"], run.job.task)
    raise ValueError(f"no micro-batch of width {width} in the job's plan")


def step_inputs(run: Run, batches: list[list[int]]) -> tuple[list[dict[str, torch.Tensor]], int]:
    """Planned ``batches`` (example indices) collated and split into micro-batches, with their loss terms."""
    group = [run.collator([run.train_set[i] for i in batch]) for batch in batches]
    pieces = [piece for planned in group for piece in split_batch(planned, run.state.micro_split)]
    return pieces, sum(loss_terms(piece["labels"], run.job.task) for piece in pieces)


def notify(reporter: Reporter | None, code: str, message: str, level: str = "info") -> None:
    """An event on the job, when there is a reporter to take it."""
    if reporter is not None:
        reporter.event(code, message, level=level)


def eager_steps(run: Run, reporter: Reporter | None = None) -> Steps:
    """Eager steps for ``run``; bf16 trains a bf16 copy of the model (``worker.steps``). A job
    with ``packing`` trains on packed micro-batches unless ``worker.packing.padded_reason`` says
    why not; an event (``packing``) says which."""
    if uses_bf16_copy(run) and next(run.forward_model.parameters()).dtype != torch.bfloat16:
        compute = bf16_copy(run.model)
        run.forward_model = torch.compile(compute) if run.hp.torch_compile else compute
    hp = run.hp
    reason = padded_reason(run.model, hp.torch_compile, hp.gradient_checkpointing) if hp.packing else "packing is off"
    if reason is None:
        notify(reporter, "packing", "packed micro-batches: no padding, attention per example (variable-length kernel)")
    elif hp.packing:
        notify(reporter, "packing", f"padded micro-batches: {reason}", "warning")
    return Steps(run, packing=reason is None)


# ----------------------------------------------------------------------------- train


@timed("train")
def train(run: Run, reporter: Reporter) -> str:
    """The training loop. One optimizer step per ``gradient_accumulation_steps`` micro-batches;
    evaluation and checkpoints every ``eval_every_steps``/``save_every_steps`` (default: at the end
    of each epoch); ``reporter.should_stop()`` is asked after every step.

    No step waits for the device: each step's loss, gradient norm and skip flag stay on it and
    are read back in bulk (on CUDA about once a second; on the CPU, where reading costs nothing,
    after every step), and always before an evaluation, a checkpoint or a stop. Every step's
    metrics are logged then; ``max_nonfinite_steps`` is checked then too.

    Returns ``"completed"`` (also after early stopping), ``"pruned"`` (a sweep's pruner stopped the
    trial after an evaluation: ``Reporter.should_prune``) or why it stopped (see
    ``Reporter.should_stop``); on ``"shutdown"`` it saves a checkpoint first.
    """
    hp, st = run.hp, run.state
    if run.steps is None:
        warm_up(run, reporter)
    timer = StepTimer(st.step)
    values = StepValues(run.device, read_every_seconds(run.device))
    run.model.train()
    run.forward_model.train()
    while st.step < run.total_steps:
        for group in step_groups(run):
            lr = learning_rate(run)
            step_values, stats = train_step_with_backoff(run, reporter, group)
            st.add(len(group), stats)
            epoch = st.epoch + st.batch_in_epoch / max(1, len(run.plan.batches))
            values.add(step_values, StepRecord(st.step, epoch, lr, stats))
            if st.step >= run.total_steps:
                log_steps(run, reporter, values.poll(wait=True), timer)
                return "completed"
            log_steps(run, reporter, values.poll(), timer)
            end_of_epoch = st.batch_in_epoch == len(run.plan.batches)
            evaluate_now = run.val_set is not None and due(st.step, hp.eval_every_steps, end_of_epoch)
            stop = reporter.should_stop()
            checkpoint_due = due(st.step, hp.save_every_steps, end_of_epoch) if stop is None else stop == "shutdown"
            if evaluate_now or checkpoint_due or stop:  # these need every step's values: wait for them
                log_steps(run, reporter, values.poll(wait=True), timer)
            if evaluate_now:
                if run_evaluation(run, reporter):
                    save_best(run)
                if should_stop_early(run, reporter):
                    return "completed"
                if reporter.should_prune(st.step, st.last_eval):  # a sweep's trial (shared.jobs.sweeps)
                    return "pruned"
                run.model.train()
                timer.restart()
            if checkpoint_due and st.nonfinite_run == 0:  # on shutdown: the next worker resumes from here
                save_checkpoint(run, reporter)
                timer.restart()
            if stop:
                return stop
        st.epoch, st.batch_in_epoch = st.epoch + 1, 0
    return "completed"


def read_every_seconds(device: torch.device) -> float:
    """How often per-step values are copied to the host: about once a second on CUDA, where a read
    waits for the GPU; after every step on the CPU, where it costs nothing."""
    return READ_EVERY_SECONDS if device.type == "cuda" else 0.0


def due(step: int, every: int | None, end_of_epoch: bool) -> bool:
    return step % every == 0 if every else end_of_epoch


def step_groups(run: Run) -> Iterator[list[dict]]:
    """The rest of the current epoch as groups of ``gradient_accumulation_steps`` padded micro-batches."""
    run.plan.set_epoch(run.state.epoch, skip=run.state.batch_in_epoch)
    micro_batches = iter(make_loader(run, run.train_set, run.plan, run.state.epoch))
    while group := list(itertools.islice(micro_batches, run.hp.gradient_accumulation_steps)):
        yield group


def train_step_with_backoff(run: Run, reporter: Reporter, group: list[dict]) -> tuple[torch.Tensor, BatchStats]:
    """``train_step``, retried after an out-of-memory error with each micro-batch cut in half (and so
    twice the accumulation): the effective batch, and the step's gradient, stay the same. After an
    out-of-memory error a job on CUDA graphs drops them (and the worker's cached graphs, to free
    their memory) and trains on eagerly.

    Raises:
        UserError: ``out_of_memory`` when a micro-batch of one example does not fit.
    """
    st = run.state
    while True:
        try:
            return train_step(run, group)
        except torch.OutOfMemoryError as e:
            run.steps.discard_step()
            if isinstance(run.steps, CapturedSteps):
                clear_cache()
                run.steps = eager_steps(run, reporter)
                reporter.event("cuda_graphs_off", "out of memory: dropped the CUDA graphs, training eagerly",
                               level="warning")
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
            largest = max(len(b["labels"]) for b in group)
            if math.ceil(largest / st.micro_split) <= 1:
                raise UserError("out_of_memory", f"out of memory at step {st.step + 1} with a micro-batch of one "
                                "example; lower max_length or turn on gradient_checkpointing",
                                "hyperparameters.max_length") from e
            st.micro_split *= 2
            micro, accumulation = micro_batch_size(run), run.hp.gradient_accumulation_steps * st.micro_split
            reporter.event("out_of_memory", f"out of memory at step {st.step + 1}: micro-batch cut to {micro}, "
                           f"gradient_accumulation_steps raised to {accumulation}; the effective batch is unchanged",
                           level="warning")


def micro_batch_size(run: Run) -> int:
    return math.ceil(run.hp.batch_size / run.state.micro_split)


def train_step(run: Run, group: list[dict]) -> tuple[torch.Tensor, BatchStats]:
    """Forward and backward over the micro-batches of one optimizer step, then clip and step
    (``run.steps``; ``warm_up`` first if it has not run).

    The loss of each micro-batch is summed over its examples and divided by the number of
    examples in the whole step (token_classification: labelled tokens, ``loss_terms``), so
    micro-batches of unequal size weigh correctly and the gradient equals that of one batch of
    all of them. A step whose loss or gradient is not finite is
    skipped (the fused AdamW leaves weights and moments alone).

    Returns:
        (``[loss, grad_norm, skipped]`` as a device tensor, not yet read; token counts of the step,
        filler rows of CUDA graphs included in ``padded``).
    """
    if run.steps is None:
        warm_up(run)
    n_examples = sum(loss_terms(b["labels"], run.job.task) for b in group)
    stats = BatchStats(0, 0, 0)
    for planned in group:
        s = BatchStats.of(planned, padded_to_longest=run.hp.batching != "fixed")
        stats = BatchStats(stats.real + s.real, stats.unrounded + s.unrounded, stats.padded + s.padded)
    pieces = [piece for planned in group for piece in split_batch(planned, run.state.micro_split)]
    values, filler_tokens = run.steps.step(pieces, n_examples)
    run.scheduler.step()
    return values, BatchStats(stats.real, stats.unrounded, stats.padded + filler_tokens)


def split_batch(batch: dict[str, torch.Tensor], pieces: int) -> list[dict[str, torch.Tensor]]:
    """Cut a padded batch into ``pieces`` row-wise chunks (out-of-memory backoff)."""
    if pieces == 1:
        return [batch]
    chunks = {k: v.tensor_split(pieces) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(pieces) if len(chunks["labels"][i])]


def loss_sum_of(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Summed loss of a micro-batch: cross-entropy (logits ``[n, classes]``, labels ``[n]`` int64),
    squared error (logits ``[n, 1]``, labels ``[n]`` float), or token_classification's cross-entropy
    over labelled tokens (``example_losses``), computed in fp32."""
    return example_losses(logits, labels, task).sum()


def check_finite(run: Run, step: int) -> None:
    """Fail the job after ``max_nonfinite_steps`` consecutive non-finite steps (the last one being
    ``step``); the checkpoints written before them (only finite steps are checkpointed) are kept."""
    st, limit = run.state, run.hp.max_nonfinite_steps
    if st.nonfinite_run >= limit:
        raise UserError("nonfinite_loss", f"{limit} consecutive optimizer steps (up to step {step}) had a "
                        "non-finite loss or gradient; lower the learning_rate or use bf16/fp32 precision; "
                        "the last good checkpoint is kept", "hyperparameters.learning_rate")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_in_use_mb(device: torch.device) -> float:
    """Memory held now, in MiB: CUDA tensors on a GPU, the worker's resident set (psutil) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


def log_steps(run: Run, reporter: Reporter, landed: list[tuple[StepRecord, list[float]]], timer: StepTimer) -> None:
    """Account for and log the steps whose values reached the host (oldest first): each step's
    metrics, then the job's progress, ETA and running totals. Their time is the wall time since the
    previous read (evaluation and checkpoints left out), shared by their real tokens.

    Raises:
        UserError: ``nonfinite_loss`` (``check_finite``).
    """
    if not landed:
        return
    st = run.state
    seconds = timer.lap()
    st.train_seconds += seconds
    tokens_per_second = sum(record.stats.real for record, _ in landed) / seconds
    peak = peak_memory_mb(run.device)
    for record, (loss, grad_norm, skipped) in landed:
        st.count_skip(skipped > 0)
        reporter.log(record.step, record.epoch, {
            "train_loss": loss,
            "learning_rate": record.learning_rate,
            "grad_norm": grad_norm,
            "tokens_per_second": tokens_per_second,
            "padding_efficiency": record.stats.real / record.stats.padded,
            "padding_efficiency_unrounded": record.stats.real / record.stats.unrounded,
            "peak_memory_mb": peak,
            "skipped_steps": st.skipped_steps,
        })
        check_finite(run, record.step)
    totals = {"loss": loss, "learning_rate": record.learning_rate, "peak_memory_mb": peak,
              "memory_mb": memory_in_use_mb(run.device),
              "micro_batch_size": micro_batch_size(run),
              "gradient_accumulation_steps": run.hp.gradient_accumulation_steps * st.micro_split, **st.throughput()}
    reporter.progress(step=record.step, epoch=record.epoch, eta_seconds=timer.eta(record.step, run.total_steps),
                      train_metrics=totals)


# ----------------------------------------------------------------------------- evaluate


@torch.no_grad()
def evaluate(run: Run, reporter: Reporter | None = None) -> dict[str, float]:
    """Validation loss plus accuracy and macro-F1 (classification), MSE and Pearson r (regression),
    ``multi_label_metrics`` (multi_label), or entity-level precision, recall and F1, token accuracy
    and ``per_entity`` metrics (token_classification: ``worker.tagging.tagging_metrics``; its loss
    is per labelled token).

    Runs eagerly on ``run.model`` (the fp32 master weights, under autocast with the job's dtype):
    it never touches the training step's CUDA graphs or their inputs. ``reporter``, if given,
    renews the job's lease while a long evaluation runs.
    """
    model, task = run.model, run.job.task
    model.eval()
    plan = BatchPlan(run.val_set.lengths, run.hp.batch_size * 2, "smart", run.hp.seed)
    loss_total, predictions, targets = torch.zeros((), device=run.device), [], []
    for batch in make_loader(run, run.val_set, plan, epoch=0):
        batch = {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast(run.device.type, dtype=run.dtype or torch.float32, enabled=run.dtype is not None):
            logits = model(**batch).logits.float()
        loss_total += loss_sum_of(logits, labels, task)
        predictions.append(logits.squeeze(-1) if task == "regression" else torch.sigmoid(logits)
                           if task == "multi_label" else logits.argmax(-1))
        targets.append(labels)
        if reporter is not None:
            reporter.heartbeat()
    if task == "token_classification":
        names = run.job.label_names
        return {"loss": loss_total.item() / max(1, sum(loss_terms(t, task) for t in targets)),
                **tagging_metrics(*word_sequences(predictions, targets, names), names)}
    y_pred, y_true = torch.cat(predictions).cpu().numpy(), torch.cat(targets).cpu().numpy()
    metrics = {"loss": loss_total.item() / len(y_true)}
    if task == "regression":
        metrics["mse"] = float(mean_squared_error(y_true, y_pred))
        metrics["pearson_r"] = float(pearsonr(y_true, y_pred).statistic) if len(y_true) > 1 else float("nan")
    elif task == "multi_label":
        spec = run.job.spec
        threshold = None if spec.get("tune_threshold") else spec.get("decision_threshold", 0.5)
        metrics.update(multi_label_metrics(y_true, y_pred, run.job.label_names, threshold))
    else:
        metrics["accuracy"] = float(accuracy_score(y_true, y_pred))
        metrics["f1_macro"] = float(f1_score(y_true, y_pred, average="macro"))
    return metrics


def multi_label_metrics(y_true: np.ndarray, scores: np.ndarray, label_names: list[str],
                        threshold: float | None) -> dict:
    """Multi-label metrics (scikit-learn) of sigmoid ``scores`` ``[n, labels]`` against multi-hot
    ``y_true`` ``[n, labels]``, a label predicted where its score >= ``threshold``: ``f1_micro``,
    ``f1_macro``, ``subset_accuracy`` (every label of a row right), ``f1_per_label`` ({name: F1}),
    and the ``threshold`` used. ``threshold`` None: the one of ``THRESHOLDS`` with the best micro-F1
    (the lowest on ties). A label with neither true nor predicted rows has F1 0."""
    y_true = y_true.astype(np.int8)
    if threshold is None:
        threshold = max(THRESHOLDS, key=lambda t: f1_score(y_true, scores >= t, average="micro", zero_division=0))
    y_pred = (scores >= threshold).astype(np.int8)
    per_label = f1_score(y_true, y_pred, average=None, zero_division=0)
    return {"f1_micro": float(f1_score(y_true, y_pred, average="micro", zero_division=0)),
            "f1_macro": float(per_label.mean()),
            "subset_accuracy": float(accuracy_score(y_true, y_pred)),
            "threshold": float(threshold),
            "f1_per_label": dict(zip(label_names, per_label.tolist()))}


@timed("evaluate")
def run_evaluation(run: Run, reporter: Reporter) -> bool:
    """Evaluate, log, and note the best evaluation so far (``run.state.best``). Returns whether
    this one is the new best; saving its weights is the caller's (``save_best``, or ``finish``)."""
    st = run.state
    metrics = st.last_eval = evaluate(run, reporter)
    st.last_eval_step = st.step
    reporter.log(st.step, st.epoch, {f"eval_{k}": v for k, v in metrics.items()
                                     if isinstance(v, float) and math.isfinite(v)})  # not f1_per_label, per_entity
    reporter.progress(validation_metrics=metrics)
    name = run.hp.metric_for_best_model
    value = metrics.get(name, float("nan"))
    better = GREATER_IS_BETTER[name]
    improved = math.isfinite(value) and (st.best is None or (value > st.best["value"] if better else
                                                              value < st.best["value"]))
    if improved:
        st.best, st.evals_since_best = {"step": st.step, "value": value, "metrics": metrics}, 0
    else:
        st.evals_since_best += 1
    return improved


def should_stop_early(run: Run, reporter: Reporter) -> bool:
    """Early stopping: ``early_stopping_patience`` evaluations in a row without a new best."""
    patience, st = run.hp.early_stopping_patience, run.state
    if patience and st.evals_since_best >= patience:
        reporter.event("early_stopping", f"stopped at step {st.step}: {patience} evaluations without improving "
                       f"{run.hp.metric_for_best_model} (best {st.best['value']:.4f} at step {st.best['step']})")
        return True
    return False


# ----------------------------------------------------------------------------- save


def _write_atomically(final_dir: Path, write) -> None:
    """Write a directory under a temporary name, fsync its files, then rename it into place."""
    tmp = final_dir.with_name(f".{final_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(tmp, final_dir)
    dir_fd = os.open(final_dir.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@timed("save")
def save_best(run: Run) -> None:
    """Write the model as the best so far, to ``<checkpoints>/best`` (weights and config). Unless
    a later evaluation is better, these are the weights the artifact gets: ``save_model`` links
    them instead of saving them again."""
    _write_atomically(run.out_dir / "best", lambda tmp: run.model.save_pretrained(tmp, safe_serialization=True))


def save_final_weights(run: Run) -> dict[str, dict]:
    """Write the model's weights and config to ``<checkpoints>/final`` as ``save_best`` does, and
    return their manifest entries (``shared.store.manifest.manifest_entries``: size in bytes, sha256),
    hashed right after the write, while the file's pages are still in memory, and before the
    fsync. Untimed: ``finish`` runs it in a thread, and ``run.timer`` is the main thread's.

    Raises:
        OSError: the files cannot be written.
    """
    entries = {}

    def write(tmp: Path) -> None:
        run.model.save_pretrained(tmp, safe_serialization=True)
        entries.update(manifest_entries(artifacts.files_of(tmp)))

    _write_atomically(run.out_dir / "final", write)
    return entries


@timed("save")
def save_checkpoint(run: Run, reporter: Reporter) -> None:
    """Save model weights (safetensors), tokenizer and the full training state atomically, then
    record it; the store keeps the newest ``save_total_limit`` and their directories, and deletes
    the rest. A checkpoint is a complete model directory (``GET /jobs/{id}/checkpoints/{step}/model.tar``).
    At a step whose evaluation was the best so far, the weights are hard-linked from ``save_best``'s
    directory instead of being written a second time."""
    st = run.state
    path = run.out_dir / f"step-{st.step:08d}"

    def write(tmp: Path) -> None:
        if st.best and st.best["step"] == st.step:  # save_best has just written these weights: link them
            artifacts.link_or_copy_files(run.out_dir / "best", tmp)
        else:
            run.model.save_pretrained(tmp, safe_serialization=True)
        run.tokenizer.save_pretrained(tmp)
        torch.save(training_state(run), tmp / artifacts.TRAINING_STATE)

    _write_atomically(path, write)
    store = objects.store()  # the bucket, with TUNEJOB_STORAGE_URL: published before it is recorded
    for old in reporter.checkpoint(st.step, store.publish(path), st.last_eval, keep=run.hp.save_total_limit):
        store.remove(old)


def training_state(run: Run) -> dict:
    """Optimizer, schedule, scaler, RNG states and loop position: all ``torch.load(weights_only=True)`` safe."""
    np_state = np.random.get_state()
    return {
        "train_state": vars(run.state).copy(),
        "optimizer": portable_state_dict(run.optimizer),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
    }


def portable_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with plain-float learning rates and ``capturable`` off, so that
    any optimizer ``make_optimizer`` builds (CPU or CUDA, eager or captured) can load it."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        group["lr"], group["capturable"] = float(group["lr"]), False
    return state


def load_training_state(run: Run, checkpoint: Path) -> None:
    """Restore what ``training_state`` saved (the weights are loaded with the model)."""
    state = torch.load(checkpoint / artifacts.TRAINING_STATE, weights_only=True, map_location="cpu")
    run.state = TrainState(**state["train_state"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state((rng["numpy"][0], np.array(rng["numpy"][1], dtype=np.uint32), *rng["numpy"][2:]))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def finish(run: Run, reporter: Reporter) -> Path:
    """From the last optimizer step to the saved model: the final evaluation, unless training
    ended with an evaluation at this very step (early stopping), then ``save_model``. Returns the
    model directory.

    While the final evaluation runs (it only reads the weights), a thread writes and hashes the
    final weights (``save_final_weights``). They are the artifact's when that evaluation is the
    best so far (always for a job's only evaluation) or when there is no best (no validation, or
    only non-finite metrics); otherwise the artifact gets ``<checkpoints>/best`` and the final
    weights are deleted with the job's checkpoints. The thread's time counts as ``evaluate``;
    waiting for it after the evaluation, as ``save``.

    Raises:
        OSError: the model cannot be written.
    """
    st = run.state
    evaluate_now = run.val_set is not None and st.last_eval_step != st.step
    with ThreadPoolExecutor(1, thread_name_prefix="final-weights") as pool:
        final = pool.submit(save_final_weights, run) if evaluate_now or st.best is None else None
        if evaluate_now:
            run_evaluation(run, reporter)
        with run.timer.phase("save"):
            final_entries = final.result() if final else None
    reporter.flush()  # every metric row in the store: save_model draws the training curves from them
    if final_entries is not None and (st.best is None or st.best["step"] == st.step):
        model_dir = save_model(run, run.out_dir / "final", final_entries)
    else:
        model_dir = save_model(run, run.out_dir / "best")
    reporter.flush()  # the save phase's timings: the job's end keeps what the store has
    return model_dir


@timed("save")
def save_model(run: Run, weights: Path, hashed: dict[str, dict] | None = None) -> Path:
    """Write the job's model to ``artifacts/<job>/model`` in Hugging Face format: the files of
    ``weights`` (safetensors and config with id2label, hard-linked: written once), tokenizer files
    (``model_max_length`` = the job's ``max_length``), ``training_args.json``,
    ``training_curves.png`` and TensorBoard event files under ``runs/`` (``worker.run_logs``),
    ``metrics.json`` (the best and final evaluations, training totals and the ``timings`` so far)
    and ``manifest.json`` (each file's size and sha256; the entries in ``hashed``, from
    ``manifest_entries``, are taken as they are instead of reading those files again).
    multi_label: config.json gets the best evaluation's ``decision_threshold`` (``write_decision_threshold``).

    Written under a temporary name, fsynced, then renamed into place. Returns the model directory.

    Raises:
        OSError: the files cannot be written.
    """
    st = run.state
    best = st.best or {"step": st.step, "value": None, "metrics": st.last_eval or {}}
    metrics = {"best_step": best["step"], "final_step": st.step, "metric_for_best_model": run.hp.metric_for_best_model,
               "best_value": best["value"], "validation": best["metrics"], "final_validation": st.last_eval,
               "train": st.throughput()}

    threshold = None
    if run.job.task == "multi_label":
        threshold = best["metrics"].get("threshold", run.job.spec.get("decision_threshold", 0.5))
        hashed = {name: entry for name, entry in (hashed or {}).items() if name != "config.json"}

    def write(tmp: Path) -> None:
        artifacts.link_or_copy_files(weights, tmp)
        if threshold is not None:
            write_decision_threshold(tmp, threshold)
        run.tokenizer.save_pretrained(tmp)
        (tmp / "training_args.json").write_text(json.dumps(run.job.spec, indent=2))
        write_run_logs(tmp, run.job)  # training_curves.png and runs/ (TensorBoard)
        metrics_json = json.dumps(json_safe({**metrics, "timings": timings_so_far(run)}), indent=2, allow_nan=False)
        (tmp / artifacts.METRICS).write_text(metrics_json)
        artifacts.write_manifest(tmp, hashed)

    model_dir = artifacts.model_dir(run.job.id)
    _write_atomically(model_dir, write)
    store = objects.store()  # with TUNEJOB_STORAGE_URL: into the bucket, then this host's cache
    return store.local(store.publish(model_dir))


def write_decision_threshold(model_dir: Path, threshold: float) -> None:
    """Add ``decision_threshold`` (a multi_label score at or above it predicts the label) to the
    model's config.json, as a new file: the one there may be hard-linked to a checkpoint's.
    ``transformers.PretrainedConfig`` keeps unknown keys, so ``model.config.decision_threshold`` reads it."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    path.unlink()
    path.write_text(json.dumps({**config, "decision_threshold": threshold}, indent=2, sort_keys=True) + "\n")


def timings_so_far(run: Run) -> dict[str, float | None]:
    """The run's phase timings, with ``total`` = POST to now when the job is in the store."""
    timings = run.timer.timings()
    if run.job.created_at is not None:
        timings["total"] = round((datetime.now(UTC) - run.job.created_at).total_seconds(), 3)
    return timings
