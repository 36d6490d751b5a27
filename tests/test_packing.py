"""Packed (padding-free) micro-batches give the padded step's loss and gradients (worker.training.packing).

fp32, dropout off, tiny models built from a config: classification, pairs (token_type_ids),
multi_label, regression, token classification and RoBERTa positions (``padding_idx + 1``), at
lengths 1 and ``max_length``. Relative tolerance 1e-5 on the loss and on each gradient, with an
absolute floor for gradients that are exactly zero in theory (the key bias: softmax is invariant
to a constant added to every score).
"""

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
    DistilBertConfig,
    RobertaConfig,
)

from worker.training.packing import pack, pack_fixed, packed_logits, position_offset, token_bucket, unsupported_reason
from worker.training.steps import example_losses

MAX_LENGTH = 12
VOCAB = 50
RTOL, ATOL = 1e-5, 1e-7


def tiny(kind: str, task: str, num_labels: int = 3) -> torch.nn.Module:
    common = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": MAX_LENGTH + 4,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "num_labels": num_labels,
        "type_vocab_size": 2,
    }
    config = RobertaConfig(pad_token_id=1, **common) if kind == "roberta" else BertConfig(**common)
    if task == "multi_label":
        config.problem_type = "multi_label_classification"
    torch.manual_seed(0)
    cls = AutoModelForTokenClassification if task == "token_classification" else AutoModelForSequenceClassification
    return cls.from_config(config, attn_implementation="sdpa")


def padded_batch(lengths: list[int], task: str, num_labels: int, pad_id: int, pairs: bool) -> dict[str, torch.Tensor]:
    """A right-padded micro-batch with examples of these lengths (ids never equal to the pad id)."""
    g = torch.Generator().manual_seed(1)
    n, width = len(lengths), max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, VOCAB, (n, width), generator=g) * mask + pad_id * (1 - mask)
    batch = {"input_ids": ids, "attention_mask": mask}
    if pairs:
        batch["token_type_ids"] = (torch.arange(width)[None] >= torch.tensor(lengths)[:, None] // 2).long() * mask
    if task == "token_classification":
        batch["labels"] = torch.where(mask.bool(), torch.randint(0, num_labels, (n, width), generator=g), -100)
    elif task == "regression":
        batch["labels"] = torch.rand(n, generator=g)
    elif task == "multi_label":
        batch["labels"] = torch.randint(0, 2, (n, num_labels), generator=g).float()
    else:
        batch["labels"] = torch.randint(0, num_labels, (n,), generator=g)
    return batch


def loss_and_grads(model, batch, task, packed: bool):
    model.zero_grad()
    labels = batch["labels"]
    if packed:
        inputs = pack(batch, position_offset(model), token_labels=task == "token_classification")
        labels = inputs.pop("labels")
        logits = packed_logits(model, inputs, task)
    else:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    loss = example_losses(logits, labels, task).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [
    ("bert", "classification", False),
    ("bert", "classification", True),
    ("bert", "multi_label", False),
    ("bert", "regression", False),
    ("bert", "token_classification", False),
    ("roberta", "classification", False),
    ("roberta", "token_classification", True),
]


@pytest.mark.parametrize("kind,task,pairs", CASES)
def test_packed_step_equals_padded(kind, task, pairs):
    num_labels = 1 if task == "regression" else 3
    model = tiny(kind, task, num_labels)
    pad_id = model.config.pad_token_id or 0
    batch = padded_batch([1, MAX_LENGTH, 5, 2, MAX_LENGTH - 1], task, num_labels, pad_id, pairs)
    loss_pad, grads_pad = loss_and_grads(model, batch, task, packed=False)
    loss_pack, grads_pack = loss_and_grads(model, batch, task, packed=True)
    torch.testing.assert_close(loss_pack, loss_pad, rtol=RTOL, atol=0)
    assert grads_pad.keys() == grads_pack.keys()
    for name, grad in grads_pad.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads_pack[name], grad, rtol=RTOL, atol=max(ATOL, RTOL * scale), msg=name)


