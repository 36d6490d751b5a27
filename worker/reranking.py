"""Task ``reranking``: a cross-encoder (``AutoModelForSequenceClassification`` with one logit, the
query and the passage as the tokenizer's pair input) trained with binary cross-entropy on labels
of 0/1 or scores in [0, 1] (``worker.training.steps.example_losses``), its positive pairs weighted
(``positive_weight``), as sentence-transformers' ``CrossEncoder`` with
``BinaryCrossEntropyLoss(pos_weight=...)``; ``CrossEncoder(path)`` loads the artifact (one label:
a sigmoid score).

Validation reranks each query's passages of the validation split by the model's score
(``ranking_metrics``): ``ndcg@10`` (scikit-learn's ``ndcg_score``, graded by the labels) and
``mrr@10`` (the reciprocal rank of the first relevant passage, label > 0.5, within the top 10; 0
beyond), averaged over the queries that have two or more passages and a relevant one.
"""

import math

import numpy as np
import torch
from sklearn.metrics import ndcg_score

from shared.data.batching import BatchPlan
from worker.reporter import Reporter
from worker.training.steps import example_losses


def positive_weight(pos_weight: float | None, labels) -> float:
    """The weight of positive pairs in the job's binary cross-entropy: ``pos_weight`` (the job's
    hyperparameter) or by default the training ``labels``' (``[n]`` in [0, 1]) negatives per
    positive, ``sum(1 - label) / sum(label)`` (at most 1000; 1 when every label is on one side).
    sentence-transformers' reranker recipes weigh the positives by the hard negatives mined per
    query (``BinaryCrossEntropyLoss(pos_weight=torch.tensor(num_hard_negatives))``); unweighted,
    one positive in five pulls the scores towards the labels' prior."""
    if pos_weight is not None:
        return pos_weight
    labels = np.asarray(labels, dtype=np.float64)
    positive, negative = labels.sum(), (1.0 - labels).sum()
    return float(min(negative / positive, 1000.0)) if positive > 0 and negative > 0 else 1.0


def ranking_metrics(queries: list[str], scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """``ndcg@10`` and ``mrr@10`` of ranking each query's passages by ``scores`` (``[n]``, one per
    (query, passage) row) against ``labels`` (``[n]`` in [0, 1]); NaN when no query counts."""
    groups: dict[str, list[int]] = {}
    for i, query in enumerate(queries):
        groups.setdefault(query, []).append(i)
    ndcg, mrr = [], []
    for rows in groups.values():
        relevance, ranked = labels[rows], scores[rows]
        if len(rows) < 2 or not (relevance > 0.5).any():
            continue
        ndcg.append(ndcg_score(relevance[None], ranked[None], k=10))
        order = np.argsort(-ranked, kind="stable")[:10]
        hits = np.flatnonzero(relevance[order] > 0.5)
        mrr.append(1.0 / (hits[0] + 1) if len(hits) else 0.0)
    if not ndcg:
        return {"ndcg@10": math.nan, "mrr@10": math.nan}
    return {"ndcg@10": float(np.mean(ndcg)), "mrr@10": float(np.mean(mrr))}


@torch.no_grad()
def evaluate(model: torch.nn.Module, job_setup, reporter: Reporter | None = None) -> dict[str, float]:
    """Validation ``loss`` (binary cross-entropy per pair, weighted as in training:
    ``job_setup.pos_weight``) and ``ranking_metrics`` of ``model`` (the fp32 master weights, autocast to
    the job's compute dtype) on ``job_setup.val_set`` (the recipe's
    ``worker.training.setup.JobSetup``), whose ``queries`` hold each pair's query text (set by
    ``worker.training.setup.prepare_job``). Leaves ``model`` in eval mode."""
    data, device, dtype = job_setup.val_set, job_setup.device, job_setup.dtype
    model.eval()
    plan = BatchPlan(data.lengths, job_setup.hp.batch_size * 2, "smart", job_setup.hp.seed)
    scores = np.zeros(len(data), dtype=np.float32)
    for batch in plan.epoch_batches(0):
        inputs = job_setup.collator([data[i] for i in batch])
        inputs = {k: v.to(device) for k, v in inputs.items() if k != "labels"}
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            scores[batch] = model(**inputs).logits.float().squeeze(-1).cpu().numpy()
        if reporter is not None:
            reporter.heartbeat()
    labels = np.asarray(data.labels, dtype=np.float32)
    pos_weight = None if job_setup.pos_weight is None else torch.tensor(job_setup.pos_weight)
    loss = example_losses(torch.from_numpy(scores)[:, None], torch.from_numpy(labels), "reranking", pos_weight)
    return {"loss": loss.mean().item(), **ranking_metrics(data.queries, scores, labels)}
