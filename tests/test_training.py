"""The training recipe (``worker.training.recipe.Recipe``) driven directly, without the job store or a broker: a
transient ``Job``, DataFrames, and a reporter that only records what it is told."""

import math
import random

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from shared.inference.precision import compute_dtype
from shared.schemas.jobs import JobCreate
from shared.store.rows import Job
from tests.conftest import TINY_MODEL, RecordingReporter, no_dropout
from worker.data import BatchStats, JobData
from worker.training.metrics import loss_sum_of
from worker.training.recipe import Recipe

CPU = torch.device("cpu")
WORDS = {
    "sports": ["match", "goal", "team", "coach", "league"],
    "business": ["shares", "market", "profit", "bank", "sales"],
}


def texts_frame(rows: int, seed: int = 0) -> pd.DataFrame:
    """Two word-list classes, 3-30 words each, plus a numeric ``score`` (the share of sports words)."""
    rng = random.Random(seed)
    data = []
    for i in range(rows):
        label = ["sports", "business"][i % 2]
        words = rng.choices(WORDS[label], k=rng.randint(3, 30))
        noise = rng.choices(WORDS["business" if label == "sports" else "sports"], k=rng.randint(0, 10))
        sports = sum(w in WORDS["sports"] for w in words + noise)
        data.append({"text": " ".join(words + noise), "label": label, "score": sports / len(words + noise)})
    return pd.DataFrame(data)


def make_job(task: str = "classification", **hyperparameters) -> Job:
    hp = {"epochs": 1, "batch_size": 8, "max_length": 48, "learning_rate": 1e-3, "precision": "fp32", **hyperparameters}
    spec = JobCreate(
        base_model=TINY_MODEL,
        task=task,
        training_dataset="ds_test",
        text_column="text",
        label_column="label" if task == "classification" else "score",
        hyperparameters=hp,
    )
    return Job(
        id="t",
        task=task,
        base_model=TINY_MODEL,
        spec=spec.model_dump(mode="json"),
        label_names=["business", "sports"] if task == "classification" else None,
    )


def make_run(job: Job, train_rows: int = 40, validation_rows: int = 0, reporter=None):
    train_df = texts_frame(train_rows, seed=1)
    val_df = texts_frame(validation_rows, seed=2) if validation_rows else None
    return Recipe(job, CPU).setup(JobData(train_df, val_df), reporter or RecordingReporter())


def capture_gradients(run) -> list[list[torch.Tensor]]:
    """Record the (clipped) gradients of the trainable parameters each time the optimizer steps."""
    captured = []
    trainable = [p for p in run.model.parameters() if p.requires_grad]

    def before_step(optimizer, args, kwargs):
        captured.append([p.grad.detach().clone() for p in trainable])

    run.optimizer.register_step_pre_hook(before_step)
    return captured


def micro_batches(run, sizes: list[int]) -> list[dict]:
    """Collated micro-batches of consecutive training examples, of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(run.job_setup.collator([run.job_setup.train_set[i] for i in range(start, start + size)]))
        start += size
    return out


def direct_gradient(run, init: dict, sizes: list[int]) -> list[torch.Tensor]:
    """The mean over micro-batches (of ``sizes`` consecutive examples) of each one's mean
    cross-entropy, differentiated at ``init``: one micro-batch gives the true mean-loss gradient."""
    run.model.load_state_dict(init)
    run.model.zero_grad(set_to_none=True)
    start = 0
    for size in sizes:
        batch = run.job_setup.collator([run.job_setup.train_set[i] for i in range(start, start + size)])
        labels = batch.pop("labels")
        (F.cross_entropy(run.model(**batch).logits, labels) / len(sizes)).backward()
        start += size
    grads = [p.grad.detach().clone() for p in run.model.parameters() if p.requires_grad]
    run.model.zero_grad(set_to_none=True)
    return grads


def norm(tensors: list[torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])).item()


def step_values(values: torch.Tensor) -> dict[str, float]:
    """A step's device-side values, read back (``train_step`` leaves them on the device)."""
    return dict(zip(("loss", "grad_norm", "skipped"), values.tolist()))


