"""The dry run of a training job (``POST /jobs?dry_run=true``): its plan, computed from the tokenized
training split without training (``shared.jobs.planning.plan_job``)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TokenLengths(BaseModel):
    bin_edges: list[int] = Field(
        description="whole tokens: bin i holds lengths from bin_edges[i] up to, not including, bin_edges[i + 1]"
    )
    counts: list[int]
    mean: float
    max: int


class PaddingEfficiency(BaseModel):
    unrounded: float = Field(description="real tokens / tokens padded to each micro-batch's longest example")
    bucketed: float = Field(
        description="the same with each micro-batch padded up to its bucket width (what a "
        "CUDA worker computes; shared.data.batching.bucket_ladder)"
    )


class BucketWidth(BaseModel):
    width: int = Field(description="padded width in tokens")
    micro_batches: int = Field(description="micro-batches of this width over the job's epochs")


class Buckets(BaseModel):
    ladder: list[int] = Field(description="the widths a CUDA worker pads micro-batches to, up to max_length")
    widths: list[BucketWidth] = Field(description="the widths the chosen batching uses")
    padding_efficiency: float = Field(description="real / padded tokens of the chosen batching at these widths")


class Plan(BaseModel):
    """What a job will do, computed from its tokenized training split without training
    (``shared.jobs.planning.plan_job``). Other fields may be added."""

    model_config = ConfigDict(extra="allow")

    examples: int = Field(description="training examples, after any validation_split")
    token_lengths: TokenLengths = Field(description="histogram of real tokens per example, after truncation")
    truncated_fraction: float = Field(description="share of examples longer than max_length")
    truncated_examples: int = Field(
        description="examples longer than max_length, cut there (token_classification: "
        "the words past it are neither trained on nor scored)"
    )
    padding_efficiency: dict[str, PaddingEfficiency] = Field(description="per batching strategy")
    buckets: Buckets = Field(description="the chosen batching's bucket widths on a CUDA worker")
    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    estimated_seconds: float | None = Field(
        description="from the newest succeeded job on the same base model; null when there is none"
    )
    estimate_basis: str
    sampled_rows: int | None = Field(
        None,
        description="training examples tokenized for this plan, where the file has more rows than "
        "TUNEJOB_DRY_RUN_ROWS: a random sample, the counts scaled to the whole; null when all were",
    )
    notes: list[str] = Field([], description="what a user should know about the plan (a sample, unlabelled rows)")


class DryRunOut(BaseModel):
    """Response of ``POST /jobs?dry_run=true``: nothing is stored or queued."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "dry_run": True,
                    "plan": {
                        "examples": 1602,
                        "token_lengths": {
                            "bin_edges": [24, 31, 38, 45, 52, 59, 66, 73, 80, 87, 94, 101, 108, 115, 122, 129],
                            "counts": [3, 5, 9, 14, 22, 31, 40, 51, 60, 72, 85, 97, 110, 261, 742],
                            "mean": 112.4,
                            "max": 128,
                        },
                        "truncated_fraction": 0.463,
                        "truncated_examples": 742,
                        "padding_efficiency": {
                            s: {"unrounded": e, "bucketed": b}
                            for s, e, b in [
                                ("smart", 0.993, 0.947),
                                ("token_budget", 0.991, 0.952),
                                ("dynamic", 0.912, 0.874),
                                ("fixed", 0.878, 0.878),
                            ]
                        },
                        "buckets": {
                            "ladder": [16, 32, 48, 64, 80, 96, 112, 128],
                            "widths": [
                                {"width": 128, "micro_batches": 88},
                                {"width": 112, "micro_batches": 9},
                                {"width": 96, "micro_batches": 4},
                            ],
                            "padding_efficiency": 0.947,
                        },
                        "micro_batches_per_epoch": 101,
                        "steps_per_epoch": 101,
                        "total_steps": 101,
                        "estimated_seconds": 171.4,
                        "estimate_basis": "job job_8e2d4c1a9b7f3e05: 1907 padded tokens/s on cpu",
                    },
                }
            ]
        }
    )

    dry_run: Literal[True]
    plan: Plan
