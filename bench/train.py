"""Training throughput benchmark: our engine's batching strategies against the Hugging Face Trainer.

One process, one model, one precision, one seed and one batch size per block; the engine runs
through its real ``worker.train.setup``/``train`` (driven without the job store: a transient
``Job`` and a reporter whose ``should_stop`` cancels after the steps to time), the peer is
``transformers.Trainer`` with ``train_sampling_strategy="group_by_length"`` (``group_by_length=True``
before transformers 5) and ``DataCollatorWithPadding(pad_to_multiple_of=8)``.

Sections:
    plan      padding efficiency of each strategy (and of the Trainer's ``LengthGroupedSampler``)
              from token lengths alone, before and after rounding to 8; no training, seconds.
    timing    real tokens/s, padding efficiency, seconds per step, extrapolated epoch time and peak
              memory of each configuration: in every (dataset, batch size) block each configuration
              trains ``warmup`` steps on its epoch's largest batch, then ``steps`` timed steps on a
              stratified sample of its own epoch's batches; round-robin over ``--repeats`` (so drift
              hits all alike), each repeat from the same initial weights and batches; medians.
    accuracy  (``--accuracy``) one full epoch of fixed, smart, token_budget and the Trainer on a
              subset, then validation accuracy with the same evaluation code; measured epoch time.

    python -m bench.train --plan-only                       # seconds
    python -m bench.train --estimate-only                   # prints the time the full run needs
    python -m bench.train --accuracy --markdown docs/benchmarks.md --json bench-results.json
"""

import argparse
import gc
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever downloaded at run time
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np

from shared.batching import STRATEGIES, BatchPlan

SEED = 42
PLAN_ROUNDING = 8  # the plan section reports efficiency before and after rounding to this
TRAINER_PAD_MULTIPLE = 8  # DataCollatorWithPadding(pad_to_multiple_of=8) for the Trainer peer
DEFAULT_MAX_LENGTH = {"bbc": 512, "rotten_tomatoes": 128}
DEFAULT_TRAIN_SIZE = {"bbc": None, "rotten_tomatoes": 4000}  # None: the whole 80% training split
DEFAULT_VAL_SIZE = {"bbc": None, "rotten_tomatoes": 2000}
# The cost model behind the printed time estimate, fitted on the 2-core Xeon (fp32,
# all-MiniLM-L6-v2): seconds per optimizer step of n sequences padded to width w
# = OVERHEAD + n * w * (PER_TOKEN + PER_TOKEN_WIDTH * w), scaled by the model's size.
EST_OVERHEAD_S = 0.15
EST_PER_TOKEN_S = 0.40e-3
EST_PER_TOKEN_WIDTH_S = 0.55e-6
EST_MINILM_BODY = 6 * (4 * 384 * 384 + 2 * 384 * 1536)  # non-embedding weights of all-MiniLM-L6-v2
EST_SETUP_S = {"bbc": 4.0, "rotten_tomatoes": 2.0}  # tokenize + load the model, per configuration and repeat
# bf16 autocast on this CPU (avx512_bf16, no AMX): forward + backward of all-MiniLM-L6-v2 at 32 x 32
# and 32 x 128 took 1.9-3.8x the fp32 time (interleaved, busy machine)
EST_BF16_FACTOR = 2.5


# ----------------------------------------------------------------------------- data


def load_corpus(name: str, train_size: int | None, val_size: int | None, seed: int = SEED):
    """(train, validation) DataFrames: a stratified 80/20 split of the corpus, each optionally cut to
    a stratified subset of ``train_size``/``val_size`` rows."""
    from sklearn.model_selection import train_test_split

    from bench.corpora import bbc_news, rotten_tomatoes, stratified_split

    df = bbc_news() if name == "bbc" else rotten_tomatoes()
    train, val = stratified_split(df, test_size=0.2, seed=seed)

    def cut(part, size):
        if size is None or size >= len(part):
            return part.reset_index(drop=True)
        if size < 2 * part["label"].nunique():
            return part.sample(n=size, random_state=seed).reset_index(drop=True)
        return train_test_split(part, train_size=size, random_state=seed, stratify=part["label"])[0].reset_index(drop=True)

    return cut(train, train_size), cut(val, val_size)


def token_lengths(tokenizer, texts: list[str], max_length: int) -> np.ndarray:
    enc = tokenizer(texts, truncation=True, max_length=max_length, padding=False)
    return np.array([len(ids) for ids in enc["input_ids"]], dtype=np.int64)


# ----------------------------------------------------------------------------- plan section


def round_up(width: int, multiple: int) -> int:
    return multiple * math.ceil(width / multiple)


def batch_tokens(lengths: np.ndarray, batches: list[list[int]], multiple: int, fixed_width: int | None = None):
    """(real, padded to longest, padded to longest rounded to ``multiple``) tokens of ``batches``;
    with ``fixed_width`` every batch is padded to it."""
    real = unrounded = padded = 0
    for batch in batches:
        lens = lengths[batch]
        width = fixed_width or int(lens.max())
        real += int(lens.sum())
        unrounded += len(batch) * width
        padded += len(batch) * (fixed_width or round_up(width, multiple))
    return real, unrounded, padded


