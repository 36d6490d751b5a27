"""Which jobs train on CUDA graphs (``eager_reason``), and the captured steps a worker keeps
between jobs (``capture_steps``). Capturing returns new parts for the recipe to train with
(``CapturedParts``); this module never sees the recipe.

The graphs outlive the job: they are kept in a per-process cache (``TUNEJOB_CUDA_GRAPH_CACHE``
entries, least recently used evicted) keyed by what they bake in (model configuration, number of labels, trainable
parameters, task, micro-batch rows, precision, weight decay, input names). A later job with the
same key copies its initial weights into the captured parameters and its optimizer state into the
captured AdamW, in place, and captures only widths not captured before. Where a job cannot be
captured (fp16 GradScaler, gradient checkpointing, ``torch_compile``, ``token_budget`` batching,
or an error or out-of-memory during capture) it trains eagerly with the same bodies and says so in
an event.
"""

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.settings import get_settings
from worker.training.capture import CapturedSteps
from worker.training.parity import check_new_capture
from worker.training.setup import JobSetup
from worker.training.steps import (
    StepInputs,
    bf16_copy,
    make_optimizer,
    make_scheduler,
    uses_bf16_copy,
)

_cache: "OrderedDict[tuple, CapturedSteps]" = OrderedDict()
_failed: dict[tuple, str] = {}  # keys whose capture failed in this process: not tried again


@dataclass(frozen=True)
class CapturedParts:
    """What a job trains with on CUDA graphs: the fp32 master ``model`` the graphs update, the
    ``forward_model`` they compute with (its bf16 copy under bf16), the capturable ``optimizer``
    (its learning rate a device tensor), the ``scheduler`` over it, and the captured ``steps``."""

    model: torch.nn.Module
    forward_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    steps: CapturedSteps


def eager_reason(job_setup: JobSetup, packing: bool = False) -> str | None:
    """Why this job trains eagerly, or None when its steps can be captured as CUDA graphs. A packed
    job (``packing``) is captured whatever its micro-batches' size: the size threshold was measured
    for padded graphs, whose attention runs on the masked memory-efficient kernel, while eager
    packed steps are bound by the host (docs/benchmarks.md)."""
    if job_setup.device.type != "cuda":
        return f"{job_setup.device.type} trains eagerly"
    hp = job_setup.hp
    if not get_settings().cuda_graphs:
        return "TUNEJOB_CUDA_GRAPHS is off"
    if job_setup.dtype == torch.float16:
        return "fp16 with a GradScaler (its scale and skip decisions are host-side)"
    if hp.gradient_checkpointing:
        return "gradient_checkpointing (recomputation inside a captured backward is untested)"
    if hp.torch_compile:
        return "torch_compile (it makes its own graphs)"
    if hp.batching == "token_budget":
        return "token_budget batching (micro-batches vary in rows)"
    if job_setup.job.task == "token_classification":
        return "token_classification (the captured step takes one label per row)"
    if job_setup.job.task == "embedding":
        return "embedding (its loss compares the rows of a micro-batch: filler rows would be negatives)"
    tokens, most = mean_padded_tokens(job_setup), get_settings().cuda_graphs_max_tokens
    if tokens >= most and not packing:
        return (
            f"micro-batches of {tokens:,.0f} padded tokens on average keep the GPU busy, where eager steps "
            f"are as fast and need no capture (TUNEJOB_CUDA_GRAPHS_MAX_TOKENS={most})"
        )
    return None


def mean_padded_tokens(job_setup: JobSetup) -> float:
    """Padded tokens (rows x bucket width) of the job's average micro-batch over its first
    ``ceil(epochs)`` epochs, the quantity that decides whether graphs pay (``eager_reason``): small
    micro-batches leave the GPU waiting on kernel launches, which graphs remove; large ones keep it
    busy, where eager steps are as fast and need no capture (the measurements behind the default
    threshold: ``docs/benchmarks.md``)."""
    hp = job_setup.hp
    counts = job_setup.plan.width_counts(job_setup.collator.ladder, hp.epochs)
    batches = sum(counts.values())
    return hp.batch_size * sum(width * n for width, n in counts.items()) / max(1, batches)


