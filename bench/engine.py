"""The engine runner: whole epochs of one configuration through the worker's own recipe
(``worker.training.recipe.Recipe``: ``setup``, ``warm_up`` then ``train``, as a job runs them), with a
transient ``Job`` and a reporter that needs no job store.

A configuration is a batching strategy with optional hyperparameters, ``<batching>[:<name>=<value>...]``:
``smart``, ``fixed``, ``smart:pad_to_multiple_of=8``, ``token_budget:max_tokens_per_batch=866``.
Values are read as JSON where they parse (``8``, ``true``), else as strings.
"""

import json
import uuid

import pandas as pd
import torch

from bench.measure import (
    HELD_OUT,
    Clock,
    Mark,
    epoch_figures,
    flops_per_real_token,
    steady_from,
)

BATCHINGS = ("fixed", "dynamic", "smart", "token_budget")


def engine_hyperparameters(config: str) -> dict:
    """The hyperparameters a configuration name sets.

    Raises:
        ValueError: not ``<batching>[:<name>=<value>...]`` with a known batching strategy.
    """
    batching, *pairs = config.split(":")
    if batching not in BATCHINGS:
        raise ValueError(f"{config!r}: an engine configuration starts with one of {', '.join(BATCHINGS)}")
    hp = {"batching": batching}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{config!r}: expected <name>=<value> after ':', got {pair!r}")
        try:
            hp[name] = json.loads(value)
        except ValueError:
            hp[name] = value
    return hp


def make_job(config: str, spec, labels: list[str], task: str = "classification", text_pair_column: str | None = None):
    """A transient ``Job`` (never stored) of ``task`` for ``config``: ``spec``'s epochs, batch size,
    max_length, precision, learning rate and seed; no evaluation and no checkpoint inside the timed
    epochs. ``text_pair_column``: the column of second texts, for a corpus of pairs.

    Raises:
        pydantic.ValidationError: a hyperparameter the schema rejects (name or value).
    """
    from shared.schemas.hyperparameters import Hyperparameters
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job

    never = 10**12
    hp = Hyperparameters(
        epochs=spec.epochs,
        learning_rate=spec.learning_rate,
        batch_size=spec.batch_size,
        max_length=spec.max_length,
        precision=spec.precision,
        seed=spec.seed,
        eval_every_steps=never,
        save_every_steps=never,
        save_total_limit=1,
        **engine_hyperparameters(config),
    )
    body = JobCreate(
        base_model=spec.model,
        task=task,
        training_dataset="bench",
        hyperparameters=hp,
        text_pair_column=text_pair_column,
    )
    return Job(
        id=f"bench-{uuid.uuid4().hex[:12]}",
        task=task,
        base_model=spec.model,
        label_names=labels,
        spec=body.model_dump(mode="json"),
    )


class BenchReporter:
    """The engine's reporter without a job store (the methods ``worker.reporter.Reporter`` offers the
    recipe): events are kept, metrics dropped, the run never stopped. ``should_stop``, which the
    recipe asks after every optimizer step but the last, marks the end of each epoch and the start
    of a one-epoch run's steady-state window; it reads the host-side counts of ``run.state`` and
    synchronizes the device only at those steps."""

    def __init__(self, clock: Clock, epochs: int):
        self.clock, self.epochs = clock, epochs
        self.run = None  # set once setup has built it
        self.epoch_ends: list[Mark] = []
        self.steady_start: Mark | None = None
        self.events: list[dict] = []

    def mark(self) -> Mark:
        st = self.run.state
        return self.clock.mark(st.step, st.real_tokens, st.unrounded_tokens, st.padded_tokens)

    def should_stop(self) -> str | None:
        st = self.run.state if self.run is not None else None
        if st is None or st.step == 0:
            return None
        batches = len(self.run.job_setup.plan.batches)
        if st.batch_in_epoch == batches and len(self.epoch_ends) == st.epoch:
            self.epoch_ends.append(self.mark())
        elif self.epochs == 1 and self.steady_start is None and st.batch_in_epoch >= steady_from(batches):
            self.steady_start = self.mark()
        return None

    def interrupted(self) -> str | None:
        return None

    def event(self, code: str, message: str, level: str = "info") -> None:
        self.events.append({"code": code, "message": message, "level": level})

    def log(self, step: int, epoch: float, values: dict) -> None:
        pass

    def progress(self, **fields) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def checkpoint(self, step: int, path, metrics: dict | None, keep: int) -> list:
        return []


def run_engine(
    config: str,
    spec,
    train: pd.DataFrame,
    val: pd.DataFrame | None,
    labels: list[str],
    device: torch.device,
    task: str = "classification",
) -> dict:
    """One job of ``task`` and ``config`` on ``train`` (and, with ``val``, the held-out figures of
    ``bench.measure.HELD_OUT`` after training; multi_label at the default threshold, 0.5).

    Load (tokenize, build model and optimizer) is timed apart from the epochs; the first epoch's
    time runs from the end of ``setup`` and so holds any warm-up or capture the recipe does.

    Raises:
        RuntimeError: the run did not complete its epochs.
    """
    from worker.data import JobData
    from worker.training.recipe import Recipe

    clock = Clock(device)
    reporter = BenchReporter(clock, spec.epochs)
    job = make_job(config, spec, labels, task, "text_pair" if "text_pair" in train else None)
    began = clock.now()
    run = Recipe(job, device)
    reporter.run = run.setup(JobData(train, val), reporter)
    loaded = clock.now()
    run.warm_up(reporter)
    warmed = clock.now()
    outcome = run.train(reporter)
    if outcome != "completed":
        raise RuntimeError(f"the engine stopped with {outcome!r} before its last epoch")
    reporter.epoch_ends.append(reporter.mark())
    figures = epoch_figures(loaded, reporter.epoch_ends, reporter.steady_start)
    row = {
        "kind": "engine",
        "load_seconds": loaded - began,
        "warmup_seconds": warmed - loaded,
        "train_seconds": sum(figures["epoch_seconds"]),
        **figures,
        **flops_per_real_token(run.model, run.job_setup.train_set.lengths),
        "events": reporter.events,
    }
    if val is not None:
        metrics = run.evaluate()
        row.update({name: metrics[name] for name in HELD_OUT[task]})
    return row
