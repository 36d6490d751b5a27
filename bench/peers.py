"""The peers: ``transformers.Trainer`` as its users run it, and its tuned variants, on the examples,
model initialisation, precision, batch size, seed and schedule the engine gets.

Every peer trains with ``train_sampling_strategy="group_by_length"`` (transformers 5's name for
``group_by_length=True``), ``DataCollatorWithPadding(pad_to_multiple_of=8)`` (token_classification:
``DataCollatorForTokenClassification(pad_to_multiple_of=8)`` on the Hugging Face recipe's
first-subword labels, ``AutoModelForTokenClassification``), the same learning
rate, linear warmup over 10% of the steps then linear decay, weight decay 0.01, gradient clipping
at 1.0, its default optimizer (``adamw_torch_fused``), no logging, saving or evaluation while it
trains, and ``dataloader_num_workers=0``. Its time is ``Trainer.train()``'s own ``train_runtime``.

- ``trainer``: nothing more.
- ``trainer_cudnn_off``: ``torch.backends.cuda.enable_cudnn_sdp(False)`` first, the one line that
  spares the cuDNN attention backend's per-shape planning on a GPU (a no-op on the CPU).
- ``trainer_compile``: ``torch_compile=True`` (compiles each new shape; minutes on the CPU).
- ``trainer_accumulate_4``: ``gradient_accumulation_steps=4`` (the peer of an engine configuration
  with ``gradient_accumulation_steps=4``: the same effective batch).
"""

from dataclasses import dataclass, field

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

PAD_TO_MULTIPLE_OF = 8


@dataclass(frozen=True)
class Peer:
    arguments: dict = field(default_factory=dict)  # extra ``TrainingArguments``
    cudnn_sdp: bool = True


PEERS = {
    "trainer": Peer(),
    "trainer_cudnn_off": Peer(cudnn_sdp=False),
    "trainer_compile": Peer(arguments={"torch_compile": True}),
    "trainer_accumulate_4": Peer(arguments={"gradient_accumulation_steps": 4}),
}


def encode(tokenizer, df: pd.DataFrame, labels: list[str], max_length: int) -> list[dict]:
    """Examples as the Trainer takes them: tokenized without padding (``text`` with ``text_pair``
    where the corpus has pairs, as the engine tokenizes them), truncated to ``max_length``,
    each a dict of ``input_ids``, ``attention_mask`` (and ``token_type_ids``) and ``labels`` (a
    class index, or for lists of labels a multi-hot float vector: ``worker.data.label_targets``)."""
    from worker.data import label_targets

    pairs = df["text_pair"].astype(str).tolist() if "text_pair" in df else None  # the tokenizer's pair input
    enc = tokenizer(df["text"].astype(str).tolist(), pairs, truncation=True, max_length=max_length)
    keys = [k for k in tokenizer.model_input_names if k in enc]
    targets = label_targets(df["label"], labels)
    return [{**{k: enc[k][i] for k in keys}, "labels": target} for i, target in enumerate(targets)]


def encode_words(tokenizer, df: pd.DataFrame, labels: list[str], max_length: int) -> list[dict]:
    """token_classification examples as the Hugging Face recipe builds them: words tokenized with
    ``is_split_into_words=True``, truncated to ``max_length``, each word's tag on its first subword
    and -100 elsewhere (``worker.tagging.align_labels``, the recipe's loop)."""
    from worker.tagging import align_labels

    enc = tokenizer(df["tokens"].tolist(), is_split_into_words=True, truncation=True, max_length=max_length)
    index = {name: i for i, name in enumerate(labels)}
    keys = [k for k in tokenizer.model_input_names if k in enc]
    return [
        {**{k: enc[k][i] for k in keys}, "labels": align_labels(enc.word_ids(i), [index[t] for t in tags], None)}
        for i, tags in enumerate(df["tags"])
    ]


class CountingCollator:
    """``DataCollatorWithPadding`` (``labels_per_token``: ``DataCollatorForTokenClassification``)
    that records each training batch's token counts in order (real, padded to its longest member,
    computed), so the counts of the first k optimizer steps are the first k x
    ``gradient_accumulation_steps`` records (the DataLoader may already have collated the next)."""

    def __init__(self, tokenizer, labels_per_token: bool = False):
        from transformers import (
            DataCollatorForTokenClassification,
            DataCollatorWithPadding,
        )

        pad = DataCollatorForTokenClassification if labels_per_token else DataCollatorWithPadding
        self.pad = pad(tokenizer, pad_to_multiple_of=PAD_TO_MULTIPLE_OF)
        self.batches: list[tuple[int, int, int]] = []

    def __call__(self, features: list[dict]) -> dict:
        batch = self.pad(features)
        lengths = batch["attention_mask"].sum(dim=1)
        n, width = batch["attention_mask"].shape
        self.batches.append((int(lengths.sum()), n * int(lengths.max()), n * width))
        return batch

    def counts(self, micro_batches: int) -> tuple[int, int, int]:
        done = self.batches[:micro_batches]
        return tuple(sum(batch[i] for batch in done) for i in range(3))


