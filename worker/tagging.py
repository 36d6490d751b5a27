"""token_classification: word tags aligned to subword tokens, and entity-level metrics.

Alignment is the Hugging Face token-classification recipe (``transformers`` examples
``run_ner.py``; the course's chapter 7, "Token classification"): each row's words are tokenized with
``is_split_into_words=True``, the fast tokenizer's ``word_ids()`` maps every subword to its word,
the word's tag goes on its first subword and every other position (special tokens, later
subwords) gets ``IGNORE`` (-100), which the loss skips. With ``label_all_subwords`` the later
subwords get the word's tag too, ``B-X`` as ``I-X`` (``run_ner.py``'s ``label_all_tokens`` with
``b_to_i_label``).

Metrics are seqeval's entity-level precision, recall and F1 (micro-averaged over entities, and per
entity type), in strict IOB2 mode where the tag set is IOB2, plus token accuracy over the first
subword of every word (the words themselves, whatever ``label_all_subwords`` trained on). Plain tags
without IOB prefixes (the IO scheme) are scored as ``I-`` tags: a run of one type is one entity.
"""

from collections.abc import Callable

import numpy as np
import pandas as pd
import torch
from seqeval.metrics import accuracy_score, classification_report
from seqeval.scheme import IOB2
from transformers import PreTrainedTokenizerBase

from worker.data import TOKENIZE_BATCH, Ragged, TokenizedDataset, add_encodings
from worker.reporter import Interrupted

IGNORE = -100  # label of a position the loss and the metrics skip (torch's cross_entropy ignore_index)


def inside_tags(names: list[str]) -> list[int]:
    """For each tag index, the index of the tag that a word's later subwords get: ``I-X`` for
    ``B-X`` where the tag set has it, else the tag itself."""
    index = {name: i for i, name in enumerate(names)}
    return [index.get("I-" + name[2:], i) if name.startswith("B-") else i for i, name in enumerate(names)]


def align_labels(word_ids: list[int | None], tags: list[int], inside: list[int] | None) -> list[int]:
    """Subword labels from word tags: ``word_ids`` (one per subword, None for special tokens) as the
    fast tokenizer's ``word_ids()`` gives them, ``tags`` one index per word. The first subword of a
    word gets its tag; later subwords get ``IGNORE``, or, with ``inside`` (``inside_tags``), the
    tag's inside form; special tokens get ``IGNORE``. Words cut off by truncation have no subword."""
    labels, previous = [], None
    for word in word_ids:
        if word is None:
            labels.append(IGNORE)
        elif word != previous:
            labels.append(tags[word])
        else:
            labels.append(inside[tags[word]] if inside is not None else IGNORE)
        previous = word
    return labels


def tokenize_words(
    tokenizer: PreTrainedTokenizerBase,
    df: pd.DataFrame,
    words_column: str,
    tags_column: str,
    label_names: list[str],
    max_length: int,
    label_all_subwords: bool = False,
    interrupted: Callable[[], str | None] = lambda: None,
) -> TokenizedDataset:
    """Tokenize rows of words (``words_column``: lists of strings) with the fast tokenizer, in
    batches of ``TOKENIZE_BATCH`` rows, truncated to ``max_length`` tokens, without padding, and
    align their tags (``tags_column``: lists of names in ``label_names``) with ``align_labels``.

    Returns a ``TokenizedDataset`` whose ``labels[i]`` is a list of ints as long as example i's
    ``input_ids``. Not cached (``worker.data.tokenize``'s cache holds no word ids).

    Raises:
        ValueError: the tokenizer is not a fast one (only those have ``word_ids()``).
        worker.reporter.Interrupted: ``interrupted()`` gave a reason, as in ``worker.data.tokenize``.
    """
    if not tokenizer.is_fast:
        raise ValueError("token_classification needs a fast tokenizer (word_ids())")
    index = {name: i for i, name in enumerate(label_names)}
    inside = inside_tags(label_names) if label_all_subwords else None
    words, tags = df[words_column].tolist(), df[tags_column].tolist()
    parts: dict[str, list[Ragged]] = {}
    labels = []
    for start in range(0, len(words), TOKENIZE_BATCH):
        if reason := interrupted():
            raise Interrupted(reason)
        enc = tokenizer(
            words[start : start + TOKENIZE_BATCH],
            is_split_into_words=True,
            truncation=True,
            max_length=max_length,
            padding=False,
        )
        add_encodings(parts, enc, tokenizer)
        for i, row_tags in enumerate(tags[start : start + TOKENIZE_BATCH]):
            labels.append(align_labels(enc.word_ids(i), [index[t] for t in row_tags], inside))
    return TokenizedDataset({k: Ragged.join(rows) for k, rows in parts.items()}, labels)


