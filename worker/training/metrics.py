"""The task metrics of a validation set: loss plus accuracy and macro-F1 (classification), MSE and
Pearson r (regression), micro/macro-F1, subset accuracy and a tuned decision threshold
(multi_label), entity-level scores (token_classification; ``worker.tagging``), retrieval
(embedding; ``worker.embedding``) and reranking scores (reranking; ``worker.reranking``).
scikit-learn, SciPy, seqeval and sentence-transformers compute them."""

import numpy as np
import torch
from scipy.stats import pearsonr
from sklearn.metrics import accuracy_score, f1_score, mean_squared_error

from shared.data.batching import BatchPlan
from worker import embedding, reranking
from worker.reporter import Reporter
from worker.tagging import tagging_metrics, word_sequences
from worker.training.batches import make_loader
from worker.training.setup import JobSetup
from worker.training.steps import example_losses, loss_terms

THRESHOLDS = np.round(np.arange(0.05, 0.951, 0.05), 2)  # multi_label: the decision thresholds tune_threshold tries


@torch.no_grad()
def evaluate(model: torch.nn.Module, job_setup: JobSetup, reporter: Reporter | None = None) -> dict[str, float]:
    """Validation loss plus accuracy and macro-F1 (classification), MSE and Pearson r (regression),
    ``multi_label_metrics`` (multi_label), or entity-level precision, recall and F1, token accuracy
    and ``per_entity`` metrics (token_classification: ``worker.tagging.tagging_metrics``; its loss
    is per labelled token), retrieval metrics (embedding: ``worker.embedding.evaluate``) or
    reranking metrics (reranking: ``worker.reranking.evaluate``), of ``model`` on ``job_setup.val_set``.

    Runs eagerly on ``model`` (the recipe passes the fp32 master weights; under autocast with the
    job's dtype): it never touches the training step's CUDA graphs or their inputs. ``reporter``,
    if given, renews the job's lease while a long evaluation runs. Leaves ``model`` in eval mode.
    """
    job, hp, device, dtype = job_setup.job, job_setup.hp, job_setup.device, job_setup.dtype
    task = job.task
    if task == "embedding":
        return embedding.evaluate(model, job_setup.val_set, reporter)
    if task == "reranking":
        return reranking.evaluate(model, job_setup, reporter)
    model.eval()
    plan = BatchPlan(job_setup.val_set.lengths, hp.batch_size * 2, "smart", hp.seed)
    loss_total, predictions, targets = torch.zeros((), device=device), [], []
    for batch in make_loader(job_setup, job_setup.val_set, plan, epoch=0):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(**batch).logits.float()
        loss_total += loss_sum_of(logits, labels, task)
        predictions.append(
            logits.squeeze(-1)
            if task == "regression"
            else torch.sigmoid(logits)
            if task == "multi_label"
            else logits.argmax(-1)
        )
        targets.append(labels)
        if reporter is not None:
            reporter.heartbeat()
    if task == "token_classification":
        names = job.label_names
        return {
            "loss": loss_total.item() / max(1, sum(loss_terms(t, task) for t in targets)),
            **tagging_metrics(*word_sequences(predictions, targets, names), names),
        }
    y_pred, y_true = torch.cat(predictions).cpu().numpy(), torch.cat(targets).cpu().numpy()
    metrics = {"loss": loss_total.item() / len(y_true)}
    if task == "regression":
        metrics["mse"] = float(mean_squared_error(y_true, y_pred))
        metrics["pearson_r"] = float(pearsonr(y_true, y_pred).statistic) if len(y_true) > 1 else float("nan")
    elif task == "multi_label":
        threshold = None if job.spec.get("tune_threshold") else job.spec.get("decision_threshold", 0.5)
        metrics.update(multi_label_metrics(y_true, y_pred, job.label_names, threshold))
    else:
        metrics["accuracy"] = float(accuracy_score(y_true, y_pred))
        metrics["f1_macro"] = float(f1_score(y_true, y_pred, average="macro"))
    return metrics


def multi_label_metrics(
    y_true: np.ndarray, scores: np.ndarray, label_names: list[str], threshold: float | None
) -> dict:
    """Multi-label metrics (scikit-learn) of sigmoid ``scores`` ``[n, labels]`` against multi-hot
    ``y_true`` ``[n, labels]``, a label predicted where its score >= ``threshold``: ``f1_micro``,
    ``f1_macro``, ``subset_accuracy`` (every label of a row right), ``f1_per_label`` ({name: F1}),
    and the ``threshold`` used. ``threshold`` None: the one of ``THRESHOLDS`` with the best micro-F1
    (the lowest on ties). A label with neither true nor predicted rows has F1 0."""
    y_true = y_true.astype(np.int8)
    if threshold is None:
        threshold = max(THRESHOLDS, key=lambda t: f1_score(y_true, scores >= t, average="micro", zero_division=0))
    y_pred = (scores >= threshold).astype(np.int8)
    per_label = f1_score(y_true, y_pred, average=None, zero_division=0)
    return {
        "f1_micro": float(f1_score(y_true, y_pred, average="micro", zero_division=0)),
        "f1_macro": float(per_label.mean()),
        "subset_accuracy": float(accuracy_score(y_true, y_pred)),
        "threshold": float(threshold),
        "f1_per_label": dict(zip(label_names, per_label.tolist())),
    }


def loss_sum_of(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Summed loss of a micro-batch: cross-entropy (logits ``[n, classes]``, labels ``[n]`` int64),
    squared error (logits ``[n, 1]``, labels ``[n]`` float), or token_classification's cross-entropy
    over labelled tokens (``example_losses``), computed in fp32."""
    return example_losses(logits, labels, task).sum()
