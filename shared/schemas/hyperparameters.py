"""The training hyperparameters of a job (``Hyperparameters``), the validation metrics each task
produces and which way each is better."""

from functools import lru_cache
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

HYPERPARAMETERS_EXAMPLE: JsonDict = {"epochs": 1, "learning_rate": 1e-4, "batch_size": 16, "max_length": 128}
# The values of Hyperparameters.metric_for_best_model that apply to each task.
TASK_METRICS = {
    "classification": ("loss", "accuracy", "f1_macro"),
    "regression": ("loss", "mse", "pearson_r"),
    "multi_label": ("loss", "f1_micro", "f1_macro", "subset_accuracy"),
    "token_classification": ("loss", "entity_f1", "entity_precision", "entity_recall", "token_accuracy"),
    "embedding": ("ndcg@10", "mrr@10", "recall@1", "recall@10", "map@100"),
    "reranking": ("ndcg@10", "mrr@10", "loss"),
}
# embedding: information-retrieval metrics of the validation split (worker.embedding.retrieval_metrics)
IR_METRICS = TASK_METRICS["embedding"]
# Hyperparameters that apply to one task only: a job or a sweep's search space of another task is a 422.
TASK_ONLY = {"pos_weight": "reranking"}

# Whether a larger value of each metric is better (the best evaluation; a sweep's objective direction).
GREATER_IS_BETTER = {
    "loss": False,
    "mse": False,
    "accuracy": True,
    "f1_macro": True,
    "pearson_r": True,
    "f1_micro": True,
    "subset_accuracy": True,
    "entity_f1": True,
    "entity_precision": True,
    "entity_recall": True,
    "token_accuracy": True,
    **dict.fromkeys(IR_METRICS, True),
}


def _takes_int(annotation: Any) -> bool:
    """Whether a field's type is ``int`` or a union with an ``int`` member (``Annotated`` or not)."""
    if get_origin(annotation) is Annotated:
        return _takes_int(get_args(annotation)[0])
    return annotation is int or any(_takes_int(a) for a in get_args(annotation))


def integral_floats(model: type[BaseModel], data: Any) -> Any:
    """``data`` with each integral float given to an ``int`` field of ``model`` made an int: JSON
    Schema counts 3.0 as an integer; pydantic's strict mode would refuse it."""
    if not isinstance(data, dict):
        return data
    ints = int_fields(model)
    return {k: int(v) if k in ints and isinstance(v, float) and v.is_integer() else v for k, v in data.items()}


@lru_cache
def int_fields(model: type[BaseModel]) -> frozenset[str]:
    """The names of ``model``'s ``int`` fields (worked out once: a job's view validates its
    hyperparameters, and the jobs page shows 50 jobs)."""
    return frozenset(name for name, f in model.model_fields.items() if _takes_int(f.annotation))


class Hyperparameters(BaseModel):
    """Training hyperparameters. Defaults suit a small BERT-family encoder on a few thousand texts.

    ``batch_size`` is the micro-batch (examples per forward pass); one optimizer step sees
    ``batch_size * gradient_accumulation_steps`` examples.
    """

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [HYPERPARAMETERS_EXAMPLE]})

    epochs: float = Field(3.0, gt=0, le=1000)
    learning_rate: float = Field(5e-5, gt=0, le=1.0)
    batch_size: int = Field(16, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024)
    max_length: int = Field(256, ge=8, le=8192)
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    batching: Literal["smart", "dynamic", "fixed", "token_budget"] = "smart"
    max_tokens_per_batch: int | None = Field(
        None, ge=8, description="token_budget: padded tokens per micro-batch. Default batch_size * max_length."
    )
    pad_to_multiple_of: int | None = Field(
        None,
        ge=1,
        le=512,
        description="Round padded lengths up to a multiple of this. Default: the bucket ladder "
        "(16, 32, ..., 128, 160, ..., 256, 320, ...) on CUDA, the longest member on the CPU.",
    )
    gradient_checkpointing: bool = False
    freeze_embeddings: bool = False
    torch_compile: bool = Field(False, description="torch.compile the model; lengths are padded to multiples of 64.")
    packing: bool = Field(
        False,
        description="Lay each micro-batch's examples end to end without padding, attention per example on a "
        "variable-length kernel (flash on CUDA in bf16/fp16). Eager steps only: CUDA graphs capture padded widths. "
        "BERT and RoBERTa families; others train padded, with an event.",
    )
    pos_weight: float | None = Field(
        None,
        gt=0,
        le=1000,
        description="reranking: the weight of positive pairs in binary cross-entropy (BCEWithLogitsLoss's "
        "pos_weight). Default: the training labels' negatives per positive, sum(1 - label) / sum(label), so that "
        "four hard negatives per query weigh its positive 4 to 1; 1 trains unweighted.",
    )
    eval_every_steps: int | None = Field(None, ge=1, description="Default: once per epoch.")
    save_every_steps: int | None = Field(None, ge=1, description="Default: once per epoch.")
    save_total_limit: int = Field(2, ge=1, le=1000, description="Checkpoints kept on disk (the newest).")
    metric_for_best_model: Literal[
        "loss",
        "accuracy",
        "f1_macro",
        "mse",
        "pearson_r",
        "f1_micro",
        "subset_accuracy",
        "entity_f1",
        "entity_precision",
        "entity_recall",
        "token_accuracy",
        "ndcg@10",
        "mrr@10",
        "recall@1",
        "recall@10",
        "map@100",
    ] = Field("loss", description="Default: loss; ndcg@10 for embedding.")
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop after this many evaluations without improving metric_for_best_model."
    )
    max_nonfinite_steps: int = Field(
        25, ge=1, description="Fail after this many consecutive optimizer steps with a non-finite loss or gradient."
    )
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.01, ge=0, le=1)
    seed: int = Field(42, ge=0, le=2**32 - 1)
    dataloader_num_workers: int = Field(0, ge=0, le=64)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        return integral_floats(cls, data)


def contrastive_hyperparameters(hp: Hyperparameters, task: str) -> Hyperparameters:
    """The hyperparameters the loop (and the dry run's plan) runs a job of ``task`` with: ``hp``,
    but for an embedding job with ``gradient_accumulation_steps`` k > 1, one micro-batch of
    ``batch_size`` x k examples per optimizer step, which
    ``CachedMultipleNegativesRankingLoss`` computes ``batch_size`` examples at a time (so the
    accumulated examples are each other's negatives and memory stays that of ``batch_size``)."""
    k = hp.gradient_accumulation_steps
    if task != "embedding" or k == 1:
        return hp
    return hp.model_copy(update={"batch_size": hp.batch_size * k, "gradient_accumulation_steps": 1})
