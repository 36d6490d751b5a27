"""Data for one job: load and split the tables, tokenize once, plan batches, pad per batch.

Which examples share a micro-batch is planned by ``shared.batching.BatchPlan``; this module pads
each micro-batch to its longest member (dynamic padding).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase

from shared.datasets import read_table, regression_targets, split_train_validation
from shared.models import Dataset


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


class TokenizedDataset(torch.utils.data.Dataset):
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
