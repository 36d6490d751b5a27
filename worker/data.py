"""Data for one job: load and split the tables, tokenize once (cached), plan batches, pad per batch.

Which examples share a micro-batch is planned by ``shared.data.batching.BatchPlan``; this module pads
each micro-batch up to the bucket width that holds its longest member (dynamic padding).
"""

import hashlib
import itertools
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from transformers import (
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerBase,
)

from shared.data.batching import bucket_ladder, bucket_width
from shared.data.columns import JobColumns
from shared.data.labels import read_job_table
from shared.data.split import split_train_validation, text_groups
from shared.data.texts import head_words
from shared.store import objects
from shared.store.artifacts import tokenized_cache_dir
from shared.store.rows import Dataset
from worker.reporter import Interrupted

log = logging.getLogger(__name__)
TOKENIZE_BATCH = 8192  # texts per call of the fast tokenizer: bounds the memory of its intermediate encodings
CACHE_FORMAT = 1  # bump when the cached layout or what tokenize() does changes


@dataclass
class JobData:
    """A job's training and validation tables (the job's columns, labels as class names or float32
    targets)."""

    train: pd.DataFrame
    validation: pd.DataFrame | None
    # sha256 of the uploaded files the tables come from: tokenizations are cached under them
    # (None: not cached, e.g. tables built in memory)
    train_sha256: str | None = None
    validation_sha256: str | None = None


def load_job_data(spec: dict, train: Dataset, validation: Dataset | None) -> JobData:
    """Read a job's uploaded tables through the API's checks (``shared.data.labels.read_job_table``:
    only the job's columns, labels as class names or float32 targets); without a validation
    dataset, hold out ``validation_split`` of the training table exactly as the API's dry run did
    (stratified for classification, whole queries or anchors for reranking and embedding, seeded
    by ``hyperparameters.seed``).

    Raises:
        UserError: bad data (the job fails at once, without retries).
    """
    cols = JobColumns.of(spec)
    train_df, summary = read_job_table(objects.dataset_file(train), train.format, train.filename, cols)
    if validation is not None:
        val_df, _ = read_job_table(objects.dataset_file(validation), validation.format, validation.filename, cols)
        return JobData(train_df, val_df, train.sha256, validation.sha256)
    train_rows, val_rows = split_train_validation(
        summary.rows,
        summary.codes,
        spec.get("validation_split") or 0.0,
        spec["hyperparameters"]["seed"],
        text_groups(train_df[cols.text].tolist()) if cols.grouped else None,
    )
    val_df = train_df.iloc[val_rows].reset_index(drop=True) if val_rows is not None else None
    return JobData(train_df.iloc[train_rows].reset_index(drop=True), val_df, train.sha256, train.sha256)


class TokenizedDataset(torch.utils.data.Dataset):
    """Examples tokenized once, without padding, truncated to ``max_length``.

    Each item is a dict of Python lists (``input_ids``, ``attention_mask`` and, when the tokenizer
    produces them, ``token_type_ids``: each held as one ``Ragged`` array) plus ``labels`` (class index, float target, a multi-hot list
    of floats, one per class, for multi_label, or a list of tag indices as long as ``input_ids`` for
    token_classification).
    ``lengths[i]`` is the number of real tokens of example i. ``from_cache``: the encodings came
    from the tokenization cache.
    """

    def __init__(self, encodings: dict[str, "Ragged"], labels: list, from_cache: bool = False):
        self.encodings, self.labels, self.from_cache = encodings, labels, from_cache
        self.lengths = encodings["input_ids"].lengths

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
    dataset_sha256: str | None = None,
    interrupted: Callable[[], str | None] = lambda: None,
) -> TokenizedDataset:
    """Tokenize a table once with the fast tokenizer (pairs as the tokenizer's pair input), in
    batches of ``TOKENIZE_BATCH`` texts, truncating to ``max_length``, without padding; before
    each batch, ``interrupted()`` (``Reporter.interrupted``) says whether to stop.

    With ``dataset_sha256`` (the uploaded file's), the encodings are cached under the data
    directory (``shared.store.artifacts.tokenized_cache_dir``) and a later job on the same texts with the
    same tokenizer and ``max_length`` reads them instead (see ``cache_key``).

    Labels become training targets as ``label_targets`` makes them.

    Raises:
        worker.reporter.Interrupted: ``interrupted()`` gave a reason (the job is cancelled, ...).
    """
    texts = df[text_column].astype(str).tolist()
    pairs = df[text_pair_column].astype(str).tolist() if text_pair_column else None
    cache = (
        tokenized_cache_dir(dataset_sha256) / f"{cache_key(tokenizer, texts, pairs, max_length)}.safetensors"
        if dataset_sha256 and tokenizer.is_fast
        else None
    )
    encodings = read_cached(cache, len(texts)) if cache else None
    from_cache = encodings is not None
    if encodings is None:
        parts: dict[str, list[Ragged]] = {}
        for start in range(0, len(texts), TOKENIZE_BATCH):
            if reason := interrupted():
                raise Interrupted(reason)
            end = start + TOKENIZE_BATCH
            enc = tokenizer(
                head_words(texts[start:end], max_length),  # the tokens kept, read faster
                head_words(pairs[start:end], max_length) if pairs else None,
                truncation=True,
                max_length=max_length,
                padding=False,
            )
            add_encodings(parts, enc, tokenizer)
        encodings = {k: Ragged.join(rows) for k, rows in parts.items()}
        if cache:
            write_cached(cache, encodings)
    return TokenizedDataset(encodings, label_targets(df[label_column], label_names), from_cache)


