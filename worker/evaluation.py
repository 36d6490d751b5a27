"""The evaluation report (issue 37): where a model fails, on the validation split at the kept (best)
checkpoint, or on a labelled test set.

The report is computed from what the saved model predicts (``shared.inference.loop``, the code
behind ``POST /predict`` and prediction jobs), so its confusion matrix and per-class figures are
what a user who downloads the model finds on the same rows. The metrics are scikit-learn's
(``precision_recall_fscore_support``, ``confusion_matrix``, ``roc_auc_score``,
``average_precision_score``, ``calibration_curve``, ``mean_absolute_error``...), scipy's
correlations and seqeval's entity report (``worker.tagging.tagging_metrics``, the validation
metrics' own definitions). Expected calibration error is Guo et al., "On Calibration of Modern
Neural Networks" (ICML 2017), eq. 3, over ``CALIBRATION_BINS`` equal-width bins of the top
label's probability: ``sum_b |B_b| / n * |accuracy(B_b) - confidence(B_b)|``.

Written into the model directory as ``evaluation.json`` (``EVALUATION``) with its pictures
(matplotlib's ``Figure``, no pyplot): ``confusion_matrix.png`` and ``reliability_diagram.png``
(classification), ``residuals.png`` (regression).
"""

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.calibration import calibration_curve
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    confusion_matrix,
    mean_absolute_error,
    mean_squared_error,
    precision_recall_fscore_support,
    roc_auc_score,
)

from shared.data.batching import job_ladder, token_budget_batches
from shared.inference.loop import DEFAULT_MAX_TOKENS, LoadedModel, load_for_inference, predict_texts, run_batches
from shared.schemas.jobs import json_safe
from shared.store.artifacts import EVALUATION
from worker.tagging import tagging_metrics

MISTAKES = 25  # the most confident mistakes, largest errors, or sentences with most errors listed
CALIBRATION_BINS = 10
TEXT_CHARS = 1000  # a listed text is cut to this many characters


REPORTED_TASKS = ("classification", "regression", "multi_label", "token_classification")


def write_evaluation(
    model_dir: Path, task: str, table: pd.DataFrame | None, columns: dict, device: torch.device
) -> dict | None:
    """Predict ``table`` (the validation rows) with the model saved in ``model_dir`` and write the
    report there (``write_report``). ``columns``: the job's ``text_column``, ``text_pair_column``
    and ``label_column``. Returns the report, or None (nothing written) without a table or for a
    task this report does not cover (``REPORTED_TASKS``: embedding and reranking jobs report their
    retrieval metrics in validation instead)."""
    if table is None or not len(table) or task not in REPORTED_TASKS:
        return None
    loaded = load_for_inference(model_dir, device)
    texts, labels = table[columns["text_column"]].tolist(), table[columns["label_column"]].tolist()
    if task == "token_classification":
        report = token_report(loaded.label_names, labels, predict_words(loaded, texts), texts)
    else:
        pair_column = columns.get("text_pair_column")
        pairs = table[pair_column].tolist() if pair_column else None
        rows = predict_texts(loaded, texts, pairs).rows
        report = sequence_report(task, loaded.label_names, labels, rows, texts, loaded.decision_threshold)
    return write_report(model_dir, report)


def sequence_report(
    task: str,
    label_names: list[str] | None,
    gold: list,
    rows: list[dict],
    texts: list[str],
    threshold: float | None = None,
) -> dict:
    """The report of a classification, multi_label or regression model from its prediction ``rows``
    (``shared.inference.loop.Predictions.rows``, in the order of ``gold`` and ``texts``). ``gold``:
    class names, lists of class names (multi_label) or numbers; ``threshold``: multi_label's
    decision threshold, which the rows' ``labels`` already applied."""
    if task == "classification":
        return classification_report(label_names, [str(g) for g in gold], rows, texts)
    if task == "multi_label":
        return multi_label_report(label_names, gold, rows, threshold)
    return regression_report(np.asarray(gold, dtype=np.float64), np.array([r["value"] for r in rows]), texts)


