"""A job's micro-batches as its optimizer steps take them: loaders over the batch plan, the groups
of one step, their out-of-memory split, and samples read from the plan ahead of training (what
CUDA-graph capture and its checks train on)."""

import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from shared.data.batching import BatchPlan, bucket_width
from shared.errors import UserError
from shared.schemas.hyperparameters import Hyperparameters
from worker.data import BatchStats, TokenizedDataset
from worker.reporter import Reporter
from worker.training.packing import PACKED
from worker.training.setup import JobSetup
from worker.training.state import TrainState
from worker.training.steps import StepInputs, loss_terms


def make_loader(
    job_setup: JobSetup,
    dataset: TokenizedDataset,
    plan: BatchPlan,
    epoch: int,
    collator: Callable[[list[dict]], dict] | None = None,
) -> DataLoader:
    """A DataLoader over ``plan``, collating with ``collator`` (default: the job's); it draws
    worker seeds from its own generator so that the global RNG (dropout) advances the same whether
    or not a run was resumed."""
    hp, device = job_setup.hp, job_setup.device
    return DataLoader(
        dataset,
        batch_sampler=plan,
        collate_fn=collator or job_setup.collator,
        num_workers=hp.dataloader_num_workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(hp.seed + epoch),
    )


def step_groups(
    job_setup: JobSetup, state: TrainState, collator: Callable[[list[dict]], dict] | None = None
) -> Iterator[list[dict]]:
    """The rest of the current epoch (``state.epoch`` from ``state.batch_in_epoch``) as groups of
    ``gradient_accumulation_steps`` padded micro-batches, collated by ``collator`` (default: the
    job's; the steps' own, ``Steps.collator``, for packed ones)."""
    job_setup.plan.set_epoch(state.epoch, skip=state.batch_in_epoch)
    micro_batches = iter(make_loader(job_setup, job_setup.train_set, job_setup.plan, state.epoch, collator))
    while group := list(itertools.islice(micro_batches, job_setup.hp.gradient_accumulation_steps)):
        yield group


def split_batch(batch: dict[str, torch.Tensor], pieces: int) -> list[dict[str, torch.Tensor]]:
    """Cut a padded batch into ``pieces`` row-wise chunks (out-of-memory backoff); a packed layout
    collated beside it (``packing.PACKED``) is left out of the pieces, which are packed as they run."""
    if pieces == 1:
        return [batch]
    chunks = {k: v.tensor_split(pieces) for k, v in batch.items() if k != PACKED}
    return [{k: c[i] for k, c in chunks.items()} for i in range(pieces) if len(chunks["labels"][i])]


def group_stats(group: list[dict[str, torch.Tensor]], padded_to_longest: bool, columns: int = 1) -> BatchStats:
    """The token counts of a step's planned micro-batches, summed (``BatchStats.of`` each)."""
    stats = BatchStats(0, 0, 0)
    for planned in group:
        s = BatchStats.of(planned, padded_to_longest=padded_to_longest, columns=columns)
        stats = BatchStats(stats.real + s.real, stats.unrounded + s.unrounded, stats.padded + s.padded)
    return stats


def micro_batch_size(hp: Hyperparameters, micro_split: int) -> int:
    """Rows of a micro-batch once each planned one runs as ``micro_split`` pieces."""
    return math.ceil(hp.batch_size / micro_split)


def halved_split(
    hp: Hyperparameters, state: TrainState, largest: int, reporter: Reporter, error: torch.OutOfMemoryError
) -> int:
    """The micro-batch split after an out-of-memory ``error`` at the next step: twice
    ``state.micro_split`` (each micro-batch halved, the accumulation doubled, the step's examples
    unchanged), with an ``out_of_memory`` event. ``largest``: the step's largest micro-batch (rows).

    Raises:
        UserError: ``out_of_memory`` when a micro-batch of one example did not fit.
    """
    step = state.step + 1
    if math.ceil(largest / state.micro_split) <= 1:
        raise UserError(
            "out_of_memory",
            f"out of memory at step {step} with a micro-batch of one example; lower "
            "max_length or turn on gradient_checkpointing",
            "hyperparameters.max_length",
        ) from error
    split = state.micro_split * 2
    reporter.event(
        "out_of_memory",
        f"out of memory at step {step}: micro-batch cut to "
        f"{micro_batch_size(hp, split)}, gradient_accumulation_steps raised to "
        f"{hp.gradient_accumulation_steps * split}; the effective batch is unchanged",
        level="warning",
    )
    return split


def first_steps(job_setup: JobSetup, state: TrainState, n: int) -> list[StepInputs]:
    """The micro-batches of the job's next ``n`` optimizer steps (fewer if its epoch ends first),
    collated and split as the recipe's ``train_step`` will have them, each step with its loss
    terms; read from the plan, with no RNG drawn."""
    batches = job_setup.plan.epoch_batches(state.epoch)
    start = state.batch_in_epoch if state.batch_in_epoch < len(batches) else 0
    accumulation = job_setup.hp.gradient_accumulation_steps
    return [
        step_inputs(job_setup, state.micro_split, batches[s : s + accumulation])
        for s in range(start, min(len(batches), start + n * accumulation), accumulation)
    ]


def width_sample(
    job_setup: JobSetup, micro_split: int, width: int, shape_of: Callable[[np.ndarray], int] | None = None
) -> StepInputs:
    """One micro-batch the job will train on at bucket ``width`` (the first in plan order over its
    epochs), collated and split as ``train_step`` will have it, with its loss terms. ``shape_of``:
    the shape of a planned batch (its example indices) if not its bucket width (a packed job's
    token bucket).

    Raises:
        ValueError: no micro-batch of the job's plan has that width.
    """
    plan = job_setup.plan

    def bucket(batch: np.ndarray) -> int:
        return bucket_width(job_setup.collator.ladder, int(plan.lengths[batch].max()))

    for epoch in range(max(1, math.ceil(job_setup.hp.epochs))):
        for batch in plan.epoch_batches(epoch):
            if (shape_of or bucket)(batch) == width:
                pieces, _ = step_inputs(job_setup, micro_split, [batch])
                return pieces[:1], loss_terms(pieces[0]["labels"], job_setup.job.task)
    raise ValueError(f"no micro-batch of {'shape' if shape_of else 'width'} {width} in the job's plan")


def step_inputs(job_setup: JobSetup, micro_split: int, batches: list[list[int]]) -> StepInputs:
    """Planned ``batches`` (example indices) collated and split into micro-batches, with their loss terms."""
    train_set, collator = job_setup.train_set, job_setup.collator
    group = [collator([train_set[i] for i in batch]) for batch in batches]
    pieces = [piece for planned in group for piece in split_batch(planned, micro_split)]
    return pieces, sum(loss_terms(piece["labels"], job_setup.job.task) for piece in pieces)
