"""What a training run tells its job while it trains: every step's metrics, once their values
reach the host, the job's progress, ETA and running totals, and its events."""

import resource
import time
from dataclasses import dataclass

import psutil
import torch

from shared.errors import UserError
from shared.schemas.hyperparameters import Hyperparameters
from worker.data import BatchStats
from worker.reporter import Reporter
from worker.training.batches import micro_batch_size
from worker.training.setup import JobSetup
from worker.training.state import TrainState

READ_EVERY_SECONDS = 1.0  # CUDA: copy the per-step values to the host this often (``read_every_seconds``)


class StepTimer:
    """ETA from the mean wall time per optimizer step of this attempt (evaluation included), and
    the training time of each window of steps whose values are read back together (``lap``;
    evaluation and checkpoints are left out by ``restart``)."""

    def __init__(self, first_step: int):
        self.start, self.first_step = time.perf_counter(), first_step
        self.window_start = self.start

    def eta(self, step: int, total_steps: int) -> float:
        """Seconds until ``total_steps``, at this attempt's mean seconds per step so far."""
        return (time.perf_counter() - self.start) / max(1, step - self.first_step) * (total_steps - step)

    def lap(self) -> float:
        """Seconds since the last ``lap`` or ``restart``."""
        now = time.perf_counter()
        seconds, self.window_start = now - self.window_start, now
        return seconds

    def restart(self) -> None:
        """Start the next window now (what came since the last ``lap`` is not training time)."""
        self.window_start = time.perf_counter()


@dataclass
class StepRecord:
    """What the host knows about an optimizer step when it queues it."""

    step: int
    epoch: float
    learning_rate: float
    stats: BatchStats


def read_every_seconds(device: torch.device) -> float:
    """How often per-step values are copied to the host: about once a second on CUDA, where a read
    waits for the GPU; after every step on the CPU, where it costs nothing."""
    return READ_EVERY_SECONDS if device.type == "cuda" else 0.0


def notify(reporter: Reporter | None, code: str, message: str, level: str = "info") -> None:
    """An event on the job, when there is a reporter to take it."""
    if reporter is not None:
        reporter.event(code, message, level=level)


def peak_memory_mb(device: torch.device) -> float:
    """The most memory held so far, in MiB: CUDA tensors on a GPU, the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_in_use_mb(device: torch.device) -> float:
    """Memory held now, in MiB: CUDA tensors on a GPU, the worker's resident set (psutil) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


def check_finite(state: TrainState, limit: int, step: int) -> None:
    """Fail the job after ``limit`` (``max_nonfinite_steps``) consecutive non-finite steps (the last
    one being ``step``); the checkpoints written before them (only finite steps are checkpointed)
    are kept.

    Raises:
        UserError: ``nonfinite_loss``.
    """
    if state.nonfinite_run >= limit:
        raise UserError(
            "nonfinite_loss",
            f"{limit} consecutive optimizer steps (up to step {step}) had a "
            "non-finite loss or gradient; lower the learning_rate or use bf16/fp32 precision; "
            "the last good checkpoint is kept",
            "hyperparameters.learning_rate",
        )


def should_stop_early(hp: Hyperparameters, state: TrainState, reporter: Reporter) -> bool:
    """Early stopping (the Hugging Face Trainer's ``EarlyStoppingCallback``): after
    ``early_stopping_patience`` evaluations in a row without a new best; an event says so."""
    patience, st = hp.early_stopping_patience, state
    if patience and st.evals_since_best >= patience:
        reporter.event(
            "early_stopping",
            f"stopped at step {st.step}: {patience} evaluations without improving "
            f"{hp.metric_for_best_model} (best {st.best['value']:.4f} at step {st.best['step']})",
        )
        return True
    return False


def log_steps(
    job_setup: JobSetup,
    state: TrainState,
    reporter: Reporter,
    landed: list[tuple[StepRecord, list[float]]],
    timer: StepTimer,
) -> None:
    """Account for (in ``state``) and log the steps whose values reached the host (oldest first):
    each step's metrics, then the job's progress, ETA and running totals. Their time is the wall
    time since the previous read (evaluation and checkpoints left out), shared by their real tokens.

    Raises:
        UserError: ``nonfinite_loss`` (``check_finite``).
    """
    if not landed:
        return
    st, hp, device = state, job_setup.hp, job_setup.device
    seconds = timer.lap()
    st.train_seconds += seconds
    tokens_per_second = sum(record.stats.real for record, _ in landed) / seconds
    peak = peak_memory_mb(device)
    for record, (loss, grad_norm, skipped) in landed:
        st.count_skip(skipped > 0)
        reporter.log(
            record.step,
            record.epoch,
            {
                "train_loss": loss,
                "learning_rate": record.learning_rate,
                "grad_norm": grad_norm,
                "tokens_per_second": tokens_per_second,
                "padding_efficiency": record.stats.real / record.stats.padded,
                "padding_efficiency_unrounded": record.stats.real / record.stats.unrounded,
                "peak_memory_mb": peak,
                "skipped_steps": st.skipped_steps,
            },
        )
        check_finite(st, hp.max_nonfinite_steps, record.step)
    totals = {
        "loss": loss,
        "learning_rate": record.learning_rate,
        "peak_memory_mb": peak,
        "memory_mb": memory_in_use_mb(device),
        "micro_batch_size": micro_batch_size(hp, st.micro_split),
        "gradient_accumulation_steps": hp.gradient_accumulation_steps * st.micro_split,
        **st.throughput(),
    }
    reporter.progress(
        step=record.step,
        epoch=record.epoch,
        eta_seconds=timer.eta(record.step, job_setup.total_steps),
        train_metrics=totals,
    )