def input_names(job_setup: JobSetup) -> list[str]:
    """The model inputs of the job's micro-batches (``input_ids``, ``attention_mask``, and
    ``token_type_ids`` when the tokenizer makes them), as its collator makes them."""
    return [name for name in job_setup.collator([job_setup.train_set[0]]) if name != "labels"]


def graph_key(
    job_setup: JobSetup, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: int, packing: bool = False
) -> tuple:
    """What captured graphs bake in: a later job with an equal key can replay them (packed graphs
    also bake in ``max_length``, the longest sequence their attention kernel takes)."""
    config = model.config.to_dict()
    for name in ("id2label", "label2id", "_name_or_path", "transformers_version"):
        config.pop(name, None)
    trainable = tuple(p.requires_grad for p in model.parameters())
    decay = tuple(g["weight_decay"] for g in optimizer.param_groups)
    return (
        type(model).__name__,
        json.dumps(config, sort_keys=True, default=str),
        model.config.num_labels,
        trainable,
        job_setup.job.task,
        rows,
        str(job_setup.dtype),
        decay,
        tuple(input_names(job_setup)),
        str(job_setup.device),
        job_setup.hp.max_length if packing else None,
    )


def capture_steps(
    job_setup: JobSetup,
    model: torch.nn.Module,
    forward_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    rows: int,
    widths: list[int],
    first_steps: Callable[[], list[StepInputs]],
    width_sample: Callable[[int], StepInputs],
    packing: bool = False,
) -> tuple[CapturedParts, str]:
    """The job's steps as CUDA graphs for micro-batches of ``rows`` rows and these ``widths`` (with
    ``packing``: token buckets, ``CapturedSteps.key_of``):
    from the cache when an earlier job captured them (the job's weights and optimizer state copied
    in: ``adopt``), else captured now over ``model`` (with a capturable copy of ``optimizer``).
    Before the graphs are used they are checked against eager steps (``check_new_capture``): a new
    capture over ``first_steps()`` (the job's first ``CHECK_STEPS`` steps, padded as training pads
    them) under a warm-up schedule, with the dropout probe; and every width captured now, this
    job's or added to cached graphs, over ``width_sample(width)`` (one micro-batch of that width).
    The given parts are left as they were but for their weights and state, which are the same.
    Returns the parts to train with and a sentence for the job's events.

    Raises:
        CaptureMismatch: a replayed step does not match the eager one.
        Exception: whatever capture or the checks raised (including ``torch.OutOfMemoryError`` and
            ``SharedPoolError``). In every case the graphs are released and the key is not tried
            again in this process; the given parts still train eagerly from their initial state.
    """
    key = graph_key(job_setup, model, optimizer, rows, packing)
    if key in _failed:
        raise RuntimeError(f"capture failed earlier in this worker: {_failed[key]}")
    steps = _cache.pop(key, None)
    if steps is not None:
        parts = adopt(steps, job_setup, model, optimizer, scheduler, scaler)
    else:
        while len(_cache) >= max(1, get_settings().cuda_graph_cache):
            _cache.popitem(last=False)  # least recently used: frees its graphs, model and optimizer
        parts = uncaptured_parts(job_setup, model, forward_model, optimizer, scheduler, scaler, rows, packing)
        steps = parts.steps
    try:
        new_update = steps.replay_update is None
        new = steps.capture(widths)
        checks = check_new_capture(steps, new, new_update, first_steps, width_sample, job_setup.hp.learning_rate)
    except Exception as e:
        _failed[key] = f"{type(e).__name__}: {e}"
        steps.release()
        raise
    _cache[key] = steps
    old = sorted(set(widths) - set(new))
    shapes = "token buckets" if packing else "widths"
    return parts, (
        f"CUDA graphs for {'packed ' if packing else ''}micro-batches of {rows} rows: captured {shapes} "
        f"{new or 'none'}"
        + (f", reused {old} from an earlier job" if old else "")
        + f" (cache of {len(_cache)})"
        + (f"; checked against eager steps: {'; '.join(checks)}" if checks else "")
    )


