"""A sweep's search: its spec checked (the search space itself: ``shared.jobs.search_space``) and a
trial's hyperparameters checked whole, and its study rebuilt from the job store's rows to ask for
trials and to prune them (Optuna's samplers and pruners; Akiba et al. 2019, https://optuna.org). No
writes: ``shared.jobs.trials`` and ``shared.jobs.sweeps`` act on what it answers.

**Where the study lives.** In tunejob's own rows, not in an Optuna storage: each decision rebuilds an
in-memory study (``optuna.create_study`` with its default ``InMemoryStorage``) from the sweep's trial
jobs: their parameters (``Job.spec``), their objective at every evaluation (the ``eval_<metric>``
rows of ``job_metrics``, which the worker streams anyway), their status, and the Optuna trial system
attributes their sampler and pruner keep (``Job.trial_attrs``: ``grid_id``, ASHA's rungs). So the
one job lease covers trials (Optuna's heartbeat does not cover ask/tell; Optuna's FAQ advises
against SQLite with concurrent writers), and the same code runs on SQLite and PostgreSQL.
"""

from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.errors import UserError
from shared.jobs import priors, search_space
from shared.jobs.search_space import distributions
from shared.schemas.jobs import GREATER_IS_BETTER, TASK_METRICS, Hyperparameters, JobCreate
from shared.schemas.sweeps import SweepCreate
from shared.settings import get_settings
from shared.store.rows import Job, JobMetric, JobStatus, Sweep

optuna.logging.set_verbosity(optuna.logging.WARNING)

RUNNING, SUCCEEDED, FAILED, CANCELLED = "running", "succeeded", "failed", "cancelled"  # sweep statuses stored
ENDED = (SUCCEEDED, FAILED, CANCELLED)
METRIC_ALIASES = {"f1": "entity_f1"}  # the "f1 for entities"
STATES = {JobStatus.SUCCEEDED: TrialState.COMPLETE, JobStatus.PRUNED: TrialState.PRUNED,
          JobStatus.FAILED: TrialState.FAIL, JobStatus.CANCELLED: TrialState.FAIL,
          JobStatus.QUEUED: TrialState.RUNNING, JobStatus.RUNNING: TrialState.RUNNING}
TRIAL_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.PRUNED, JobStatus.FAILED,
                  JobStatus.CANCELLED)


# ----------------------------------------------------------------------------- the spec


def check_sweep(spec: SweepCreate) -> tuple[SweepCreate, dict[str, BaseDistribution]]:
    """Check what the schema cannot: the search space against ``Hyperparameters``, the objective
    against the task, the trial quota. Returns the spec with its objective filled in (the metric's
    canonical name, its direction) and the ranges left to tunejob filled (``shared.jobs.priors``),
    and the space as Optuna distributions.

    Raises:
        UserError: 422 naming the field (``search_space.<name>``, ``objective.metric``,
            ``objective.direction``, ``max_trials``, ``max_parallel_trials``).
    """
    spec = priors.fill(spec)
    metric = METRIC_ALIASES.get(spec.objective.metric, spec.objective.metric)
    if metric not in TASK_METRICS[spec.task]:
        raise UserError("invalid_objective", f"objective.metric {spec.objective.metric!r} is not a metric of task "
                        f"{spec.task!r}; use one of {', '.join(TASK_METRICS[spec.task])}", "objective.metric")
    natural = "maximize" if GREATER_IS_BETTER[metric] else "minimize"
    if spec.objective.direction not in (None, natural):
        raise UserError("invalid_objective", f"objective.direction {spec.objective.direction!r}: {metric} is "
                        f"better when it is {'larger' if natural == 'maximize' else 'smaller'}; use {natural!r}",
                        "objective.direction")
    limit = get_settings().max_trials_per_sweep
    if spec.max_trials > limit:
        raise UserError("too_many_trials", f"max_trials {spec.max_trials} is over this server's quota of {limit} "
                        "trials per sweep (TUNEJOB_MAX_TRIALS_PER_SWEEP)", "max_trials")
    if spec.max_parallel_trials > spec.max_trials:
        raise UserError("too_many_parallel_trials", f"max_parallel_trials {spec.max_parallel_trials} is over max_trials "
                        f"{spec.max_trials}", "max_parallel_trials")
    spec = spec.model_copy(update={"objective": spec.objective.model_copy(update={"metric": metric,
                                                                                   "direction": natural})})
    space = distributions(spec)
    if spec.algorithm == "grid" and spec.max_trials > (size := search_space.check_grid(spec)) + spec.include_defaults:
        raise UserError("grid_too_small", f"max_trials {spec.max_trials} is over the grid's {size} points"
                        f"{' and the default trial' if spec.include_defaults else ''}: trials would repeat "
                        "parameters", "max_trials")
    return spec, space


