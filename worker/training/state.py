"""Where training stands (``TrainState``) and the training state a checkpoint keeps beside the
weights, saved and loaded so that a resumed run trains exactly as an uninterrupted one."""

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.store import artifacts, objects
from worker.data import BatchStats
from worker.reporter import Reporter
from worker.training.files import save_tokenizer, write_atomically


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

    def due(self, every: int | None, end_of_epoch: bool) -> bool:
        """Whether something done every ``every`` steps (None: at the end of each epoch) is due at this step."""
        return self.step % every == 0 if every else end_of_epoch

    def record_evaluation(self, scores: dict, metric: str, greater_is_better: bool) -> bool:
        """Note an evaluation at the current step (``last_eval``) and whether its ``metric`` is the
        best so far (``best``; a non-finite value never is). Returns whether it is."""
        self.last_eval, self.last_eval_step = scores, self.step
        value = scores.get(metric, float("nan"))
        improved = math.isfinite(value) and (
            self.best is None or (value > self.best["value"] if greater_is_better else value < self.best["value"])
        )
        if improved:
            self.best, self.evals_since_best = {"step": self.step, "value": value, "metrics": scores}, 0
        else:
            self.evals_since_best += 1
        return improved

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


def training_state(
    state: TrainState,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
) -> dict:
    """Optimizer, schedule, scaler, RNG states and loop position: all ``torch.load(weights_only=True)`` safe."""
    np_state = np.random.get_state()
    return {
        "train_state": vars(state).copy(),
        "optimizer": portable_state_dict(optimizer),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
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


def load_training_state(
    checkpoint: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
) -> TrainState:
    """Restore what ``training_state`` saved into ``optimizer``, ``scheduler``, ``scaler`` (in
    place) and the RNGs; returns the loop position (the weights are loaded with the model)."""
    state = torch.load(checkpoint / artifacts.TRAINING_STATE, weights_only=True, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state((rng["numpy"][0], np.array(rng["numpy"][1], dtype=np.uint32), *rng["numpy"][2:]))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return TrainState(**state["train_state"])


def write_checkpoint(path: Path, model: torch.nn.Module, tokenizer, state: dict, best_dir: Path | None) -> None:
    """Write a checkpoint directory atomically: model weights (safetensors) and config, tokenizer
    and the training state (``training_state``): a complete model directory. ``best_dir``: a
    directory holding these very weights already (the best evaluation's), hard-linked instead of
    written a second time.

    Raises:
        OSError: the files cannot be written.
    """

    def write(tmp: Path) -> None:
        if best_dir is not None:
            artifacts.link_or_copy_files(best_dir, tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)  # new files: never written through a link into best_dir
        torch.save(state, tmp / artifacts.TRAINING_STATE)

    write_atomically(path, write)


def record_checkpoint(reporter: Reporter, step: int, path: Path, metrics: dict | None, keep: int) -> None:
    """Publish a completely written checkpoint (``shared.store.objects``: with ``TUNEJOB_STORAGE_URL``
    into the bucket, before the row that points at it), record it, and delete the older ones the
    store no longer keeps (beyond the newest ``keep``); or, when the job store does not answer
    (``Reporter.checkpoint``), this one, which no row points at."""
    store = objects.store()
    size = objects.LocalDir().tree_bytes(str(path))  # for the tenant's quota (shared.store.quotas)
    ref = store.publish(path)
    old = reporter.checkpoint(step, ref, metrics, keep=keep, size=size)
    for gone in [ref] if old is None else old:
        store.remove(gone)
