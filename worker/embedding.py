"""Task ``embedding``: a bi-encoder (a sentence-transformers model) trained in tunejob's own loop.

The loop (``worker.training.recipe``) is the same as for every task: smart batching, accumulation,
bf16, checkpoints and exact resume. What differs lives here:

- data: every text column (anchor, positive, hard negatives) is tokenized on its own
  (``tokenize_pairs``, through ``worker.data.tokenize`` and its cache); a micro-batch lays the
  columns side by side, each padded to the micro-batch's width (``PairsCollator``), so that the
  loop's row-wise splitting (out-of-memory backoff) keeps rows whole;
- no false negatives: no micro-batch holds the same anchor or positive text twice
  (``shared.data.batching.DistinctBatchPlan``, as sentence-transformers' ``NoDuplicatesBatchSampler``);
- the model computes its own loss (``Objective``, whose ``losses`` are what
  ``worker.training.steps.Steps.forward_losses`` returns): sentence-transformers'
  ``MultipleNegativesRankingLoss`` (in-batch negatives plus the hard negatives; van den Oord et
  al., "Representation Learning with Contrastive Predictive Coding", 2018; Henderson et al.,
  "Efficient Natural Language Response Suggestion for Smart Reply", 2017), its cached form
  ``CachedMultipleNegativesRankingLoss`` when ``gradient_accumulation_steps`` > 1 (GradCache: Gao
  et al., "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", 2021: the
  accumulated examples share one set of in-batch negatives instead of being split into several),
  or ``CoSENTLoss`` for pairs with a ``score_column`` (Su, "CoSENT", 2022);
- validation: retrieval metrics of the validation split (``retrieval_metrics``, with
  sentence-transformers' ``InformationRetrievalEvaluator``), the base model scored once before
  training (``score_zero_shot``);
- the artifact is a sentence-transformers model directory (``Objective.save_pretrained``):
  ``SentenceTransformer(path)`` loads it offline.
"""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import (
    InformationRetrievalEvaluator,
)
from sentence_transformers.sentence_transformer.losses import (
    CachedMultipleNegativesRankingLoss,
    CoSENTLoss,
    MultipleNegativesRankingLoss,
)
from sentence_transformers.sentence_transformer.modules import Normalize
from sentence_transformers.util import cos_sim
from transformers import DataCollatorWithPadding

from shared.data.batching import DistinctBatchPlan, bucket_width
from shared.errors import UserError
from shared.schemas.hyperparameters import IR_METRICS, Hyperparameters
from shared.store.rows import Job
from worker.data import tokenize
from worker.reporter import PhaseTimer, Reporter

EVAL_BATCH = 64  # texts per forward pass when the evaluator encodes the validation split


def columns_of(spec: dict) -> list[str]:
    """An embedding job's text columns in the order a micro-batch holds them: anchor, positive, negatives."""
    return [
        spec.get("anchor_column", "anchor"),
        spec.get("positive_column", "positive"),
        *(spec.get("negative_columns") or []),
    ]


# ----------------------------------------------------------------------------- data


class PairsDataset(torch.utils.data.Dataset):
    """An embedding split tokenized once, one ``worker.data.TokenizedDataset`` per text column.

    Item i: ``{"columns": [encoding of each column's text i], "labels": score}`` (score 0.0
    without a ``score_column``). ``lengths[i]``: real tokens of row i's longest text (what its
    micro-batch is padded to). ``texts``: the raw texts of each column (retrieval evaluation,
    duplicate checks). ``from_cache``: every column came from the tokenization cache.
    """

    def __init__(self, columns: list, texts: list[list[str]], scores: list[float]):
        self.columns, self.texts, self.labels = columns, texts, scores
        self.lengths = np.max([c.lengths for c in columns], axis=0)
        self.from_cache = all(c.from_cache for c in columns)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"columns": [{k: v[i] for k, v in c.encodings.items()} for c in self.columns], "labels": self.labels[i]}


def tokenize_pairs(tokenizer, df: pd.DataFrame, spec: dict, max_length: int, sha256: str | None) -> PairsDataset:
    """Tokenize each text column of an embedding table alone (``worker.data.tokenize``, cached
    under ``sha256`` like every task's), truncated to ``max_length``."""
    columns, texts = [], []
    for column in columns_of(spec):
        values = df[column].astype(str).tolist()
        frame = pd.DataFrame({"text": values, "label": np.zeros(len(values), dtype=np.float32)})
        columns.append(tokenize(tokenizer, frame, "text", None, "label", None, max_length, sha256))
        texts.append(values)
    score = spec.get("score_column")
    scores = df[score].astype("float32").tolist() if score else [0.0] * len(df)
    return PairsDataset(columns, texts, scores)


