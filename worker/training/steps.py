"""How one optimizer step runs, without waiting for the device.

A step is two bodies: ``forward_backward`` for each micro-batch (its loss, weighted per example and
divided by the number of real examples in the whole step, accumulated into the gradients and into
a device-side loss sum) and ``update`` (clip, AdamW, zero the gradients, write the step's loss,
gradient norm and skip flag into a small device tensor). Neither reads a value back to the host:
a step with a non-finite loss or gradient is skipped by the fused AdamW kernel itself, which leaves
weights, moments and step count untouched when its ``found_inf`` tensor is 1 (the mechanism
``torch.amp.GradScaler`` uses with fused optimizers; ``torch/optim/adam.py``, ``_fused_adam``).
``StepValues`` copies the per-step values to the host in bulk, about once a second.

``Steps`` runs the bodies eagerly (the CPU, and CUDA where a job cannot use graphs);
``worker.training.capture.CapturedSteps`` captures the same bodies as CUDA graphs and replays them.

bf16 on CUDA (and on the CPU when asked for) trains a bf16 copy of the model with fp32 master
weights in the optimizer, as PyTorch FSDP's ``MixedPrecision(param_dtype=torch.bfloat16)`` and
DeepSpeed's bf16 optimizer do, instead of ``torch.autocast`` casting every weight in every
forward. After each micro-batch its bf16 gradients are added into fp32 master gradients (one
multi-tensor add, then the bf16 gradients are zeroed), so accumulation over micro-batches
(``gradient_accumulation_steps``, out-of-memory splits, filler-free pieces) sums in fp32, as
mixed-precision training with fp32 master weights prescribes (Micikevicius et al., "Mixed
Precision Training", ICLR 2018, sec. 3.1; DeepSpeed's bf16 optimizer accumulates in fp32 too);
one multi-tensor copy of the updated weights back to bf16 per optimizer step. The recipe's ``model``
stays the fp32 master model (checkpoints, evaluation and the artifact use it); its
``forward_model`` is the bf16 copy.

Each task's loss is a seam of its own: ``example_losses`` (per-example loss of a micro-batch's
logits) and ``loss_terms`` (what a step's loss is divided by); the step bodies call only these.
"""

import copy
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import get_linear_schedule_with_warmup

from worker.training.packing import PackingCollator, packed_logits, packed_of, position_offset

StepInputs = tuple[list[dict[str, torch.Tensor]], int]  # a step's padded micro-batches and its loss terms


def make_optimizer(model: torch.nn.Module, hp, device: torch.device, capturable: bool = False) -> torch.optim.AdamW:
    """AdamW over trainable parameters, no weight decay on biases and LayerNorm weights (BERT recipe),
    with the fused kernel (CUDA and CPU; several times faster than the default for-each kernel on
    the CPU, ``docs/benchmarks.md``; ``Steps`` needs it to skip non-finite steps). ``capturable``:
    for CUDA graphs, with the learning rate as a device tensor that the scheduler fills in place."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if capturable:
        return torch.optim.AdamW(groups, lr=torch.tensor(hp.learning_rate, device=device), fused=True, capturable=True)
    return torch.optim.AdamW(groups, lr=hp.learning_rate, fused=device.type in ("cuda", "cpu"))


def make_scheduler(optimizer: torch.optim.Optimizer, hp, total_steps: int):
    """Linear warmup over ``warmup_ratio`` of the steps, then linear decay to 0."""
    return get_linear_schedule_with_warmup(optimizer, math.ceil(hp.warmup_ratio * total_steps), total_steps)


def next_learning_rate(scheduler: torch.optim.lr_scheduler.LambdaLR) -> float:
    """The learning rate of the next optimizer step under ``scheduler`` (``make_scheduler``'s),
    computed on the host: the optimizer's own may be a device tensor (capturable AdamW)."""
    return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](scheduler.last_epoch)


