"""Pydantic schemas of the sweeps API (``POST /sweeps`` and what it returns); ``shared.jobs.sweeps`` runs them.

The field names follow Optuna's: a search space entry is one of its distributions
(``FloatDistribution``, ``IntDistribution``, ``CategoricalDistribution``), ``algorithm`` names a
sampler, ``early_stopping`` a pruner (Optuna docs, "Efficient Optimization Algorithms").
"""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

from shared.schemas.hyperparameters import integral_floats
from shared.schemas.jobs import JOB_CREATE_EXAMPLE, JobCreate, model_name

# A search space as the API answers it (every field of a Distribution): the examples of SweepOut and SweepPlan
SEARCH_SPACE_EXAMPLE: JsonDict = {
    "learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True, "step": None, "choices": None},
    "batch_size": {"type": "categorical", "low": None, "high": None, "log": False, "step": None, "choices": [16, 32]},
}
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
    "algorithm": "tpe",
    "seed": 42,
    "early_stopping": {"type": "asha", "min_steps": 50, "reduction_factor": 3},
    "max_trials": 12,
    "max_parallel_trials": 2,
}


class Distribution(BaseModel):
    """One hyperparameter's range: ``float`` (``low``, ``high``, optional ``log`` or ``step``),
    ``int`` (the same, integers) or ``categorical`` (``choices``). ``learning_rate``, ``batch_size``,
    ``warmup_ratio``, ``weight_decay`` and ``epochs`` may leave it out (``{}``): tunejob's prior for
    the base model's size fills it (``shared.jobs.priors``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["float", "int", "categorical"] | None = Field(
        None,
        description="Left out: tunejob's range for learning_rate, batch_size, warmup_ratio, weight_decay and "
        "epochs (by the base model's size); required for any other hyperparameter.",
    )
    low: float | None = Field(None, allow_inf_nan=False)
    high: float | None = Field(None, allow_inf_nan=False)
    log: bool = False
    step: float | None = Field(None, gt=0, allow_inf_nan=False)
    choices: list[Any] | None = Field(None, min_length=1, max_length=1000)


LATENCY = "latency_ms"  # the serving cost objective: measured after a trial is saved (shared.inference.latency)
SERVING_PRECISIONS = ("fp32", "bf16", "int8")


class Objective(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field(
        description="A validation metric the task produces (hyperparameters.metric_for_best_model's "
        "values): classification accuracy, f1_macro, loss; token_classification entity_f1 "
        "(alias f1); regression pearson_r, mse; multi_label f1_micro, ...; embedding "
        "ndcg@10, mrr@10, recall@10, ...; or, after the first of several objectives, "
        "latency_ms (the saved model's median time to predict a fixed batch of validation "
        "texts at serving_precision; minimize)"
    )
    direction: Literal["maximize", "minimize"] | None = Field(
        None,
        description="Default: the metric's own (minimize loss and mse, maximize the rest); the opposite is refused.",
    )


class EarlyStopping(BaseModel):
    """Which trials to stop early, from the objective at each evaluation: ``asha`` (Optuna's
    ``SuccessiveHalvingPruner``, asynchronous successive halving, Li et al. 2018), ``median``
    (``MedianPruner``: stop a trial whose best value so far is worse than the median of the
    finished trials' at the same point), or ``none``. A point is a fraction of a trial's own
    schedule (``total_steps``), not an optimizer step: with epochs or batch sizes searched, an
    equal step is an earlier point of a longer schedule (``shared.jobs.search.schedule_curve``).
    A trial's last evaluation is never pruned."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["asha", "median", "none"] = "median"
    min_steps: int = Field(
        0,
        ge=0,
        description="A trial's optimizer steps before any decision on it "
        "(ASHA's rungs: 1/100 of a trial's schedule times powers of reduction_factor).",
    )
    reduction_factor: int = Field(3, ge=2, le=100, description="asha: keep the best 1/reduction_factor at each rung.")
    min_trials: int = Field(
        1,
        ge=1,
        le=1000,
        description="median: trials that must have reported at a step before "
        "comparing there (n_startup_trials and n_min_trials).",
    )


class SweepCreate(JobCreate):
    """Body of ``POST /sweeps``: a job spec (its ``hyperparameters`` are held fixed) plus the search."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [SWEEP_CREATE_EXAMPLE]})

    search_space: dict[str, Distribution] = Field(
        default_factory=dict,
        description="Hyperparameters to search, by name (also base_model: categorical over base models of the task). "
        "Left out (or {}): tunejob's ranges for learning_rate, batch_size, warmup_ratio, weight_decay and epochs, "
        "those that hyperparameters leaves unset.",
    )
    objective: Objective = Field(
        None,
        description="The one objective; or give objectives. Default: hyperparameters.metric_for_best_model "
        "(loss; ndcg@10 for embedding and reranking), as each job picks its best evaluation.",
    )  # type: ignore[assignment]  # filled from objectives
    objectives: list[Objective] | None = Field(
        None,
        min_length=1,
        max_length=4,
        description="Several objectives (a multi-objective study; its answer is "
        "the Pareto front, pareto_trials). The first is a validation metric: it picks each trial's kept "
        "weights, and pruning decides on it alone.",
    )
    serving_precision: Literal["fp32", "bf16", "int8"] = Field(
        "fp32", description="The precision latency_ms is measured at (as POST /jobs/{id}/predict's precision)."
    )
    algorithm: Literal["tpe", "random", "grid"] = "tpe"
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seeds the sampler: the same sweep asks the same trials.")
    early_stopping: EarlyStopping = Field(default_factory=EarlyStopping)
    max_trials: int = Field(10, ge=1, description="Trials in all (at most TUNEJOB_MAX_TRIALS_PER_SWEEP).")
    max_parallel_trials: int = Field(1, ge=1, le=1000, description="Trials queued or running at once.")
    max_failed_trials: int = Field(3, ge=0, description="The sweep fails once more trials than this have failed.")
    warm_start_from: list[str] = Field(
        default_factory=list,
        max_length=20,
        description="Earlier sweeps of the same tenant, task and base model: "
        "their finished trials (succeeded and pruned, inside this search space) join the study as history, with their "
        "values and curves (for the sampler and the pruner); they are not trials of this sweep nor count against "
        "max_trials.",
    )
    max_duration_seconds: int | None = Field(
        None,
        ge=1,
        le=366 * 86400,
        description="A budget for the whole sweep, from its creation: once spent, running "
        "trials are stopped as on cancel, no trial is asked, and the sweep ends with the best so far (succeeded; "
        "failed if no trial had succeeded), its error code budget_spent saying so. At least "
        "TUNEJOB_MIN_SWEEP_DURATION_SECONDS (default 60).",
    )
    include_defaults: bool = Field(
        True,
        description="Trial 0 runs the fixed hyperparameters (tunejob's defaults "
        "where the spec leaves them out) for the searched fields, each taken to the "
        "nearest value its range holds: the sweep's best is then never worse than that job.",
    )

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        return integral_floats(cls, data)

    @model_validator(mode="after")
    def _one_objective_field(self) -> "SweepCreate":
        """``objective`` or ``objectives``; ``objective`` is then the first of ``objectives`` (the one
        that keeps weights and prunes), so that code reading one objective reads that one."""
        if self.objectives and self.objective is None:
            self.objective = self.objectives[0]
        elif self.objectives and self.objective != self.objectives[0]:
            raise ValueError("give objective or objectives, not both")
        elif self.objective is None:  # as each job picks its best evaluation (loss; embedding: ndcg@10)
            self.objective = Objective(metric=self.hyperparameters.metric_for_best_model)
        return self

    @model_validator(mode="after")
    def _tuned_threshold(self) -> "SweepCreate":
        """A multi_label sweep tunes each trial's decision threshold on its validation set
        (``tune_threshold``) unless the spec sets ``tune_threshold`` or ``decision_threshold``: at the
        fixed 0.5, short trials that leave no label's score at 0.5 all score F1 0 and the sweep
        cannot tell them apart (seen on IMDb genres: every trial of a 3-trial sweep at micro-F1 0)."""
        unset = not {"tune_threshold", "decision_threshold"} & self.model_fields_set
        if self.task == "multi_label" and unset and (self.validation_dataset or self.validation_split):
            self.tune_threshold = True  # validation_split 0: no validation set to tune it on
        return self

    @model_validator(mode="after")
    def _model_names(self) -> "SweepCreate":
        """A searched ``base_model``'s choices by tunejob's names (``model_name``), as a job's
        ``base_model`` is: a trial of a Hugging Face id stored the id, and a warm start naming the
        model by its name dropped that history."""
        searched = self.search_space.get("base_model")
        if searched is not None and searched.choices:
            searched.choices = list(dict.fromkeys(model_name(c) if isinstance(c, str) else c for c in searched.choices))
        return self

    @property
    def all_objectives(self) -> list[Objective]:
        """``objectives``, or the one ``objective``."""
        return self.objectives or [self.objective]


class BestTrial(BaseModel):
    job_id: str
    trial_number: int
    params: dict[str, Any]
    value: float = Field(description="The (first) objective's value.")


class ParetoTrial(BestTrial):
    values: list[float] = Field(description="Each objective's value, in the order of objectives.")


class History(BaseModel):
    """A warm-started sweep's history: the finished trials of ``warm_start_from`` in its study."""

    sweeps: list[str]
    trials: int = Field(description="Their succeeded and pruned trials inside this search space.")
    best: BestTrial | None = Field(description="The best succeeded one (trial_number: in its own sweep).")


class TrialOut(BaseModel):
    number: int
    job_id: str
    status: str
    params: dict[str, Any]
    default: bool = Field(False, description="The default trial: trial 0 of a sweep with include_defaults.")
    value: float | None = Field(description="The objective at the trial's best evaluation so far (its kept weights').")
    values: list[float | None] = Field(
        description="Each objective's value (the first is value; the others at "
        "the kept evaluation; latency_ms once the trial is saved)."
    )
    steps: int = Field(description="Optimizer steps run.")
    started_at: datetime | None
    finished_at: datetime | None


class SweepOut(BaseModel):
    """A sweep as ``GET /sweeps/{id}`` (and each of ``GET /sweeps``) shows it: its spec's main figures,
    what it searches (``search_space``, the dry run's ranges), its trials by status and its answer."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": "sweep_5d0c2a9e1b7f3a64",
                    "status": "running",
                    "base_model": "all-MiniLM-L6-v2",
                    "task": "classification",
                    "objective": {"metric": "accuracy", "direction": "maximize"},
                    "objectives": [{"metric": "accuracy", "direction": "maximize"}],
                    "serving_precision": "fp32",
                    "algorithm": "tpe",
                    "early_stopping": "asha",
                    "max_trials": 12,
                    "max_parallel_trials": 2,
                    "search_space": {
                        **SEARCH_SPACE_EXAMPLE,
                        "warmup_ratio": {
                            "type": "float",
                            "low": 0.0,
                            "high": 0.2,
                            "log": False,
                            "step": None,
                            "choices": None,
                        },
                        "epochs": {"type": "int", "low": 1.0, "high": 3.0, "log": False, "step": 1.0, "choices": None},
                    },
                    "trials": {"queued": 1, "running": 2, "succeeded": 6, "pruned": 3, "failed": 0, "cancelled": 0},
                    "best_trial": {
                        "job_id": "job_8e2d4c1a9b7f3e05",
                        "trial_number": 4,
                        "params": {"learning_rate": 2.1e-4, "batch_size": 16, "warmup_ratio": 0.07, "epochs": 3},
                        "value": 0.871,
                    },
                    "pareto_trials": [],
                    "created_at": "2026-11-21T09:12:10.118Z",
                    "started_at": "2026-11-21T09:12:11.402Z",
                    "finished_at": None,
                    "error": None,
                }
            ]
        }
    )

    id: str
    status: str = Field(
        description="queued | running | paused (its next trials wait for room in the tenant's "
        "quotas: see error) | succeeded | failed | cancelled"
    )
    base_model: str
    task: str
    objective: Objective
    algorithm: str
    early_stopping: str
    max_trials: int
    max_parallel_trials: int
    objectives: list[Objective] = Field(description="Every objective (one, unless the sweep has several).")
    serving_precision: str
    search_space: dict[str, Distribution] = Field(
        description="What the sweep searches: each hyperparameter's range as stored (tunejob's priors filled "
        "in), in the form of SweepCreate.search_space, as the dry run's plan shows it (an int range's step is 1 "
        "when none was given)."
    )
    trials: dict[str, int] = Field(description="Trials by status.")
    best_trial: BestTrial | None = Field(
        description="The best succeeded trial on the (first) objective; with several objectives, "
        "the Pareto front's trial best on the first (of trials that tie on it, the one the others "
        "do not beat)."
    )
    default_trial: TrialOut | None = Field(
        None,
        description="Trial 0, run with the fixed hyperparameters "
        "(include_defaults); None without one, or before it was queued.",
    )
    pareto_trials: list[ParetoTrial] = Field(
        description="Several objectives: the succeeded trials no other "
        "beats on every objective (Optuna's study.best_trials), "
        "by number; one objective: []."
    )
    history: History | None = Field(None, description="warm_start_from: the earlier sweeps' trials in its study.")
    created_at: datetime
    started_at: datetime | None = Field(description="When its first trial started.")
    finished_at: datetime | None
    error: dict[str, Any] | None = Field(
        description="Why it failed, why it is paused (trials_paused), or that it "
        "ended on its budget (budget_spent): {code, message}."
    )


class SweepList(BaseModel):
    data: list[SweepOut]
    next_cursor: str | None


class SweepPlan(BaseModel):
    """``POST /sweeps?dry_run=true``: what would run, and nothing stored."""

    dry_run: bool = True
    max_trials: int
    max_parallel_trials: int
    search_space: dict[str, Distribution] = Field(
        description="Each hyperparameter's range as understood (priors filled in), in the form of "
        "SweepCreate.search_space (an int range's step is 1 when none was given).",
        examples=[
            {
                **SEARCH_SPACE_EXAMPLE,
                "epochs": {"type": "int", "low": 2.0, "high": 5.0, "log": False, "step": 1.0, "choices": None},
            }
        ],
    )
    first_trials: list[dict[str, Any]] = Field(description="The parameters of the trials queued first.")
    objective: Objective
    trial_plan: dict[str, Any] = Field(
        description="The plan of one trial with the fixed hyperparameters (as POST /jobs?dry_run=true)."
    )
