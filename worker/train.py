"""The training recipe for one job, top to bottom: setup, train, evaluate, save_checkpoint, save_model.

Techniques and their sources:
- smart and token-budget batching: ``shared.batching`` (seed notebooks 002 and 003); dynamic
  padding per micro-batch: ``worker.data``;
- mixed precision with ``torch.autocast`` and a GradScaler for fp16, gradient accumulation,
  gradient checkpointing, frozen embeddings, DataLoader workers and pinned memory: seed notebooks
  000 and 001, PyTorch AMP docs;
- AdamW (fused kernel) with linear warmup and decay: ``transformers.get_linear_schedule_with_warmup``;
- best model and early stopping as in the Hugging Face Trainer (``metric_for_best_model``,
  ``EarlyStoppingCallback``).
"""

import itertools
import json
import math
import os
import random
import resource
import shutil
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import pearsonr
from sklearn.metrics import accuracy_score, f1_score, mean_squared_error
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup
from transformers import logging as hf_logging
from transformers import set_seed

from shared.base_models import resolve_model
from shared.batching import BatchPlan
from shared.errors import UserError
from shared.models import Job
from shared.schemas import Hyperparameters
from shared.settings import get_settings
from worker.data import BatchStats, JobData, TokenizedDataset, make_collator, tokenize
from worker.device import autocast_dtype, describe, pad_multiple
from worker.report import Reporter

hf_logging.set_verbosity_error()
GREATER_IS_BETTER = {"loss": False, "mse": False, "accuracy": True, "f1_macro": True, "pearson_r": True}


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
    best: dict | None = None  # {"step", "value", "metrics"} of the best evaluation so far
    evals_since_best: int = 0

    def add(self, micro_batches: int, stats: BatchStats, seconds: float, skipped: bool) -> None:
        """Account for one finished optimizer step."""
        self.step += 1
        self.batch_in_epoch += micro_batches
        self.real_tokens += stats.real
        self.padded_tokens += stats.padded
        self.unrounded_tokens += stats.unrounded
        self.train_seconds += seconds
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
    """ETA from the mean wall time per optimizer step of this attempt (evaluation included)."""

    def __init__(self, first_step: int):
        self.start, self.first_step = time.perf_counter(), first_step

    def eta(self, step: int, total_steps: int) -> float:
        return (time.perf_counter() - self.start) / max(1, step - self.first_step) * (total_steps - step)


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
    forward_model: torch.nn.Module  # ``model``, or its ``torch.compile`` wrapper
    state: TrainState = field(default_factory=TrainState)


def fine_tune(job: Job, data: JobData, device: torch.device, reporter: Reporter, checkpoint: Path | None = None) -> str:
    """Run one job to its end, resuming from ``checkpoint`` if given.

    Returns ``"succeeded"``, or why it stopped early (``Reporter.should_stop``).

    Raises:
        shared.errors.UserError: bad data, an unknown model, out of memory at micro-batch 1, or
            ``max_nonfinite_steps`` non-finite steps in a row (the job fails without retry).
    """
    run = setup(job, data, device, reporter, checkpoint)
    outcome = train(run, reporter)
    if outcome != "completed":
        if outcome != "lease_lost":
            reporter.flush()  # the job's last steps and progress, before it ends or is re-queued
        return outcome
    if run.val_set is not None:
        run_evaluation(run, reporter)
    save_model(run)
    reporter.flush()
    return "succeeded"


# ----------------------------------------------------------------------------- setup