def example_losses(
    logits: torch.Tensor, labels: torch.Tensor, task: str, pos_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-example loss ``[n]`` in fp32: cross-entropy (logits ``[n, classes]``, labels ``[n]`` int64),
    squared error (logits ``[n, 1]``, labels ``[n]`` float); for multi_label, binary cross-entropy
    on the sigmoid of each logit averaged over the labels (logits and multi-hot labels ``[n, labels]``;
    the mean over a batch is ``torch.nn.BCEWithLogitsLoss``, as the Trainer's
    ``problem_type="multi_label_classification"`` computes it); token_classification: the
    cross-entropy summed over each example's labelled tokens (logits ``[n, width, tags]``, labels
    ``[n, width]`` int64, -100 where there is no label); reranking: binary cross-entropy of one logit
    per (query, passage) pair (logits ``[n, 1]``, labels ``[n]`` in [0, 1]), the positive term
    weighted by ``pos_weight`` (a 0-d tensor; ``torch.nn.BCEWithLogitsLoss``'s, as
    sentence-transformers' ``BinaryCrossEntropyLoss(pos_weight=...)``)."""
    if task == "token_classification":
        return F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none").sum(-1)
    if task == "regression":
        return F.mse_loss(logits.float().squeeze(-1), labels.float(), reduction="none")
    if task == "multi_label":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none").mean(-1)
    if task == "reranking":
        return F.binary_cross_entropy_with_logits(
            logits.float().squeeze(-1), labels.float(), pos_weight=pos_weight, reduction="none"
        )
    return F.cross_entropy(logits.float(), labels, reduction="none")


def loss_terms(labels: torch.Tensor, task: str) -> int:
    """How many terms a batch's summed loss (``example_losses``) has, on the host: its examples, or
    for token_classification its labelled tokens (labels not -100). A step's loss is its sum over
    the terms of all its micro-batches, so token_classification trains on the mean over labelled
    tokens across the accumulated micro-batches, as the Hugging Face Trainer does when it counts
    ``num_items_in_batch``."""
    if task == "token_classification":
        return int((labels != -100).sum())
    return len(labels)


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of ``model`` (same modules, same ``requires_grad``) for mixed precision with
    fp32 master weights."""
    return copy.deepcopy(model).to(torch.bfloat16)


def uses_bf16_copy(dtype: torch.dtype | None) -> bool:
    """Whether training in ``dtype`` trains a bf16 copy of the model: bf16 does; fp16
    keeps ``torch.autocast`` and the GradScaler (fp16 activations overflow without autocast's fp32 ops)."""
    return dtype == torch.bfloat16


class Steps:
    """Runs a job's optimizer steps eagerly, with no host synchronisation.

    ``model``: the fp32 (master) weights the optimizer updates; ``forward_model``: what computes
    (the model, its ``torch.compile`` wrapper, or its bf16 copy, ``uses_bf16_copy(dtype)``);
    ``dtype``: the compute dtype (None: fp32); ``task``: the job's, which picks the loss
    (``example_losses``; reranking's weighs its positive pairs by ``pos_weight``). With ``packing``
    each micro-batch runs laid out without padding (``worker.training.packing``), as the
    DataLoader collated it (``collator``). With ``static_grads``
    every gradient tensor is allocated once and zeroed in place (CUDA graphs need fixed addresses;
    so does the bf16 copy); otherwise gradients are freed after each step, as
    ``zero_grad(set_to_none=True)`` does (less memory traffic on the CPU).

    Raises:
        ValueError: the optimizer is not fused (only fused AdamW honours ``found_inf``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        forward_model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        *,
        dtype: torch.dtype | None,
        device: torch.device,
        task: str,
        static_grads: bool = False,
        packing: bool = False,
        pos_weight: float | None = None,
    ):
        if not optimizer.defaults.get("fused"):
            raise ValueError("the training step needs a fused AdamW: it skips non-finite steps through found_inf")
        self.model, self.forward_model, self.optimizer, self.scaler = model, forward_model, optimizer, scaler
        self.device, self.task = device, task
        self.pos_weight = None if pos_weight is None else torch.tensor(pos_weight, device=device)
        self.packing, self.position_offset = packing, position_offset(model) if packing else 0
        self.compute_model = forward_model if uses_bf16_copy(dtype) else None
        self.autocast = dtype if self.compute_model is None else None  # bf16 copies need no autocast
        self.static_grads = static_grads or self.compute_model is not None
        self.master = [p for p in model.parameters() if p.requires_grad]
        self.compute = (
            [p for p in self.compute_model.parameters() if p.requires_grad]
            if self.compute_model is not None
            else self.master
        )
        self.n_examples = torch.ones((), device=device)  # real examples in the whole optimizer step
        self.step_loss = torch.zeros((), device=device)  # sum over its micro-batches
        self.found_inf = torch.zeros((), device=device)  # 1.0: skip this step's update
        self.clip = torch.ones((), device=device)  # the fused AdamW divides each gradient by it (``update``)
        self.values = torch.zeros(3, device=device)  # LOSS, GRAD_NORM, SKIPPED of the last step
        self.first_micro_batch = True  # of the step: its bf16 gradients are copied into the master ones
        optimizer.found_inf, optimizer.grad_scale = self.found_inf, self.clip  # read by the fused AdamW every step
        if self.static_grads:
            for p in {*self.master, *self.compute}:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.master_grads = [p.grad for p in self.master]  # fp32
            self.compute_grads = [p.grad for p in self.compute]  # the bf16 copy's (the masters' without one)

    def step(self, pieces: list[dict[str, torch.Tensor]], n_examples: int) -> tuple[torch.Tensor, int]:
        """One optimizer step over ``pieces`` (padded micro-batches on the host, with ``labels``).

        Returns:
            (``[loss, grad_norm, skipped]`` on the device, a copy the caller may keep; tokens
            computed beyond the pieces' padded ones: filler rows of CUDA graphs, or minus the
            padding that packing dropped).
        """
        self.n_examples.fill_(n_examples)
        filler_tokens = sum(self.micro_step(piece) for piece in pieces)
        self.finish_step()
        return self.values.clone(), filler_tokens

    def collator(self, padded: Callable[[list[dict]], dict]) -> Callable[[list[dict]], dict]:
        """What the DataLoader collates the job's micro-batches with: its ``padded`` collator, or
        with ``packing`` that collator with each micro-batch's packed layout built beside
        (``packing.PackingCollator``), off the training thread."""
        if not self.packing:
            return padded
        return PackingCollator(padded, self.position_offset, token_labels=self.task == "token_classification")

    def micro_step(self, batch: dict[str, torch.Tensor]) -> int:
        """Forward and backward of one padded micro-batch (``[rows, width]`` inputs and ``labels``,
        on the host, pinned on CUDA); with ``packing`` it runs packed, on the layout its collator
        built (``collator``) or, for a micro-batch collated without it, one laid out now. Returns
        the tokens it computed beyond its padded ones: none, or minus its padding when packed."""
        computed = 0
        if self.packing:
            padded = batch["input_ids"].numel()
            batch = packed_of(batch, self.position_offset, token_labels=self.task == "token_classification")
            computed = batch["input_ids"].numel() - padded
            if self.device.type == "cuda":  # a copy from pageable memory would wait for the GPU
                batch = {k: v.pin_memory() if torch.is_tensor(v) and not v.is_pinned() else v for k, v in batch.items()}
        batch = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        labels = batch.pop("labels")
        self.forward_backward(batch, labels, None)
        return computed

    def finish_step(self) -> None:
        """The optimizer step after the micro-batches (``update``)."""
        self.update()

    def forward_backward(
        self, inputs: dict[str, torch.Tensor], labels: torch.Tensor, weights: torch.Tensor | None
    ) -> None:
        """Forward and backward of one micro-batch: its loss (per-example losses times ``weights``,
        0 for filler rows, summed) divided by the real examples of the whole step, accumulated
        into the gradients and ``step_loss``."""
        losses = self.forward_losses(inputs, labels)
        if weights is not None:
            losses = losses * weights
        loss = losses.sum() / self.n_examples
        self.scaler.scale(loss).backward()
        self.step_loss += loss.detach()
        if self.compute_model is not None:
            self.accumulate_master_grads()

    def forward_losses(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        """The forward of one micro-batch and its per-example losses ``[rows]`` in fp32
        (``example_losses`` of the model's logits, under autocast where the job uses it). The seam
        for a task whose loss is not one of logits: a subclass overrides this, the loop and the
        update stay as they are. embedding: the model computes its own loss (``worker.embedding.Objective``)."""
        autocast = self.autocast
        with torch.autocast(self.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            if self.task == "embedding":
                return self.forward_model(**inputs, labels=labels).losses
            if "cu_seq_lens_q" in inputs:  # packed (``pack``)
                logits = packed_logits(self.forward_model, inputs, self.task)
            else:
                logits = self.forward_model(**inputs).logits
        return example_losses(logits, labels, self.task, self.pos_weight)

    # Whether the step's first micro-batch copies its bf16 gradients into the master gradients
    # (then never zeroed) instead of adding them to zeroed ones: 26 fewer bytes per parameter in a
    # step of one micro-batch (``bench.optimizer``). A captured graph replays one body for every
    # micro-batch of a step, so ``CapturedSteps`` adds.
    copy_first_grads = True

    @torch.no_grad()
    def accumulate_master_grads(self) -> None:
        """Add the bf16 gradients of one micro-batch into the fp32 master gradients (copy them, for
        the step's first, ``copy_first_grads``) and zero them: the sum over a step's micro-batches
        is then rounded to bf16 once per micro-batch, never accumulated in bf16."""
        if self.first_micro_batch and self.copy_first_grads:
            torch._foreach_copy_(self.master_grads, self.compute_grads)
        else:
            torch._foreach_add_(self.master_grads, self.compute_grads)
        self.first_micro_batch = False
        torch._foreach_zero_(self.compute_grads)

    @torch.no_grad()
    def update(self) -> None:
        """Clip the gradient norm to 1.0 and step AdamW unless the loss or the gradient is not
        finite; zero the gradients (``zero_grad``: a bf16 copy's that ``accumulate_master_grads``
        left to zero); write the step's values.

        The clip is the fused kernel's: it divides each gradient by ``clip`` (its ``grad_scale``,
        the input GradScaler uses to unscale) as it reads it, ``max(1, norm + 1e-6)``, which is
        ``clip_grad_norm_``'s factor without its multiply pass over the gradients."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(self.optimizer)
        # as clip_grad_norm_: a parameter the loss never reached (an embedding model's pooler) has no gradient
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.master if p.grad is not None])
        torch.clamp(grad_norm + 1e-6, min=1.0, out=self.clip)
        self.found_inf.copy_(~(torch.isfinite(self.step_loss) & torch.isfinite(grad_norm)))
        self.optimizer.step()
        if self.scaler.is_enabled():
            self.scaler.update()  # lowers the scale after an overflow, as GradScaler.step + update would
        if self.compute_model is not None:
            torch._foreach_copy_(self.compute, self.master)
        if self.compute_model is None or not self.copy_first_grads:
            self.zero_grad()  # a bf16 copy's gradients were zeroed as they were accumulated
        self.first_micro_batch = True
        self.values.copy_(torch.stack([self.step_loss, grad_norm.float(), self.found_inf]))
        self.step_loss.zero_()

    def zero_grad(self) -> None:
        """Zero the gradients the backward accumulates into, and the fp32 master gradients of a bf16
        copy unless the next step's first micro-batch overwrites them (``copy_first_grads``) (in
        place when static, else freed)."""
        self.first_micro_batch = True
        if self.static_grads:
            torch._foreach_zero_(self.compute_grads)
            if self.compute_model is not None and not self.copy_first_grads:
                torch._foreach_zero_(self.master_grads)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def discard_step(self) -> None:
        """Forget a step that failed part-way (out of memory): gradients and loss sum back to zero."""
        self.zero_grad()
        self.step_loss.zero_()


class StepValues:
    """Per-step values (``[loss, grad_norm, skipped]``) kept on the device and copied to the host in
    bulk, with each step's host-side record (step number, learning rate, token counts).

    ``add`` writes a step's values into a device buffer; ``poll`` starts a non-blocking copy of the
    buffer to (pinned) host memory every ``every_seconds`` (or when the buffer is full) and returns
    the steps of a copy that has landed; ``poll(wait=True)`` copies everything and waits.
    On the CPU a copy lands at once, so with ``every_seconds=0`` every step is returned at once.
    """

    def __init__(self, device: torch.device, every_seconds: float, capacity: int = 1024):
        self.device, self.every_seconds, self.capacity = device, every_seconds, capacity
        self.values = torch.zeros(capacity, 3, device=device)
        self.host = torch.zeros(capacity, 3, pin_memory=device.type == "cuda")
        self.records: list = []  # host records of the steps in ``values[:len(records)]``
        self.in_flight: list = []  # records of the steps being copied into ``host``
        self.event = torch.cuda.Event() if device.type == "cuda" else None
        self.last_copy = time.monotonic()

    def add(self, values: torch.Tensor, record) -> None:
        """Keep a step's ``[3]`` device values (copied, no sync) with its host ``record``."""
        self.values[len(self.records)].copy_(values)
        self.records.append(record)

    def poll(self, wait: bool = False) -> list[tuple[object, list[float]]]:
        """Steps whose values reached the host since the last poll, oldest first, as
        ``(record, [loss, grad_norm, skipped])``."""
        landed = []
        due = time.monotonic() - self.last_copy >= self.every_seconds or len(self.records) >= self.capacity
        if self.records and (wait or due):
            if self.in_flight:
                landed += self._take()  # the previous copy still owns the host buffer
            self._start_copy()
        if self.in_flight and (wait or self.event is None or self.event.query()):
            landed += self._take()
        return landed

    def _start_copy(self) -> None:
        n = len(self.records)
        self.host[:n].copy_(self.values[:n], non_blocking=True)  # ordered after the steps that wrote them
        if self.event is not None:
            self.event.record()
        self.in_flight, self.records, self.last_copy = self.records, [], time.monotonic()

    def _take(self) -> list[tuple[object, list[float]]]:
        if self.event is not None:
            self.event.synchronize()
        rows = self.host[: len(self.in_flight)].tolist()
        landed, self.in_flight = list(zip(self.in_flight, rows)), []
        return landed


def eager_forward_model(
    model: torch.nn.Module, forward_model: torch.nn.Module, dtype: torch.dtype, compile_model: bool
) -> torch.nn.Module:
    """What eager steps compute with: under bf16 (``uses_bf16_copy``) a bf16 copy of ``model``
    (``torch.compile``d with ``compile_model``), unless ``forward_model`` is one already; else
    ``forward_model`` as it is."""
    if uses_bf16_copy(dtype) and next(forward_model.parameters()).dtype != torch.bfloat16:
        compute = bf16_copy(model)
        return torch.compile(compute) if compile_model else compute
    return forward_model
