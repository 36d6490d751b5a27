"""The training step without host synchronisation (``worker.training.steps``) and as CUDA graphs
(``worker.training.capture``), driven on the CPU: per-step values read back in bulk, non-finite steps
skipped by the fused AdamW, cancel on a timer, filler rows, and the captured path with its static
inputs, warm-ups and per-worker cache (on the CPU "capture" keeps the body and "replay" calls it,
so everything but the CUDA capture and replay calls runs here)."""

import copy
import math
import threading
import time

import numpy as np
import pytest
import torch

from bench.engine_gpu_check import state_of
from shared.errors import UserError
from tests.conftest import RecordingReporter, no_dropout
from tests.test_engine import NaNLogits, OutOfMemoryAbove, make_job
from worker.reporter import Reporter
from worker.training import batches, graphs, recipe
from worker.training import capture as capturing
from worker.training.parity import TOLERANCES, Parity
from worker.training.recipe import Recipe
from worker.training.steps import Steps, StepValues, example_losses, make_optimizer

CPU = torch.device("cpu")
LADDER = [16, 32, 48, 64]  # a bucket ladder for max_length 64, as a CUDA worker would use


@pytest.fixture(autouse=True)
def empty_graph_cache():
    graphs.clear_cache()
    graphs._failed.clear()
    yield
    graphs.clear_cache()
    graphs._failed.clear()


def make_run(name: str, reporter=None, label_names=("a", "b"), **hyperparameters):
    torch.manual_seed(0)
    job, data = make_job(name, **hyperparameters)
    if list(label_names) != job.label_names:  # the same examples under other label names
        rename = dict(zip(job.label_names, label_names))
        data.train["label"], data.validation["label"] = (
            data.train["label"].map(rename),
            data.validation["label"].map(rename),
        )
        job.label_names = list(label_names)
    run = Recipe(job, CPU).setup(data, reporter or RecordingReporter())
    no_dropout(run.model)
    return run


def capture(run, rows: int | None = None) -> str:
    """What ``warm_up`` does on a CUDA worker: bucket widths, then the captured steps."""
    run.job_setup.collator.ladder = LADDER
    widths = list(run.job_setup.plan.width_counts(LADDER, run.job_setup.hp.epochs))
    return run.capture(rows or run.job_setup.hp.batch_size, widths)


def read_rarely(monkeypatch, seconds: float = 3600.0) -> None:
    """Per-step values stay on the device until a read is forced (as on CUDA between reads)."""
    monkeypatch.setattr(recipe, "read_every_seconds", lambda device: seconds)


# ----------------------------------------------------------------------------- values read in bulk


def test_step_values_are_copied_in_bulk_in_order():
    values = StepValues(CPU, every_seconds=3600.0, capacity=4)
    for step in range(1, 4):
        values.add(torch.tensor([step, 10.0 * step, 0.0]), step)
        assert values.poll() == []  # not due, buffer not full: nothing read
    values.add(torch.tensor([4.0, 40.0, 1.0]), 4)
    full = values.poll()  # the buffer is full: copied and, on the CPU, landed at once
    assert [record for record, _ in full] == [1, 2, 3, 4]
    assert [row for _, row in full] == [[s, 10.0 * s, 0.0] for s in (1, 2, 3)] + [[4.0, 40.0, 1.0]]
    values.add(torch.tensor([5.0, 50.0, 0.0]), 5)
    assert values.poll() == []
    assert values.poll(wait=True) == [(5, [5.0, 50.0, 0.0])]
    assert values.poll(wait=True) == []

    every_step = StepValues(CPU, every_seconds=0.0)
    every_step.add(torch.tensor([1.0, 2.0, 0.0]), "a")
    assert every_step.poll() == [("a", [1.0, 2.0, 0.0])]