def setup(job: Job, data: JobData, device: torch.device, reporter: Reporter, checkpoint: Path | None = None) -> Run:
    """Tokenize the data, build the model, optimizer and schedule; restore ``checkpoint`` if given.

    ``job`` needs only ``id``, ``task``, ``base_model``, ``label_names`` and ``spec``; it may be a
    transient ``Job`` that is not in the store (the benchmark does this).
    """
    hp = Hyperparameters(**job.spec["hyperparameters"])
    spec = job.spec
    set_seed(hp.seed)
    model_dir = resolve_model(job.base_model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise UserError("model_load_failed", f"tokenizer of {job.base_model!r} could not be loaded: {e}",
                        "base_model") from e

    def encode(df, filename):
        return tokenize(tokenizer, df, spec["text_column"], spec.get("text_pair_column"), spec["label_column"],
                        job.label_names, hp.max_length, filename)

    train_set = encode(data.train, data.train_name)
    val_set = encode(data.validation, data.validation_name) if data.validation is not None else None

    model = load_model(checkpoint or model_dir, job).to(device)
    if hp.freeze_embeddings:
        model.base_model.embeddings.requires_grad_(False)
    if hp.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    plan = BatchPlan(train_set.lengths, hp.batch_size, hp.batching, hp.seed, hp.max_tokens_per_batch)
    total_steps = plan.count_steps(hp.epochs, hp.gradient_accumulation_steps)
    optimizer = make_optimizer(model, hp, device)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(hp.warmup_ratio * total_steps), total_steps)
    dtype = autocast_dtype(hp.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    collator = make_collator(tokenizer, hp.batching, hp.max_length, pad_multiple(hp, device))

    run = Run(job, hp, device, dtype, tokenizer, model, optimizer, scheduler, scaler, train_set, val_set, plan,
              collator, total_steps, get_settings().path("checkpoints", job.id, "x").parent,
              torch.compile(model) if hp.torch_compile else model)
    if checkpoint:
        load_training_state(run, checkpoint)
        reporter.event("resumed", f"resumed from the checkpoint at step {run.state.step}")
    reporter.progress(total_steps=total_steps, device=describe(device), step=run.state.step)
    reporter.flush()
    return run


def load_model(path: Path, job: Job) -> torch.nn.Module:
    """A sequence-classification model from a base model or checkpoint directory: safetensors only,
    no remote code, SDPA attention where the architecture supports it."""
    if job.task == "regression":
        labels = {"num_labels": 1, "problem_type": "regression"}
    else:
        names = job.label_names
        labels = {"num_labels": len(names), "id2label": dict(enumerate(names)),
                  "label2id": {n: i for i, n in enumerate(names)}, "problem_type": "single_label_classification"}
    kwargs = dict(use_safetensors=True, ignore_mismatched_sizes=True, trust_remote_code=False, **labels)
    try:
        try:
            return AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="sdpa", **kwargs)
        except (ValueError, ImportError):  # the architecture has no SDPA implementation
            return AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:  # the same files fail the same way: no retry
        raise UserError("model_load_failed", f"model {job.base_model!r} could not be loaded: {e}", "base_model") from e


