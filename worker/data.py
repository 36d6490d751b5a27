"""Data for one job: load and split the tables, tokenize once, plan batches, pad per batch.

Smart batching (dynamic padding + uniform-length batching) follows the seed notebooks
(McCormick, "Smart Batching Tutorial"; Benesty, "Divide Hugging Face Transformers training time
by 2 or more"): sequences of similar length share a micro-batch, each batch is padded only to its
longest member, and the batch order is shuffled every epoch.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, Sampler
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase

from shared.datasets import read_table, regression_targets
from shared.models import Dataset


def split_train_validation(
    df: pd.DataFrame, label_column: str, fraction: float, seed: int, stratify: bool
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Hold out ``fraction`` of ``df`` for validation, stratified by label when every class has
    at least two rows (scikit-learn ``train_test_split``)."""
    if not fraction:
        return df, None
    labels = df[label_column].astype(str)
    can_stratify = stratify and labels.value_counts().min() >= 2 and round(len(df) * fraction) >= labels.nunique()
    train, val = train_test_split(
        df, test_size=fraction, random_state=seed, stratify=labels if can_stratify else None
    )
    return train, val


@dataclass
class JobData:
    """A job's training and validation tables, with the file names used in error messages."""

    train: pd.DataFrame
    validation: pd.DataFrame | None
    train_name: str
    validation_name: str | None


def load_job_data(spec: dict, train: Dataset, validation: Dataset | None) -> JobData:
    """Read a job's uploaded tables; without a validation dataset, hold out ``validation_split``
    of the training table (stratified for classification, seeded by ``hyperparameters.seed``)."""
    train_df = read_table(Path(train.path), train.format, train.filename)
    if validation is not None:
        val_df = read_table(Path(validation.path), validation.format, validation.filename)
        return JobData(train_df, val_df, train.filename, validation.filename)
    train_df, val_df = split_train_validation(train_df, spec["label_column"], spec.get("validation_split") or 0.0,
                                              spec["hyperparameters"]["seed"], spec["task"] == "classification")
    return JobData(train_df, val_df, train.filename, train.filename)


class TokenizedDataset(Dataset):
    """Examples tokenized once, without padding, truncated to ``max_length``.

    Each item is a dict of Python lists (``input_ids``, ``attention_mask`` and, when the tokenizer
    produces them, ``token_type_ids``) plus ``labels`` (class index or float target).
    ``lengths[i]`` is the number of real tokens of example i.
    """

    def __init__(self, encodings: dict[str, list[list[int]]], labels: list):
        self.encodings, self.labels = encodings, labels
        self.lengths = np.array([len(ids) for ids in encodings["input_ids"]], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        item = {k: v[i] for k, v in self.encodings.items()}
        item["labels"] = self.labels[i]
        return item


def tokenize(
    tokenizer: PreTrainedTokenizerBase,
    df: pd.DataFrame,
    text_column: str,
    text_pair_column: str | None,
    label_column: str,
    label_names: list[str] | None,
    max_length: int,
    filename: str = "dataset",
) -> TokenizedDataset:
    """Tokenize a table once with the fast tokenizer (pairs as the tokenizer's pair input).

    Classification labels are mapped to indices of ``label_names``; regression labels to float32.
    """
    texts = df[text_column].astype(str).tolist()
    pairs = df[text_pair_column].astype(str).tolist() if text_pair_column else None
    enc = tokenizer(texts, pairs, truncation=True, max_length=max_length, padding=False)
    if label_names is None:
        labels = regression_targets(df[label_column], filename, label_column).tolist()
    else:
        index = {name: i for i, name in enumerate(label_names)}
        labels = [index[str(v)] for v in df[label_column]]
    keep = [k for k in tokenizer.model_input_names if k in enc]
    return TokenizedDataset({k: enc[k] for k in keep}, labels)


class BatchPlan(Sampler[list[int]]):
    """Yields the micro-batches (lists of example indices) of one epoch.

    Strategies:
        smart: sort by length (ties broken at random), cut into ``batch_size`` chunks starting at a
            random offset, shuffle the chunk order. Each epoch's randomness comes from
            ``seed + epoch``, so batch composition changes between epochs while a given seed
            always gives the same order.
        dynamic, fixed: a random permutation cut into chunks (``fixed`` is padded to
            ``max_length`` by the collator).

    Every example appears exactly once per epoch. The micro-batch with the most tokens is moved to
    the front so an out-of-memory error shows at the first step. ``set_epoch(epoch, skip)`` selects
    the epoch and skips its first ``skip`` micro-batches (to resume mid-epoch).
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, strategy: str, seed: int):
        self.lengths, self.batch_size, self.strategy, self.seed = lengths, batch_size, strategy, seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip
        self.batches = self.epoch_batches(epoch)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed + epoch)
        order = rng.permutation(len(self.lengths))
        bs = self.batch_size
        if self.strategy == "smart":
            order = order[np.argsort(self.lengths[order], kind="stable")]
            offset = int(rng.integers(0, bs)) if len(order) > bs else 0
            cuts = [0, *range(offset or bs, len(order), bs), len(order)]
            batches = [order[a:b].tolist() for a, b in zip(cuts, cuts[1:]) if b > a]
            batches = [batches[i] for i in rng.permutation(len(batches))]
        else:
            batches = [order[i : i + bs].tolist() for i in range(0, len(order), bs)]
        tokens = [len(b) * int(self.lengths[b].max()) for b in batches]
        batches.insert(0, batches.pop(int(np.argmax(tokens))))
        return batches

    def __iter__(self):
        yield from self.batches[self.skip :]

    def __len__(self) -> int:
        return len(self.batches) - self.skip

    def count_steps(self, epochs: float, gradient_accumulation_steps: int) -> int:
        """Optimizer steps in ``epochs`` epochs (a fractional last epoch is cut short)."""
        full, fraction = int(epochs), epochs - int(epochs)
        per_epoch = [math.ceil(len(self.epoch_batches(e)) / gradient_accumulation_steps) for e in range(full + 1)]
        return max(1, sum(per_epoch[:full]) + math.ceil(fraction * per_epoch[full]))


def make_collator(
    tokenizer: PreTrainedTokenizerBase, batching: str, max_length: int, pad_to_multiple_of: int | None
) -> DataCollatorWithPadding:
    """Pad per batch with the tokenizer's own pad id and inputs (``DataCollatorWithPadding``):
    to the longest member (``smart``/``dynamic``) or to ``max_length`` (``fixed``)."""
    if batching == "fixed":
        return DataCollatorWithPadding(tokenizer, padding="max_length", max_length=max_length)
    return DataCollatorWithPadding(tokenizer, padding="longest", pad_to_multiple_of=pad_to_multiple_of)


@dataclass
class BatchStats:
    """Token counts of one padded batch: real tokens, tokens padded to the batch's longest member
    (before any ``pad_to_multiple_of`` rounding) and tokens actually computed."""

    real: int
    unrounded: int
    padded: int

    @classmethod
    def of(cls, batch: dict[str, torch.Tensor], padded_to_longest: bool = True) -> "BatchStats":
        lengths = batch["attention_mask"].sum(dim=1)
        n, width = batch["attention_mask"].shape
        unrounded = n * int(lengths.max()) if padded_to_longest else n * width
        return cls(int(lengths.sum()), unrounded, n * width)