def trial_template(spec: SweepCreate) -> JobCreate:
    """The job spec every trial shares: the sweep's job fields, its fixed hyperparameters, and
    ``metric_for_best_model`` set to the objective (so a trial keeps its best evaluation's weights)."""
    fields = spec.model_dump(include=set(JobCreate.model_fields))
    fields["hyperparameters"] = {**fields["hyperparameters"], "metric_for_best_model": spec.objective.metric}
    return JobCreate.model_validate(fields)


def trial_hyperparameters(fixed: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's full hyperparameters (the sweep's ``fixed`` ones with the asked ``params``), as
    stored: checked whole as ``Hyperparameters`` first, so that no stored trial fails to be read back.

    Raises:
        UserError: 422 ``invalid_trial`` naming ``search_space.<name>`` and the asked value.
    """
    hyperparameters = {**fixed, **params}
    try:
        Hyperparameters.model_validate(hyperparameters)
    except ValidationError as e:
        name = str(e.errors()[0]["loc"][0]) if e.errors()[0]["loc"] else ""
        raise UserError("invalid_trial", f"search_space.{name}: the trial asked {name}={params.get(name)!r}, which "
                        f"is not a valid {name}: {e.errors()[0]['msg']}", f"search_space.{name}") from None
    return hyperparameters


def spec_of(sweep: Sweep) -> SweepCreate:
    """The sweep's stored spec, as the schema reads it."""
    return SweepCreate.model_validate(sweep.spec, strict=False)


def sampler(spec: SweepCreate, asked: int) -> optuna.samplers.BaseSampler:
    """The sampler for the next trials, seeded with ``seed + asked`` (the trials already asked): a
    rebuilt study asks what an uninterrupted one would, and never the same draw twice."""
    seed = (spec.seed + asked) % 2**32
    if spec.algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.algorithm == "grid":
        return optuna.samplers.GridSampler(search_space.grid(spec), seed=seed)
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True, n_startup_trials=startup_trials(spec.max_trials))


def startup_trials(max_trials: int) -> int:
    """TPE's random start-up trials for a sweep of ``max_trials``: a quarter of them, at least 2 and
    at most Optuna's default 10. Optuna's 10 suits studies of a hundred trials; in a sweep of 12 it
    left two trials to TPE (issue 38). The default trial and warm-start history count among the
    trials TPE has seen, so a warm-started sweep models from its first asked trial."""
    return min(10, max(2, max_trials // 4))


def pruner(spec: SweepCreate) -> optuna.pruners.BasePruner:
    """The sweep's ``early_stopping`` as an Optuna pruner."""
    es = spec.early_stopping
    if es.type == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=es.min_steps or "auto",
                                                      reduction_factor=es.reduction_factor)
    if es.type == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=es.min_trials, n_warmup_steps=es.min_steps,
                                           n_min_trials=es.min_trials)
    return optuna.pruners.NopPruner()


# ----------------------------------------------------------------------------- the study, rebuilt


def curves(s: Session, job_ids: list[str], metric: str) -> dict[str, dict[int, float]]:
    """Each job's objective by optimizer step (its ``eval_<metric>`` rows; the first per step, as
    Optuna's ``Trial.report`` keeps; non-finite values left out)."""
    out: dict[str, dict[int, float]] = {job_id: {} for job_id in job_ids}
    rows = s.execute(select(JobMetric.job_id, JobMetric.step, JobMetric.value)
                     .where(JobMetric.job_id.in_(job_ids), JobMetric.name == f"eval_{metric}",
                            JobMetric.value.isnot(None)).order_by(JobMetric.id))
    for job_id, step, value in rows:
        if value is not None:  # as the query asks: typed Optional, as the column is
            out[job_id].setdefault(step, value)
    return out


def best_value(curve: dict[int, float], spec: SweepCreate) -> float | None:
    """A trial's value: its objective at its best evaluation (None before any)."""
    if not curve:
        return None
    return (max if spec.objective.direction == "maximize" else min)(curve.values())


def params_of(job: Job, spec: SweepCreate) -> dict[str, Any]:
    return {name: job.spec["hyperparameters"][name] for name in spec.search_space}


def frozen(job: Job, spec: SweepCreate, space: dict, curve: dict[int, float], state: TrialState | None = None
           ) -> FrozenTrial:
    """Trial ``job`` as Optuna sees it."""
    state = state or STATES[job.status]
    value = best_value(curve, spec) if state == TrialState.COMPLETE else None
    if state == TrialState.COMPLETE and value is None:  # succeeded without a finite evaluation
        state = TrialState.FAIL
    return create_trial(state=state, value=value, params=params_of(job, spec), distributions=space,
                        intermediate_values=curve, system_attrs=job.trial_attrs or {})