def make_optimizer(model: torch.nn.Module, hp: Hyperparameters, device: torch.device) -> torch.optim.AdamW:
    """AdamW over trainable parameters, no weight decay on biases and LayerNorm weights (BERT recipe),
    with the fused kernel (CUDA and CPU; on the 2-core CPU one MiniLM step took 0.020 s fused
    against 0.108 s with the default for-each kernel)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=hp.learning_rate, fused=device.type in ("cuda", "cpu"))


def make_loader(run: Run, dataset: TokenizedDataset, plan: BatchPlan, epoch: int) -> DataLoader:
    """A DataLoader over ``plan``; it draws worker seeds from its own generator so that the global
    RNG (dropout) advances the same whether or not a run was resumed."""
    return DataLoader(dataset, batch_sampler=plan, collate_fn=run.collator, num_workers=run.hp.dataloader_num_workers,
                      pin_memory=run.device.type == "cuda", generator=torch.Generator().manual_seed(run.hp.seed + epoch))


# ----------------------------------------------------------------------------- train


def train(run: Run, reporter: Reporter) -> str:
    """The training loop. One optimizer step per ``gradient_accumulation_steps`` micro-batches;
    evaluation and checkpoints every ``eval_every_steps``/``save_every_steps`` (default: at the end
    of each epoch); the cancel flag is read after every step.

    Returns ``"completed"`` (also after early stopping) or why it stopped (see
    ``Reporter.should_stop``); on ``"shutdown"`` it saves a checkpoint first.
    """
    hp, st = run.hp, run.state
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    timer = StepTimer(st.step)
    run.model.train()
    while st.step < run.total_steps:
        for group in step_groups(run):
            t0 = time.perf_counter()
            step, stats = train_step_with_backoff(run, reporter, group, trainable)
            step["seconds"] = time.perf_counter() - t0
            st.add(len(group), stats, step["seconds"], step["skipped"])
            log_step(run, reporter, step, stats, timer)
            check_finite(run)
            if st.step >= run.total_steps:
                return "completed"
            end_of_epoch = st.batch_in_epoch == len(run.plan.batches)
            if run.val_set is not None and due(st.step, hp.eval_every_steps, end_of_epoch):
                run_evaluation(run, reporter)
                if should_stop_early(run, reporter):
                    return "completed"
                run.model.train()
            stop = reporter.should_stop()
            checkpoint_due = due(st.step, hp.save_every_steps, end_of_epoch) if stop is None else stop == "shutdown"
            if checkpoint_due and st.nonfinite_run == 0:  # on shutdown: the next worker resumes from here
                save_checkpoint(run, reporter)
            if stop:
                return stop
        st.epoch, st.batch_in_epoch = st.epoch + 1, 0
    return "completed"


def due(step: int, every: int | None, end_of_epoch: bool) -> bool:
    return step % every == 0 if every else end_of_epoch


def step_groups(run: Run) -> Iterator[list[dict]]:
    """The rest of the current epoch as groups of ``gradient_accumulation_steps`` padded micro-batches."""
    run.plan.set_epoch(run.state.epoch, skip=run.state.batch_in_epoch)
    micro_batches = iter(make_loader(run, run.train_set, run.plan, run.state.epoch))
    while group := list(itertools.islice(micro_batches, run.hp.gradient_accumulation_steps)):
        yield group


def train_step_with_backoff(run: Run, reporter: Reporter, group: list[dict],
                            trainable: list[torch.nn.Parameter]) -> tuple[dict, BatchStats]:
    """``train_step``, retried after an out-of-memory error with each micro-batch cut in half (and so
    twice the accumulation): the effective batch, and the step's gradient, stay the same.

    Raises:
        UserError: ``out_of_memory`` when a micro-batch of one example does not fit.
    """
    st = run.state
    while True:
        try:
            return train_step(run, group, trainable)
        except torch.OutOfMemoryError as e:
            run.optimizer.zero_grad(set_to_none=True)
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


def train_step(run: Run, group: list[dict], trainable: list[torch.nn.Parameter]) -> tuple[dict, BatchStats]:
    """Forward and backward over the micro-batches of one optimizer step, then clip and step.

    The loss of each micro-batch is summed over its examples and divided by the number of
    examples in the whole step, so micro-batches of unequal size weigh correctly and the gradient
    equals that of one batch of all of them. A step whose loss or gradient is not finite is
    skipped (by the GradScaler under fp16, here otherwise).

    Returns:
        ({"loss", "grad_norm", "learning_rate", "skipped"}, token counts of the step).
    """
    n_examples = sum(len(b["labels"]) for b in group)
    stats = BatchStats(0, 0, 0)
    loss_sum = torch.zeros((), device=run.device)
    for planned in group:
        s = BatchStats.of(planned, padded_to_longest=run.hp.batching != "fixed")
        stats = BatchStats(stats.real + s.real, stats.unrounded + s.unrounded, stats.padded + s.padded)
        for batch in split_batch(planned, run.state.micro_split):
            batch = {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.autocast(run.device.type, dtype=run.dtype or torch.float32, enabled=run.dtype is not None):
                logits = run.forward_model(**batch).logits
            loss = loss_sum_of(logits, labels, run.job.task) / n_examples
            run.scaler.scale(loss).backward()
            loss_sum += loss.detach()
    run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    learning_rate = run.scheduler.get_last_lr()[0]
    finite = bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
    if run.scaler.is_enabled():
        scale = run.scaler.get_scale()
        run.scaler.step(run.optimizer)  # skips the update itself when the gradient has inf/NaN
        run.scaler.update()
        skipped = run.scaler.get_scale() < scale or not finite
    else:
        if finite:
            run.optimizer.step()
        skipped = not finite
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_sum.item(), "grad_norm": grad_norm.item(), "learning_rate": learning_rate,
            "skipped": skipped}, stats


def split_batch(batch: dict[str, torch.Tensor], pieces: int) -> list[dict[str, torch.Tensor]]:
    """Cut a padded batch into ``pieces`` row-wise chunks (out-of-memory backoff)."""
    if pieces == 1:
        return [batch]
    chunks = {k: v.tensor_split(pieces) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(pieces) if len(chunks["labels"][i])]


def loss_sum_of(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Summed loss of a micro-batch: cross-entropy (logits ``[n, classes]``, labels ``[n]`` int64)
    or squared error (logits ``[n, 1]``, labels ``[n]`` float), computed in fp32."""
    if task == "regression":
        return F.mse_loss(logits.float().squeeze(-1), labels.float(), reduction="sum")
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def check_finite(run: Run) -> None:
    """Fail the job after ``max_nonfinite_steps`` consecutive non-finite steps; the checkpoints
    written before them (only finite steps are checkpointed) are kept."""
    st, limit = run.state, run.hp.max_nonfinite_steps
    if st.nonfinite_run >= limit:
        raise UserError("nonfinite_loss", f"{limit} consecutive optimizer steps (up to step {st.step}) had a "
                        "non-finite loss or gradient; lower the learning_rate or use bf16/fp32 precision; "
                        "the last good checkpoint is kept", "hyperparameters.learning_rate")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def log_step(run: Run, reporter: Reporter, step: dict, stats: BatchStats, timer: StepTimer) -> None:
    """Buffer this step's metrics and update the job's progress, ETA and running totals."""
    st = run.state
    epoch = st.epoch + st.batch_in_epoch / max(1, len(run.plan.batches))
    peak = peak_memory_mb(run.device)
    reporter.log(st.step, epoch, {
        "train_loss": step["loss"],
        "learning_rate": step["learning_rate"],
        "grad_norm": step["grad_norm"],
        "tokens_per_second": stats.real / step["seconds"],
        "padding_efficiency": stats.real / stats.padded,
        "padding_efficiency_unrounded": stats.real / stats.unrounded,
        "peak_memory_mb": peak,
        "skipped_steps": st.skipped_steps,
    })
    totals = {"loss": step["loss"], "learning_rate": step["learning_rate"], "peak_memory_mb": peak,
              "micro_batch_size": micro_batch_size(run),
              "gradient_accumulation_steps": run.hp.gradient_accumulation_steps * st.micro_split, **st.throughput()}
    reporter.progress(step=st.step, epoch=epoch, eta_seconds=timer.eta(st.step, run.total_steps), train_metrics=totals)


