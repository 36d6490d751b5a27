"""Pydantic schemas of the REST API: the job spec with its hyperparameters, and the resources returned."""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Hyperparameters(BaseModel):
    """Training hyperparameters. Defaults suit a small BERT-family encoder on a few thousand texts.

    ``batch_size`` is the micro-batch (examples per forward pass); one optimizer step sees
    ``batch_size * gradient_accumulation_steps`` examples.
    """

    model_config = ConfigDict(extra="forbid")

    epochs: float = Field(3.0, gt=0, le=1000)
    learning_rate: float = Field(5e-5, gt=0, le=1.0)
    batch_size: int = Field(16, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(1, ge=1, le=1024)
    max_length: int = Field(256, ge=8, le=8192)
    precision: Literal["auto", "fp32", "fp16", "bf16"] = "auto"
    batching: Literal["smart", "dynamic", "fixed", "token_budget"] = "smart"
    max_tokens_per_batch: int | None = Field(
        None, ge=8, description="token_budget: padded tokens per micro-batch. Default batch_size * max_length.")
    pad_to_multiple_of: int | None = Field(
        None, ge=1, le=512, description="Round padded lengths up to a multiple of this. Default: 8 on CUDA, 1 on the CPU.")
    gradient_checkpointing: bool = False
    freeze_embeddings: bool = False
    torch_compile: bool = Field(False, description="torch.compile the model; lengths are padded to multiples of 64.")
    eval_every_steps: int | None = Field(None, ge=1, description="Default: once per epoch.")
    save_every_steps: int | None = Field(None, ge=1, description="Default: once per epoch.")
    save_total_limit: int = Field(2, ge=1, le=1000, description="Checkpoints kept on disk (the newest).")
    metric_for_best_model: Literal["loss", "accuracy", "f1_macro", "mse", "pearson_r"] = "loss"
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop after this many evaluations without improving metric_for_best_model.")
    max_nonfinite_steps: int = Field(
        25, ge=1, description="Fail after this many consecutive optimizer steps with a non-finite loss or gradient.")
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    weight_decay: float = Field(0.01, ge=0, le=1)
    seed: int = Field(42, ge=0, le=2**32 - 1)
    dataloader_num_workers: int = Field(0, ge=0, le=64)


class JobCreate(BaseModel):
    """Body of ``POST /jobs``."""

    model_config = ConfigDict(extra="forbid")

    base_model: str
    task: Literal["classification", "regression"] = "classification"
    training_dataset: str
    validation_dataset: str | None = None
    validation_split: float | None = Field(None, ge=0, lt=1, description="Default 0.1 when no validation_dataset.")
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "JobCreate":
        if self.validation_dataset and self.validation_split:
            raise ValueError("give validation_dataset or validation_split, not both")
        if self.validation_dataset is None and self.validation_split is None:
            self.validation_split = 0.1
        hp = self.hyperparameters
        allowed = {"classification": ("loss", "accuracy", "f1_macro"), "regression": ("loss", "mse", "pearson_r")}
        if hp.metric_for_best_model not in allowed[self.task]:
            raise ValueError(f"hyperparameters.metric_for_best_model {hp.metric_for_best_model!r} does not apply to "
                             f"{self.task}; use one of {allowed[self.task]}")
        if hp.early_stopping_patience and not (self.validation_dataset or self.validation_split):
            raise ValueError("hyperparameters.early_stopping_patience needs a validation set")
        return self


class DatasetOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    filename: str
    format: str
    rows: int
    columns: list[str]
    bytes: int
    sha256: str
    created_at: datetime


class Progress(BaseModel):
    step: int
    total_steps: int | None
    epoch: float
    fraction: float
    eta_seconds: float | None


class JobOut(BaseModel):
    id: str
    status: str
    base_model: str
    task: str
    training_dataset: str
    validation_dataset: str | None
    validation_split: float | None
    text_column: str
    text_pair_column: str | None
    label_column: str
    label_names: list[Any] | None
    hyperparameters: Hyperparameters
    metadata: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: Progress
    train_metrics: dict[str, Any] | None
    validation_metrics: dict[str, Any] | None
    device: str | None
    attempts: int
    error: dict[str, Any] | None


class JobList(BaseModel):
    data: list[JobOut]
    next_cursor: str | None


class MetricOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    epoch: float
    name: str
    value: float
    time: datetime


class EventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    time: datetime
    level: str
    code: str
    message: str


class CheckpointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    metrics: dict[str, Any] | None
    created_at: datetime


class ArtifactOut(BaseModel):
    name: str
    bytes: int
    url: str


class BaseModelOut(BaseModel):
    name: str
    source: Literal["builtin", "models_dir"]
    model_type: str | None