def classification_report(label_names: list[str], gold: list[str], rows: list[dict], texts: list[str]) -> dict:
    """Per-class precision, recall, F1 and support; macro, micro and weighted averages; the
    confusion matrix (rows gold, columns predicted; counts and row-normalized); ROC-AUC and PR-AUC
    of the second class when there are two; calibration; the ``MISTAKES`` most confident mistakes.

    A gold label the model does not know (a test set's) is counted as an error, as
    ``trainer.evaluate`` would: it gets a row of the matrix and of the per-class table after the
    model's classes, and is listed in ``unknown_labels``."""
    predicted = [r["label"] for r in rows]
    scores = np.array([[r["probabilities"][n] for n in label_names] for r in rows])
    unknown = sorted(set(gold) - set(label_names))
    names = label_names + unknown
    counts = confusion_matrix(gold, predicted, labels=names)
    confidence = scores.max(axis=1)
    correct = np.array(gold) == np.array(predicted)
    report = {
        "task": "classification",
        "rows": len(gold),
        "accuracy": float(accuracy_score(gold, predicted)),
        **per_label_figures("per_class", gold, predicted, names, ("macro", "micro", "weighted")),
        "confusion_matrix": {
            "labels": names,
            "counts": counts.tolist(),
            "normalized": (counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)).tolist(),
        },
        "calibration": calibration(confidence, correct),
        "unknown_labels": unknown,
        "mistakes": [
            {
                "row": int(i),
                "text": texts[i][:TEXT_CHARS],
                "label": gold[i],
                "prediction": predicted[i],
                "score": float(confidence[i]),
            }
            for i in np.argsort(-confidence, kind="stable")
            if not correct[i]
        ][:MISTAKES],
    }
    if len(label_names) == 2:
        positive = np.array(gold) == label_names[1]
        both = 0 < positive.sum() < len(positive)
        report["roc_auc"] = float(roc_auc_score(positive, scores[:, 1])) if both else None
        report["pr_auc"] = float(average_precision_score(positive, scores[:, 1])) if both else None
    return report


def calibration(confidence: np.ndarray, correct: np.ndarray) -> dict:
    """Expected calibration error (module docstring) and the reliability diagram's points: per
    non-empty bin of the top label's probability, its mean ``confidence``, ``accuracy`` and ``count``
    (``sklearn.calibration.calibration_curve``, uniform bins)."""
    confidence = np.clip(confidence, 0.0, 1.0)
    accuracy, mean_confidence = calibration_curve(
        correct, confidence, n_bins=CALIBRATION_BINS, strategy="uniform", pos_label=True
    )
    bins = np.searchsorted(np.linspace(0, 1, CALIBRATION_BINS + 1)[1:-1], confidence)  # calibration_curve's bins
    counts = np.bincount(bins, minlength=CALIBRATION_BINS)
    counts = counts[counts > 0]
    ece = float(np.sum(counts / len(confidence) * np.abs(accuracy - mean_confidence)))
    return {
        "ece": ece,
        "bins": [
            {"confidence": float(c), "accuracy": float(a), "count": int(n)}
            for c, a, n in zip(mean_confidence, accuracy, counts)
        ],
    }


def multi_label_report(label_names: list[str], gold: list[list[str]], rows: list[dict], threshold: float) -> dict:
    """Per-label precision, recall, F1 and support at the model's decision ``threshold`` (the tuned
    one, saved with the model), their micro and macro averages, and subset accuracy."""
    index = {n: i for i, n in enumerate(label_names)}
    y_true = np.zeros((len(gold), len(label_names)), dtype=np.int8)
    y_pred = np.zeros_like(y_true)
    for i, (labels, row) in enumerate(zip(gold, rows)):
        y_true[i, [index[n] for n in labels if n in index]] = 1
        y_pred[i, [index[n] for n in row["labels"]]] = 1
    return {
        "task": "multi_label",
        "rows": len(gold),
        "threshold": threshold,
        "subset_accuracy": float(accuracy_score(y_true, y_pred)),
        **per_label_figures("per_label", y_true, y_pred, label_names, ("macro", "micro")),
        "unknown_labels": sorted({n for labels in gold for n in labels} - set(label_names)),
    }