# ----------------------------------------------------------------------------- evaluate


@torch.no_grad()
def evaluate(run: Run, reporter: Reporter | None = None) -> dict[str, float]:
    """Validation loss plus accuracy and macro-F1 (classification) or MSE and Pearson r (regression).

    ``reporter``, if given, renews the job's lease while a long evaluation runs.
    """
    model, task = run.forward_model, run.job.task
    model.eval()
    plan = BatchPlan(run.val_set.lengths, run.hp.batch_size * 2, "smart", run.hp.seed)
    loss_total, predictions, targets = 0.0, [], []
    for batch in make_loader(run, run.val_set, plan, epoch=0):
        batch = {k: v.to(run.device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast(run.device.type, dtype=run.dtype or torch.float32, enabled=run.dtype is not None):
            logits = model(**batch).logits.float()
        loss_total += loss_sum_of(logits, labels, task).item()
        predictions.append(logits.squeeze(-1) if task == "regression" else logits.argmax(-1))
        targets.append(labels)
        if reporter is not None:
            reporter.heartbeat()
    y_pred, y_true = torch.cat(predictions).cpu().numpy(), torch.cat(targets).cpu().numpy()
    metrics = {"loss": loss_total / len(y_true)}
    if task == "regression":
        metrics["mse"] = float(mean_squared_error(y_true, y_pred))
        metrics["pearson_r"] = float(pearsonr(y_true, y_pred).statistic) if len(y_true) > 1 else float("nan")
    else:
        metrics["accuracy"] = float(accuracy_score(y_true, y_pred))
        metrics["f1_macro"] = float(f1_score(y_true, y_pred, average="macro"))
    return metrics


def run_evaluation(run: Run, reporter: Reporter) -> None:
    """Evaluate, log, and keep the best model so far (in ``<checkpoints>/best``)."""
    st = run.state
    metrics = st.last_eval = evaluate(run, reporter)
    reporter.log(st.step, st.epoch, {f"eval_{k}": v for k, v in metrics.items() if math.isfinite(v)})
    reporter.progress(validation_metrics=metrics)
    name = run.hp.metric_for_best_model
    value = metrics.get(name, float("nan"))
    better = GREATER_IS_BETTER[name]
    improved = math.isfinite(value) and (st.best is None or (value > st.best["value"] if better else
                                                              value < st.best["value"]))
    if improved:
        st.best, st.evals_since_best = {"step": st.step, "value": value, "metrics": metrics}, 0
        _write_atomically(run.out_dir / "best", lambda tmp: run.model.save_pretrained(tmp, safe_serialization=True))
    else:
        st.evals_since_best += 1


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
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(tmp, final_dir)
    dir_fd = os.open(final_dir.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(run: Run, reporter: Reporter) -> None:
    """Save model weights (safetensors) and the full training state atomically, then record it;
    the store keeps the newest ``save_total_limit`` and their directories, and deletes the rest."""
    st = run.state
    path = run.out_dir / f"step-{st.step:08d}"

    def write(tmp: Path) -> None:
        run.model.save_pretrained(tmp, safe_serialization=True)
        torch.save(training_state(run), tmp / "training_state.pt")

    _write_atomically(path, write)
    for old in reporter.checkpoint(st.step, path, st.last_eval, keep=run.hp.save_total_limit):
        shutil.rmtree(old, ignore_errors=True)


def training_state(run: Run) -> dict:
    """Optimizer, schedule, scaler, RNG states and loop position: all ``torch.load(weights_only=True)`` safe."""
    np_state = np.random.get_state()
    return {
        "train_state": vars(run.state).copy(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "rng": {
            "python": random.getstate(),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
    }


def load_training_state(run: Run, checkpoint: Path) -> None:
    """Restore what ``training_state`` saved (the weights are loaded with the model)."""
    state = torch.load(checkpoint / "training_state.pt", weights_only=True, map_location="cpu")
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


def save_model(run: Run) -> Path:
    """Save the best model (by ``metric_for_best_model``; the final one without validation) in
    Hugging Face format: safetensors, config with id2label, tokenizer files, ``training_args.json``
    and ``metrics.json`` (which says the step it came from). Pack it as
    ``artifacts/<job>/model.tar.gz``."""
    st = run.state
    best = st.best or {"step": st.step, "value": None, "metrics": st.last_eval or {}}
    model = run.model if best["step"] == st.step else load_model(run.out_dir / "best", run.job)
    metrics = {"best_step": best["step"], "final_step": st.step, "metric_for_best_model": run.hp.metric_for_best_model,
               "best_value": best["value"], "validation": best["metrics"], "final_validation": st.last_eval,
               "train": st.throughput()}
    model_dir = get_settings().path("artifacts", run.job.id, "model")

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        run.tokenizer.save_pretrained(tmp)
        (tmp / "training_args.json").write_text(json.dumps(run.job.spec, indent=2))
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))

    _write_atomically(model_dir, write)
    archive = model_dir.parent / "model.tar.gz"
    tmp_archive = archive.with_name(".model.tar.gz.tmp")
    with tarfile.open(tmp_archive, "w:gz") as tar:
        for f in sorted(model_dir.iterdir()):
            tar.add(f, arcname=f.name)
    os.replace(tmp_archive, archive)
    shutil.copyfile(model_dir / "metrics.json", model_dir.parent / "metrics.json")
    return archive
