"""The training engine without the service: exact resume, out-of-memory backoff, non-finite steps,
best model and early stopping. Runs ``worker.training.recipe.Recipe`` on a tiny BERT with a recording reporter."""

import json
import random
from collections import Counter

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from shared.errors import UserError
from shared.schemas.jobs import JobCreate
from shared.store.rows import Job
from tests.conftest import TINY_MODEL, RecordingReporter, no_dropout
from worker.data import JobData, TokenizedDataset
from worker.training import batches
from worker.training.recipe import Recipe

WORDS = ["alpha", "beta", "gamma", "delta", "market", "goal", "team", "profit"]


def make_job(job_id: str, **hyperparameters) -> tuple[Job, JobData]:
    rng = random.Random(0)
    rows = [{"text": " ".join(rng.choices(WORDS, k=rng.randint(2, 40))), "label": ["a", "b"][i % 2]} for i in range(40)]
    df = pd.DataFrame(rows)
    spec = JobCreate(
        base_model=TINY_MODEL,
        training_dataset="ds_x",
        validation_split=0.2,
        hyperparameters={"epochs": 3, "batch_size": 8, "max_length": 64, "learning_rate": 1e-3, **hyperparameters},
    )
    job = Job(
        id=job_id,
        task="classification",
        base_model=TINY_MODEL,
        label_names=["a", "b"],
        spec=spec.model_dump(mode="json"),
    )
    return job, JobData(df.iloc[:32], df.iloc[32:])


class NaNLogits(torch.nn.Module):
    """Returns NaN logits on the forward calls in ``bad_calls`` (counted from 1)."""

    def __init__(self, model, bad_calls):
        super().__init__()
        self.model, self.bad_calls, self.calls = model, bad_calls, 0

    def forward(self, **batch):
        self.calls += 1
        out = self.model(**batch)
        if self.calls in self.bad_calls:
            out.logits = out.logits * float("nan")
        return out


class OutOfMemoryAbove(torch.nn.Module):
    """Raises CUDA's out-of-memory error for micro-batches larger than ``rows``."""

    def __init__(self, model, rows):
        super().__init__()
        self.model, self.rows = model, rows

    def forward(self, **batch):
        if batch["input_ids"].shape[0] > self.rows:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return self.model(**batch)