def trainer_epochs(lengths: np.ndarray, batch_size: int, epochs: int, seed: int = SEED) -> list[list[list[int]]]:
    """The batches of ``epochs`` epochs of the Trainer's ``LengthGroupedSampler`` (as the Trainer
    builds it: ``train_batch_size * gradient_accumulation_steps``, last batch kept), from lengths
    alone. The Trainer draws from the global torch RNG; this draws from a seeded generator, so the
    batches are like, not equal to, the ones an unmodified run sees (the timing section trains the
    Trainer on a sample of exactly these)."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    sampler = LengthGroupedSampler(batch_size, lengths=lengths.tolist(), generator=torch.Generator().manual_seed(seed))
    out = []
    for _ in range(epochs):
        order = list(iter(sampler))
        out.append([order[i : i + batch_size] for i in range(0, len(order), batch_size)])
    return out


def changed_fraction(epochs: list[list[list[int]]]) -> float:
    """Mean fraction of an epoch's batches that are not, as a set of examples, a batch of the
    previous epoch: 0 means the batch composition never changes."""
    fractions = []
    for before, after in zip(epochs, epochs[1:]):
        seen = {frozenset(b) for b in before}
        fractions.append(sum(frozenset(b) not in seen for b in after) / len(after))
    return float(np.mean(fractions)) if fractions else float("nan")


def pairs_kept(epochs: list[list[list[int]]]) -> float:
    """Mean fraction of the example pairs that share a micro-batch in one epoch and share one again
    in the next (1.0: the same groups every epoch, in a new order)."""
    fractions = []
    for before, after in zip(epochs, epochs[1:]):
        n = 1 + max(i for b in after for i in b)
        where = np.empty(n, dtype=np.int64)
        for k, b in enumerate(after):
            where[b] = k
        kept = total = 0
        for b in before:
            ids = where[np.asarray(b)]
            _, counts = np.unique(ids, return_counts=True)
            kept += int((counts * (counts - 1) // 2).sum())
            total += len(b) * (len(b) - 1) // 2
        fractions.append(kept / total if total else float("nan"))
    return float(np.mean(fractions)) if fractions else float("nan")


def token_budget_for(lengths: np.ndarray, batch_size: int) -> int:
    """max_tokens_per_batch for token_budget: batch size x the mean real length, so that the mean
    number of examples per micro-batch is about ``batch_size``."""
    return max(8, int(round(batch_size * float(lengths.mean()))))


def plan_rows(dataset: str, lengths: np.ndarray, batch_size: int, max_length: int, epochs: int) -> list[dict]:
    """Padding efficiency of every strategy over ``epochs`` epochs of its plan (and of the Trainer's
    length-grouped sampler): real / padded tokens before rounding and rounded to 8."""
    rows = []
    for strategy in (*STRATEGIES, "trainer"):
        if strategy == "trainer":
            per_epoch = trainer_epochs(lengths, batch_size, epochs)
        else:
            plan = BatchPlan(lengths, batch_size, strategy, SEED, token_budget_for(lengths, batch_size)
                             if strategy == "token_budget" else None)
            per_epoch = [plan.epoch_batches(e) for e in range(epochs)]
        fixed_width = max_length if strategy == "fixed" else None
        real = unrounded = padded = 0
        for batches in per_epoch:
            r, u, p = batch_tokens(lengths, batches, PLAN_ROUNDING, fixed_width)
            real, unrounded, padded = real + r, unrounded + u, padded + p
        n_batches = float(np.mean([len(b) for b in per_epoch]))
        rows.append({
            "dataset": dataset, "batch_size": batch_size, "strategy": strategy, "max_length": max_length,
            "examples": len(lengths), "mean_length": float(lengths.mean()), "epochs": epochs,
            "steps_per_epoch": n_batches, "examples_per_batch": len(lengths) / n_batches,
            "efficiency_unrounded": real / unrounded, "efficiency_rounded": real / padded,
            "changed_batches": changed_fraction(per_epoch), "pairs_kept": pairs_kept(per_epoch),
            "max_tokens_per_batch": token_budget_for(lengths, batch_size) if strategy == "token_budget" else None,
        })
    return rows


# ----------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Config:
    """One row of the timing table."""

    name: str
    kind: str  # "engine" or "trainer"
    batching: str | None = None
    pad_multiple: int = 1
    memory_savers: bool = False  # gradient_checkpointing + freeze_embeddings (CUDA memory comparison)


def rounding_matters(lengths: np.ndarray, batch_size: int, pads: list[int]) -> bool:
    """Whether rounding smart batches to the other multiples changes the computed tokens by >= 2%
    (by the plan): on long texts it does not, and the timing could not tell the two apart."""
    plan = BatchPlan(lengths, batch_size, "smart", SEED)
    base = plan.padding_efficiency(0, multiple=pads[0])
    return any(abs(base / plan.padding_efficiency(0, multiple=p) - 1) >= 0.02 for p in pads[1:])


def make_configs(names: list[str], pad: int, extra_pads: list[int], device_type: str) -> list[Config]:
    configs = []
    for name in names:
        if name == "trainer":
            configs.append(Config("trainer", "trainer", pad_multiple=TRAINER_PAD_MULTIPLE))
        else:
            configs.append(Config(name, "engine", name, pad))
            if name == "smart":
                configs += [Config(f"smart (pad {p})", "engine", "smart", p) for p in extra_pads]
                if device_type == "cuda":
                    configs.append(Config("smart + checkpointing + frozen embeddings", "engine", "smart", pad, True))
    return configs


@dataclass
class Block:
    """One (dataset, batch size) comparison: its data and the number of steps each window times."""

    dataset: str
    batch_size: int
    max_length: int
    train: object  # DataFrame
    val: object
    lengths: np.ndarray
    steps: int
    labels: list[str] = field(default_factory=list)
    bf16: bool = False  # the estimate's CPU cost model charges bf16 autocast EST_BF16_FACTOR

    @property
    def key(self) -> str:
        return f"{self.dataset} b{self.batch_size}"


# ----------------------------------------------------------------------------- measurement helpers


class TokenCounter:
    """Counts what the model is fed in training mode (a forward pre-hook reading ``attention_mask``):
    real tokens, tokens padded to each batch's longest member, tokens computed, and the sum of
    squared real lengths (for attention FLOPs)."""

    def __init__(self, model):
        self.real = self.unrounded = self.padded = self.squares = self.forwards = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None or not module.training:
            return
        lengths = mask.sum(dim=1).tolist()
        n, width = mask.shape
        self.real += int(sum(lengths))
        self.unrounded += n * int(max(lengths))
        self.padded += n * width
        self.squares += int(sum(x * x for x in lengths))
        self.forwards += 1

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.real, self.unrounded, self.padded, self.squares

    def remove(self) -> None:
        self.handle.remove()


def reset_peak_memory(device) -> bool:
    """Reset the peak-memory mark: the CUDA allocator's, or the process's peak RSS (``ru_maxrss``
    and VmHWM, through ``/proc/self/clear_refs``), after handing the memory that malloc keeps for
    reuse back to the kernel (``malloc_trim``: under ``--cpu-memory reuse`` the heap would still
    hold the previous window's peak). Returns False if it could not be reset."""
    import torch

    from worker.device import glibc_function

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return True
    malloc_trim = glibc_function("malloc_trim")
    if malloc_trim is not None:  # not glibc: nothing is kept
        malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BenchReporter:
    """The engine's reporter, without a job store: marks the wall time and token counts at every
    optimizer step and cancels the run after ``stop_after`` steps."""

    def __init__(self, stop_after: int, device):
        self.stop_after, self.device = stop_after, device
        self.run = None
        self.counter: TokenCounter | None = None
        self.marks: list[dict] = []  # one per finished optimizer step
        self.events: list[tuple[str, str, str]] = []

    def event(self, code: str, message: str, level: str = "info") -> None:
        self.events.append((level, code, message))

    def log(self, step: int, epoch: float, values: dict) -> None:
        sync(self.device)
        st = self.run.state
        self.marks.append({"step": step, "time": time.perf_counter(), "cpu": time.process_time(),
                           "engine": (st.real_tokens, st.unrounded_tokens, st.padded_tokens, st.train_seconds),
                           "hook": self.counter.snapshot()})

    def progress(self, **fields) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def checkpoint(self, step: int, path: Path, metrics: dict | None, keep: int) -> list:
        return []

    def should_stop(self) -> str | None:
        return "cancelled" if len(self.marks) >= self.stop_after else None


def make_job(model: str, labels: list[str], block_max_length: int, batch_size: int, batching: str, pad: int,
             precision: str, epochs: float, learning_rate: float, max_tokens: int | None, memory_savers: bool,
             evaluate_each_epoch: bool):
    from shared.models import Job
    from shared.schemas import Hyperparameters, JobCreate

    never = None if evaluate_each_epoch else 10**12
    hp = Hyperparameters(epochs=epochs, learning_rate=learning_rate, batch_size=batch_size, max_length=block_max_length,
                         precision=precision, batching=batching, pad_to_multiple_of=pad,
                         max_tokens_per_batch=max_tokens if batching == "token_budget" else None,
                         gradient_checkpointing=memory_savers, freeze_embeddings=memory_savers,
                         eval_every_steps=never, save_every_steps=10**12, save_total_limit=1, seed=SEED)
    spec = JobCreate(base_model=model, task="classification", training_dataset="bench", hyperparameters=hp)
    return Job(id=f"bench-{uuid.uuid4().hex[:12]}", task="classification", base_model=model, label_names=labels,
               spec=spec.model_dump(mode="json"))


def window(marks: list[dict], warmup: int, key: str) -> dict:
    """Wall time and token counts of the steps after the first ``warmup`` (mark-to-mark, so the
    data loading and collation of each timed step are included)."""
    start, end = marks[warmup - 1] if warmup else None, marks[-1]
    if start is None:
        raise ValueError("at least one warm-up step is needed to open the timed window")
    d = [b - a for a, b in zip(start[key], end[key])]
    return {"seconds": end["time"] - start["time"], "cpu_seconds": end["cpu"] - start["cpu"],
            "steps": len(marks) - warmup, "real": d[0], "unrounded": d[1], "padded": d[2], "extra": d[3]}


def model_shape(model) -> dict:
    """Non-embedding parameters, layers and width (for MFU)."""
    embedding = {id(p) for p in model.base_model.embeddings.parameters()}
    body = sum(p.numel() for p in model.parameters() if id(p) not in embedding)
    return {"non_embedding_params": body, "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size}


# ----------------------------------------------------------------------------- windows


def epoch_batches_of(block: Block, cfg: Config) -> list[list[int]]:
    """Epoch 0's micro-batches: the engine's plan, or one epoch of the Trainer's sampler."""
    if cfg.kind == "trainer":
        return trainer_epochs(block.lengths, block.batch_size, 1)[0]
    return epoch_plan(block, cfg).epoch_batches(0)


def epoch_plan(block: Block, cfg: Config) -> BatchPlan:
    return BatchPlan(block.lengths, block.batch_size, cfg.batching or "smart", SEED,
                     token_budget_for(block.lengths, block.batch_size) if cfg.batching == "token_budget" else None)


def batch_width(block: Block, cfg: Config, batch: list[int]) -> int:
    if cfg.batching == "fixed":
        return block.max_length
    return round_up(int(block.lengths[batch].max()), cfg.pad_multiple)


def choose_window(block: Block, cfg: Config, batches: list[list[int]], warmup: int, steps: int):
    """(warm-up batches, timed batches) drawn from an epoch's ``batches``.

    Warm-up: the ``warmup`` batches with the most computed tokens (so the peak memory falls in the
    window too). Timed: a stratified sample of the rest, the batches at the quantiles
    ``(k + 0.5) / steps`` of (padded width, computed tokens), kept in epoch order; so ``seconds per
    step x steps per epoch`` estimates the epoch even from a few steps. The Trainer's sample holds
    only full batches (its DataLoader cuts the sampled indices into ``batch_size`` chunks).
    """
    def computed(i):
        return batch_width(block, cfg, batches[i]) * len(batches[i])

    warm = sorted(range(len(batches)), key=computed, reverse=True)[:warmup]
    by_width = sorted(range(len(batches)), key=lambda i: (batch_width(block, cfg, batches[i]), computed(i)))
    rest = [i for i in by_width if i not in warm and (cfg.kind != "trainer" or len(batches[i]) == block.batch_size)]
    if steps >= len(rest):
        timed = rest
    else:
        timed = [rest[int((k + 0.5) * len(rest) / steps)] for k in range(steps)]
    return [batches[i] for i in warm], [batches[i] for i in sorted(timed)]


def epoch_tokens(block: Block, epoch: list[list[int]], multiple: int, fixed_width: int | None = None) -> dict:
    """Token counts of the whole epoch the window was sampled from (exact, from the plan)."""
    real, unrounded, padded = batch_tokens(block.lengths, epoch, multiple, fixed_width)
    return {"epoch_real_tokens": real, "epoch_unrounded_tokens": unrounded, "epoch_padded_tokens": padded}


class SampledPlan(BatchPlan):
    """A run's plan cut down to the chosen batches: every epoch is exactly ``batches``."""

    def __init__(self, plan: BatchPlan, batches: list[list[int]]):
        vars(self).update(vars(plan))
        self.sample = [list(b) for b in batches]
        self.set_epoch(0)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        return [list(b) for b in self.sample]


# ----------------------------------------------------------------------------- one timed window


def time_engine(block: Block, cfg: Config, args, device, warmup: int, steps: int) -> dict:
    """A fresh engine run (``setup``) trains the warm-up batches, then the timed sample of its own
    epoch-0 plan, through ``train``; the reporter cancels it after the last."""
    from worker.data import JobData
    from worker.train import setup, train

    job = make_job(args.model, block.labels, block.max_length, block.batch_size, cfg.batching, cfg.pad_multiple,
                   args.precision, 2, args.learning_rate, token_budget_for(block.lengths, block.batch_size),
                   cfg.memory_savers, evaluate_each_epoch=False)
    reporter = BenchReporter(warmup + steps, device)
    run = setup(job, JobData(block.train, None, block.dataset, block.dataset), device, reporter)
    if not np.array_equal(run.train_set.lengths, block.lengths):
        raise RuntimeError("the engine tokenized the training set differently from the benchmark")
    epoch = run.plan.epoch_batches(0)
    warm, timed = choose_window(block, cfg, epoch, warmup, steps)
    run.plan = SampledPlan(run.plan, warm + timed)
    reporter.run, reporter.counter, reporter.stop_after = run, TokenCounter(run.model), len(warm) + len(timed)
    reset_ok = reset_peak_memory(device)
    outcome = train(run, reporter)
    peak = peak_memory_mib(device)
    measured = window(reporter.marks, len(warm), "engine")
    hook = window(reporter.marks, len(warm), "hook")
    fixed_width = block.max_length if cfg.batching == "fixed" else None
    result = {
        "outcome": outcome, "engine_step_seconds": measured["extra"], "hook_real": hook["real"],
        "hook_padded": hook["padded"], "squares": hook["extra"], "steps_per_epoch": len(epoch),
        "expected_real": batch_tokens(block.lengths, timed, cfg.pad_multiple, fixed_width)[0],
        **epoch_tokens(block, epoch, cfg.pad_multiple, fixed_width),
        "peak_memory_mib": peak, "peak_reset": reset_ok,
        "dtype": str(run.dtype).replace("torch.", "") if run.dtype else "fp32", **model_shape(run.model), **measured,
    }
    reporter.counter.remove()
    del run, reporter
    return result


def trainer_arguments(args, block: Block, device, out_dir: str, max_steps: int, warmup_steps: int, dtype):
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=block.batch_size,
        per_device_eval_batch_size=block.batch_size * 2, learning_rate=args.learning_rate, weight_decay=0.01,
        lr_scheduler_type="linear", warmup_steps=warmup_steps, max_steps=max_steps, max_grad_norm=1.0, seed=SEED,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, use_cpu=device.type == "cpu",
        train_sampling_strategy="group_by_length", report_to=[], save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        dataloader_pin_memory=device.type == "cuda",
    )


def trainer_parts(args, block: Block, device):
    """The model (same initialisation and attention implementation as the engine's), tokenizer,
    tokenized training set and autocast dtype for a Trainer run."""
    from transformers import AutoTokenizer, set_seed

    from shared.base_models import resolve_model
    from worker.data import tokenize
    from worker.device import autocast_dtype
    from worker.train import load_model

    job = make_job(args.model, block.labels, block.max_length, block.batch_size, "smart", 8, args.precision, 1,
                   args.learning_rate, None, False, False)
    set_seed(SEED)  # as setup(): seed, tokenize, then load (the classifier head draws from the RNG)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_set = tokenize(tokenizer, block.train, "text", None, "label", block.labels, block.max_length, block.dataset)
    model = load_model(model_dir, job).to(device)
    return job, model, tokenizer, train_set, autocast_dtype(args.precision, device)


def make_trainer(args, block, device, model, tokenizer, train_set, dtype, max_steps: int, callbacks: list,
                 out_dir: str, sample: list[int] | None = None):
    """The Trainer peer; with ``sample``, its training sampler yields those indices instead of the
    length-grouped order (the benchmark's timed batches, each one of the sampler's own batches)."""
    from torch.utils.data import Sampler
    from transformers import DataCollatorWithPadding, PrinterCallback, Trainer

    class Fixed(Sampler):
        def __init__(self, indices):
            self.indices = indices

        def __iter__(self):
            return iter(self.indices)

        def __len__(self):
            return len(self.indices)

    class SampledTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return Fixed(sample) if sample is not None else super()._get_train_sampler(train_dataset)

    warmup_steps = math.ceil(0.1 * max_steps)  # the engine's warmup_ratio 0.1
    trainer = SampledTrainer(
        model=model, args=trainer_arguments(args, block, device, out_dir, max_steps, warmup_steps, dtype),
        train_dataset=train_set, processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=TRAINER_PAD_MULTIPLE), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # it prints the final train metrics
    return trainer


def step_clock(stop_after: int | None, counter: TokenCounter, device):
    """A TrainerCallback that marks the wall time and token counts at every optimizer step and
    stops training after ``stop_after`` steps."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks, self.began = [], None

        def on_train_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            self.marks.append({"step": state.global_step, "time": time.perf_counter(), "cpu": time.process_time(),
                               "hook": counter.snapshot()})
            if stop_after is not None and state.global_step >= stop_after:
                control.should_training_stop = True

    return StepClock()


def time_trainer(block: Block, cfg: Config, args, device, warmup: int, steps: int, scratch: Path) -> dict:
    """A fresh Trainer trains the warm-up batches, then the timed sample of one epoch of its
    length-grouped sampler."""
    job, model, tokenizer, train_set, dtype = trainer_parts(args, block, device)
    epoch = trainer_epochs(block.lengths, block.batch_size, 1)[0]
    warm, timed = choose_window(block, cfg, epoch, warmup, steps)
    counter = TokenCounter(model)
    clock = step_clock(len(warm) + len(timed), counter, device)
    out_dir = tempfile.mkdtemp(dir=scratch)
    trainer = make_trainer(args, block, device, model, tokenizer, train_set, dtype, 2 * len(epoch), [clock], out_dir,
                           sample=[i for b in warm + timed for i in b])
    reset_ok = reset_peak_memory(device)
    trainer.train()
    peak = peak_memory_mib(device)
    measured = window(clock.marks, len(warm), "hook")
    result = {
        "outcome": "stopped", "hook_real": measured["real"], "hook_padded": measured["padded"],
        "squares": measured["extra"], "steps_per_epoch": len(epoch),
        "expected_real": batch_tokens(block.lengths, timed, TRAINER_PAD_MULTIPLE)[0],
        **epoch_tokens(block, epoch, TRAINER_PAD_MULTIPLE), "peak_memory_mib": peak, "peak_reset": reset_ok,
        "optimizer": f"Trainer default optim={getattr(trainer.args.optim, 'value', trainer.args.optim)}",
        "dtype": str(dtype).replace("torch.", "") if dtype else "fp32", **model_shape(model), **measured,
    }
    counter.remove()
    del trainer, model
    shutil.rmtree(out_dir, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- estimate


def model_scale(model: str) -> tuple[float, float]:
    """(body, attention) cost of ``model`` relative to all-MiniLM-L6-v2, from its config.json."""
    from shared.base_models import resolve_model

    try:
        cfg = json.loads((resolve_model(model) / "config.json").read_text())
        layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
        ff = cfg.get("intermediate_size", 4 * hidden)
    except Exception:
        return 1.0, 1.0
    return layers * (4 * hidden * hidden + 2 * hidden * ff) / EST_MINILM_BODY, layers * hidden / (6 * 384)


def step_seconds(n: int, width: int, scale: tuple[float, float]) -> float:
    return EST_OVERHEAD_S * scale[0] + n * width * (EST_PER_TOKEN_S * scale[0] + EST_PER_TOKEN_WIDTH_S * width * scale[1])


def estimate_window(block: Block, cfg: Config, warmup: int, steps: int, scale) -> float:
    """Estimated seconds of one window (CPU cost model), its setup included."""
    warm, timed = choose_window(block, cfg, epoch_batches_of(block, cfg), warmup, steps)
    seconds = sum(step_seconds(len(b), batch_width(block, cfg, b), scale) for b in warm + timed)
    return seconds * (EST_BF16_FACTOR if block.bf16 else 1.0) + EST_SETUP_S[block.dataset]


def window_steps(block: Block, cfg: Config, warmup: int, scale, min_seconds: float) -> int:
    """``block.steps``, raised (for configurations with short steps) until the timed steps take about
    ``min_seconds`` by the cost model, so that a short burst of load cannot dominate a window."""
    batches = epoch_batches_of(block, cfg)
    steps = block.steps
    while steps < len(batches) - warmup:
        _, timed = choose_window(block, cfg, batches, warmup, steps)
        seconds = sum(step_seconds(len(b), batch_width(block, cfg, b), scale) for b in timed)
        if seconds * (EST_BF16_FACTOR if block.bf16 else 1.0) >= min_seconds:
            break
        steps += max(1, steps // 4)
    return min(steps, max(1, len(batches) - warmup))


def estimate_accuracy(block: Block, configs: list[Config], scale) -> float:
    seconds = 0.0
    for cfg in configs:
        seconds += sum(step_seconds(len(b), batch_width(block, cfg, b), scale) for b in epoch_batches_of(block, cfg))
        seconds += EST_SETUP_S[block.dataset] + len(block.val) * block.lengths.mean() * EST_PER_TOKEN_S / 3
    return seconds * (EST_BF16_FACTOR if block.bf16 else 1.0)


# ----------------------------------------------------------------------------- summaries


def summarize(block: Block, configs: list[Config], results: dict, args, device) -> list[dict]:
    """One row per configuration: medians over repeats, and ratios paired within a repeat."""
    rows = []
    by_name = {cfg.name: results[cfg.name] for cfg in configs if results.get(cfg.name)}
    repeats = min(len(v) for v in by_name.values())

    def epoch_seconds(m):  # extrapolated: measured seconds per step x steps per epoch
        return m["seconds"] / m["steps"] * m["steps_per_epoch"]

    def tps(m):  # every example once: the epoch's real tokens (exact) / its extrapolated time
        return m["epoch_real_tokens"] / epoch_seconds(m)

    for cfg in configs:
        ms = by_name.get(cfg.name)
        if not ms:
            continue
        m0 = ms[0]
        row = {
            "block": block.key, "dataset": block.dataset, "batch_size": block.batch_size, "config": cfg.name,
            "kind": cfg.kind, "pad_multiple": cfg.pad_multiple, "repeats": len(ms), "steps": m0["steps"],
            "tokens_per_second": statistics.median(tps(m) for m in ms),
            "tokens_per_second_all": [tps(m) for m in ms],
            "window_tokens_per_second": statistics.median(m["real"] / m["seconds"] for m in ms),
            "efficiency_unrounded": m0["epoch_real_tokens"] / m0["epoch_unrounded_tokens"],
            "efficiency_rounded": m0["epoch_real_tokens"] / m0["epoch_padded_tokens"],
            "window_efficiency_unrounded": m0["real"] / m0["unrounded"],
            "window_efficiency_rounded": m0["real"] / m0["padded"],
            "seconds_per_step": statistics.median(m["seconds"] / m["steps"] for m in ms),
            "steps_per_epoch": m0["steps_per_epoch"], "epoch_seconds": statistics.median(epoch_seconds(m) for m in ms),
            # how well the timed sample stands for the epoch: its computed tokens per step / the epoch's
            "sample_vs_epoch_tokens": (m0["padded"] / m0["steps"]) / (m0["epoch_padded_tokens"] / m0["steps_per_epoch"]),
            "peak_memory_mib": max(m["peak_memory_mib"] for m in ms),
            # CPU seconds of the process (all threads) per wall second per torch thread: well below 1
            # when other processes took the cores during the window
            "cpu_use": statistics.median(m["cpu_seconds"] / m["seconds"] / args.threads for m in ms),
            "counted_as_expected": all(m["real"] == m["expected_real"] for m in ms),
            "dtype": m0["dtype"], "optimizer": m0.get("optimizer", "engine AdamW (fused on CUDA only)"),
        }
        if cfg.kind == "engine":
            # The engine's own token accounting agrees with what the model was fed, and its step
            # timer (which leaves out fetching and collating the batch) against the wall time.
            row["hook_matches_engine"] = all(m["hook_real"] == m["real"] and m["hook_padded"] == m["padded"] for m in ms)
            row["engine_timer_share"] = statistics.median(m["engine_step_seconds"] / m["seconds"] for m in ms)
        flops = 6 * m0["non_embedding_params"] * m0["real"] + 12 * m0["layers"] * m0["hidden"] * m0["squares"]
        row["mfu"] = statistics.median(flops / m["seconds"] / args.peak_flops for m in ms) if device.type == "cuda" else None
        rows.append(row)

    def paired(a: str, b: str, fn) -> float | None:
        if a not in by_name or b not in by_name:
            return None
        return statistics.median(fn(x, y) for x, y in zip(by_name[a][:repeats], by_name[b][:repeats]))

    for row in rows:
        row["vs_trainer"] = paired(row["config"], "trainer", lambda x, y: tps(x) / tps(y))
        row["speedup_vs_fixed"] = paired("fixed", row["config"], lambda x, y: epoch_seconds(x) / epoch_seconds(y))
        if "fixed" in by_name and row["config"] != "fixed":
            # The token bound: computed tokens of a fixed-padded epoch over this configuration's.
            row["token_bound"] = by_name["fixed"][0]["epoch_padded_tokens"] / by_name[row["config"]][0]["epoch_padded_tokens"]
            row["speedup_of_bound"] = row["speedup_vs_fixed"] / row["token_bound"]
    return rows


# ----------------------------------------------------------------------------- accuracy


def accuracy_section(args, device, scratch: Path, log) -> list[dict]:
    """One epoch of fixed, smart, token_budget and the Trainer on the same subset; validation
    accuracy of each, all scored by ``worker.train.evaluate``."""
    from transformers import set_seed

    from worker.data import JobData, make_collator, tokenize
    from worker.train import evaluate, setup, train

    block = build_block(args, args.accuracy_dataset, args.accuracy_batch_size, steps=0)
    names = [n for n in ("fixed", "smart", "token_budget", "trainer") if n in args.configs]
    rows = []
    for name in names:
        cfg = Config(name, "trainer" if name == "trainer" else "engine", None if name == "trainer" else name,
                     TRAINER_PAD_MULTIPLE if name == "trainer" else args.pad[0])
        set_seed(SEED)
        if cfg.kind == "engine":
            job = make_job(args.model, block.labels, block.max_length, block.batch_size, name, cfg.pad_multiple,
                           args.precision, 1, args.learning_rate, token_budget_for(block.lengths, block.batch_size),
                           False, evaluate_each_epoch=True)
            reporter = BenchReporter(10**12, device)
            run = setup(job, JobData(block.train, block.val, block.dataset, block.dataset), device, reporter)
            reporter.run, reporter.counter = run, TokenCounter(run.model)
            began = time.perf_counter()
            train(run, reporter)
            seconds = reporter.marks[-1]["time"] - began
            steps, counter = len(reporter.marks), reporter.counter
            metrics = evaluate(run)
            counter.remove()
            del run
        else:
            job, model, tokenizer, train_set, dtype = trainer_parts(args, block, device)
            counter = TokenCounter(model)
            clock = step_clock(None, counter, device)
            out_dir = tempfile.mkdtemp(dir=scratch)
            trainer = make_trainer(args, block, device, model, tokenizer, train_set, dtype,
                                   math.ceil(len(train_set) / block.batch_size), [clock], out_dir)
            trainer.train()
            seconds, steps = clock.marks[-1]["time"] - clock.began, len(clock.marks)
            hp = SimpleNamespace(batch_size=block.batch_size, seed=SEED, dataloader_num_workers=0)
            view = SimpleNamespace(forward_model=model, job=job, hp=hp, device=device, dtype=dtype,
                                   val_set=tokenize(tokenizer, block.val, "text", None, "label", block.labels,
                                                    block.max_length, block.dataset),
                                   collator=make_collator(tokenizer, "smart", block.max_length, args.pad[0]))
            metrics = evaluate(view)
            counter.remove()
            del trainer, model
            shutil.rmtree(out_dir, ignore_errors=True)
        rows.append({"dataset": block.dataset, "batch_size": block.batch_size, "config": name,
                     "train_examples": len(block.train), "val_examples": len(block.val), "steps": steps,
                     "epoch_seconds": seconds, "real_tokens": counter.real, "padded_tokens": counter.padded,
                     "tokens_per_second": counter.real / seconds, "efficiency_rounded": counter.real / counter.padded,
                     "accuracy": metrics["accuracy"], "f1_macro": metrics["f1_macro"], "val_loss": metrics["loss"]})
        log(f"  accuracy {block.key} {name}: {metrics['accuracy']:.4f} after {steps} steps in {seconds:.0f} s")
    fixed = next((r for r in rows if r["config"] == "fixed"), None)
    trainer = next((r for r in rows if r["config"] == "trainer"), None)
    for r in rows:
        r["delta_vs_fixed_points"] = 100 * (r["accuracy"] - fixed["accuracy"]) if fixed else None
        r["vs_trainer"] = r["tokens_per_second"] / trainer["tokens_per_second"] if trainer else None
        if fixed and r["config"] != "fixed":
            r["wall_speedup_vs_fixed"] = fixed["epoch_seconds"] / r["epoch_seconds"]
            r["token_bound"] = fixed["padded_tokens"] / r["padded_tokens"]  # counted over the whole epoch
    return rows


# ----------------------------------------------------------------------------- markdown


def fmt(x, spec: str = ".3f", none: str = "n/a", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec) + suffix


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def provenance(meta: dict) -> str:
    return (f"_Measured {meta['date']} on {meta['machine']} with `{meta['command']}` "
            f"(torch {meta['torch']}, transformers {meta['transformers']}, model {meta['model']}, "
            f"precision {meta['precision']}" + (f", CPU memory {meta['cpu_memory']}" if meta.get("cpu_memory") else "")
            + ")._")


def render_plan(plan: list[dict], meta: dict) -> str:
    parts = [provenance(meta), ""]
    for dataset in dict.fromkeys(r["dataset"] for r in plan):
        rows = [r for r in plan if r["dataset"] == dataset]
        r0 = rows[0]
        parts.append(f"**{dataset}**: {r0['examples']} training texts, max_length {r0['max_length']}, mean real "
                     f"length {r0['mean_length']:.1f} tokens; averaged over {r0['epochs']} epochs.\n")
        parts.append(table(
            ["batch", "strategy", "steps/epoch", "examples/micro-batch", "efficiency (before rounding)",
             "efficiency (rounded to 8)", "batches changed between epochs", "co-batched pairs kept next epoch"],
            [[str(r["batch_size"]), r["strategy"] + (f" (max_tokens {r['max_tokens_per_batch']})"
                                                     if r["max_tokens_per_batch"] else ""),
              f"{r['steps_per_epoch']:.1f}", f"{r['examples_per_batch']:.1f}", f"{r['efficiency_unrounded']:.3f}",
              f"{r['efficiency_rounded']:.3f}", f"{100 * r['changed_batches']:.0f}%",
              f"{100 * r['pairs_kept']:.0f}%"] for r in rows]))
        parts.append("")
    return "\n".join(parts).rstrip()


def render_timing(rows: list[dict], meta: dict, device) -> str:
    parts = [provenance(meta), "",
             f"{meta['repeats']} repeats, round-robin over configurations (the first one rotates); each repeat "
             "starts every configuration afresh (same weights, seed and batches). A window is "
             f"{meta['warmup']} untimed warm-up step(s) on the epoch's largest batch, then the timed steps: a "
             "stratified sample of the same epoch's batches (the quantiles of padded width). Time is wall time "
             "from step end to step end, fetching and collating each batch included. Medians over repeats; "
             "ratios are paired within a repeat, then the median. **Epoch time is extrapolated, not measured**: "
             "median seconds per timed step x steps per epoch. Real tokens/s (epoch) = the epoch's real tokens "
             "(every training text once, the same for all) / that epoch time; \"vs Trainer\" compares these. "
             "Real tokens/s (timed steps) = what the timed steps themselves did. Efficiency: the whole epoch's, "
             "from the plan. Token bound = computed tokens of a fixed-padded epoch / this configuration's. "
             "CPU use = process CPU seconds / (wall seconds x torch threads) over the window: well below its "
             "usual value, other processes had the cores.", ""]
    mem = "peak GPU MiB (allocated)" if device.type == "cuda" else "peak RSS MiB (process)"
    for key in dict.fromkeys(r["block"] for r in rows):
        rs = [r for r in rows if r["block"] == key]
        parts.append(f"**{key}**\n")
        header = ["config", "timed steps", "real tokens/s (epoch)", "vs Trainer", "real tokens/s (timed steps)",
                  "efficiency (before rounding)", "efficiency (rounded)", "s/step", "steps/epoch",
                  "s/epoch (extrapolated)", "speedup vs fixed", "token bound", "speedup / bound", mem, "CPU use"]
        if device.type == "cuda":
            header.append("MFU")
        body = []
        for r in rs:
            line = [r["config"], str(r["steps"]), f"{r['tokens_per_second']:,.0f}", fmt(r["vs_trainer"], ".2f", suffix="x"),
                    f"{r['window_tokens_per_second']:,.0f}", f"{r['efficiency_unrounded']:.3f}",
                    f"{r['efficiency_rounded']:.3f}",
                    f"{r['seconds_per_step']:.3f}", str(r["steps_per_epoch"]), f"{r['epoch_seconds']:.0f}",
                    fmt(r.get("speedup_vs_fixed"), ".2f"), fmt(r.get("token_bound"), ".2f"),
                    fmt(r.get("speedup_of_bound"), ".0%"), f"{r['peak_memory_mib']:,.0f}", f"{r['cpu_use']:.0%}"]
            if device.type == "cuda":
                line.append(fmt(r["mfu"], ".1%"))
            body.append(line)
        parts += [table(header, body), ""]
    return "\n".join(parts).rstrip()


def render_accuracy(rows: list[dict], meta: dict) -> str:
    r0 = rows[0]
    se = 100 * math.sqrt(max(r0["accuracy"] * (1 - r0["accuracy"]), 1e-9) / r0["val_examples"])
    head = (f"{provenance(meta)}\n\n{r0['dataset']}: one epoch on {r0['train_examples']} training texts, batch "
            f"{r0['batch_size']}, one run each, one after the other; validation on {r0['val_examples']} held-out "
            f"texts, all scored by `worker.train.evaluate` (one accuracy's standard error is about {se:.1f} points). "
            "Epoch time and tokens/s here are **measured** over the whole epoch, first step to last.\n")
    return head + "\n" + table(
        ["config", "validation accuracy", "vs fixed (points)", "macro-F1", "steps", "epoch seconds (measured)",
         "real tokens/s", "vs Trainer", "efficiency (rounded)", "speedup vs fixed", "token bound", "speedup / bound"],
        [[r["config"], f"{r['accuracy']:.4f}", fmt(r["delta_vs_fixed_points"], "+.2f"), f"{r['f1_macro']:.4f}",
          str(r["steps"]), f"{r['epoch_seconds']:.0f}", f"{r['tokens_per_second']:,.0f}",
          fmt(r["vs_trainer"], ".2f", suffix="x"), f"{r['efficiency_rounded']:.3f}", fmt(r.get("wall_speedup_vs_fixed"), ".2f"),
          fmt(r.get("token_bound"), ".2f"),
          fmt(r["wall_speedup_vs_fixed"] / r["token_bound"] if r.get("token_bound") else None, ".0%")] for r in rows])


def target_rows(plan: list[dict], timing: list[dict], accuracy: list[dict], device) -> list[list[str]]:
    """The issue's targets: measured value and met/missed; a target this run did not measure gets a
    ``not run`` row, so the table always has the same shape."""
    out = []
    need = 1.3 if device.type == "cuda" else 1.1
    for dataset in dict.fromkeys(r["dataset"] for r in plan):
        for strategy in ("smart", "token_budget"):
            r = next((x for x in plan if x["dataset"] == dataset and x["batch_size"] == 32 and
                      x["strategy"] == strategy), None)
            if r:
                ok = r["efficiency_unrounded"] >= 0.98 and r["changed_batches"] > 0 and r["pairs_kept"] < 1
                out.append([f"padding efficiency >= 0.98, {strategy}, {dataset}, batch 32 (before rounding), "
                            "batch composition changing between epochs",
                            f"{r['efficiency_unrounded']:.3f}; {100 * r['changed_batches']:.0f}% of batches change, "
                            f"{100 * r['pairs_kept']:.0f}% of co-batched pairs stay together",
                            "met" if ok else "missed"])
    speed = [r for r in timing if r["config"] == "smart" and r.get("speedup_of_bound") is not None]
    for r in speed:
        v = r["speedup_of_bound"]
        out.append([f"smart wall-time speedup over fixed >= 95% of the token bound, {r['block']} (extrapolated)",
                    f"{r['speedup_vs_fixed']:.2f}x of {r['token_bound']:.2f}x = {v:.0%}", "met" if v >= 0.95 else "missed"])
    acc_speed = [r for r in accuracy if r["config"] == "smart" and r.get("token_bound")]
    for r in acc_speed:
        v = r["wall_speedup_vs_fixed"] / r["token_bound"]
        out.append([f"smart wall-time speedup over fixed >= 95% of the token bound, {r['dataset']} b{r['batch_size']} "
                    "(measured over one full epoch, single run)",
                    f"{r['wall_speedup_vs_fixed']:.2f}x of {r['token_bound']:.2f}x = {v:.0%}",
                    "met" if v >= 0.95 else "missed"])
    if not speed and not acc_speed:
        out.append(["smart wall-time speedup over fixed >= 95% of the token bound", "not run", "to be filled"])
    rel = [r for r in timing if r["config"] in ("smart", "token_budget") and r.get("vs_trainer") is not None]
    rel_acc = [r for r in accuracy if r["config"] in ("smart", "token_budget") and r.get("vs_trainer")]
    for r in rel:
        out.append([f"{r['config']} real tokens/s >= {need}x the Trainer, {r['block']}", f"{r['vs_trainer']:.2f}x",
                    "met" if r["vs_trainer"] >= need else "missed"])
    for r in rel_acc:
        out.append([f"{r['config']} real tokens/s >= {need}x the Trainer, {r['dataset']} b{r['batch_size']} "
                    "(measured over one full epoch, single run)", f"{r['vs_trainer']:.2f}x",
                    "met" if r["vs_trainer"] >= need else "missed"])
    if not rel and not rel_acc:
        out.append([f"smart and token_budget real tokens/s >= 1.1x the Trainer on the CPU (>= 1.3x on a GPU)",
                    "not run", "to be filled"])
    acc = [r for r in accuracy if r["config"] in ("smart", "token_budget") and r["delta_vs_fixed_points"] is not None]
    for r in acc:
        d = r["delta_vs_fixed_points"]
        out.append([f"{r['config']} validation accuracy within 0.5 points of fixed ({r['dataset']}, one run each)",
                    f"{d:+.2f} points", "met" if abs(d) <= 0.5 else "missed"])
    if not acc:
        out.append(["smart and token_budget validation accuracy within 0.5 points of fixed", "not run (--accuracy)",
                    "to be filled"])
    return out


def update_markdown(path: Path, sections: dict[str, str], append_missing: bool = True) -> list[str]:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` for each
    section; a section the file lacks is appended with its markers (or, with ``append_missing``
    false, left out). Returns the names written."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    written = []
    for name, body in sections.items():
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        block = f"{start}\n{body}\n{end}"
        pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _: block, text, count=1)
        elif append_missing:
            text = text.rstrip() + f"\n\n{block}\n"
        else:
            continue
        written.append(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return written


# ----------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=["bbc", "rotten_tomatoes", "both"], default="both")
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="a built-in model or a directory name under TUNEJOB_MODELS_DIR")
    p.add_argument("--steps", type=int, default=None,
                   help="timed optimizer steps per window (default: enough for --window-tokens fixed-padded tokens)")
    p.add_argument("--window-tokens", type=int, default=65536,
                   help="default --steps: batch_size x max_length x steps ~ this (clamped to 2..30)")
    p.add_argument("--min-window-seconds", type=float, default=10.0,
                   help="without --steps, configurations with short steps time more of them, up to about this "
                        "many seconds per window by the CPU cost model")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps before each window (>= 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-sizes", default="16,32")
    p.add_argument("--max-length", type=int, default=None, help="default: 512 for bbc, 128 for rotten_tomatoes")
    p.add_argument("--train-size", type=int, default=None,
                   help="training texts (default: bbc all 1,780 of its 80%% split, rotten_tomatoes 4,000)")
    p.add_argument("--val-size", type=int, default=None, help="validation texts (default: bbc 445, rotten_tomatoes 2,000)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="as the engine: auto is fp32 on the CPU, bf16 (or fp16) on a GPU; the Trainer gets the same")
    p.add_argument("--pad-to-multiple-of", default="auto",
                   help="comma list: the first is used by dynamic/smart/token_budget, smart is also timed with each "
                        "other; auto = the engine's default (1 on the CPU, 8 on CUDA) plus smart with the other")
    p.add_argument("--configs", default="fixed,dynamic,smart,token_budget,trainer")
    p.add_argument("--learning-rate", type=float, default=5e-5)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--cpu-memory", choices=["reuse", "default"], default="reuse",
                   help="on the CPU, for the whole process (engine and Trainer alike): reuse = keep freed memory "
                        "for reuse, as the worker does (worker.device.reuse_freed_cpu_memory); default = glibc's")
    p.add_argument("--peak-flops", type=float, default=989e12, help="peak dense bf16 FLOP/s for MFU (H100 SXM: 989e12)")
    p.add_argument("--accuracy", action="store_true", help="also train fixed/smart/token_budget/trainer one epoch each")
    p.add_argument("--accuracy-dataset", choices=["bbc", "rotten_tomatoes"], default="rotten_tomatoes")
    p.add_argument("--accuracy-batch-size", type=int, default=32)
    p.add_argument("--plan-only", action="store_true", help="only the plan section (no training, seconds)")
    p.add_argument("--plan-epochs", type=int, default=5)
    p.add_argument("--estimate-only", action="store_true", help="print the time estimate and exit")
    p.add_argument("--markdown", type=Path, default=None, help="write/update the result tables in this file")
    p.add_argument("--json", type=Path, default=None, help="write every measurement here")
    p.add_argument("--tag", default=None,
                   help="write the sections as NAME-TAG (e.g. timing-bf16), and only those the file already has")
    args = p.parse_args(argv)
    args.datasets = ["bbc", "rotten_tomatoes"] if args.dataset == "both" else [args.dataset]
    args.batch_size_list = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - {*STRATEGIES, "trainer"}
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)}")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the timed window opens at the end of a warm-up step)")
    return args


def build_block(args, dataset: str, batch_size: int, steps: int | None = None) -> Block:
    from transformers import AutoTokenizer

    from shared.base_models import resolve_model

    key = (dataset, args.train_size, args.val_size)
    if key not in args.cache:
        train, val = load_corpus(dataset, args.train_size or DEFAULT_TRAIN_SIZE[dataset],
                                 args.val_size or DEFAULT_VAL_SIZE[dataset])
        args.cache[key] = (train, val)
    train, val = args.cache[key]
    max_length = args.max_length or DEFAULT_MAX_LENGTH[dataset]
    tkey = (dataset, max_length)
    if tkey not in args.cache:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
        args.cache[tkey] = token_lengths(tokenizer, train["text"].astype(str).tolist(), max_length)
    if steps is None:
        steps = args.steps or min(30, max(2, round(args.window_tokens / (batch_size * max_length))))
    labels = sorted(str(v) for v in train["label"].unique())
    return Block(dataset, batch_size, max_length, train, val, args.cache[tkey], steps, labels)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.cache = {}
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="tunejob-bench-"))
    saved_env = {k: os.environ.get(k) for k in ("TUNEJOB_DATA_DIR",)}
    os.environ["TUNEJOB_DATA_DIR"] = str(scratch / "data")  # the engine's checkpoints, if any
    warnings.filterwarnings("ignore", message=".*pin_memory.*")

    import torch
    import transformers
    from transformers import logging as hf_logging

    from shared.settings import get_settings
    from worker.device import autocast_dtype, describe, resolve_device, reuse_freed_cpu_memory

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    get_settings.cache_clear()

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        args.threads = torch.get_num_threads()
        device, note = resolve_device(args.device)
        if note:
            log(note)
        if device.type == "cpu" and args.cpu_memory == "reuse" and not reuse_freed_cpu_memory():
            args.cpu_memory = "default (mallopt unavailable)"
        default_pad = 8 if device.type == "cuda" else 1
        if args.pad_to_multiple_of == "auto":
            args.pad = [default_pad, 1 if default_pad == 8 else 8]
        else:
            args.pad = [int(x) for x in args.pad_to_multiple_of.split(",") if x.strip()]
        dtype = autocast_dtype(args.precision, device)
        precision = str(dtype).replace("torch.", "") if dtype else "fp32"
        meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "command": "python -m bench.train " +
                " ".join(sys.argv[1:] if argv is None else argv), "machine": f"{describe(device)}; {machine()}",
                "torch": torch.__version__, "transformers": transformers.__version__, "model": args.model,
                "precision": precision, "repeats": args.repeats, "warmup": args.warmup,
                "cpu_memory": args.cpu_memory if device.type == "cpu" else None}
        results: dict = {"meta": meta, "plan": [], "timing": [], "accuracy": [], "raw": {}}
        sections: dict[str, str] = {}

        # -- plan: lengths only
        t0 = time.perf_counter()
        for dataset in args.datasets:
            for bs in args.batch_size_list:
                block = build_block(args, dataset, bs)
                results["plan"] += plan_rows(dataset, block.lengths, bs, block.max_length, args.plan_epochs)
        log(render_plan(results["plan"], meta))
        log(f"\n(plan section: {time.perf_counter() - t0:.1f} s)\n")
        sections["plan"] = render_plan(results["plan"], meta)
        if args.plan_only:
            targets = target_rows(results["plan"], [], [], device)
            sections["targets"] = provenance(meta) + "\n\n" + table(["target", "measured", "status"], targets)
            return finish(args, results, sections, log, started)

        # -- timing: blocks x configurations, round-robin over repeats
        blocks = [build_block(args, d, bs) for d in args.datasets for bs in args.batch_size_list]
        block_configs = {}
        for b in blocks:
            extra = args.pad[1:] if "smart" in args.configs else []
            if args.pad_to_multiple_of == "auto" and not rounding_matters(b.lengths, b.batch_size, args.pad):
                extra = []  # auto: smart is timed with the other rounding only where it changes the work
            block_configs[b.key] = make_configs(args.configs, args.pad[0], extra, device.type)
        for b in blocks:
            b.bf16 = dtype == torch.bfloat16
        scale = model_scale(args.model)
        steps = {(b.key, c.name): b.steps if args.steps or device.type == "cuda" else
                 window_steps(b, c, args.warmup, scale, args.min_window_seconds)
                 for b in blocks for c in block_configs[b.key]}
        est = {(b.key, c.name): estimate_window(b, c, args.warmup, steps[(b.key, c.name)], scale)
               for b in blocks for c in block_configs[b.key]}
        est_timing = args.repeats * sum(est.values())
        acc_block = build_block(args, args.accuracy_dataset, args.accuracy_batch_size, steps=0) if args.accuracy else None
        acc_configs = [Config(n, "trainer" if n == "trainer" else "engine", None if n == "trainer" else n,
                              TRAINER_PAD_MULTIPLE if n == "trainer" else args.pad[0])
                       for n in ("fixed", "smart", "token_budget", "trainer") if n in args.configs]
        if acc_block is not None:
            acc_block.bf16 = dtype == torch.bfloat16
        est_acc = estimate_accuracy(acc_block, acc_configs, scale) if args.accuracy else 0.0
        where = "this 2-core CPU" if device.type == "cpu" else "the CPU cost model (a GPU run is far shorter)"
        log(f"Estimated time on {where}: timing {est_timing / 60:.1f} min "
            f"({len(est)} block configurations x {args.repeats} repeats; warm-up + timed steps per window: "
            + "; ".join(f"{b.key}: " + ", ".join(f"{c.name} {args.warmup}+{steps[(b.key, c.name)]}"
                                                 for c in block_configs[b.key]) for b in blocks) + ")"
            + (f", accuracy {est_acc / 60:.1f} min" if args.accuracy else "")
            + f"; total about {(est_timing + est_acc) / 60 + 0.5:.0f} min on a quiet machine.")
        if args.estimate_only:
            return 0
        raw: dict[str, dict[str, list]] = {b.key: {c.name: [] for c in block_configs[b.key]} for b in blocks}
        done_est = 0.0
        timing_started = time.perf_counter()
        for r in range(args.repeats):
            for block in blocks:
                configs = block_configs[block.key]
                order = configs[r % len(configs):] + configs[: r % len(configs)]  # rotate who goes first
                for cfg in order:
                    n = steps[(block.key, cfg.name)]
                    if cfg.kind == "trainer":
                        m = time_trainer(block, cfg, args, device, args.warmup, n, scratch)
                    else:
                        m = time_engine(block, cfg, args, device, args.warmup, n)
                    raw[block.key][cfg.name].append(m)
                    done_est += est[(block.key, cfg.name)]
                    elapsed = time.perf_counter() - timing_started
                    left = max(0.0, est_timing - done_est) * elapsed / done_est
                    log(f"[repeat {r + 1}/{args.repeats}] {block.key} {cfg.name}: {m['real'] / m['seconds']:,.0f} "
                        f"real tokens/s, {m['seconds'] / m['steps']:.3f} s/step, efficiency "
                        f"{m['real'] / m['padded']:.3f}, peak {m['peak_memory_mib']:,.0f} MiB, CPU use "
                        f"{m['cpu_seconds'] / m['seconds'] / args.threads:.0%} "
                        f"(timing {elapsed / 60:.1f} min in, about {left / 60:.1f} min left)")
        for block in blocks:
            results["timing"] += summarize(block, block_configs[block.key], raw[block.key], args, device)
        results["raw"] = raw
        sections["timing"] = render_timing(results["timing"], meta, device)
        log("\n" + sections["timing"])

        if args.accuracy:
            results["accuracy"] = accuracy_section(args, device, scratch, log)
            sections["accuracy"] = render_accuracy(results["accuracy"], meta)
            log("\n" + sections["accuracy"])
        targets = target_rows(results["plan"], results["timing"], results["accuracy"], device)
        sections["targets"] = provenance(meta) + "\n\n" + table(["target", "measured", "status"], targets)
        if device.type == "cuda":
            sections["gpu"] = render_gpu(results["timing"], meta, args)
        return finish(args, results, sections, log, started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_settings.cache_clear()


def render_gpu(rows: list[dict], meta: dict, args) -> str:
    body = [[r["block"], r["config"], f"{r['tokens_per_second']:,.0f}", fmt(r["mfu"], ".1%"),
             f"{r['peak_memory_mib']:,.0f}"] for r in rows]
    return (f"{provenance(meta)}\n\nMFU = (6 x non-embedding parameters x real tokens/s + 12 x layers x hidden x "
            f"sum of squared real lengths / s) / {args.peak_flops:.3g} FLOP/s.\n\n"
            + table(["block", "config", "real tokens/s", "MFU", "peak GPU MiB (allocated)"], body))


def finish(args, results: dict, sections: dict[str, str], log, started: float) -> int:
    wall = time.perf_counter() - started
    results["meta"]["wall_seconds"] = wall
    if "targets" in sections:
        log("\n" + sections["targets"])
    if args.markdown:
        if args.tag:
            sections = {f"{name}-{args.tag}": body for name, body in sections.items()}
        written = update_markdown(args.markdown, sections, append_missing=not args.tag)
        log(f"\nupdated {args.markdown}: sections {', '.join(written) or 'none'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {args.json}")
    log(f"wall time {wall / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