def is_iob2(names: list[str]) -> bool:
    """Whether a tag set is IOB2: every tag is ``O``, ``B-X`` or ``I-X``, each ``I-X`` with its ``B-X``."""
    if not all(name == "O" or name[:2] in ("B-", "I-") and len(name) > 2 for name in names):
        return False
    return all("B-" + name[2:] in names for name in names if name.startswith("I-"))


def inside_names(names: list[str]) -> dict[str, str] | None:
    """How plain tags are scored: None when the tag set uses IOB prefixes (scored as written);
    otherwise (``PER``, ``LOC``, ``O``) each tag but ``O`` as ``I-<tag>``, which seqeval reads as
    runs of one type (it would read ``PER`` as prefix ``P`` of type ``ER``)."""
    if any(name[:2] in ("B-", "I-") for name in names):
        return None
    return {name: name if name == "O" else f"I-{name}" for name in names}


def word_sequences(
    predictions: list[torch.Tensor], targets: list[torch.Tensor], names: list[str]
) -> tuple[list[list[str]], list[list[str]]]:
    """Gold and predicted tag names per example, at the positions whose target is not ``IGNORE``
    (the first subword of each word in a validation set). ``predictions`` and ``targets`` are per
    micro-batch ``[rows, width]`` ints."""
    lookup = np.array(names, dtype=object)
    y_true, y_pred = [], []
    for predicted, target in zip(predictions, targets):
        predicted, target = predicted.cpu().numpy(), target.cpu().numpy()
        for p_row, t_row in zip(predicted, target):
            keep = t_row != IGNORE
            y_true.append(lookup[t_row[keep]].tolist())
            y_pred.append(lookup[p_row[keep]].tolist())
    return y_true, y_pred


def tagging_metrics(y_true: list[list[str]], y_pred: list[list[str]], names: list[str]) -> dict:
    """``entity_precision``, ``entity_recall``, ``entity_f1`` (seqeval, micro-averaged over
    entities; strict IOB2 when ``is_iob2(names)``, else seqeval's default conlleval-style
    chunking; plain tags as ``inside_names`` maps them), ``token_accuracy`` (share of words tagged right) and ``per_entity``: for each entity
    type, its ``precision``, ``recall``, ``f1`` and ``support`` (gold entities)."""
    if (plain := inside_names(names)) is not None:
        y_true, y_pred = ([[plain[t] for t in row] for row in rows] for rows in (y_true, y_pred))
        names = list(plain.values())
    strict = {"mode": "strict", "scheme": IOB2} if is_iob2(names) else {}
    report = classification_report(y_true, y_pred, output_dict=True, zero_division=0, **strict)
    overall = report.pop("micro avg", {"precision": 0.0, "recall": 0.0, "f1-score": 0.0})
    for average in ("macro avg", "weighted avg"):
        report.pop(average, None)
    return {
        "entity_precision": float(overall["precision"]),
        "entity_recall": float(overall["recall"]),
        "entity_f1": float(overall["f1-score"]),
        "token_accuracy": float(accuracy_score(y_true, y_pred)),
        "per_entity": {
            kind: {
                "precision": float(v["precision"]),
                "recall": float(v["recall"]),
                "f1": float(v["f1-score"]),
                "support": int(v["support"]),
            }
            for kind, v in report.items()
        },
    }