class Ragged:
    """Rows of ints of different lengths (one example's ``input_ids``, ...) in one flat int32 array,
    ``values``, and each row's start in it, ``offsets`` (int64 ``[rows + 1]``). About 4 bytes a
    token, where lists of Python ints took about ten times that (a worker held 5.3 GB after
    tokenizing 1.35 million short rows). A row reads back as a list of ints (``ragged[i]``), so
    the collators see what the tokenizer returned."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, values: np.ndarray, lengths: np.ndarray):
        self.values = values.astype(np.int32, copy=False)
        self.offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    @classmethod
    def of(cls, rows: list[list[int]]) -> "Ragged":
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        return cls(np.fromiter(itertools.chain.from_iterable(rows), np.int32, int(lengths.sum())), lengths)

    @classmethod
    def join(cls, parts: list["Ragged"]) -> "Ragged":
        return cls(np.concatenate([p.values for p in parts]), np.concatenate([p.lengths for p in parts]))

    @property
    def lengths(self) -> np.ndarray:
        """Each row's length, int64 ``[rows]``."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> list[int]:
        if not 0 <= i < len(self):  # a negative i would read an empty slice, not the row from the end
            raise IndexError(f"row {i} of {len(self)}")
        return self.values[self.offsets[i] : self.offsets[i + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Ragged)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.values, other.values)
        )


def add_encodings(parts: dict[str, list[Ragged]], enc, tokenizer: PreTrainedTokenizerBase) -> None:
    """Append one tokenizer call's model inputs (``enc``: ``BatchEncoding``) to ``parts``, a
    ``Ragged`` per input per call (``Ragged.join`` makes them one)."""
    for k in tokenizer.model_input_names:
        if k in enc:
            parts.setdefault(k, []).append(Ragged.of(enc[k]))


def label_targets(labels: pd.Series, label_names: list[str] | None) -> list:
    """Training targets of a label column: float32 targets when ``label_names`` is None
    (regression); else class indices into ``label_names``, or, where a label is a list of class
    names (multi_label), a multi-hot vector ``[len(label_names)]`` of 0.0 / 1.0."""
    if label_names is None:
        return labels.astype("float32").tolist()
    index = {name: i for i, name in enumerate(label_names)}
    if len(labels) and isinstance(labels.iloc[0], list):
        hot = np.zeros((len(labels), len(label_names)), dtype=np.float32)
        for row, names in enumerate(labels):
            hot[row, [index[n] for n in names]] = 1.0
        return hot.tolist()
    return [index[str(v)] for v in labels]


def cache_key(tokenizer: PreTrainedTokenizerBase, texts: list[str], pairs: list[str] | None, max_length: int) -> str:
    """sha256 of everything the encodings depend on: the texts and text pairs themselves (so the
    columns, the validation split and the rows all count), the tokenizer's full definition
    (``tokenizer.json``: vocabulary, normalizer, pre-tokenizer, post-processor), its truncation
    side and input names, and ``max_length``. Hashing costs a small fraction of tokenizing the same
    texts (docs/benchmarks.md, "Measurements behind the defaults")."""
    h = hashlib.sha256(
        json.dumps(
            {
                "format": CACHE_FORMAT,
                "max_length": max_length,
                "truncation_side": tokenizer.truncation_side,
                "inputs": list(tokenizer.model_input_names),
                "pairs": pairs is not None,
            }
        ).encode()
    )
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    for call_state in ("truncation", "padding"):  # set by each call; max_length is in the key already
        definition.pop(call_state, None)
    h.update(json.dumps(definition, sort_keys=True).encode())
    for column in (texts, pairs or []):
        for text in column:
            data = text.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()