def test_metrics_of_every_step_arrive_when_read_in_bulk(engine_env, monkeypatch):
    every = RecordingReporter()
    run = make_run("every", every, epochs=2, save_every_steps=10**6)
    run.warm_up(every)
    assert run.train(every) == "completed"

    read_rarely(monkeypatch)
    bulk = RecordingReporter()
    run = make_run("bulk", bulk, epochs=2, save_every_steps=10**6)
    run.warm_up(bulk)
    assert run.train(bulk) == "completed"
    logged = [step for step, _, values in bulk.logged if "train_loss" in values]
    assert logged == list(range(1, run.job_setup.total_steps + 1))  # every step logged once, in order
    for name in ("train_loss", "grad_norm", "learning_rate", "padding_efficiency", "skipped_steps"):
        assert bulk.series(name) == pytest.approx(every.series(name), rel=1e-6), name
    assert all(v > 0 for v in bulk.series("tokens_per_second").values())
    assert run.state.train_seconds > 0 and bulk.fields["step"] == run.job_setup.total_steps
    # Reads were rare: the values of the first epoch reached the host at its end (the evaluation
    # forces a read), not step by step.
    epoch_of = {step: epoch for step, epoch, _ in bulk.logged}
    assert epoch_of[1] < 1


def test_nonfinite_steps_are_skipped_without_a_sync_and_fail_the_job_at_the_next_read(engine_env, monkeypatch):
    read_rarely(monkeypatch)
    run = make_run("nan-step", epochs=1)
    run.forward_model = NaNLogits(run.model, bad_calls={2})
    run.warm_up()
    groups = batches.step_groups(run.job_setup, run.state)
    values, _ = run.train_step(next(groups))
    assert values.tolist()[2] == 0.0
    before = state_of(run)
    values, _ = run.train_step(next(groups))
    loss, grad_norm, skipped = values.tolist()
    assert math.isnan(loss) and skipped == 1.0
    after = state_of(run)  # the fused AdamW skipped it: weights, moments and step count unchanged
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    run = make_run("nan-once", reporter := RecordingReporter(), epochs=1, save_every_steps=10**6, max_nonfinite_steps=3)
    run.forward_model = NaNLogits(run.model, bad_calls={2})
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    assert run.state.skipped_steps == 1 and run.state.nonfinite_run == 0
    assert reporter.series("skipped_steps")[1] == 0 and reporter.series("skipped_steps")[2] == 1
    assert math.isnan(reporter.series("train_loss")[2])
    assert all(torch.isfinite(p).all() for p in run.model.parameters())

    reporter = RecordingReporter()
    run = make_run("nan-run", reporter, epochs=3, save_every_steps=10**6, eval_every_steps=10**6, max_nonfinite_steps=3)
    run.forward_model = NaNLogits(run.model, bad_calls=set(range(3, 1000)))
    with pytest.raises(UserError) as error:
        run.warm_up(reporter)
        run.train(reporter)
    assert error.value.code == "nonfinite_loss" and "up to step 5" in error.value.message
    assert run.state.step >= 5 and run.state.nonfinite_run == 3  # seen at the read after step 5
    assert sorted(reporter.series("train_loss")) == [1, 2, 3, 4, 5]


def test_cancel_is_read_on_a_timer_and_stops_within_two_seconds(engine_env, monkeypatch):
    from worker import reporter as reporting

    requested = threading.Event()
    queries, flushed = [], []
    monkeypatch.setattr(
        reporting.lifecycle, "cancel_requested", lambda job_id: queries.append(time.monotonic()) or requested.is_set()
    )
    monkeypatch.setattr(
        reporting.lifecycle,
        "record_progress",
        lambda job_id, worker, progress, metrics: flushed.extend(metrics) or True,
    )
    monkeypatch.setattr(reporting.lifecycle, "add_event", lambda *args, **kwargs: None)
    read_rarely(monkeypatch, 0.5)
    reporter = Reporter("cancel", "worker-1")
    run = make_run(
        "cancel", reporter, epochs=1000, batch_size=4, max_length=32, eval_every_steps=10**6, save_every_steps=10**6
    )
    run.warm_up()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # short steps even when other processes have the cores
    timer = threading.Timer(1.5, requested.set)
    started = time.monotonic()
    timer.start()
    try:
        outcome = run.train(reporter)
    finally:
        timer.cancel()
        torch.set_num_threads(threads)
    stopped = time.monotonic()
    assert outcome == "cancelled"
    asked = started + 1.5
    assert stopped - asked < 2.0, stopped - asked
    assert (
        len(queries) >= 2
        and all(
            b - a >= Reporter.CANCEL_CHECK_SECONDS  # on a timer, not every step
            for a, b in zip(queries, queries[1:])
        )
    )
    reporter.flush()
    logged_steps = sorted({step for step, _, name, _, _ in flushed if name == "train_loss"})
    assert logged_steps == list(range(1, run.state.step + 1))  # the metrics of every step arrived