def test_resume_gives_the_same_losses_and_each_example_once_per_epoch(engine_env, monkeypatch):
    seen: list[int] = []
    original_getitem = TokenizedDataset.__getitem__

    def recording_getitem(self, i):
        if self.is_training:
            seen.append(i)
        return original_getitem(self, i)

    monkeypatch.setattr(TokenizedDataset, "__getitem__", recording_getitem)
    cpu = torch.device("cpu")

    job, data = make_job("uninterrupted", save_every_steps=100)
    whole = RecordingReporter()
    run = Recipe(job, cpu).setup(data, whole)
    run.job_setup.train_set.is_training, run.job_setup.val_set.is_training = True, False
    run.warm_up(whole)
    assert run.train(whole) == "completed"
    total = run.job_setup.total_steps
    batches_per_epoch = [len(run.job_setup.plan.epoch_batches(e)) for e in range(3)]

    seen.clear()
    job, data = make_job("resumed", save_every_steps=100)
    first = RecordingReporter(stop_after_step=5)  # a SIGTERM after step 5: checkpoint, then stop
    run = Recipe(job, cpu).setup(data, first)
    run.job_setup.train_set.is_training, run.job_setup.val_set.is_training = True, False
    run.warm_up(first)
    assert run.train(first) == "shutdown"
    [(step, path)] = first.checkpoints
    assert step == 5

    second = RecordingReporter()
    run = Recipe(job, cpu).setup(data, second, path)
    run.job_setup.train_set.is_training, run.job_setup.val_set.is_training = True, False
    assert "resumed" in second.events
    run.warm_up(second)
    assert run.train(second) == "completed"

    expected, before, after = whole.series("train_loss"), first.series("train_loss"), second.series("train_loss")
    assert sorted(before) == list(range(1, 6)) and sorted(after) == list(range(6, total + 1))
    for step in range(6, total + 1):
        assert after[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    # The stopped-and-resumed run saw every training example exactly once per epoch.
    n = len(run.job_setup.train_set)
    assert len(seen) == 3 * n
    epochs = [seen[:n], seen[n : 2 * n], seen[2 * n :]]
    assert all(Counter(e) == Counter(range(n)) for e in epochs)
    assert sum(batches_per_epoch) == total  # one optimizer step per micro-batch here


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_step(engine_env):
    cpu = torch.device("cpu")
    job, data = make_job("reference", epochs=1)
    reference = RecordingReporter()
    run = Recipe(job, cpu).setup(data, reference)
    no_dropout(run.model)
    run.warm_up(reference)
    run.train(reference)
    reference_weights = {k: v.clone() for k, v in run.model.state_dict().items()}

    job, data = make_job("oom", epochs=1)
    reporter = RecordingReporter()
    run = Recipe(job, cpu).setup(data, reporter)
    no_dropout(run.model)
    run.forward_model = OutOfMemoryAbove(run.model, rows=2)
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    assert reporter.events.count("out_of_memory") == 2  # 8 -> 4 -> 2
    assert run.state.micro_split == 4 and batches.micro_batch_size(run.job_setup.hp, run.state.micro_split) == 2
    assert run.state.step == run.job_setup.total_steps
    losses, reference_losses = reporter.series("train_loss"), reference.series("train_loss")
    assert losses.keys() == reference_losses.keys()
    for step, loss in losses.items():
        assert loss == pytest.approx(reference_losses[step], rel=1e-4), step
    for name, tensor in run.model.state_dict().items():
        torch.testing.assert_close(tensor, reference_weights[name], rtol=1e-4, atol=1e-5)

    job, data = make_job("oom-at-one", epochs=1)
    run = Recipe(job, cpu).setup(data, RecordingReporter())
    run.forward_model = OutOfMemoryAbove(run.model, rows=0)
    with pytest.raises(UserError) as error:
        run.warm_up()
        run.train(RecordingReporter())
    assert error.value.code == "out_of_memory"


def test_nonfinite_steps_are_skipped_counted_and_fail_after_a_run(engine_env):
    cpu = torch.device("cpu")
    job, data = make_job("nan-once", epochs=1, save_every_steps=1, max_nonfinite_steps=3)
    reporter = RecordingReporter()
    run = Recipe(job, cpu).setup(data, reporter)
    run.forward_model = NaNLogits(run.model, bad_calls={2})
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    assert run.state.skipped_steps == 1
    assert reporter.series("skipped_steps")[run.job_setup.total_steps] == 1
    assert 2 not in {step for step, _ in reporter.checkpoints}  # no checkpoint of a bad step
    assert all(torch.isfinite(p).all() for p in run.model.parameters())

    job, data = make_job("nan-run", epochs=3, save_every_steps=1, max_nonfinite_steps=3)
    reporter = RecordingReporter()
    run = Recipe(job, cpu).setup(data, reporter)
    run.forward_model = NaNLogits(run.model, bad_calls=set(range(3, 100)))
    with pytest.raises(UserError) as error:
        run.warm_up(reporter)
        run.train(reporter)
    assert error.value.code == "nonfinite_loss"
    assert [step for step, _ in reporter.checkpoints] == [1, 2]  # the last good checkpoint is kept
    assert run.state.step == 5 and run.state.skipped_steps == 3


def test_early_stopping_and_the_artifact_is_the_best_model(engine_env, monkeypatch):
    scripted = iter([1.0, 0.5, 0.7, 0.8, 0.9, 0.95])  # best at the 2nd evaluation, then worse
    evaluated_at = []

    def scripted_evaluate(run, reporter=None):
        evaluated_at.append(run.state.step)
        return {"loss": next(scripted), "accuracy": 0.5, "f1_macro": 0.5}

    monkeypatch.setattr(Recipe, "evaluate", scripted_evaluate)
    job, data = make_job("early", epochs=10, eval_every_steps=2, early_stopping_patience=2)
    reporter = RecordingReporter()
    run = Recipe(job, torch.device("cpu")).setup(data, reporter)
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    assert "early_stopping" in reporter.events
    assert run.state.step == 8 < run.job_setup.total_steps  # evaluations at steps 2, 4, 6, 8
    assert run.state.best["step"] == 4 and run.state.best["value"] == 0.5

    best_weights = load_file(run.job_setup.out_dir / "best" / "model.safetensors")
    model_dir = run.finish(reporter)
    assert evaluated_at == [2, 4, 6, 8]  # step 8 was just evaluated: no second, final evaluation of it
    assert not (run.job_setup.out_dir / "final").exists()  # nor final weights that the artifact does not use
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["best_step"] == 4 and metrics["final_step"] == 8 and metrics["best_value"] == 0.5
    saved = load_file(model_dir / "model.safetensors")
    assert saved.keys() == best_weights.keys()
    assert all(torch.equal(saved[k], best_weights[k]) for k in saved)
    final = run.model.state_dict()
    assert any(not torch.equal(saved[k], final[k]) for k in saved)  # not the last weights
