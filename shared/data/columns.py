"""A job's columns, checked row by row: non-empty text, class names, ``multi_label`` lists, regression
targets, token_classification words and tags (``job_batches``), each problem put in a validation
report."""

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.data.formats import FLOAT32_MAX, MAX_CLASS_NAME_CHARS, MAX_REGRESSION_TARGET
from shared.data.problems import Problems
from shared.data.read import read_batches
from shared.data.readers.base import Batch

# ----------------------------------------------------------------------------- job data


@dataclass(frozen=True)
class JobColumns:
    """The columns a job reads and how its labels are checked (from a ``JobCreate`` or its stored
    ``spec`` dict)."""

    task: str
    text: str  # embedding: the anchor column
    text_pair: str | None  # embedding: the positive column
    label: str | None  # embedding: the score column, if any
    allow_large_targets: bool = False
    label_separator: str | None = None  # multi_label: splits a text label cell
    negatives: tuple[str, ...] = ()  # embedding: hard-negative columns

    @classmethod
    def of(cls, spec) -> "JobColumns":
        get = spec.get if isinstance(spec, dict) else lambda k, default=None: getattr(spec, k, default)
        if get("task") == "embedding":
            return cls(
                "embedding",
                get("anchor_column", "anchor"),
                get("positive_column", "positive"),
                get("score_column"),
                negatives=tuple(get("negative_columns") or ()),
            )
        if get("task") == "reranking":
            return cls(
                "reranking",
                get("query_column", "query"),
                get("passage_column", "passage"),
                get("label_column", "label"),
            )
        return cls(
            get("task", "classification"),
            get("text_column", "text"),
            get("text_pair_column"),
            get("label_column", "label"),
            bool(get("allow_large_targets", False)),
            get("label_separator"),
        )

    @property
    def grouped(self) -> bool:
        """Rows that share their first text (a reranking query's passages, an embedding anchor's
        positives) belong together: the validation split holds them out whole (``shared.data.split``)."""
        return self.task in ("embedding", "reranking")

    @property
    def has_classes(self) -> bool:
        """The labels are class names (one per row, or a list of them)."""
        return self.task in ("classification", "multi_label")

    def label_of(self, value: Any) -> str | float | list[str]:
        """A label cell as the task reads it (``class_name``, ``regression_target``, ``label_list``).

        Raises:
            ValueError: the message says what is wrong with the cell.
        """
        if self.task == "regression":
            return regression_target(value, self.allow_large_targets)
        if self.task == "multi_label":
            return label_list(value, self.label_separator)
        if self.task in ("embedding", "reranking"):
            return similarity_score(value)
        return class_name(value)

    @property
    def label_param(self) -> str:
        """The spec field that names the label column."""
        return "score_column" if self.task == "embedding" else "label_column"

    @property
    def texts(self) -> list[tuple[str, str]]:
        """(column, spec field) of each text input."""
        if self.task in ("embedding", "reranking"):
            assert self.text_pair is not None  # ``of`` names both text columns of these tasks
            if self.task == "reranking":
                return [(self.text, "query_column"), (self.text_pair, "passage_column")]
            return [
                (self.text, "anchor_column"),
                (self.text_pair, "positive_column"),
                *((column, "negative_columns") for column in self.negatives),
            ]
        return [(self.text, "text_column")] + ([(self.text_pair, "text_pair_column")] if self.text_pair else [])

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([c for c, _ in self.texts] + ([self.label] if self.label else [])))

    @property
    def list_columns(self) -> tuple[str, ...]:
        """Columns of lists: multi_label's labels, token_classification's words and tags."""
        if self.label is None:  # embedding without a score_column
            return ()
        return {"multi_label": (self.label,), "token_classification": (self.text, self.label)}.get(self.task, ())