def per_label_figures(key: str, gold, predicted, names: list[str], averages: tuple[str, ...]) -> dict:
    """``{key: {name: {precision, recall, f1, support}}, "averages": {average: {precision, recall,
    f1}}}`` from scikit-learn's ``precision_recall_fscore_support``: ``gold`` and ``predicted`` are
    label lists (``names`` their order) or 0/1 indicator arrays ``[rows, len(names)]``."""
    labels = None if isinstance(gold, np.ndarray) and gold.ndim == 2 else names
    precision, recall, f1, support = precision_recall_fscore_support(gold, predicted, labels=labels, zero_division=0)
    return {
        key: {
            n: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
            for n, p, r, f, s in zip(names, precision, recall, f1, support)
        },
        "averages": {
            average: dict(
                zip(
                    ("precision", "recall", "f1"),
                    map(
                        float,
                        precision_recall_fscore_support(
                            gold, predicted, labels=labels, average=average, zero_division=0
                        )[:3],
                    ),
                )
            )
            for average in averages
        },
    }


def regression_report(gold: np.ndarray, predicted: np.ndarray, texts: list[str]) -> dict:
    """MAE, RMSE, Pearson's and Spearman's correlations (None under two rows or a constant side),
    the residuals (prediction - gold) for the residual plot, and the ``MISTAKES`` largest errors."""
    residuals = predicted - gold
    varied = len(gold) > 1 and np.ptp(gold) > 0 and np.ptp(predicted) > 0
    return {
        "task": "regression",
        "rows": len(gold),
        "mae": float(mean_absolute_error(gold, predicted)),
        "rmse": float(np.sqrt(mean_squared_error(gold, predicted))),
        "pearson_r": float(pearsonr(gold, predicted).statistic) if varied else None,
        "spearman_r": float(spearmanr(gold, predicted).statistic) if varied else None,
        "residuals": {"label": gold.tolist(), "residual": residuals.tolist()},
        "largest_errors": [
            {
                "row": int(i),
                "text": texts[i][:TEXT_CHARS],
                "label": float(gold[i]),
                "prediction": float(predicted[i]),
                "error": float(residuals[i]),
            }
            for i in np.argsort(-np.abs(residuals), kind="stable")[:MISTAKES]
        ],
    }


def predict_words(loaded: LoadedModel, words: list[list[str]]) -> list[list[str]]:
    """Each sentence's predicted tag per word, from the word's first subword (as validation scores
    words: ``worker.tagging``); words cut off by truncation at the model's ``max_length`` get none."""
    encoded = loaded.tokenizer(
        words, is_split_into_words=True, truncation=True, max_length=loaded.model_max_length, padding=False
    )
    features = [
        {k: encoded[k][i] for k in loaded.tokenizer.model_input_names if k in encoded} for i in range(len(words))
    ]
    ladder = job_ladder(loaded.model_max_length, None, False, loaded.device.type == "cuda")
    budget = DEFAULT_MAX_TOKENS.get(loaded.device.type, DEFAULT_MAX_TOKENS["cpu"])
    lengths = np.array([len(f["input_ids"]) for f in features])
    logits, _ = run_batches(loaded, features, token_budget_batches(lengths, budget, ladder), ladder)
    tags = []
    for i, scores in enumerate(logits):
        word_ids = encoded.word_ids(i)
        first = [p for p, w in enumerate(word_ids) if w is not None and (p == 0 or word_ids[p - 1] != w)]
        tags.append([loaded.label_names[t] for t in scores[first].argmax(-1).tolist()])
    return tags


