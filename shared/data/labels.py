"""Label and tag indexing: each class's rows and first row (``ClassIndex``, ``TagIndex``), and the
whole-file scans of a job's data (``scan_job_data`` for the API, ``read_job_table`` for the worker)."""

import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from shared.data.columns import JobBatch, JobColumns, job_batches
from shared.data.problems import Problems
from shared.data.split import text_groups
from shared.errors import UserError
from shared.settings import get_settings

GROUPS_COUNTED = 10_000  # distinct query or anchor texts scan_job_data counts up to


@dataclass
class LabelSummary:
    """What checking a job's file keeps: its row count and, for classification, the class of
    each row (``codes``, indices into ``names``), each class's row count and first row;
    multi_label: each label's row count and first row, and the rows without a label (``empty_rows``)."""

    rows: int = 0
    names: list[str] | None = None
    codes: np.ndarray | None = None
    counts: dict[str, int] = field(default_factory=dict)
    first_row: dict[str, int] = field(default_factory=dict)
    empty_rows: int = 0
    groups: int | None = None  # scan_job_data, reranking and embedding: distinct first texts, up to GROUPS_COUNTED


def sort_class_names(names) -> list[str]:
    """Class names sorted numerically when every one spells a finite number, else as text."""

    def number(name: str) -> float | None:
        try:
            x = float(name)
        except ValueError:
            return None
        return x if math.isfinite(x) else None

    numbers = [number(n) for n in names]
    if all(x is not None for x in numbers):
        return [n for _, n in sorted(zip(numbers, names))]
    return sorted(names)


class ClassIndex:
    """Numbers a file's class names as they stream past (one per row, or a list per row for
    multi_label): each class's row count and first row, the rows without a label, and
    (``keep_codes``, single-label only) one int32 per row; ``summary`` sorts the classes
    (``sort_class_names``) and renumbers."""

    def __init__(self, filename: str, column: str, keep_codes: bool = True):
        self.filename, self.column = filename, column
        self.index: dict[str, int] = {}
        self.first_row: dict[str, int] = {}
        self.counts: list[int] = []
        self.rows = self.empty_rows = 0
        self.codes = array("i") if keep_codes else None

    @staticmethod
    def of(filename: str, cols: JobColumns, keep_codes: bool = True) -> "ClassIndex | None":
        """The index for a job's labels: a ``TagIndex`` for token_classification's tags, None when
        they are not class names (regression). Per-row codes are kept for single-label
        classification only (they stratify the split)."""
        if cols.label is None:  # embedding without a score_column
            return None
        if cols.task == "token_classification":
            return TagIndex(filename, cols.label)
        if not cols.has_classes:
            return None
        return ClassIndex(filename, cols.label, keep_codes and cols.task == "classification")

    def add(self, batch: JobBatch) -> None:
        for i, label in enumerate(batch.labels):
            names = label if isinstance(label, list) else (label,)
            self.rows += 1
            self.empty_rows += not names
            for name in names:
                code = self._code(name, batch.start + i + 1)
                self.counts[code] += 1
            if self.codes is not None:
                self.codes.append(code)

    def _code(self, name: str, row: int) -> int:
        """The index of class ``name``, numbering it if new (first seen at 1-based ``row``).

        Raises:
            UserError: ``too_many_classes``.
        """
        code = self.index.get(name)
        if code is None:
            limit = get_settings().max_classes
            if len(self.index) == limit:
                raise UserError(
                    "too_many_classes",
                    f"{self.filename!r}: label column {self.column!r} has "
                    f"{limit + 1} classes by row {row}; at most {limit} "
                    "(TUNEJOB_MAX_CLASSES): is it the right column, or is this a regression task?",
                    "label_column",
                )
            code = self.index[name] = len(self.index)
            self.first_row[name] = row
            self.counts.append(0)
        return code

    def summary(self) -> LabelSummary:
        names = sort_class_names(self.index)
        counts = {name: self.counts[self.index[name]] for name in names}
        codes = None
        if self.codes is not None:
            position = {name: i for i, name in enumerate(names)}
            order = np.array([position[n] for n in self.index] or [0], dtype=np.int32)
            codes = order[np.frombuffer(self.codes, dtype=np.int32)] if len(self.codes) else np.zeros(0, np.int32)
        return LabelSummary(self.rows, names, codes, counts, self.first_row, self.empty_rows)


