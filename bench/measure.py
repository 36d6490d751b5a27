"""What the engine runner and the peers measure alike: marks in time with token counts, epoch and
steady-state figures from them, the FLOPs model behind MFU, peak memory, the machine, and the
held-out figures of each task.

Steady state is the second half of the last epoch when one epoch runs, else the whole last epoch:
by then every padded width of the run has usually been seen once, so its warm-up is behind.
"""

import gc
import os
import platform
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# The held-out figures the benchmark reports per task (validation metrics of worker.training.metrics.evaluate):
# classification's accuracy and macro-F1, multi_label's micro-/macro-F1 and subset accuracy,
# token_classification's entity F1 (seqeval) and token accuracy; and their column titles.
HELD_OUT = {
    "classification": ("accuracy", "f1_macro"),
    "multi_label": ("f1_micro", "f1_macro", "subset_accuracy"),
    "token_classification": ("entity_f1", "token_accuracy"),
}
QUALITY_TITLES = {
    "accuracy": "held-out accuracy (mean over seeds)",
    "f1_micro": "held-out micro-F1 (mean over seeds)",
    "f1_macro": "macro-F1",
    "subset_accuracy": "subset accuracy",
    "entity_f1": "held-out entity F1 (mean over seeds)",
    "token_accuracy": "token accuracy",
}
QUALITY = tuple(QUALITY_TITLES)  # every held-out figure a run may report, in column order


@dataclass(frozen=True)
class Mark:
    """The end of an optimizer step: wall time (``perf_counter`` seconds, the device synchronized)
    and the run's cumulative token counts: real (attention-mask) tokens, tokens padded to each
    micro-batch's longest member, and tokens computed (after ``pad_to_multiple_of``, buckets or
    fixed padding)."""

    time: float
    step: int
    real: int
    unrounded: int
    padded: int


class Clock:
    """Wall time with the device synchronized first, so that queued GPU work is counted where it
    ran (on the CPU, plain ``perf_counter``)."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def mark(self, step: int, real: int, unrounded: int, padded: int) -> Mark:
        return Mark(self.now(), step, real, unrounded, padded)


def steady_from(steps_per_epoch: int) -> int:
    """The step of a one-epoch run after which its steady-state window starts (half way)."""
    return max(1, steps_per_epoch // 2)


def epoch_figures(start: float, epoch_ends: list[Mark], steady_start: Mark | None) -> dict:
    """Per-epoch wall times and token counts, and the steady-state window, from the marks of one run.

    Args:
        start: when training began (after loading; warm-up/capture, if any, comes after it).
        epoch_ends: one mark at the end of each epoch.
        steady_start: the half-way mark of a one-epoch run; with more epochs the end of the
            second-to-last epoch is used and this is ignored.
    """
    before = [Mark(start, 0, 0, 0, 0), *epoch_ends]
    first = steady_start if len(epoch_ends) == 1 else epoch_ends[-2]
    last = epoch_ends[-1]
    window = last.time - first.time if first is not None else 0.0
    return {
        "epoch_seconds": [b.time - a.time for a, b in zip(before, before[1:])],
        "epoch_real_tokens": [b.real - a.real for a, b in zip(before, before[1:])],
        "steps": last.step,
        "steps_per_epoch": epoch_ends[0].step,
        "real_tokens": last.real,
        "unrounded_tokens": last.unrounded,
        "padded_tokens": last.padded,
        "efficiency_unrounded": last.real / last.unrounded,
        "efficiency_padded": last.real / last.padded,
        "steady_steps": last.step - first.step if first is not None else 0,
        "steady_seconds": window,
        "steady_tokens_per_second": (last.real - first.real) / window if window > 0 else None,
    }


def flops_per_real_token(model: torch.nn.Module, lengths) -> dict:
    """Training FLOPs per real token: 6 x non-embedding parameters (forward + backward of every
    matmul, Kaplan et al. 2020) plus attention, 12 x layers x hidden x the token-weighted mean
    real length (the ``QK^T`` and ``AV`` products, forward + backward). Counted on real tokens
    only: padding is work a padding-free model would not do, so it lowers MFU."""
    embedding = {id(p) for p in model.base_model.embeddings.parameters()}
    params = sum(p.numel() for p in model.parameters() if id(p) not in embedding)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    lengths = [int(n) for n in lengths]
    mean_attended = sum(n * n for n in lengths) / sum(lengths)
    return {
        "non_embedding_params": params,
        "layers": layers,
        "hidden": hidden,
        "flops_per_real_token": 6 * params + 12 * layers * hidden * mean_attended,
    }


def mfu(figures: dict, flops_per_token: float, peak_flops: float | None) -> dict:
    """Model FLOPs utilization over the first epoch (warm-up included) and over the steady window;
    None without a peak (the CPU)."""
    if not peak_flops:
        return {"mfu_epoch": None, "mfu_steady": None}
    epoch = figures["epoch_real_tokens"][0] / figures["epoch_seconds"][0]
    steady = figures["steady_tokens_per_second"]
    return {
        "mfu_epoch": epoch * flops_per_token / peak_flops,
        "mfu_steady": steady * flops_per_token / peak_flops if steady else None,
    }


def before_job(device: torch.device) -> None:
    """Free what the previous job left, as the worker does after each job, and on CUDA start the
    peak-memory mark afresh (the CPU's peak RSS is the process's)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float:
    """``torch.cuda.max_memory_allocated`` since ``before_job``, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def host() -> str:
    """This machine in words, for a benchmark's provenance line: CPU model, cores, and the load
    average when the benchmark started (other work on the machine skews timings)."""
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        cpu = platform.processor() or platform.machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores, load average {load} at the start"


def machine(device: torch.device) -> str:
    """The device in words: the GPU's name, or the CPU model, cores, load and torch threads."""
    from worker.device import describe

    return describe(device) if device.type == "cuda" else f"{describe(device)}; {host()}"


def environment(device: torch.device) -> dict:
    import transformers

    return {
        "device": machine(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