def test_pack_layout_restarts_positions_and_drops_padding():
    batch = padded_batch([3, 1, 2], "classification", 3, 0, pairs=False)
    out = pack(batch, position_offset=2)
    assert out["input_ids"].shape == (1, 6) and (out["input_ids"] != 0).all()
    assert out["position_ids"].tolist() == [[2, 3, 4, 2, 2, 3]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 4, 6] and out["cu_seq_lens_q"].dtype == torch.int32
    assert out["cls_index"].tolist() == [0, 3, 4] and out["max_length_q"] == 3


def test_examples_do_not_attend_to_each_other():
    """Changing one example's tokens leaves every other example's logits as they were."""
    model = tiny("bert", "classification").eval()
    batch = padded_batch([4, 6, 3], "classification", 3, 0, pairs=False)
    before = packed_logits(model, pack(batch), "classification")
    batch["input_ids"][1, :6] = torch.arange(10, 16)
    after = packed_logits(model, pack(batch), "classification")
    torch.testing.assert_close(after[[0, 2]], before[[0, 2]])
    assert not torch.allclose(after[1], before[1])


def test_a_family_without_packed_attention_is_named():
    config = DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32)
    model = AutoModelForSequenceClassification.from_config(config)
    assert "distilbert" in unsupported_reason(model)
    assert unsupported_reason(tiny("bert", "classification")) is None


def test_a_packed_job_trains_like_the_padded_job(engine_env):
    """The whole loop (``worker.training.recipe``) with ``packing: true`` on the CPU: the same losses, weights
    and real tokens as padded, no padding computed, and an event that says so."""
    from tests.conftest import RecordingReporter
    from tests.test_steps import make_run

    padded_reporter, packed_reporter = RecordingReporter(), RecordingReporter()
    padded = make_run("padded", padded_reporter, epochs=2, batch_size=8)
    padded.warm_up(padded_reporter)
    assert padded.train(padded_reporter) == "completed" and not padded.steps.packing
    packed = make_run("packed", packed_reporter, epochs=2, batch_size=8, packing=True)
    packed.warm_up(packed_reporter)
    assert packed.train(packed_reporter) == "completed" and packed.steps.packing
    losses = padded_reporter.series("train_loss")
    assert len(losses) > 2 and packed_reporter.series("train_loss") == pytest.approx(losses, rel=1e-5)
    for (name, p), q in zip(packed.model.named_parameters(), padded.model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)
    assert packed.state.real_tokens == padded.state.real_tokens == packed.state.padded_tokens
    assert padded.state.padded_tokens > padded.state.real_tokens
    assert ("packing", "packed micro-batches: no padding, attention per example (variable-length kernel)") in zip(
        packed_reporter.events, packed_reporter.messages
    )
    assert "packing" not in padded_reporter.events  # the default says nothing


def test_packed_micro_batches_are_laid_out_by_the_dataloader_workers(engine_env, monkeypatch):
    """With ``dataloader_num_workers``, each micro-batch arrives with its packed layout (``pack`` of
    its padded tensors, built by the loader's collate function in a worker process), and the
    training thread never packs: a whole packed epoch trains with ``pack`` refused outside workers."""
    from tests.conftest import RecordingReporter
    from tests.test_steps import make_run
    from worker.training import batches, packing

    reporter = RecordingReporter()
    run = make_run("packed-in-workers", reporter, epochs=1, batch_size=8, packing=True, dataloader_num_workers=1)
    run.warm_up(reporter)
    js, pack_anywhere = run.job_setup, packing.pack
    collated = next(iter(batches.make_loader(js, js.train_set, js.plan, 0, run.steps.collator(js.collator))))
    expected = pack_anywhere({k: v for k, v in collated.items() if k != packing.PACKED})
    assert collated[packing.PACKED].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(collated[packing.PACKED][name], value, rtol=0, atol=0, msg=name)

    def pack_in_workers_only(*args, **kwargs):
        if torch.utils.data.get_worker_info() is None:
            raise AssertionError("a micro-batch was packed on the training thread")
        return pack_anywhere(*args, **kwargs)

    monkeypatch.setattr(packing, "pack", pack_in_workers_only)
    assert run.train(reporter) == "completed" and run.steps.packing
    assert run.state.padded_tokens == run.state.real_tokens > 0