def token_report(
    label_names: list[str], gold: list[list[str]], predicted: list[list[str]], words: list[list[str]]
) -> dict:
    """seqeval's entity-level report (``tagging_metrics``: overall and per entity type) and the
    ``MISTAKES`` sentences with the most wrongly tagged words. Gold tags of words the prediction
    does not reach (truncated) are left out, as in validation."""
    gold = [g[: len(p)] for g, p in zip(gold, predicted)]
    errors = np.array([sum(a != b for a, b in zip(g, p)) for g, p in zip(gold, predicted)])
    return {
        "task": "token_classification",
        "rows": len(gold),
        **tagging_metrics(gold, predicted, label_names),
        "worst_sentences": [
            {"row": int(i), "words": words[i], "labels": gold[i], "predictions": predicted[i], "errors": int(errors[i])}
            for i in np.argsort(-errors, kind="stable")[:MISTAKES]
            if errors[i]
        ],
    }


def headline(report: dict) -> dict[str, float | None]:
    """The report's summary figures (its ``metrics``; the model card's ``model-index``)."""
    if report["task"] == "classification":
        macro = report["averages"]["macro"]
        return {
            "accuracy": report["accuracy"],
            "f1_macro": macro["f1"],
            "precision_macro": macro["precision"],
            "recall_macro": macro["recall"],
        }
    if report["task"] == "multi_label":
        return {
            "f1_micro": report["averages"]["micro"]["f1"],
            "f1_macro": report["averages"]["macro"]["f1"],
            "subset_accuracy": report["subset_accuracy"],
        }
    names = {
        "regression": ("mae", "rmse", "pearson_r", "spearman_r"),
        "token_classification": ("entity_precision", "entity_recall", "entity_f1", "token_accuracy"),
    }
    return {name: report[name] for name in names[report["task"]]}


def write_report(directory: Path, report: dict) -> dict:
    """Write ``report`` as ``evaluation.json`` with its ``metrics`` (``headline``) and pictures (named
    in its ``figures``) into ``directory``; returns it."""
    pictures = figures(report)
    report = {**report, "metrics": headline(report), "figures": sorted(pictures)}
    for name, png in pictures.items():
        (directory / name).write_bytes(png)
    (directory / EVALUATION).write_text(json.dumps(json_safe(report), indent=2, allow_nan=False))
    return report


def figures(report: dict) -> dict[str, bytes]:
    """The report's pictures as PNG bytes by file name."""
    from matplotlib.figure import Figure

    pictures = {}
    if report["task"] == "classification":
        matrix = report["confusion_matrix"]
        names, normalized = matrix["labels"], np.array(matrix["normalized"])
        fig = Figure(figsize=(2 + 0.5 * len(names), 1.5 + 0.5 * len(names)), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        image = ax.imshow(normalized, cmap="Blues", vmin=0, vmax=1)
        ax.set(
            xticks=range(len(names)),
            yticks=range(len(names)),
            xlabel="predicted",
            ylabel="gold",
            title="confusion matrix (row-normalized)",
        )
        ax.set_xticklabels(names, rotation=45, ha="right")
        ax.set_yticklabels(names)
        if len(names) <= 20:
            for (i, j), count in np.ndenumerate(np.array(matrix["counts"])):
                ax.text(j, i, count, ha="center", va="center", color="white" if normalized[i, j] > 0.5 else "black")
        fig.colorbar(image, ax=ax)
        pictures["confusion_matrix.png"] = png_of(fig)
        fig = Figure(figsize=(5, 5), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        bins = report["calibration"]["bins"]
        ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfectly calibrated")
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", label="model")
        ax.set(
            xlim=(0, 1),
            ylim=(0, 1),
            xlabel="confidence (top label's probability)",
            ylabel="accuracy",
            title=f"reliability diagram (ECE {report['calibration']['ece']:.3f})",
        )
        ax.legend(loc="upper left")
        pictures["reliability_diagram.png"] = png_of(fig)
    elif report["task"] == "regression":
        fig = Figure(figsize=(6, 4.5), dpi=100, layout="constrained")
        ax = fig.add_subplot()
        ax.scatter(report["residuals"]["label"], report["residuals"]["residual"], s=8, alpha=0.6)
        ax.axhline(0, color="grey", linestyle="--")
        ax.set(xlabel="gold value", ylabel="residual (prediction - gold)", title="residuals")
        pictures["residuals.png"] = png_of(fig)
    return pictures


def png_of(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