def step_from(run, init: dict, group: list[dict]):
    run.model.load_state_dict(init)
    values, stats = run.train_step(group)
    return step_values(values), stats


def mean_loss(run, init: dict, n: int) -> float:
    """Cross-entropy averaged over the first ``n`` training examples, at weights ``init``."""
    run.model.load_state_dict(init)
    batch = run.job_setup.collator([run.job_setup.train_set[i] for i in range(n)])
    labels = batch.pop("labels")
    with torch.no_grad():
        return F.cross_entropy(run.model(**batch).logits, labels).item()


# ----------------------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [8, 8, 8, 5], [3, 12, 1, 9]])
def test_accumulated_micro_batches_give_the_gradient_of_one_batch(engine_env, sizes):
    run = make_run(make_job(gradient_accumulation_steps=len(sizes), weight_decay=0.0, warmup_ratio=0.0))
    no_dropout(run.model)
    run.model.train()
    captured = capture_gradients(run)
    init = {k: v.clone() for k, v in run.model.state_dict().items()}
    n = sum(sizes)

    run.warm_up()
    # Sanity: with dropout off a step is deterministic, so any difference below is the recipe's.
    whole, whole_stats = step_from(run, init, micro_batches(run, [n]))
    again, _ = step_from(run, init, micro_batches(run, [n]))
    assert again["loss"] == whole["loss"]
    assert all(torch.equal(a, b) for a, b in zip(captured[0], captured[1]))

    group = micro_batches(run, sizes)
    assert [len(b["labels"]) for b in group] == sizes
    accumulated, stats = step_from(run, init, group)
    assert len(captured) == 3  # exactly one optimizer step per train_step

    # The loss reported is the mean over every example of the step...
    assert whole["loss"] == pytest.approx(mean_loss(run, init, n), rel=1e-5)
    assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    # The reference, by autograd here: the gradient of the mean loss over all n examples. Its
    # norm is the step's grad_norm (taken before clipping).
    reference = direct_gradient(run, init, [n])
    assert whole["grad_norm"] == pytest.approx(norm(reference), rel=1e-4)
    if len(set(sizes)) > 1:
        # Averaging the micro-batch means instead weighs a short micro-batch too much; the
        # tolerance used below tells that apart.
        wrong = direct_gradient(run, init, sizes)
        with pytest.raises(AssertionError):
            for a, b in zip(wrong, reference):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    # The gradient (norm before clipping, and every clipped tensor) is that of the single batch.
    assert accumulated["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
    for a, b in zip(captured[2], captured[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    # Token accounting covers every micro-batch of the step.
    assert stats.real == whole_stats.real == int(run.job_setup.train_set.lengths[:n].sum())
    assert stats.padded == sum(b["input_ids"].numel() for b in group)


def test_gradient_is_unchanged_when_micro_batches_are_split_for_memory(engine_env):
    """The out-of-memory backoff cuts each micro-batch into pieces; the step's gradient must not move."""
    run = make_run(make_job(weight_decay=0.0, warmup_ratio=0.0))
    no_dropout(run.model)
    run.model.train()
    captured = capture_gradients(run)
    init = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.warm_up()
    reference, _ = step_from(run, init, micro_batches(run, [8, 7]))
    for split in (2, 4):
        run.state.micro_split = split
        out, _ = step_from(run, init, micro_batches(run, [8, 7]))
        assert out["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert out["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)
        for a, b in zip(captured[-1], captured[0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- frozen embeddings


def test_frozen_embeddings_with_gradient_checkpointing_train_the_rest(engine_env):
    run = make_run(make_job(epochs=2, freeze_embeddings=True, gradient_checkpointing=True, learning_rate=5e-3))
    model = run.model
    checkpointing = getattr(type(model), "is_activation_checkpointing", None)
    assert model.is_activation_checkpointing if checkpointing is not None else model.is_gradient_checkpointing

    # Count the checkpointed layer calls, to prove the recompute path really ran.
    calls = {"n": 0}
    layers = [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) and hasattr(m, "_gradient_checkpointing_func")
    ]
    assert layers
    for layer in layers:
        inner = layer._gradient_checkpointing_func

        def counted(*args, _inner=inner, **kwargs):
            calls["n"] += 1
            return _inner(*args, **kwargs)

        layer._gradient_checkpointing_func = counted

    embeddings = dict(model.base_model.embeddings.named_parameters())
    assert embeddings and not any(p.requires_grad for p in embeddings.values())
    optimized = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in embeddings.values()}
    frozen_before = {n: p.detach().clone() for n, p in embeddings.items()}
    prefix = f"{model.base_model_prefix}.embeddings."
    rest_before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith(prefix)}
    assert len(rest_before) == len(list(model.parameters())) - len(embeddings)

    reporter = RecordingReporter()
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    assert run.state.step == run.job_setup.total_steps > 1
    assert calls["n"] > 0
    assert all(math.isfinite(v) for v in list(reporter.series("train_loss").values()))

    for name, p in model.base_model.embeddings.named_parameters():
        assert torch.equal(p, frozen_before[name]), name  # bit-identical
    # Every other parameter moved, the first encoder layer's included: with frozen inputs, reentrant
    # checkpointing would have left the checkpointed layers without gradients.
    unchanged = [n for n, p in model.named_parameters() if not n.startswith(prefix) and torch.equal(p, rest_before[n])]
    assert unchanged == []


# ----------------------------------------------------------------------------- regression


def test_regression_trains_on_mse_and_evaluates_mse_and_pearson(engine_env):
    run = make_run(make_job(task="regression", epochs=2, learning_rate=2e-3), train_rows=48, validation_rows=16)
    assert run.model.config.num_labels == 1
    assert run.model.config.problem_type == "regression"
    assert run.job_setup.train_set.labels == pytest.approx(texts_frame(48, seed=1)["score"].tolist())

    # The loss is the squared error, summed; the training step divides it by the examples.
    batch = run.job_setup.collator([run.job_setup.val_set[i] for i in range(8)])
    labels = batch.pop("labels")
    assert labels.dtype == torch.float32
    with torch.no_grad():
        logits = run.model(**batch).logits
    assert logits.shape == (8, 1)
    expected = ((logits.squeeze(-1) - labels) ** 2).sum()
    torch.testing.assert_close(loss_sum_of(logits, labels, "regression"), expected)
    torch.testing.assert_close(loss_sum_of(logits, labels, "regression") / 8, F.mse_loss(logits.squeeze(-1), labels))

    reporter = RecordingReporter()
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    losses = list(reporter.series("train_loss").values())
    assert losses and all(math.isfinite(v) and v >= 0 for v in losses)

    metrics = run.evaluate()
    assert set(metrics) == {"loss", "mse", "pearson_r"}
    assert metrics["loss"] == pytest.approx(metrics["mse"], rel=1e-5)
    assert -1.0 <= metrics["pearson_r"] <= 1.0
    # evaluate() agrees with predictions made here, in eval mode.
    run.model.eval()
    batch = run.job_setup.collator([run.job_setup.val_set[i] for i in range(len(run.job_setup.val_set))])
    labels = batch.pop("labels")
    with torch.no_grad():
        predictions = run.model(**batch).logits.squeeze(-1)
    assert metrics["mse"] == pytest.approx(F.mse_loss(predictions, labels).item(), rel=1e-4)
    assert metrics["pearson_r"] == pytest.approx(
        float(np.corrcoef(predictions.numpy(), labels.numpy())[0, 1]), abs=1e-4
    )
    # The per-epoch evaluations were logged under eval_ names.
    assert reporter.series("eval_mse") and reporter.series("eval_pearson_r")


def test_classification_evaluates_accuracy_and_macro_f1(engine_env):
    run = make_run(make_job(epochs=1), train_rows=32, validation_rows=10)
    metrics = run.evaluate()
    assert set(metrics) == {"loss", "accuracy", "f1_macro"}
    run.model.eval()
    batch = run.job_setup.collator([run.job_setup.val_set[i] for i in range(len(run.job_setup.val_set))])
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = run.model(**batch).logits
    assert metrics["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-4)
    assert metrics["accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())


# ----------------------------------------------------------------------------- precision


@pytest.mark.parametrize("precision, dtype", [("fp32", None), ("bf16", torch.bfloat16)])
def test_cpu_precisions_train_with_finite_losses(engine_env, precision, dtype):
    reporter = RecordingReporter()
    run = make_run(make_job(precision=precision, epochs=2), train_rows=32, validation_rows=8, reporter=reporter)
    assert run.job_setup.dtype == dtype
    assert not run.scaler.is_enabled()  # a GradScaler is for fp16 only
    run.warm_up(reporter)
    assert run.train(reporter) == "completed"
    losses = list(reporter.series("train_loss").values())
    assert len(losses) == run.job_setup.total_steps and all(math.isfinite(v) for v in losses)
    assert all(math.isfinite(v) for v in list(reporter.series("grad_norm").values()))
    assert run.state.skipped_steps == 0
    metrics = run.evaluate()
    assert all(math.isfinite(v) for v in metrics.values())
    # Autocast leaves the master weights in fp32.
    assert all(p.dtype == torch.float32 for p in run.model.parameters())


@pytest.mark.parametrize(
    "amx, setting, dtype",
    [(True, None, torch.bfloat16), (False, None, None), (True, "false", None), (False, "true", torch.bfloat16)],
)
def test_auto_precision_is_bf16_on_cpus_with_amx_unless_set(monkeypatch, amx, setting, dtype):
    """``auto`` is bf16 where the CPU multiplies bf16 on AMX tiles (faster than fp32 there, the same
    held-out accuracy), fp32 on other CPUs (bf16 is slower there), unless ``TUNEJOB_CPU_BF16`` says
    which: training and prediction alike. (The suite sets it false: conftest.)"""
    from shared.settings import get_settings

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    if setting is None:
        monkeypatch.delenv("TUNEJOB_CPU_BF16", raising=False)
    else:
        monkeypatch.setenv("TUNEJOB_CPU_BF16", setting)
    get_settings.cache_clear()
    try:
        assert compute_dtype("auto", torch.device("cpu")) == dtype
        assert compute_dtype("fp32", torch.device("cpu")) is None
        assert compute_dtype("int8", torch.device("cpu")) is None  # prediction's: its model runs its own autocast
        assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def test_a_job_says_what_precision_auto_chose_and_why(engine_env):
    reporter = RecordingReporter()
    run = make_run(make_job(precision="auto"), train_rows=16, reporter=reporter)  # the suite sets TUNEJOB_CPU_BF16
    assert run.job_setup.dtype is None
    assert reporter.messages[reporter.events.index("precision")] == "precision auto: fp32 (TUNEJOB_CPU_BF16)"
    reporter = RecordingReporter()
    make_run(make_job(precision="bf16"), train_rows=16, reporter=reporter)
    assert "precision" not in reporter.events  # asked for, nothing chosen


def test_bf16_first_step_loss_matches_fp32(engine_env):
    """Same seed, same data, same initial weights: bf16 autocast changes the first loss only by rounding."""
    first = {}
    for precision in ["fp32", "bf16"]:
        run = make_run(make_job(precision=precision), train_rows=32)
        no_dropout(run.model)
        run.model.train()
        run.warm_up()
        values, _ = run.train_step(micro_batches(run, [16]))
        first[precision] = step_values(values)["loss"]
    assert first["bf16"] == pytest.approx(first["fp32"], rel=0.05)


def test_batch_stats_of_a_step_are_summed_over_micro_batches(engine_env):
    run = make_run(make_job())
    group = micro_batches(run, [4, 4, 2])
    run.warm_up()
    _, stats = run.train_step(group)
    parts = [BatchStats.of(b) for b in group]
    assert stats == BatchStats(
        sum(p.real for p in parts), sum(p.unrounded for p in parts), sum(p.padded for p in parts)
    )