# ----------------------------------------------------------------------------- filler rows


def test_filler_rows_give_the_loss_and_gradient_of_the_short_batch(engine_env):
    run = make_run("filler", epochs=1)
    run.warm_up()
    run.model.train()
    batch = run.job_setup.collator([run.job_setup.train_set[i] for i in range(5)])
    steps = run.steps

    def loss_and_grads(inputs, labels, weights):
        steps.discard_step()
        steps.n_examples.fill_(5)
        steps.forward_backward(inputs, labels, weights)
        grads = [p.grad.clone() for p in steps.master]
        loss = steps.step_loss.item()
        steps.discard_step()
        return loss, grads

    labels = batch["labels"]
    short = loss_and_grads({k: v for k, v in batch.items() if k != "labels"}, labels, None)
    filled = capturing.with_filler_rows(batch, 8, pad_id=run.job_setup.tokenizer.pad_token_id)
    assert filled["input_ids"].shape == (8, batch["input_ids"].shape[1])
    assert filled["weights"].tolist() == [1.0] * 5 + [0.0] * 3
    assert filled["attention_mask"][5:].sum(dim=1).tolist() == [1, 1, 1]  # one visible token each
    assert (filled["input_ids"][5:] == run.job_setup.tokenizer.pad_token_id).all()
    inputs = {k: v for k, v in filled.items() if k not in ("labels", "weights")}
    padded = loss_and_grads(inputs, filled["labels"], filled["weights"])
    assert padded[0] == pytest.approx(short[0], rel=1e-6)
    for a, b in zip(padded[1], short[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="does not fit"):
        capturing.with_filler_rows(batch, 4, pad_id=0)


def test_the_update_clips_in_the_fused_kernel_as_clip_grad_norm_does(engine_env):
    """fp32: the steps' update (the clip factor handed to the fused AdamW as its ``grad_scale``)
    gives the losses and weights of ``clip_grad_norm_`` then the fused AdamW, the update before
    issue 40, over steps whose gradient norm is clipped."""
    run = make_run("clip-in-kernel", epochs=1, batch_size=8)
    run.warm_up()
    with torch.no_grad():
        run.model.classifier.weight.mul_(100.0)  # confident logits: gradient norms above 1
    reference = copy.deepcopy(run.model)
    optimizer = make_optimizer(reference, run.job_setup.hp, CPU)
    for group in run.optimizer.param_groups:  # no schedule (its warm-up starts at 0): the same rate on both
        group["lr"] = run.job_setup.hp.learning_rate
    run.model.train()
    reference.train()
    losses, norms, reference_losses = [], [], []
    for pieces, n in batches.first_steps(run.job_setup, run.state, 5):
        values, _ = run.steps.step(pieces, n)
        losses.append(values[0].item())
        norms.append(values[1].item())
        loss = (
            sum(
                example_losses(
                    reference(**{k: v for k, v in p.items() if k != "labels"}).logits, p["labels"], "classification"
                ).sum()
                for p in pieces
            )
            / n
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reference_losses.append(loss.item())
    assert len(losses) == 5 and max(norms) > 1.0  # steps that clip
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    for (name, p), q in zip(run.model.named_parameters(), reference.parameters()):
        if not name.endswith("key.bias"):  # its gradient is 0 in theory: AdamW turns rounding noise into steps
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------- the captured path


def test_captured_steps_train_exactly_like_eager_steps(engine_env):
    eager = RecordingReporter()
    run = make_run("eager", eager, epochs=2, batch_size=8)
    run.job_setup.collator.ladder = LADDER  # the same widths on both sides; the captured side adds filler rows
    run.warm_up(eager)
    assert run.train(eager) == "completed"
    assert type(run.steps) is Steps
    eager_weights = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    eager_state = run.state

    captured = RecordingReporter()
    run = make_run("captured", captured, epochs=2, batch_size=8)
    message = capture(run)
    assert isinstance(run.steps, capturing.CapturedSteps) and "captured widths" in message
    assert "first steps: 3 step(s)" in message  # checked, and the checks left no trace: same losses below
    assert set(run.steps.replays) == set(run.job_setup.plan.width_counts(LADDER, 2))
    assert all(f"width {width}: 1 step(s)" in message for width in run.steps.replays)  # each width checked
    assert all(p.grad is not None for p in run.model.parameters() if p.requires_grad)  # static gradients
    lr = run.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and run.optimizer.defaults["capturable"]
    assert run.train(captured) == "completed"
    assert run.optimizer.param_groups[0]["lr"] is lr  # the scheduler filled it in place
    assert captured.series("train_loss") == pytest.approx(eager.series("train_loss"), rel=1e-5)
    assert captured.series("learning_rate") == pytest.approx(eager.series("learning_rate"))
    assert run.state.real_tokens == eager_state.real_tokens
    assert run.state.padded_tokens > eager_state.padded_tokens  # the filler rows of short micro-batches count
    for name, p in run.model.named_parameters():
        torch.testing.assert_close(p.detach(), eager_weights[name], rtol=1e-4, atol=1e-6)


def test_capture_warm_ups_move_no_state(engine_env):
    run = make_run("warm", epochs=1)
    run.warm_up()  # eager first: a few steps give AdamW real moments to preserve
    reporter = RecordingReporter(stop_after_step=3)
    run.train(reporter)
    before, rng = state_of(run), torch.get_rng_state()
    run.steps = None
    capture(run)
    after = state_of(run)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.count_nonzero(p.grad) == 0 for p in run.steps.compute)
    assert run.steps.step_loss.item() == 0.0


def test_a_later_job_reuses_the_captured_model_with_its_own_weights_and_a_fresh_optimizer(engine_env):
    first = make_run("first", epochs=1)
    capture(first)
    first.train(RecordingReporter())
    model, optimizer = first.model, first.optimizer

    reference = RecordingReporter()
    alone = make_run("second-alone", reference, epochs=1, learning_rate=2e-3)
    alone.job_setup.collator.ladder = LADDER
    initial = {n: p.detach().clone() for n, p in alone.model.named_parameters()}
    alone.warm_up(reference)
    alone.train(reference)

    reporter = RecordingReporter()
    second = make_run("second", reporter, label_names=("no", "yes"), epochs=1, learning_rate=2e-3)
    message = capture(second)
    assert "reused" in message and "captured widths none" in message
    assert second.model is model and second.optimizer is optimizer  # the captured tensors, not copies
    assert second.model.config.id2label == {0: "no", 1: "yes"}  # this job's labels in its artifact
    for name, p in second.model.named_parameters():
        assert torch.equal(p, initial[name]), name  # this job's initial weights, copied in place
    assert all(
        float(s["step"]) == 0 and torch.count_nonzero(s["exp_avg"]) == 0 for s in second.optimizer.state.values()
    )
    assert second.train(reporter) == "completed"
    assert reporter.series("train_loss") == pytest.approx(reference.series("train_loss"), rel=1e-5)
    assert reporter.series("learning_rate") == pytest.approx(reference.series("learning_rate"))

    other = make_run("other-shape", epochs=1, batch_size=4)
    assert "reused" not in capture(other)  # another micro-batch size: a new capture, the old one evicted
    assert other.model is not model and len(graphs._cache) == 1


def test_resume_with_captured_steps_gives_the_same_losses(engine_env):
    whole = RecordingReporter()
    run = make_run("whole", whole, epochs=2, save_every_steps=100)
    capture(run)
    run.train(whole)

    graphs.clear_cache()
    first = RecordingReporter(stop_after_step=4)
    run = make_run("stopped", first, epochs=2, save_every_steps=100)
    capture(run)
    assert run.train(first) == "shutdown"
    [(step, path)] = first.checkpoints
    state = torch.load(path / "training_state.pt", weights_only=True)
    assert all(isinstance(g["lr"], float) and not g["capturable"] for g in state["optimizer"]["param_groups"])

    second = RecordingReporter()
    job, data = make_job("stopped", epochs=2, save_every_steps=100)
    run = Recipe(job, CPU).setup(data, second, path)
    no_dropout(run.model)
    capture(run)  # reuses the cached graphs: the checkpoint's weights and AdamW state are copied in
    assert run.train(second) == "completed"
    expected = whole.series("train_loss")
    for s, loss in second.series("train_loss").items():
        assert loss == pytest.approx(expected[s], rel=1e-5, abs=1e-6), s


def test_out_of_memory_with_captured_steps_drops_the_graphs_and_backs_off_eagerly(engine_env):
    reference = RecordingReporter()
    run = make_run("reference", reference, epochs=1)
    run.job_setup.collator.ladder = LADDER
    run.forward_model = OutOfMemoryAbove(run.model, rows=2)
    run.warm_up(reference)
    run.train(reference)

    reporter = RecordingReporter()
    run = make_run("oom", reporter, epochs=1)
    run.forward_model = OutOfMemoryAbove(run.model, rows=10**6)
    capture(run)
    run.forward_model.rows = 2  # out of memory from the first step on, as a too large batch would be
    assert run.train(reporter) == "completed"
    assert reporter.events.count("cuda_graphs_off") == 1 and reporter.events.count("out_of_memory") == 2
    assert type(run.steps) is Steps and not graphs._cache  # the graphs and their memory are gone
    assert run.state.micro_split == 4
    assert reporter.series("train_loss") == pytest.approx(reference.series("train_loss"), rel=1e-5)


def test_a_failed_capture_falls_back_to_eager_steps_and_says_so(engine_env, monkeypatch):
    def broken(*args):
        raise RuntimeError("injected: operation not permitted when stream is capturing")

    monkeypatch.setattr(recipe, "eager_reason", lambda *args: None)
    monkeypatch.setattr(recipe, "capture_steps", broken)
    reporter = RecordingReporter()
    run = make_run("fallback", reporter, epochs=1)
    run.warm_up(reporter)
    assert type(run.steps) is Steps and "cuda_graphs_off" in reporter.events
    assert run.train(reporter) == "completed"
    assert all(math.isfinite(v) for v in reporter.series("train_loss").values())


def test_jobs_that_cannot_be_captured_say_why(engine_env, monkeypatch):
    from types import SimpleNamespace

    from shared.data.batching import BatchPlan
    from shared.schemas.hyperparameters import Hyperparameters
    from shared.settings import get_settings

    def reason(length=40, packing=False, **hp):
        dtype = torch.float16 if hp.pop("fp16", False) else None
        job = SimpleNamespace(task=hp.pop("task", "classification"))
        hp = Hyperparameters(**hp)
        plan = BatchPlan(np.full(96, length), hp.batch_size, hp.batching, hp.seed, hp.max_tokens_per_batch)
        job_setup = SimpleNamespace(
            device=torch.device("cuda", 0),
            hp=hp,
            dtype=dtype,
            job=job,
            plan=plan,
            collator=SimpleNamespace(ladder=[64, 128, 256, 512]),
        )
        return graphs.eager_reason(job_setup, packing)

    assert reason() is None
    assert "fp16" in reason(fp16=True)
    assert "gradient_checkpointing" in reason(gradient_checkpointing=True)
    assert "torch_compile" in reason(torch_compile=True)
    assert "token_budget" in reason(batching="token_budget")
    assert "token_classification" in reason(task="token_classification")
    assert graphs.eager_reason(SimpleNamespace(device=CPU)) == "cpu trains eagerly"
    # micro-batches of many padded tokens keep the GPU busy: eager (TUNEJOB_CUDA_GRAPHS_MAX_TOKENS, 8,192)
    assert reason(length=100, batch_size=32) is None  # 32 rows x width 128 = 4,096
    assert "8,192 padded tokens on average" in reason(length=200, batch_size=32)  # 32 x 256
    assert reason(length=200, batch_size=32, packing=True) is None  # packed jobs are captured whatever their size
    assert "padded tokens" in reason(length=40, batch_size=128)  # 128 x 64
    monkeypatch.setattr(get_settings(), "cuda_graphs_max_tokens", 16384)
    assert reason(length=200, batch_size=32) is None


@pytest.mark.parametrize("fault", ["update_not_replayed", "loss_of_other_inputs"])
def test_a_capture_that_does_not_match_the_eager_step_trains_eagerly_and_is_not_tried_again(
    engine_env, monkeypatch, fault
):
    """A replayed step that differs from the eager step (here an update graph that does nothing, or
    a forward that sees other inputs) is not used: the job trains eagerly from its initial state,
    exactly like a job that never tried graphs, an event says why, and a later job of the same
    shape does not capture again."""
    reference = RecordingReporter()
    run = make_run("reference", reference, epochs=1)
    run.job_setup.collator.ladder = LADDER
    run.warm_up(reference)
    run.train(reference)

    captured = []
    original = capturing.CapturedSteps._capture

    def faulty_capture(self, body, warm_up):
        replay = original(self, body, warm_up)
        captured.append(body)
        if fault == "update_not_replayed" and body == self.update:
            return lambda: None
        if fault == "loss_of_other_inputs" and body != self.update:
            return lambda: (replay(), self.step_loss.add_(0.5))
        return replay

    monkeypatch.setattr(capturing.CapturedSteps, "_capture", faulty_capture)
    monkeypatch.setattr(recipe, "eager_reason", lambda *args: None)
    reporter = RecordingReporter()
    run = make_run("mismatch", reporter, epochs=1)
    run.job_setup.collator.ladder = LADDER
    run.warm_up(reporter)
    assert type(run.steps) is Steps and reporter.events[-1] == "cuda_graphs_off"
    assert "does not match the eager step" in reporter.messages[-1]
    assert (
        "updated weights differ by 1 of the update" if fault == "update_not_replayed" else "step 1: loss "
    ) in reporter.messages[-1]
    assert run.train(reporter) == "completed"
    assert reporter.series("train_loss") == pytest.approx(reference.series("train_loss"), rel=1e-5)

    captures = len(captured)
    later = RecordingReporter()
    run = make_run("later", later, epochs=1)
    run.job_setup.collator.ladder = LADDER
    run.warm_up(later)
    assert len(captured) == captures and type(run.steps) is Steps  # not captured again in this worker
    assert later.events[-1] == "cuda_graphs_off" and "failed earlier in this worker" in later.messages[-1]


def test_parity_tolerances_are_tight_in_fp32_and_bf16_aware():
    def parity(dtype, loss=(1.0, 1.0), norm=(2.0, 2.0), update=0.0):
        return Parity([loss], [norm], update, TOLERANCES[dtype])

    assert parity(torch.float32).failures() == []
    assert parity(torch.float32, loss=(1.001, 1.0)).failures()[0].startswith("step 1: loss")  # 1e-3: not fp32 rounding
    assert parity(torch.bfloat16, loss=(1.001, 1.0)).failures() == []  # within bf16 rounding
    assert parity(torch.bfloat16, loss=(1.1, 1.0)).failures()[0].startswith("step 1: loss")
    assert parity(torch.float32, norm=(2.0, float("nan"))).failures()[0].startswith("step 1: grad_norm")
    assert parity(torch.float32, update=0.05).failures()[0].startswith("updated weights")
    assert (
        Parity([(1.0, 1.0)] * 3, [(2.0, 2.0), (2.0, 2.0), (3.0, 2.0)], 0.0, TOLERANCES[torch.float32])
        .failures()[0]
        .startswith("step 3: grad_norm")
    )
    assert (
        Parity([(1.0, 1.0)], [(2.0, 2.0)], 0.0, TOLERANCES[torch.float32], fresh_dropout=False)
        .failures()[0]
        .startswith("two replays")
    )
    assert parity(torch.bfloat16, update=0.05).failures() == []
    assert parity(torch.bfloat16, update=1.0).failures()[0].startswith("updated weights")