def read_cached(path: Path, n: int) -> dict[str, Ragged] | None:
    """Encodings from a cache file (safetensors: each input flattened to int32, plus ``lengths``),
    or None if there is none or it does not hold ``n`` examples."""
    try:
        arrays = load_file(path)
    except (OSError, SafetensorError):
        return None
    lengths = arrays.pop("lengths")
    if len(lengths) != n:
        return None
    return {k: Ragged(flat, lengths) for k, flat in arrays.items()}


def write_cached(path: Path, encodings: dict[str, Ragged]) -> None:
    """Write encodings atomically (temporary file, then rename); a failure only costs the cache."""
    arrays = {k: rows.values for k, rows in encodings.items()}
    tmp = path.with_name(f".{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({**arrays, "lengths": encodings["input_ids"].lengths}, tmp)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # safetensors' own error for a full disk is no OSError
        log.warning("tokenization cache not written to %s: %s", path, e)
        tmp.unlink(missing_ok=True)


class BucketCollator:
    """Pads each micro-batch to the first width of ``ladder`` that holds its longest member, with
    the tokenizer's own pad id and inputs (``transformers.DataCollatorWithPadding``), so RoBERTa-
    style (pad id 1) and MPNet-style (no ``token_type_ids``) encoders work.

    Returns a dict of int64 ``[rows, width]`` tensors (``input_ids``, ``attention_mask``, and
    ``token_type_ids`` when the tokenizer makes them) plus ``labels`` ``[rows]``; with
    ``labels_per_token`` (token_classification), ``labels`` ``[rows, width]`` padded with -100
    (``transformers.DataCollatorForTokenClassification``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, ladder: list[int], labels_per_token: bool = False):
        self.tokenizer, self.ladder = tokenizer, ladder
        self.pad = DataCollatorForTokenClassification if labels_per_token else DataCollatorWithPadding

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = bucket_width(self.ladder, max(len(f["input_ids"]) for f in features))
        return self.pad(self.tokenizer, padding="max_length", max_length=width)(features)


def make_collator(
    tokenizer: PreTrainedTokenizerBase,
    batching: str,
    max_length: int,
    pad_to: list[int] | int | None,
    labels_per_token: bool = False,
) -> BucketCollator:
    """The collator of a job: ``fixed`` pads everything to ``max_length``; the other strategies pad
    each micro-batch up to a width of the ladder ``pad_to`` (``shared.data.batching.bucket_ladder``), or
    to a multiple of ``pad_to`` when it is a number (None: to the longest member).
    ``labels_per_token``: see ``BucketCollator``."""
    if batching == "fixed":
        ladder = [max_length]
    elif isinstance(pad_to, list):
        ladder = pad_to
    else:
        ladder = bucket_ladder(max_length, pad_to or 1)
    return BucketCollator(tokenizer, ladder, labels_per_token)


@dataclass
class BatchStats:
    """Token counts of one padded batch: real tokens, tokens padded to the batch's longest member
    (before any ``pad_to_multiple_of`` rounding) and tokens actually computed."""

    real: int
    unrounded: int
    padded: int

    @classmethod
    def of(cls, batch: dict[str, torch.Tensor], padded_to_longest: bool = True, columns: int = 1) -> "BatchStats":
        """The counts of ``batch`` (``attention_mask`` ``[rows, columns * width]``). ``columns``: texts
        laid side by side (``worker.embedding.PairsCollator``), each column computed at its own
        longest text (``worker.embedding.split_columns``), not at the shared width."""
        if columns > 1:
            parts = [cls.of({"attention_mask": m}) for m in batch["attention_mask"].chunk(columns, dim=1)]
            return cls(sum(p.real for p in parts), sum(p.unrounded for p in parts), sum(p.unrounded for p in parts))
        lengths = batch["attention_mask"].sum(dim=1)
        n, width = batch["attention_mask"].shape
        unrounded = n * int(lengths.max()) if padded_to_longest else n * width
        return cls(int(lengths.sum()), unrounded, n * width)