def _kind(value: Any) -> str:
    """What a cell holds, in words."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "a nested value (an object)"
    if isinstance(value, (list, tuple)):
        return "a nested value (a list)"
    if isinstance(value, bytes):
        return "bytes (binary)"
    return f"a {type(value).__name__} value"


def check_text(value: Any) -> str | None:
    """What is wrong with a text cell, or None when it is a non-empty string."""
    if value is None:
        return "is missing"
    if isinstance(value, bytes):
        return "holds bytes (binary), not text: store text as a UTF-8 string column"
    if not isinstance(value, str):
        return f"holds {_kind(value)}, not text"
    if not value.strip():
        return "is empty"
    return None


def class_name(value: Any) -> str:
    """A classification label as its class name: text as written, integers in decimal, booleans
    as ``true``/``false`` (so a JSONL ``1`` and ``"1"`` are the same class, as in a CSV).

    Raises:
        ValueError: the message says what is wrong (missing, float, nested, ...).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is empty")
        if len(value) > MAX_CLASS_NAME_CHARS:
            raise ValueError(
                f"is {len(value):,} characters long; class names are at most {MAX_CLASS_NAME_CHARS:,} "
                "(is it the right column?)"
            )
        return value
    if value is None:
        raise ValueError("is missing")
    if isinstance(value, float):
        raise ValueError(
            "is a float; classification labels are class names (strings, integers or booleans): "
            "use task 'regression' for numeric targets"
        )
    raise ValueError(f"holds {_kind(value)}; labels are strings, integers or booleans")


def label_list(value: Any, separator: str | None) -> list[str]:
    """A multi_label cell as its class names (``class_name`` each), duplicates dropped, first
    occurrence first: a list (JSONL, Parquet), or text split on ``separator`` (each part
    stripped). An empty list, or empty text with a separator, is a row with no label.

    Raises:
        ValueError: missing, text without a separator, not a list, or an item that is not a
            class name (empty, a float, nested).
    """
    if isinstance(value, str) and separator is not None:
        value = [part.strip() for part in value.split(separator)] if value.strip() else []
    if value is None:
        raise ValueError("is missing")
    if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
        # pandas' to_csv of a list column: split on "," it would read "['Comedy'" as a class
        raise ValueError(
            "holds a list written as text (as pandas' to_csv writes one): write the file as JSONL or "
            "Parquet (df.to_json(path, orient='records', lines=True)), or join each row's labels with a "
            "separator and give label_separator"
        )
    if isinstance(value, str):
        raise ValueError('holds text, not a list of labels: give label_separator (e.g. ",") to split it')
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"holds {_kind(value)}; multi_label labels are lists of class names, or text split on label_separator"
        )
    names = []
    for item in value:
        try:
            names.append(class_name(item))
        except ValueError as e:
            raise ValueError(f"holds a label that {e}") from None
    return list(dict.fromkeys(names))