def history(s: Session, spec: SweepCreate, space: dict) -> list[FrozenTrial]:
    """The warm start (``warm_start_from``): the earlier sweeps' succeeded and pruned trials, in
    their order and then by number, as Optuna trials of this space, with their values and curves
    (``curves``, of this sweep's objective) and their ``job_id``, ``sweep_id`` and ``trial_number``
    as user attributes. A trial whose parameters lie outside this space is left out (an Optuna
    study holds no such trial)."""
    if not spec.warm_start_from:
        return []
    jobs = sorted(s.scalars(select(Job).where(Job.sweep_id.in_(spec.warm_start_from), Job.deleted_at.is_(None),
                                              Job.status.in_((JobStatus.SUCCEEDED, JobStatus.PRUNED)))),
                  key=lambda j: (spec.warm_start_from.index(j.sweep_id or ""), j.trial_number or 0))
    trial_curves = curves(s, [job.id for job in jobs], spec.objective.metric)
    out = []
    for job in jobs:
        curve, state = trial_curves[job.id], STATES[job.status]
        value = best_value(curve, spec) if state == TrialState.COMPLETE else None
        try:
            out.append(create_trial(state=state, value=value, distributions=space, intermediate_values=curve,
                                    params={name: job.spec["hyperparameters"].get(name) for name in space},
                                    user_attrs={"job_id": job.id, "sweep_id": job.sweep_id,
                                                "trial_number": job.trial_number}))
        except (ValueError, TypeError):  # outside this space, or succeeded without a finite evaluation
            continue
    return out


def study_of(spec: SweepCreate, space: dict, trials: list[Job], trial_curves: dict[str, dict[int, float]],
             asking: bool = False, past: list[FrozenTrial] | None = None) -> optuna.Study:
    """An in-memory Optuna study holding the warm start's ``past`` trials (``history``) and then
    ``trials`` (in number order). Only a study ``asking`` for trials gets the sweep's sampler
    (``sampler``: a grid's is built from all its points); pruning and the report get a random one,
    which costs nothing to build."""
    chosen = sampler(spec, len(trials)) if asking else optuna.samplers.RandomSampler(seed=spec.seed)
    study = optuna.create_study(direction=spec.objective.direction, sampler=chosen, pruner=pruner(spec))
    study.add_trials(past or [])
    for job in sorted(trials, key=lambda j: j.trial_number or 0):  # every trial has its number
        study.add_trial(frozen(job, spec, space, trial_curves[job.id]))
    return study


def default_params(spec: SweepCreate, space: dict[str, BaseDistribution]) -> dict[str, Any]:
    """The default trial's parameters (``include_defaults``): each searched field's fixed value (the
    spec's hyperparameter, or tunejob's default), taken to the nearest value its range holds (a
    bound; on a stepped range, the nearest step; a categorical's first choice when it holds no
    equal one; a range's low bound for a value left null), since every trial of an Optuna study lies inside its distributions."""
    fixed = spec.hyperparameters.model_dump()
    params: dict[str, Any] = {}
    for name, d in space.items():
        value = fixed[name]
        if isinstance(d, CategoricalDistribution):
            params[name] = next((c for c in d.choices if c == value and isinstance(c, bool) == isinstance(value, bool)),
                                d.choices[0])
            continue
        assert isinstance(d, (FloatDistribution, IntDistribution))  # the only kinds search_space builds
        value = d.low if value is None else min(max(value, d.low), d.high)  # None: e.g. eval_every_steps
        if d.step:
            value = min(d.low + round((value - d.low) / d.step) * d.step, d.high)
        params[name] = int(round(value)) if isinstance(d, IntDistribution) else float(value)
    return params


def ask(spec: SweepCreate, space: dict, trials: list[Job], trial_curves: dict, n: int,
        past: list[FrozenTrial] | None = None) -> list[tuple[dict, dict]]:
    """The next ``n`` trials' (params, Optuna system attributes), each asked with the ones before it
    (and every queued or running trial) in the study as running. A sweep's first trial, with
    ``include_defaults``, is the default trial (``default_params``), enqueued through Optuna's
    ``enqueue_trial`` so that the sampler knows it as a fixed trial (``fixed_params``). ``past``:
    the warm start's trials (``history``)."""
    study = study_of(spec, space, trials, trial_curves, asking=True, past=past)
    if spec.include_defaults and not trials:
        study.enqueue_trial(default_params(spec, space))
    asked = []
    for _ in range(n):
        trial = study.ask(fixed_distributions=space)
        asked.append((trial.params, dict(study.get_trials(deepcopy=False)[trial.number].system_attrs)))
    return asked