class TagIndex(ClassIndex):
    """``ClassIndex`` over the tags of a token_classification file: each tag's count (in words)
    and first row (sentence), and the rows (sentences); no per-row codes (the validation split is
    not stratified)."""

    def __init__(self, filename: str, column: str):
        super().__init__(filename, column, keep_codes=False)

    def add(self, batch: JobBatch) -> None:
        for i, tags in enumerate(batch.labels):
            self.rows += 1
            for name in tags:
                self.counts[self._code(name, batch.start + i + 1)] += 1


def scan_job_data(path: Path, fmt: str, filename: str, cols: JobColumns) -> LabelSummary:
    """Check a job's columns in one file, batch by batch, keeping only the row count and, for
    classification, each class's row count and first row: never the texts, nothing per row. For
    tasks whose validation split holds out whole queries or anchors (``JobColumns.grouped``), the
    distinct first texts, counted up to ``GROUPS_COUNTED`` (keys of at most that many: enough to
    tell whether any ``validation_split`` below 1 - 1 / GROUPS_COUNTED leaves one for training).

    Raises:
        UserError: the validation report (``missing_value``, ``invalid_text``, ``invalid_label``,
            ``invalid_column``, ...), ``too_many_classes``, or a reader error (see ``read_batches``).
    """
    problems, rows, groups = Problems(filename), 0, set[int]()
    classes = ClassIndex.of(filename, cols, keep_codes=False)
    for batch in job_batches(path, fmt, filename, cols, problems):
        rows += len(batch.texts)
        if classes is not None:
            classes.add(batch)
        if cols.grouped and len(groups) < GROUPS_COUNTED:
            groups.update(text_groups(batch.texts[:GROUPS_COUNTED]).tolist())
    problems.raise_if_any()
    summary = classes.summary() if classes is not None else LabelSummary(rows)
    summary.groups = min(len(groups), GROUPS_COUNTED) if cols.grouped else None
    return summary


def read_job_table(path: Path, fmt: str, filename: str, cols: JobColumns) -> tuple[pd.DataFrame, LabelSummary]:
    """The worker's view of one file: a DataFrame with only the job's columns, checked as the API
    checked them, texts as ``str``, labels as class names (``str``) or float32 targets
    (multi_label: lists of class names; token_classification: lists of words and of tag names;
    embedding: anchors, positives, each hard-negative column and any float32 scores);
    and the same ``LabelSummary`` as ``scan_job_data`` (classes and per-row codes, to split alike).

    Raises:
        UserError: as ``scan_job_data``; the worker fails the job at once with it.
    """
    problems, pairs, labels = Problems(filename), list[str](), list[Any]()
    texts: list[Any] = []  # strings, or lists of words (token_classification)
    negatives: dict[str, list[str]] = {column: [] for column in cols.negatives}
    classes = ClassIndex.of(filename, cols)
    for batch in job_batches(path, fmt, filename, cols, problems):
        texts += batch.texts
        pairs += batch.pairs or []
        labels += batch.labels
        for column, values in batch.negatives.items():
            negatives[column] += values
        if classes is not None:
            classes.add(batch)
    problems.raise_if_any()
    frame: dict[str, Any] = {cols.text: texts, **({cols.text_pair: pairs} if cols.text_pair else {}), **negatives}
    if cols.label:
        frame[cols.label] = labels if classes is not None else np.array(labels, dtype=np.float32)
    return pd.DataFrame(frame), classes.summary() if classes is not None else LabelSummary(len(texts))