def regression_target(value: Any, allow_large: bool = False) -> float:
    """A regression label as a float: a number, or text that spells one (CSV cells are text).

    Raises:
        ValueError: missing, not a number (booleans are not), not finite, beyond float32, or
            |y| > ``MAX_REGRESSION_TARGET`` unless ``allow_large``.
    """
    if value is None or isinstance(value, str) and not value.strip():
        raise ValueError("is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"holds {_kind(value)}, not a number")
    try:
        if isinstance(value, str) and "_" in value:
            raise ValueError
        y = float(value)
    except (ValueError, OverflowError):
        raise ValueError("is not a number" if isinstance(value, str) else "is not a finite number") from None
    if not math.isfinite(y) or abs(y) > FLOAT32_MAX:
        raise ValueError("is not a finite number (float32)")
    if abs(y) > MAX_REGRESSION_TARGET and not allow_large:
        raise ValueError(
            f"is larger than {MAX_REGRESSION_TARGET:g} in absolute value; scale the targets, or set "
            "allow_large_targets to true in the job spec"
        )
    return y


def similarity_score(value: Any) -> float:
    """An embedding pair's score or a reranking label (``regression_target``) in [0, 1].

    Raises:
        ValueError: not a number, or outside [0, 1].
    """
    y = regression_target(value)
    if not 0.0 <= y <= 1.0:
        raise ValueError(
            "is outside [0, 1]; an embedding pair's score is its similarity, a reranking label its "
            "relevance, each from 0 (unrelated) to 1 (the same meaning, or relevant)"
        )
    return y


@dataclass
class JobBatch:
    """Validated rows of a job's file: ``texts`` (and ``pairs``) are non-empty strings, ``labels``
    class names, float targets or (multi_label) lists of class names (token_classification:
    ``texts`` are lists of words, ``labels`` lists of tag names as long); ``start`` is the 0-based
    index of the first row."""

    start: int
    texts: list[str] | list[list[str]]
    pairs: list[str] | None
    labels: list
    negatives: dict[str, list[str]] = field(default_factory=dict)  # embedding: each hard-negative column's texts


def job_batches(path: Path, fmt: str, filename: str, cols: JobColumns, problems: Problems) -> Iterator[JobBatch]:
    """Read and check a job's columns batch by batch. Problems go to ``problems`` (the caller
    raises them once the file is read); no batch is yielded after the first problem."""
    for batch in read_batches(path, fmt, filename, cols.names, problems, cols.list_columns):
        if cols.task == "token_classification":
            yield from _tagged_batch(batch, cols, problems)
            continue
        labels = []
        for column, param in cols.texts:
            for i, value in enumerate(batch.values[column]):
                if (message := check_text(value)) is not None:
                    code = "missing_value" if message in ("is missing", "is empty") else "invalid_text"
                    problems.add(batch.start + i + 1, column, value, message, code, param)
        for i, value in enumerate(batch.values[cols.label] if cols.label else []):
            try:
                labels.append(cols.label_of(value))
            except ValueError as e:
                code = "missing_value" if str(e) in ("is missing", "is empty") else "invalid_label"
                problems.add(batch.start + i + 1, cols.label, value, str(e), code, cols.label_param)
        if problems.items:
            continue  # keep reading to report up to MAX_PROBLEMS, but hand out no data
        yield JobBatch(
            batch.start,
            batch.values[cols.text],
            batch.values[cols.text_pair] if cols.text_pair else None,
            labels,
            {column: batch.values[column] for column in cols.negatives},
        )


# -- token_classification: a list of words and a list of tags per row


def check_words(value: Any) -> str | None:
    """What is wrong with a cell of words, or None when it is a non-empty list of non-empty strings."""
    if value is None:
        return "is missing"
    if isinstance(value, str):
        return (
            "holds text, not a list of words: token_classification reads a JSON list per row (JSONL), a list "
            "column (Parquet) or a CoNLL file"
        )
    if not isinstance(value, (list, tuple)):
        return f"holds {_kind(value)}, not a list of words"
    if not value:
        return "is an empty sentence (no words)"
    for i, word in enumerate(value):
        if (message := check_text(word)) is not None:
            return f"word {i + 1} {message}"
    return None


def tag_names(value: Any, words: Any) -> list[str]:
    """A cell of tags as class names (``class_name``), one per word of ``words``.

    Raises:
        ValueError: missing, not a list, a tag that is not a class name, or not as many tags as words.
    """
    if value is None:
        raise ValueError("is missing")
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"holds {'text' if isinstance(value, str) else _kind(value)}, not a list of tags")
    names = []
    for i, tag in enumerate(value):
        try:
            names.append(class_name(tag))
        except ValueError as e:
            raise ValueError(f"tag {i + 1} {e}") from None
    if isinstance(words, (list, tuple)) and len(names) != len(words):
        raise ValueError(f"has {len(names)} tag(s) for {len(words)} word(s); give one tag per word")
    return names


def _tagged_batch(batch: Batch, cols: JobColumns, problems: Problems) -> Iterator[JobBatch]:
    """A token_classification batch checked (``check_words``, ``tag_names``): a ``JobBatch`` of
    word lists and tag-name lists, or nothing once ``problems`` has any."""
    assert cols.label is not None  # token_classification's tags
    words, tags = batch.values[cols.text], []
    for i, (value, label) in enumerate(zip(words, batch.values[cols.label])):
        if (message := check_words(value)) is not None:
            code = "missing_value" if message.startswith(("is missing", "is an empty")) else "invalid_text"
            problems.add(batch.start + i + 1, cols.text, value, message, code, "text_column")
        try:
            tags.append(tag_names(label, value))
        except ValueError as e:
            code = "missing_value" if str(e) == "is missing" else "invalid_label"
            problems.add(batch.start + i + 1, cols.label, label, str(e), code, "label_column")
    if not problems.items:
        yield JobBatch(batch.start, [list(w) for w in words], None, tags)
