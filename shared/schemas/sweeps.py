"""Pydantic schemas of the sweeps API (``POST /sweeps`` and what it returns); ``shared.jobs.sweeps`` runs them.

The field names follow Optuna's: a search space entry is one of its distributions
(``FloatDistribution``, ``IntDistribution``, ``CategoricalDistribution``), ``algorithm`` names a
sampler, ``early_stopping`` a pruner (Optuna docs, "Efficient Optimization Algorithms").
"""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

from shared.schemas.jobs import JOB_CREATE_EXAMPLE, JobCreate, integral_floats

SWEEP_CREATE_EXAMPLE: JsonDict = {
    **JOB_CREATE_EXAMPLE,
    "hyperparameters": {"max_length": 128},
    "search_space": {
        "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
        "batch_size": {"type": "categorical", "choices": [16, 32]},
        "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2},
        "epochs": {"type": "int", "low": 1, "high": 3},
    },
    "objective": {"metric": "accuracy", "direction": "maximize"},
    "algorithm": "tpe", "seed": 42,
    "early_stopping": {"type": "asha", "min_steps": 50, "reduction_factor": 3},
    "max_trials": 12, "max_parallel_trials": 2,
}


class Distribution(BaseModel):
    """One hyperparameter's range: ``float`` (``low``, ``high``, optional ``log`` or ``step``),
    ``int`` (the same, integers) or ``categorical`` (``choices``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["float", "int", "categorical"]
    low: float | None = Field(None, allow_inf_nan=False)
    high: float | None = Field(None, allow_inf_nan=False)
    log: bool = False
    step: float | None = Field(None, gt=0, allow_inf_nan=False)
    choices: list[Any] | None = Field(None, min_length=1, max_length=1000)


class Objective(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field(description="A validation metric the task produces (hyperparameters.metric_for_best_model's "
                                    "values): classification accuracy, f1_macro, loss; token_classification entity_f1 "
                                    "(alias f1); regression pearson_r, mse; multi_label f1_micro, ...; embedding "
                                    "ndcg@10, mrr@10, recall@10, ...")
    direction: Literal["maximize", "minimize"] | None = Field(
        None, description="Default: the metric's own (minimize loss and mse, maximize the rest); the opposite is refused.")


class EarlyStopping(BaseModel):
    """Which trials to stop early, from the objective at each evaluation: ``asha`` (Optuna's
    ``SuccessiveHalvingPruner``, asynchronous successive halving, Li et al. 2018), ``median``
    (``MedianPruner``: stop a trial whose value is worse than the median of the others' at the same
    step), or ``none``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["asha", "median", "none"] = "median"
    min_steps: int = Field(0, ge=0, description="Optimizer steps before any decision (median: n_warmup_steps; "
                                                "asha: min_resource, 0 meaning Optuna's 'auto').")
    reduction_factor: int = Field(3, ge=2, le=100, description="asha: keep the best 1/reduction_factor at each rung.")
    min_trials: int = Field(1, ge=1, le=1000, description="median: trials that must have reported at a step before "
                                                          "comparing there (n_startup_trials and n_min_trials).")


class SweepCreate(JobCreate):
    """Body of ``POST /sweeps``: a job spec (its ``hyperparameters`` are held fixed) plus the search."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [SWEEP_CREATE_EXAMPLE]})

    search_space: dict[str, Distribution] = Field(min_length=1, description="Hyperparameters to search, by name.")
    objective: Objective
    algorithm: Literal["tpe", "random", "grid"] = "tpe"
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seeds the sampler: the same sweep asks the same trials.")
    early_stopping: EarlyStopping = Field(default_factory=EarlyStopping)
    max_trials: int = Field(10, ge=1, description="Trials in all (at most TUNEJOB_MAX_TRIALS_PER_SWEEP).")
    max_parallel_trials: int = Field(1, ge=1, le=1000, description="Trials queued or running at once.")
    max_failed_trials: int = Field(3, ge=0, description="The sweep fails once more trials than this have failed.")

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        return integral_floats(cls, data)


class BestTrial(BaseModel):
    job_id: str
    trial_number: int
    params: dict[str, Any]
    value: float


class SweepOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "sweep_5d0c2a9e1b7f3a64", "status": "running", "base_model": "all-MiniLM-L6-v2",
        "task": "classification", "objective": {"metric": "accuracy", "direction": "maximize"}, "algorithm": "tpe",
        "early_stopping": "asha", "max_trials": 12, "max_parallel_trials": 2,
        "trials": {"queued": 1, "running": 2, "succeeded": 6, "pruned": 3, "failed": 0, "cancelled": 0},
        "best_trial": {"job_id": "job_8e2d4c1a9b7f3e05", "trial_number": 4,
                       "params": {"learning_rate": 2.1e-4, "batch_size": 16, "warmup_ratio": 0.07, "epochs": 3},
                       "value": 0.871},
        "created_at": "2026-11-21T09:12:10.118Z", "started_at": "2026-11-21T09:12:11.402Z", "finished_at": None,
        "error": None}]})

    id: str
    status: str = Field(description="queued | running | paused (its next trials wait for room in the tenant's "
                                    "quotas: see error) | succeeded | failed | cancelled")
    base_model: str
    task: str
    objective: Objective
    algorithm: str
    early_stopping: str
    max_trials: int
    max_parallel_trials: int
    trials: dict[str, int] = Field(description="Trials by status.")
    best_trial: BestTrial | None
    created_at: datetime
    started_at: datetime | None = Field(description="When its first trial started.")
    finished_at: datetime | None
    error: dict[str, Any] | None


class TrialOut(BaseModel):
    number: int
    job_id: str
    status: str
    params: dict[str, Any]
    value: float | None = Field(description="The objective at the trial's best evaluation so far (its kept weights').")
    steps: int = Field(description="Optimizer steps run.")
    started_at: datetime | None
    finished_at: datetime | None


class SweepList(BaseModel):
    data: list[SweepOut]
    next_cursor: str | None


class SweepPlan(BaseModel):
    """``POST /sweeps?dry_run=true``: what would run, and nothing stored."""

    dry_run: bool = True
    max_trials: int
    max_parallel_trials: int
    search_space: dict[str, str] = Field(description="Each hyperparameter's Optuna distribution, as understood.")
    first_trials: list[dict[str, Any]] = Field(description="The parameters of the trials queued first.")
    objective: Objective
    trial_plan: dict[str, Any] = Field(description="The plan of one trial with the fixed hyperparameters "
                                                   "(as POST /jobs?dry_run=true).")
