"""The training recipe for one job, top to bottom: setup, warm_up, train, finish.

``Recipe`` follows torchtune's single-device recipe: one class whose methods are the phases, the
only code that assigns the parts that train; what never changes during a run is the frozen
``JobSetup``. Each phase is timed once (``worker.reporter.PhaseTimer``): ``setup`` times ``tokenize``
and ``load``, ``@timed`` marks ``warm_up``, ``train``, ``run_evaluation`` and the saves.

Techniques and their sources:
- smart and token-budget batching: ``shared.data.batching`` (seed notebooks 002 and 003); dynamic
  padding per micro-batch up to a bucket width: ``worker.data``;
- the step without host synchronisation, bf16 with fp32 master weights: ``worker.training.steps``;
  as CUDA graphs: ``worker.training.capture`` (PyTorch docs, "CUDA Graphs");
- mixed precision with ``torch.autocast`` and a GradScaler for fp16, gradient accumulation,
  gradient checkpointing, frozen embeddings, DataLoader workers and pinned memory: seed notebooks
  000 and 001, PyTorch AMP docs;
- AdamW (fused kernel) with linear warmup and decay: ``transformers.get_linear_schedule_with_warmup``;
- best model and early stopping as in the Hugging Face Trainer (``metric_for_best_model``,
  ``EarlyStoppingCallback``).
"""

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from shared.schemas.hyperparameters import GREATER_IS_BETTER
from shared.store.rows import Job
from worker import embedding
from worker.data import BatchStats, JobData
from worker.device import describe
from worker.latency import record_latency
from worker.reporter import PhaseTimer, Reporter, timed
from worker.training import batches, export, metrics
from worker.training.capture import CapturedSteps
from worker.training.graphs import capture_steps, clear_cache, eager_reason
from worker.training.packing import batch_bucket, bucket_counts, padded_reason
from worker.training.parity import CHECK_STEPS
from worker.training.progress import StepRecord, StepTimer, log_steps, notify, read_every_seconds, should_stop_early
from worker.training.setup import prepare_job, setup_model
from worker.training.state import TrainState, load_training_state, record_checkpoint, training_state, write_checkpoint
from worker.training.steps import (
    Steps,
    StepValues,
    eager_forward_model,
    loss_terms,
    make_optimizer,
    make_scheduler,
    next_learning_rate,
)

log = logging.getLogger(__name__)


def fine_tune(
    job: Job,
    data: JobData,
    device: torch.device,
    reporter: Reporter,
    checkpoint: Path | None = None,
    timer: PhaseTimer | None = None,
) -> str:
    """Run one job to its end (``Recipe``: setup, warm_up, train, finish), resuming from
    ``checkpoint`` if given. ``timer`` times the phases and reports them as the job's ``timings``
    (default: a new one reporting to ``reporter``; the worker passes its own, which has already timed
    ``load_job_data``). Returns ``"succeeded"``, or why it stopped early (``Reporter.should_stop``).

    Raises:
        shared.errors.UserError: bad data, an unknown model, out of memory at micro-batch 1, or
            ``max_nonfinite_steps`` non-finite steps in a row (the job fails without retry).
    """
    recipe = Recipe(job, device, timer or PhaseTimer(reporter))
    recipe.setup(data, reporter, checkpoint)
    embedding.score_zero_shot(recipe.job_setup, recipe.model, recipe.state.step, recipe.timer, reporter)
    recipe.warm_up(reporter)
    outcome = recipe.train(reporter)
    if outcome != "completed":
        if outcome != "lease_lost":
            reporter.flush()  # the job's last steps and progress, before it ends or is re-queued
        return outcome
    model_dir = recipe.finish(reporter)
    record_latency(job, data, model_dir, device, reporter, recipe.state.step, recipe.state.epoch)  # a sweep's
    return "succeeded"


