"""The options of a job to create (``tunejob jobs create``, ``tunejob predict create``), read into
the request's body; ``tunejob sweeps create`` (``client.sweeps``) takes the same ones for its trials.
A usage error (``UsageError``) exits 2 (``client.cli``)."""

import argparse
import difflib
import json
from pathlib import Path
from typing import Any


class UsageError(Exception):
    """A command line the client cannot act on (a missing option, an unreadable file): exit code 2."""


def add_create_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``tunejob jobs create`` (and of ``sweeps create``: its trials' fixed spec), on parser ``p``."""
    p.add_argument("--spec", type=Path, help="a JSON job spec (the POST /jobs body); the options below override it")
    p.add_argument("--model", help="base_model, e.g. all-MiniLM-L6-v2 (tunejob models lists them)")
    p.add_argument("--dataset", help="training_dataset: a dataset id (tunejob datasets upload FILE)")
    p.add_argument("--validation", help="validation_dataset id (default: validation_split 0.1 of the training set)")
    p.add_argument("--validation-split", type=float, help="the share of the training rows held out (0.1)")
    p.add_argument(
        "--task",
        choices=["classification", "regression", "multi_label", "token_classification", "embedding", "reranking"],
        help="token_classification: --text-column holds word lists (default tokens), "
        "--label-column tag lists (default tags); embedding: the columns below",
    )
    p.add_argument("--anchor-column", help="embedding: the queries (default anchor)")
    p.add_argument("--positive-column", help="embedding: the text each anchor should find (default positive)")
    p.add_argument(
        "--negative-column",
        action="append",
        dest="negative_columns",
        metavar="COLUMN",
        help="embedding: a column of hard negatives (repeat for several)",
    )
    p.add_argument("--score-column", help="embedding: a similarity in [0, 1] per pair (CoSENT)")
    p.add_argument("--query-column", help="reranking: the queries (default query)")
    p.add_argument("--passage-column", help="reranking: the passage scored against each query (default passage)")
    p.add_argument("--text-column", help="the texts (default text)")
    p.add_argument("--text-pair-column", help="a second text per row, read as the tokenizer's pair (default none)")
    p.add_argument("--label-column", help="the labels (default label)")
    p.add_argument("--label-separator", help="multi_label: split text labels on this, e.g. '|' (CSV needs it)")
    threshold = p.add_mutually_exclusive_group()
    threshold.add_argument(
        "--decision-threshold", type=float, help="multi_label: predict a label from this score (0.5)"
    )
    threshold.add_argument(
        "--tune-threshold",
        action="store_const",
        const=True,
        help="multi_label: pick the threshold with the best validation micro-F1",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        type=setting,
        metavar="KEY=VALUE",
        help="a hyperparameter, e.g. --set epochs=1 --set learning_rate=1e-4 (values are JSON, else text)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan (steps, padding efficiency, duration); nothing is queued"
    )
    p.add_argument("--watch", action="store_true", help="then follow it as `tunejob jobs watch` does")


def setting(text: str) -> tuple[str, Any]:
    """``key=value`` -> (key, value): the value as JSON (``1``, ``1e-4``, ``true``), else as text.

    Raises:
        argparse.ArgumentTypeError: not ``KEY=VALUE``, or ``KEY`` is no hyperparameter (the closest
            names suggested: the server would refuse it too, without them).
    """
    from shared.schemas.hyperparameters import Hyperparameters

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    if key not in Hyperparameters.model_fields:
        close = difflib.get_close_matches(key, list(Hyperparameters.model_fields), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(close)}?" if close else f"one of {', '.join(Hyperparameters.model_fields)}"
        raise argparse.ArgumentTypeError(f"{key!r} is not a hyperparameter: {hint}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def job_spec(args) -> dict[str, Any]:
    """The POST /jobs body: ``--spec``'s JSON, overridden by the options given.

    Raises:
        UsageError: unreadable ``--spec``, or no base model or training dataset.
    """
    spec = read_spec(args.spec)
    options = {
        "base_model": args.model,
        "training_dataset": args.dataset,
        "validation_dataset": args.validation,
        "validation_split": args.validation_split,
        "task": args.task,
        "text_column": args.text_column,
        "text_pair_column": args.text_pair_column,
        "label_column": args.label_column,
        "label_separator": args.label_separator,
        "decision_threshold": args.decision_threshold,
        "tune_threshold": args.tune_threshold,
        "anchor_column": args.anchor_column,
        "positive_column": args.positive_column,
        "negative_columns": args.negative_columns,
        "score_column": args.score_column,
        "query_column": args.query_column,
        "passage_column": args.passage_column,
    }
    spec.update({k: v for k, v in options.items() if v is not None})
    spec.setdefault("hyperparameters", {}).update(dict(args.set))
    require(spec, [("--model", "base_model"), ("--dataset", "training_dataset")])
    return spec


def prediction_spec(args) -> dict[str, Any]:
    """The POST /predictions body: ``--spec``'s JSON, overridden by the options given.

    Raises:
        UsageError: unreadable ``--spec``, or no model or dataset.
    """
    spec = read_spec(args.spec)
    options = {
        "model": args.model,
        "dataset": args.dataset,
        "text_column": args.text_column,
        "text_pair_column": args.text_pair_column,
        "id_column": args.id_column,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "label_column": args.label_column,
        "count_unknown_labels": args.count_unknown_labels,
    }
    spec.update({k: v for k, v in options.items() if v is not None})
    require(spec, [("--model", "model"), ("--dataset", "dataset")])
    return spec


def read_spec(path: Path | None) -> dict[str, Any]:
    """The JSON object in ``path`` (``--spec``), or ``{}`` without one. Raises UsageError if unreadable."""
    try:
        spec = json.loads(path.read_text()) if path else {}
    except (OSError, ValueError) as e:
        raise UsageError(f"--spec {path}: {e}") from e
    if not isinstance(spec, dict):
        raise UsageError(f"--spec {path}: expected a JSON object (the request body), not {type(spec).__name__}")
    return spec


def require(spec: dict[str, Any], options: list[tuple[str, str]]) -> None:
    """Raise UsageError naming each (option, key) pair whose key ``spec`` lacks."""
    missing = [f"{option} (or {key} in --spec)" for option, key in options if key not in spec]
    if missing:
        raise UsageError(f"give {' and '.join(missing)}")