def uncaptured_parts(
    job_setup: JobSetup,
    model: torch.nn.Module,
    forward_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    rows: int,
    packing: bool = False,
) -> CapturedParts:
    """New ``CapturedSteps`` over ``model`` for micro-batches of ``rows`` rows, nothing captured
    yet (``CapturedSteps.capture``), with a capturable copy of ``optimizer`` (its state and
    schedule carried over: ``move_optimizer_state``) and, under bf16, a bf16 copy of the model to
    compute with."""
    captured = make_optimizer(model, job_setup.hp, job_setup.device, capturable=True)
    captured_scheduler = move_optimizer_state(job_setup, optimizer, scheduler, captured)
    if uses_bf16_copy(job_setup.dtype):
        forward_model = bf16_copy(model)
    steps = CapturedSteps(
        model,
        forward_model,
        captured,
        scaler,
        dtype=job_setup.dtype,
        device=job_setup.device,
        task=job_setup.job.task,
        rows=rows,
        input_names=input_names(job_setup),
        pad_id=job_setup.tokenizer.pad_token_id or 0,
        packing=packing,
        max_length=job_setup.hp.max_length,
        pos_weight=job_setup.pos_weight,
    )
    return CapturedParts(model, forward_model, captured, captured_scheduler, steps)


def adopt(
    steps: CapturedSteps,
    job_setup: JobSetup,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
) -> CapturedParts:
    """Point ``steps`` (captured by an earlier job) at this job: copy the job's initial weights
    (``model``) and optimizer state into the captured model and AdamW, in place, and give the
    captured model the job's configuration (its label names). Returns the captured parts, with a
    new scheduler over the captured AdamW at the job's point of its schedule."""
    with torch.no_grad():
        steps.model.load_state_dict(model.state_dict())  # copy_ into the captured parameters
        if steps.compute_model is not None:
            steps.compute_model.load_state_dict(steps.model.state_dict())
    steps.model.config = model.config  # equal but for label names and paths (``graph_key``)
    captured_scheduler = move_optimizer_state(job_setup, optimizer, scheduler, steps.optimizer)
    steps.scaler, steps.pad_id = scaler, job_setup.tokenizer.pad_token_id or 0
    steps.discard_step()
    return CapturedParts(steps.model, steps.forward_model, steps.optimizer, captured_scheduler, steps)


def move_optimizer_state(
    job_setup: JobSetup,
    source: torch.optim.Optimizer,
    source_scheduler: torch.optim.lr_scheduler.LRScheduler,
    optimizer: torch.optim.Optimizer,
) -> torch.optim.lr_scheduler.LRScheduler:
    """Copy ``source``'s moments, step counts and learning rate into ``optimizer`` (same parameter
    order; a capturable AdamW, its learning rate a device tensor) in place. Returns a scheduler over
    ``optimizer`` at ``source_scheduler``'s point of the schedule."""
    source_schedule = source_scheduler.state_dict()
    for group in optimizer.param_groups:
        group["initial_lr"] = job_setup.hp.learning_rate  # the scheduler's base; another job's may be there
    scheduler = make_scheduler(optimizer, job_setup.hp, job_setup.total_steps)  # sets the lr to step 0's
    scheduler.load_state_dict(source_schedule)
    with torch.no_grad():
        for src_group, dst_group in zip(source.param_groups, optimizer.param_groups, strict=True):
            dst_group["lr"].fill_(src_group["lr"])
            for src, dst in zip(src_group["params"], dst_group["params"], strict=True):
                state, dst_state = source.state.get(src, {}), optimizer.state[dst]
                if not dst_state:
                    dst_state.update(
                        step=torch.zeros((), dtype=torch.float32, device=dst.device),
                        exp_avg=torch.zeros_like(dst),
                        exp_avg_sq=torch.zeros_like(dst),
                    )
                for name, tensor in dst_state.items():
                    if name in state:
                        tensor.copy_(state[name])
                    else:
                        tensor.zero_()
    return scheduler


def clear_cache() -> None:
    """Drop every cached graph (and the models and optimizers they hold); e.g. after an
    out-of-memory error."""
    _cache.clear()