class Recipe:
    """One job's training run: ``setup`` builds the parts, ``warm_up`` decides how optimizer steps
    run (eagerly or on CUDA graphs), ``train`` runs them, ``finish`` saves the model. The parts,
    which only this class assigns: ``model`` (the fp32 master weights that checkpoints, evaluation
    and the artifact use), ``forward_model`` (what computes: the model, its ``torch.compile``
    wrapper or its bf16 copy), ``optimizer``, ``scheduler``, ``scaler``, ``steps`` and ``state``.

    ``job`` needs ``id``, ``task``, ``base_model``, ``label_names``, ``spec`` (and ``created_at``
    for the total time); it may be transient, not in the store (the benchmark's). ``timer``
    (default: a new, silent one) times the run's phases.
    """

    def __init__(self, job: Job, device: torch.device, timer: PhaseTimer | None = None):
        self.job, self.device, self.timer = job, device, timer or PhaseTimer()
        self.steps: Steps | None = None  # set by ``warm_up``

    # ------------------------------------------------------------------------- setup

    def setup(self, data: JobData, reporter: Reporter, checkpoint: Path | None = None) -> "Recipe":
        """Tokenize the data (``self.job_setup``), build the model, optimizer and schedule; restore
        ``checkpoint`` if given. Returns the recipe.

        Raises:
            UserError: bad data, an unknown model (``model_load_failed``).
        """
        js = self.job_setup = prepare_job(self.job, data, self.device, reporter, self.timer)
        with self.timer.phase("load"):
            self.model = setup_model(js, self.job, self.device, checkpoint)
            self.optimizer = make_optimizer(self.model, js.hp, js.device)
            self.scheduler = make_scheduler(self.optimizer, js.hp, js.total_steps)
            self.scaler = torch.amp.GradScaler(js.device.type, enabled=js.dtype == torch.float16)
            self.forward_model = torch.compile(self.model) if js.hp.torch_compile else self.model
            self.state = TrainState()
            if checkpoint:
                self.state = load_training_state(checkpoint, self.optimizer, self.scheduler, self.scaler)
                reporter.event("resumed", f"resumed from the checkpoint at step {self.state.step}")
        reporter.progress(total_steps=js.total_steps, device=describe(js.device), step=self.state.step)
        reporter.flush()
        return self

    # ------------------------------------------------------------------------- warm_up

    @timed("warmup")
    def warm_up(self, reporter: Reporter | None = None) -> None:
        """Prepare how the job's optimizer steps run (``self.steps``), before the first one, so
        that no shape is first seen mid-epoch. ``train`` needs it to have run.

        On CUDA: turn off the cuDNN attention backend, which plans every new shape (the
        memory-efficient SDPA kernel plans nothing), then capture the step as CUDA graphs
        (``capture``). Where the job cannot be captured (``eager_reason``), or capture or its check
        against eager steps fails (a mismatch, an exception, out of memory), it trains eagerly, an
        event (``cuda_graphs_off``) says why, and the worker does not try graphs for that shape
        again. Elsewhere (the CPU) the steps run eagerly, with the same bodies. ``reporter``, if
        given, gets the events.
        """
        if self.device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(False)
        js, hp = self.job_setup, self.job_setup.hp
        packing = hp.packing and padded_reason(self.model, hp.torch_compile, hp.gradient_checkpointing) is None
        reason = eager_reason(js, packing)
        if reason is None:
            rows = batches.micro_batch_size(hp, self.state.micro_split)
            shapes = (
                bucket_counts(js.plan, rows, hp.max_length, hp.epochs)
                if packing
                else js.plan.width_counts(js.collator.ladder, hp.epochs)
            )
            try:
                notify(reporter, "cuda_graphs", self.capture(rows, list(shapes), packing))
                return
            except Exception as e:  # capture or its check failed: train this job eagerly, with the same bodies
                log.exception("job %s: CUDA graphs not used; training eagerly", self.job.id)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                why = f"{type(e).__name__}: {str(e)[:400]}"
                notify(reporter, "cuda_graphs_off", f"training eagerly: CUDA graphs not used ({why})", "warning")
        elif self.device.type == "cuda":
            notify(reporter, "cuda_graphs_off", f"training eagerly: {reason}", "info")
        self.forward_model = eager_forward_model(self.model, self.forward_model, js.dtype, hp.torch_compile)
        self.steps = self._setup_eager_steps(reporter)

    def capture(self, rows: int, widths: list[int], packing: bool = False) -> str:
        """Train on CUDA graphs for micro-batches of ``rows`` rows at these bucket ``widths`` (with
        ``packing``: packed, at these token buckets) (``graphs.capture_steps``: captured now or by an
        earlier job, checked against eager steps): every part but the scaler becomes the captured
        one. Returns a sentence for the job's events.

        Raises:
            Exception: what capture or its check raised; the parts are as they were.
        """
        js = self.job_setup
        shape_of = partial(batch_bucket, js.plan.lengths, rows=rows, max_length=js.hp.max_length) if packing else None
        parts, message = capture_steps(
            js,
            self.model,
            self.forward_model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            rows,
            widths,
            lambda: batches.first_steps(js, self.state, CHECK_STEPS),
            lambda width: batches.width_sample(js, self.state.micro_split, width, shape_of),
            packing,
        )
        self.model, self.forward_model, self.steps = parts.model, parts.forward_model, parts.steps
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        return message

    def _setup_eager_steps(self, reporter: Reporter | None = None) -> Steps:
        """Eager steps over the current parts (``worker.training.steps``). A job with ``packing``
        trains on packed micro-batches unless ``packing.padded_reason`` says why not; an event
        (``packing``) says which."""
        js, hp = self.job_setup, self.job_setup.hp
        reason = padded_reason(self.model, hp.torch_compile, hp.gradient_checkpointing) if hp.packing else None
        if hp.packing and reason is None:
            notify(
                reporter, "packing", "packed micro-batches: no padding, attention per example (variable-length kernel)"
            )
        elif hp.packing:
            notify(reporter, "packing", f"padded micro-batches: {reason}", "warning")
        return Steps(
            self.model,
            self.forward_model,
            self.optimizer,
            self.scaler,
            dtype=js.dtype,
            device=js.device,
            task=js.job.task,
            packing=hp.packing and reason is None,
            pos_weight=js.pos_weight,
        )

    # ------------------------------------------------------------------------- train

    @timed("train")
    def train(self, reporter: Reporter) -> str:
        """The training loop. One optimizer step per ``gradient_accumulation_steps`` micro-batches;
        evaluation and checkpoints every ``eval_every_steps``/``save_every_steps`` (default: at the
        end of each epoch); ``reporter.should_stop()`` is asked after every step.

        No step waits for the device: each step's loss, gradient norm and skip flag stay on it and
        are read back in bulk (on CUDA about once a second; on the CPU, where reading costs
        nothing, after every step), and always before an evaluation, a checkpoint or a stop. Every
        step's metrics are logged then; ``max_nonfinite_steps`` is checked then too.

        Returns ``"completed"`` (also after early stopping), ``"pruned"`` (``Reporter.should_prune``)
        or why it stopped (``Reporter.should_stop``); on ``"shutdown"`` it saves a checkpoint first.

        Raises:
            RuntimeError: ``warm_up`` has not run. UserError: ``out_of_memory``, ``nonfinite_loss``.
        """
        if self.steps is None:
            raise RuntimeError("warm_up has not run: it decides how the optimizer steps run")
        js, st = self.job_setup, self.state
        hp, plan = js.hp, js.plan
        timer = StepTimer(st.step)
        values = StepValues(js.device, read_every_seconds(js.device))
        self.model.train()
        self.forward_model.train()
        while st.step < js.total_steps:
            for group in batches.step_groups(js, st, self.steps.collator(js.collator)):
                lr = next_learning_rate(self.scheduler)
                step_values, stats = self._train_step_with_backoff(reporter, group)
                st.add(len(group), stats)
                epoch = st.epoch + st.batch_in_epoch / max(1, len(plan.batches))
                values.add(step_values, StepRecord(st.step, epoch, lr, stats))
                if st.step >= js.total_steps:
                    log_steps(js, st, reporter, values.poll(wait=True), timer)
                    return "completed"
                log_steps(js, st, reporter, values.poll(), timer)
                end_of_epoch = st.batch_in_epoch == len(plan.batches)
                evaluate_now = js.val_set is not None and st.due(hp.eval_every_steps, end_of_epoch)
                stop = reporter.should_stop()
                checkpoint_due = st.due(hp.save_every_steps, end_of_epoch) if stop is None else stop == "shutdown"
                if evaluate_now or checkpoint_due or stop:  # these need every step's values: wait for them
                    log_steps(js, st, reporter, values.poll(wait=True), timer)
                if evaluate_now:
                    if self.run_evaluation(reporter):
                        self.save_best()
                    if should_stop_early(hp, st, reporter):
                        return "completed"
                    if reporter.should_prune(st.step, st.last_eval):  # a sweep's trial (shared.jobs.sweeps)
                        return "pruned"
                    self.model.train()
                    timer.restart()
                if checkpoint_due and st.nonfinite_run == 0:  # on shutdown: the next worker resumes from here
                    self.save_checkpoint(reporter)
                    timer.restart()
                if stop:
                    return stop
            st.epoch, st.batch_in_epoch = st.epoch + 1, 0
        return "completed"

    def _train_step_with_backoff(self, reporter: Reporter, group: list[dict]) -> tuple[torch.Tensor, BatchStats]:
        """``train_step``, retried after an out-of-memory error with each micro-batch cut in half
        (twice the accumulation: the step's gradient stays the same); a job on CUDA graphs drops
        them, and the worker's cached graphs, and trains on eagerly.

        Raises:
            UserError: ``out_of_memory`` when a micro-batch of one example does not fit.
        """
        st, hp = self.state, self.job_setup.hp
        while True:
            try:
                return self.train_step(group)
            except torch.OutOfMemoryError as e:
                self.steps.discard_step()
                if isinstance(self.steps, CapturedSteps):
                    clear_cache()
                    self.steps = self._setup_eager_steps(reporter)
                    reporter.event(
                        "cuda_graphs_off", "out of memory: dropped the CUDA graphs, training eagerly", level="warning"
                    )
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                st.micro_split = batches.halved_split(hp, st, max(len(b["labels"]) for b in group), reporter, e)

    def train_step(self, group: list[dict]) -> tuple[torch.Tensor, BatchStats]:
        """Forward and backward over the micro-batches of one optimizer step, then clip and step
        (``self.steps``), then the schedule. Each micro-batch's summed loss is divided by the loss
        terms of the whole step (``loss_terms``), so the gradient equals that of one batch of all of
        them; a step whose loss or gradient is not finite is skipped by the fused AdamW.

        Returns:
            (``[loss, grad_norm, skipped]`` as a device tensor, not yet read; token counts of the
            step, filler rows of CUDA graphs included in ``padded``).
        """
        js = self.job_setup
        n_examples = sum(loss_terms(b["labels"], js.job.task) for b in group)
        stats = batches.group_stats(group, padded_to_longest=js.hp.batching != "fixed", columns=js.text_columns)
        pieces = [piece for planned in group for piece in batches.split_batch(planned, self.state.micro_split)]
        values, filler_tokens = self.steps.step(pieces, n_examples)
        self.scheduler.step()
        return values, BatchStats(stats.real, stats.unrounded, stats.padded + filler_tokens)

    # ------------------------------------------------------------------------- evaluate

    def evaluate(self, reporter: Reporter | None = None) -> dict[str, float]:
        """The validation metrics of the fp32 master model (``worker.training.metrics.evaluate``)."""
        return metrics.evaluate(self.model, self.job_setup, reporter)

    @timed("evaluate")
    def run_evaluation(self, reporter: Reporter) -> bool:
        """Evaluate, log, and note the best evaluation so far (``state.best``). Returns whether this
        one is the new best; saving its weights is the caller's (``save_best``, or ``finish``)."""
        st, name = self.state, self.job_setup.hp.metric_for_best_model
        scores = self.evaluate(reporter)
        reporter.log(
            st.step, st.epoch, {f"eval_{k}": v for k, v in scores.items() if isinstance(v, float) and math.isfinite(v)}
        )  # not f1_per_label, per_entity
        reporter.progress(validation_metrics=scores)
        return st.record_evaluation(scores, name, GREATER_IS_BETTER[name])

    # ------------------------------------------------------------------------- save

    @timed("save")
    def save_best(self) -> None:
        """Write the model as the best so far, to ``<checkpoints>/best`` (weights and config).
        Unless a later evaluation is better, these are the weights the artifact gets: ``save_model``
        links them instead of saving them again."""
        export.save_weights(self.model, self.job_setup.out_dir / "best")

    @timed("save")
    def save_checkpoint(self, reporter: Reporter) -> None:
        """Save a checkpoint (``state.write_checkpoint``: a complete model directory and the
        training state; at a step whose evaluation was the best so far, ``save_best``'s weights are
        hard-linked), then publish and record it, keeping the newest ``save_total_limit``."""
        js, st = self.job_setup, self.state
        path = js.out_dir / f"step-{st.step:08d}"
        best_now = st.best and st.best["step"] == st.step  # save_best has just written these weights
        state = training_state(st, self.optimizer, self.scheduler, self.scaler)
        write_checkpoint(path, self.model, js.tokenizer, state, js.out_dir / "best" if best_now else None)
        record_checkpoint(reporter, st.step, path, st.last_eval, js.hp.save_total_limit)  # into the bucket, if any

    def finish(self, reporter: Reporter) -> Path:
        """From the last optimizer step to the saved model (returns its directory): the final
        evaluation, unless training ended with one at this very step (early stopping), then
        ``save_model``. Meanwhile a thread writes and hashes the final weights
        (``export.save_final_weights``; its time counts as ``evaluate``, waiting for it as ``save``).
        They are the artifact's when that evaluation is the best so far or there is no best (no
        validation, or only non-finite metrics); otherwise the artifact gets ``<checkpoints>/best``.

        Raises:
            OSError: the model cannot be written.
        """
        js, st = self.job_setup, self.state
        evaluate_now = js.val_set is not None and st.last_eval_step != st.step
        with ThreadPoolExecutor(1, thread_name_prefix="final-weights") as pool:
            final = (
                pool.submit(export.save_final_weights, self.model, js.out_dir / "final")
                if evaluate_now or st.best is None
                else None
            )
            if evaluate_now:
                self.run_evaluation(reporter)
            with self.timer.phase("save"):
                final_entries = final.result() if final else None
        reporter.flush()  # every metric row in the store: save_model draws the training curves from them
        if final_entries is not None and (st.best is None or st.best["step"] == st.step):
            model_dir = self.save_model(reporter, js.out_dir / "final", final_entries)
        else:
            model_dir = self.save_model(reporter, js.out_dir / "best")
        reporter.flush()  # the save phase's timings: the job's end keeps what the store has
        return model_dir

    @timed("save")
    def save_model(self, reporter: Reporter, weights: Path, hashed: dict[str, dict] | None = None) -> Path:
        """The job's model directory from the weights in ``weights`` (``export.save_model``), with
        the phase timings so far and the training curves of ``reporter``'s metric rows."""
        timings = partial(export.timings_so_far, self.timer, self.job.created_at)  # as of each call
        return export.save_model(self.job_setup, self.state, weights, timings, reporter.metric_rows(), hashed)