def test_pack_fixed_keeps_every_token_in_a_sequence_within_max_length():
    """The captured layout: the examples, one-token filler rows up to ``rows``, and the rest of the
    bucket as filler sequences of at most ``max_length`` (the kernel's bound), weights 0 for fillers."""
    batch = padded_batch([3, 1, 2], "classification", 3, 0, pairs=True)
    tokens = token_bucket(6, 3, rows=5, max_length=4)
    out = pack_fixed(pack(batch), rows=5, tokens=tokens, max_length=4, position_offset=0, pad_id=0)
    lengths = torch.diff(out["cu_seq_lens_q"]).tolist()
    assert out["input_ids"].shape == out["position_ids"].shape == out["token_type_ids"].shape == (1, tokens)
    assert lengths[:5] == [3, 1, 2, 1, 1] and all(1 <= n <= 4 for n in lengths) and sum(lengths) == tokens
    assert len(lengths) == 5 + -(-tokens // 4)  # the same number of sequences for every batch of this bucket
    assert out["cls_index"].tolist() == [0, 3, 4, 6, 7] and out["weights"].tolist() == [1, 1, 1, 0, 0]
    assert out["max_length_q"] == 4 and out["labels"].shape == (5,)
    with pytest.raises(ValueError, match="do not fit"):
        pack_fixed(pack(batch), rows=2, tokens=tokens, max_length=4, position_offset=0, pad_id=0)


def test_a_filled_packed_batch_gives_the_loss_and_gradient_of_the_packed_batch():
    model = tiny("bert", "classification")
    batch = padded_batch([1, MAX_LENGTH, 5], "classification", 3, 0, pairs=False)
    loss, grads = loss_and_grads(model, batch, "classification", packed=True)
    model.zero_grad()
    filled = pack_fixed(pack(batch), 8, token_bucket(MAX_LENGTH + 6, 3, 8, MAX_LENGTH), MAX_LENGTH, 0, 0)
    labels, weights = filled.pop("labels"), filled.pop("weights")
    filled_loss = (
        example_losses(packed_logits(model, filled, "classification"), labels, "classification") * weights
    ).sum()
    filled_loss.backward()
    torch.testing.assert_close(filled_loss.detach(), loss, rtol=RTOL, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad, grads[name], rtol=RTOL, atol=max(ATOL, RTOL * grads[name].abs().max().item())
        )


def test_captured_packed_steps_train_like_eager_packed_steps(engine_env):
    """The CUDA-graph path with packing, driven on the CPU (capture keeps the body, replay calls it):
    one graph per token bucket of the plan, each checked against eager steps, the same losses and
    weights as the eager packed job, filler tokens counted as computed."""
    from tests.conftest import RecordingReporter
    from tests.test_steps import make_run
    from worker.training.capture import CapturedSteps
    from worker.training.packing import bucket_counts

    eager = RecordingReporter()
    run = make_run("eager-packed", eager, epochs=2, batch_size=8, packing=True)
    run.warm_up(eager)
    assert run.train(eager) == "completed" and run.steps.packing and not isinstance(run.steps, CapturedSteps)
    eager_weights = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    eager_state = run.state

    captured = RecordingReporter()
    run = make_run("captured-packed", captured, epochs=2, batch_size=8, packing=True)
    hp = run.job_setup.hp
    buckets = bucket_counts(run.job_setup.plan, 8, hp.max_length, hp.epochs)
    message = run.capture(8, list(buckets), packing=True)
    assert isinstance(run.steps, CapturedSteps) and run.steps.packing
    assert "packed micro-batches of 8 rows: captured token buckets" in message and "first steps: 3 step(s)" in message
    assert set(run.steps.replays) == set(buckets) and all(f"width {b}: 1 step(s)" in message for b in buckets)
    assert run.train(captured) == "completed"
    assert captured.series("train_loss") == pytest.approx(eager.series("train_loss"), rel=1e-5)
    assert run.state.real_tokens == eager_state.real_tokens < run.state.padded_tokens  # fillers computed
    for name, p in run.model.named_parameters():
        torch.testing.assert_close(p.detach(), eager_weights[name], rtol=1e-4, atol=1e-6, msg=name)