class PairsCollator:
    """Pads a micro-batch of ``PairsDataset`` items: each column to the width of ``ladder`` (the
    job's, ``worker.data.make_collator``) that holds the micro-batch's longest text, with the
    tokenizer's own pad id and inputs (``transformers.DataCollatorWithPadding``), the columns laid
    side by side. Returns int64 ``input_ids``, ``attention_mask`` (and ``token_type_ids``)
    ``[rows, columns * width]`` and float32 ``labels`` ``[rows]`` (the scores)."""

    def __init__(self, tokenizer, ladder: list[int]):
        self.tokenizer, self.ladder = tokenizer, ladder

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = bucket_width(self.ladder, max(len(column["input_ids"]) for f in features for column in f["columns"]))
        pad = DataCollatorWithPadding(self.tokenizer, padding="max_length", max_length=width)
        padded = [pad([f["columns"][c] for f in features]) for c in range(len(features[0]["columns"]))]
        batch = {k: torch.cat([p[k] for p in padded], dim=1) for k in padded[0]}
        batch["labels"] = torch.tensor([f["labels"] for f in features], dtype=torch.float32)
        return batch


def split_columns(batch: dict[str, torch.Tensor], columns: int) -> list[dict[str, torch.Tensor]]:
    """The inverse of ``PairsCollator``'s layout: one features dict per column, each cut to its
    own longest text (no column computes another's padding)."""
    pieces = [{k: v.chunk(columns, dim=1)[c] for k, v in batch.items()} for c in range(columns)]
    for piece in pieces:
        width = max(1, int(piece["attention_mask"].sum(1).max()))
        for k in piece:
            piece[k] = piece[k][:, :width]
    return pieces


def text_keys(data: PairsDataset) -> np.ndarray:
    """``[n, 2]`` ids of each row's anchor and positive text (``DistinctBatchPlan``'s keys)."""
    ids: dict[str, int] = {}
    return np.array([[ids.setdefault(t, len(ids)) for t in pair] for pair in zip(*data.texts[:2])], dtype=np.int64)


def make_plan(data: PairsDataset, hp: Hyperparameters) -> DistinctBatchPlan:
    """The job's plan: ``hp``'s batching, duplicate-free (``DistinctBatchPlan``)."""
    return DistinctBatchPlan(
        data.lengths, text_keys(data), hp.batch_size, hp.batching, hp.seed, hp.max_tokens_per_batch
    )


# ----------------------------------------------------------------------------- model


class Objective(torch.nn.Module):
    """What an embedding job trains: a ``SentenceTransformer`` and its sentence-transformers loss.

    ``forward`` takes a ``PairsCollator`` batch (``labels``: the scores) and returns ``losses``
    ``[rows]``: the loss's mean over the micro-batch, once per row, so that the loop's sum over a
    step's rows divided by their number (``worker.training.steps``) is the loss of the step, and
    micro-batches of unequal size weigh as their rows. ``save_pretrained`` writes the
    sentence-transformers model directory; ``base_model`` is the transformer (frozen embeddings).
    """

    def __init__(self, model: SentenceTransformer, loss: torch.nn.Module, columns: int):
        super().__init__()
        self.st, self.loss, self.columns = model, loss, columns

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> SimpleNamespace:
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            batch["token_type_ids"] = token_type_ids
        rows = len(input_ids)
        if labels is None:
            labels = torch.zeros(rows, device=input_ids.device)
        loss = self.loss(split_columns(batch, self.columns), labels)
        return SimpleNamespace(losses=loss.float().expand(rows))

    @property
    def base_model(self) -> torch.nn.Module:
        return self.st[0].auto_model

    def activation_checkpointing_enable(self, **kwargs) -> None:
        self.base_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=kwargs.get("activation_checkpointing_kwargs")
        )

    def save_pretrained(self, path, safe_serialization: bool = True) -> None:
        """A sentence-transformers model directory: the transformer's config and safetensors
        weights, tokenizer, ``modules.json``, ``sentence_bert_config.json``, ``1_Pooling`` and
        ``2_Normalize``."""
        self.st.save(str(path), create_model_card=False, safe_serialization=safe_serialization)