def epoch_marks(clock: Clock, collator: CountingCollator, epochs: int):
    """A ``TrainerCallback`` that marks the end of each epoch and, in a one-epoch run, the start of
    the steady-state window, synchronizing the device only at those steps."""
    from transformers import TrainerCallback

    class EpochMarks(TrainerCallback):
        def __init__(self):
            self.epoch_ends: list[Mark] = []
            self.steady_start: Mark | None = None

        def mark(self, step: int, accumulation: int) -> Mark:
            # an epoch's last step may take fewer micro-batches: the slice then ends at the last
            return clock.mark(step, *collator.counts(step * accumulation))

        def on_step_end(self, args, state, control, **kwargs):
            steps_per_epoch = state.max_steps // epochs
            if epochs == 1 and state.global_step == steady_from(steps_per_epoch):
                self.steady_start = self.mark(state.global_step, args.gradient_accumulation_steps)

        def on_epoch_end(self, args, state, control, **kwargs):
            self.epoch_ends.append(self.mark(state.global_step, args.gradient_accumulation_steps))

    return EpochMarks()


def training_arguments(spec, device: torch.device, out_dir: str, dtype, peer: Peer):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=spec.batch_size,
        per_device_eval_batch_size=2 * spec.batch_size,
        num_train_epochs=spec.epochs,
        learning_rate=spec.learning_rate,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=0.1,
        max_grad_norm=1.0,
        seed=spec.seed,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu=device.type == "cpu",
        train_sampling_strategy="group_by_length",
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=device.type == "cuda",
        **peer.arguments,
    )


def load_model(model_dir, labels: list[str], seed: int, task: str = "classification") -> torch.nn.Module:
    """The model as the engine loads it: SDPA attention, a new classifier head for ``labels`` (also
    over a checkpoint's head of another size), drawn after ``set_seed(seed)`` as ``setup`` does;
    ``problem_type`` ``multi_label_classification`` for multi_label (the Trainer's loss is then
    ``BCEWithLogitsLoss``)."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        set_seed,
    )

    set_seed(seed)
    names = {
        "num_labels": len(labels),
        "id2label": dict(enumerate(labels)),
        "label2id": {n: i for i, n in enumerate(labels)},
    }
    if task == "token_classification":
        return AutoModelForTokenClassification.from_pretrained(
            model_dir, attn_implementation="sdpa", use_safetensors=True, ignore_mismatched_sizes=True, **names
        )
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir,
        attn_implementation="sdpa",
        use_safetensors=True,
        ignore_mismatched_sizes=True,
        problem_type="multi_label_classification" if task == "multi_label" else "single_label_classification",
        **names,
    )


def run_peer(
    name: str,
    spec,
    train: pd.DataFrame,
    val: pd.DataFrame | None,
    labels: list[str],
    device: torch.device,
    out_dir: str,
    task: str = "classification",
) -> dict:
    """One ``Trainer.train()`` of peer ``name`` on ``train`` (and, with ``val``, the held-out
    figures of ``bench.measure.HELD_OUT`` after it, from ``Trainer.predict``; multi_label: sigmoid
    scores at threshold 0.5; token_classification: scored by the engine's own
    ``worker.tagging.tagging_metrics``). Load (tokenize, model, ``Trainer``) is timed apart."""
    from transformers import AutoTokenizer, PrinterCallback, Trainer

    from shared.inference.precision import compute_dtype
    from shared.jobs.base_models import resolve_model

    peer = PEERS[name]
    if not peer.cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    clock = Clock(device)
    began = clock.now()
    model_dir = resolve_model(spec.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tagging = task == "token_classification"
    encoder = encode_words if tagging else encode
    examples = encoder(tokenizer, train, labels, spec.max_length)
    model = load_model(model_dir, labels, spec.seed, task)
    collator = CountingCollator(tokenizer, labels_per_token=tagging)
    marks = epoch_marks(clock, collator, spec.epochs)
    arguments = training_arguments(spec, device, out_dir, compute_dtype(spec.precision, device), peer)
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=examples,
        processing_class=tokenizer,
        data_collator=collator,
        callbacks=[marks],
    )
    trainer.remove_callback(PrinterCallback)
    loaded = clock.now()
    output = trainer.train()
    figures = epoch_figures(loaded, marks.epoch_ends, marks.steady_start)
    row = {
        "kind": "peer",
        "load_seconds": loaded - began,
        "train_seconds": output.metrics["train_runtime"],
        **figures,
        **flops_per_real_token(model, [len(e["input_ids"]) for e in examples]),
        "optimizer": trainer.args.optim.value,
    }
    if val is not None:
        trainer.data_collator = collator.pad  # held-out batches are not training tokens
        predictions = trainer.predict(encoder(tokenizer, val, labels, spec.max_length))
        row.update(held_out_figures(predictions.predictions, predictions.label_ids, labels, task))
    return row


def held_out_figures(logits, label_ids, labels: list[str], task: str) -> dict:
    """``bench.measure.HELD_OUT`` figures of ``Trainer.predict``'s logits, computed as the engine's
    ``worker.training.metrics.evaluate`` computes them (scikit-learn; seqeval for token_classification, whose
    arrays are ``[examples, width]``, padded with -100)."""
    from sklearn.metrics import accuracy_score, f1_score

    from worker.tagging import tagging_metrics, word_sequences
    from worker.training.metrics import multi_label_metrics

    if task == "multi_label":
        metrics = multi_label_metrics(label_ids, torch.sigmoid(torch.from_numpy(logits)).numpy(), labels, 0.5)
    elif task == "token_classification":
        predicted = torch.from_numpy(logits.argmax(-1))
        metrics = tagging_metrics(*word_sequences([predicted], [torch.from_numpy(label_ids)], labels), labels)
    else:
        predicted = logits.argmax(-1)
        metrics = {
            "accuracy": float(accuracy_score(label_ids, predicted)),
            "f1_macro": float(f1_score(label_ids, predicted, average="macro")),
        }
    return {name: metrics[name] for name in HELD_OUT[task]}