def load_objective(path, job: Job, device: torch.device | None = None) -> Objective:
    """The ``Objective`` of ``job`` from a base model or checkpoint directory: a
    sentence-transformers directory as it is (a plain Hugging Face encoder gets mean pooling),
    with a ``Normalize`` module added when it has none (cosine similarity is what the losses and
    the evaluation use, and what serving returns); safetensors only, no remote code.
    ``max_seq_length`` is the job's ``max_length``.

    Raises:
        UserError: ``model_load_failed``.
    """
    hp = Hyperparameters(**job.spec["hyperparameters"])
    try:
        model = SentenceTransformer(
            str(path),
            device=str(device or "cpu"),
            local_files_only=True,
            trust_remote_code=False,
            model_kwargs={"use_safetensors": True},
        )
    except (OSError, ValueError, KeyError) as e:
        raise UserError("model_load_failed", f"model {job.base_model!r} could not be loaded: {e}", "base_model") from e
    if not any(isinstance(module, Normalize) for module in model):
        model.append(Normalize())
    model.max_seq_length = hp.max_length
    if job.spec.get("score_column"):
        loss = CoSENTLoss(model)
    elif hp.gradient_accumulation_steps > 1:
        loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=hp.batch_size)
    else:
        loss = MultipleNegativesRankingLoss(model)
    return Objective(model, loss, len(columns_of(job.spec)))


# ----------------------------------------------------------------------------- evaluation


def retrieval_split(data: PairsDataset) -> tuple[dict[str, str], dict[str, str], dict[str, set[str]]]:
    """Queries, corpus and relevance of a split: the queries are its distinct anchors, the corpus
    its distinct positives; a query's relevant texts are the positives of its rows (with a
    ``score_column``: those scored above 0.5; a query with none is left out)."""
    anchors, positives = data.texts[0], data.texts[1]
    corpus_ids: dict[str, str] = {}
    for text in positives:
        corpus_ids.setdefault(text, f"d{len(corpus_ids)}")
    query_ids: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    for anchor, positive, score in zip(anchors, positives, data.labels):
        if score > 0.5 or not any(data.labels):
            qid = query_ids.setdefault(anchor, f"q{len(query_ids)}")
            relevant.setdefault(qid, set()).add(corpus_ids[positive])
    queries = {qid: text for text, qid in query_ids.items()}
    return queries, {cid: text for text, cid in corpus_ids.items()}, relevant


@torch.no_grad()
def retrieval_metrics(model: SentenceTransformer, data: PairsDataset) -> dict[str, float]:
    """``ndcg@10``, ``mrr@10``, ``recall@1``, ``recall@10`` and ``map@100`` of retrieving each
    query's relevant texts from the split's corpus by cosine similarity (``retrieval_split``;
    sentence-transformers' ``InformationRetrievalEvaluator``, whose definitions are the BEIR/TREC
    ones). NaN each when no query has a relevant text."""
    queries, corpus, relevant = retrieval_split(data)
    if not relevant:
        return dict.fromkeys(IR_METRICS, math.nan)
    evaluator = InformationRetrievalEvaluator(
        queries,
        corpus,
        relevant,
        mrr_at_k=[10],
        ndcg_at_k=[10],
        accuracy_at_k=[1],
        precision_recall_at_k=[1, 10],
        map_at_k=[100],
        batch_size=EVAL_BATCH,
        write_csv=False,
        score_functions={"cosine": cos_sim},
    )
    scores = evaluator(model)
    return {name: float(scores[f"cosine_{name}"]) for name in IR_METRICS}


def evaluate(model: Objective, data: PairsDataset, reporter: Reporter | None = None) -> dict[str, float]:
    """The validation metrics of an embedding job (``retrieval_metrics`` of ``model``, the fp32
    master weights, on the validation split ``data``); leaves ``model`` in eval mode."""
    model.eval()
    metrics = retrieval_metrics(model.st, data)
    if reporter is not None:
        reporter.heartbeat()
    return {k: float(v) for k, v in metrics.items()}


def score_zero_shot(
    job_setup, model: Objective, step: int, timer: PhaseTimer, reporter: Reporter
) -> dict[str, float] | None:
    """Score the base model on the validation split before the first step (an embedding job with
    a validation split, not resumed: ``step`` 0; else nothing, None), so that the job reports what
    fine-tuning added: logged as the ``eval_*`` metrics of step 0 and as a ``zero_shot`` event.
    Timed as ``evaluate``. ``job_setup``: the recipe's (``worker.training.setup.JobSetup``)."""
    if job_setup.job.task != "embedding" or job_setup.val_set is None or step != 0:
        return None
    with timer.phase("evaluate"):
        metrics = evaluate(model, job_setup.val_set, reporter)
    reporter.log(0, 0.0, {f"eval_{k}": v for k, v in metrics.items() if math.isfinite(v)})
    reporter.event(
        "zero_shot", "the base model before training: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    )
    return metrics
