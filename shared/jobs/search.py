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

**Where a trial is in its schedule.** Optuna's pruners compare trials at the same step. An
optimizer step is no common point when the batch size or the epochs are searched: the learning
rate decays linearly to 0 over each trial's own ``total_steps``, so a 3-epoch trial's first epoch
(its learning rate still high) scores below a 1-epoch trial's last at the same step, and pruning
there stopped the longer schedules, the defaults' among them (issue 38; docs/guide/sweeps.md).
The study's intermediate values are keyed instead by the fraction of its ``total_steps`` each
trial had run (``schedule_curve``), so that trials meet at the same point of their schedules: the
end of epoch 1 of 3 for every 3-epoch trial.
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
from shared.schemas.hyperparameters import GREATER_IS_BETTER, TASK_METRICS, Hyperparameters
from shared.schemas.jobs import JobCreate
from shared.schemas.sweeps import LATENCY, Objective, SweepCreate
from shared.settings import get_settings
from shared.store.rows import Job, JobMetric, JobStatus, Sweep

optuna.logging.set_verbosity(optuna.logging.WARNING)

RUNNING, SUCCEEDED, FAILED, CANCELLED = "running", "succeeded", "failed", "cancelled"  # sweep statuses stored
ENDED = (SUCCEEDED, FAILED, CANCELLED)
METRIC_ALIASES = {"f1": "entity_f1"}  # the "f1 for entities"
LATENCY_TASKS = ("classification", "regression", "multi_label", "token_classification")  # shared.inference.loop's
STATES = {
    JobStatus.SUCCEEDED: TrialState.COMPLETE,
    JobStatus.PRUNED: TrialState.PRUNED,
    JobStatus.FAILED: TrialState.FAIL,
    JobStatus.CANCELLED: TrialState.FAIL,
    JobStatus.QUEUED: TrialState.RUNNING,
    JobStatus.RUNNING: TrialState.RUNNING,
}
SCHEDULE = 1_000_000  # a trial's whole schedule in the study's steps (``schedule_curve``)
TRIAL_STATUSES = (
    JobStatus.QUEUED,
    JobStatus.RUNNING,
    JobStatus.SUCCEEDED,
    JobStatus.PRUNED,
    JobStatus.FAILED,
    JobStatus.CANCELLED,
)


# ----------------------------------------------------------------------------- the spec


def check_objectives(spec: SweepCreate) -> list[Objective]:
    """Each objective against the task: a validation metric it produces (``TASK_METRICS``, or an alias)
    in that metric's own direction, or, after the first, ``latency_ms`` (minimize; tasks that
    ``shared.inference.loop`` predicts). Returns them with canonical names and directions.

    Raises:
        UserError: 422 ``invalid_objective`` naming ``objective.metric``/``.direction`` (or
            ``objectives.<i>.metric``/``.direction``, ``objectives``: a metric twice).
    """
    checked: list[Objective] = []
    for i, objective in enumerate(spec.all_objectives):
        field = "objective" if spec.objectives is None else f"objectives.{i}"
        metric = METRIC_ALIASES.get(objective.metric, objective.metric)
        if metric == LATENCY and (i == 0 or spec.task not in LATENCY_TASKS):
            why = (
                f"task {spec.task!r} is not served by tunejob's prediction path (latency_ms: "
                f"{', '.join(LATENCY_TASKS)})"
                if i > 0
                else "the first objective picks each trial's kept weights "
                "from its evaluations, and pruning decides on it: put a validation metric first"
            )
            raise UserError("invalid_objective", f"{field}.metric latency_ms: {why}", f"{field}.metric")
        if metric != LATENCY and metric not in TASK_METRICS[spec.task]:
            raise UserError(
                "invalid_objective",
                f"{field}.metric {objective.metric!r} is not a metric of task "
                f"{spec.task!r}; use one of {', '.join(TASK_METRICS[spec.task])}",
                f"{field}.metric",
            )
        natural = "minimize" if metric == LATENCY or not GREATER_IS_BETTER[metric] else "maximize"
        if objective.direction not in (None, natural):
            raise UserError(
                "invalid_objective",
                f"{field}.direction {objective.direction!r}: {metric} is better "
                f"when it is {'larger' if natural == 'maximize' else 'smaller'}; use {natural!r}",
                f"{field}.direction",
            )
        if metric in {o.metric for o in checked}:
            raise UserError("invalid_objective", f"objectives: {metric} is listed twice", "objectives")
        checked.append(Objective(metric=metric, direction=natural))
    return checked


def check_sweep(spec: SweepCreate) -> tuple[SweepCreate, dict[str, BaseDistribution]]:
    """Check what the schema cannot: the search space against ``Hyperparameters`` (and its base
    models: ``search_space.check_models``), the objectives against the task (``check_objectives``),
    the trial quota. Returns the spec with its objectives filled in (the metric's canonical name,
    its direction) and the ranges left to tunejob filled (``shared.jobs.priors``), and the space as
    Optuna distributions.

    Raises:
        UserError: 422 naming the field (``search_space.<name>``, ``objective.metric``,
            ``objective.direction``, ``objectives.<i>.metric``, ``max_trials``, ``max_parallel_trials``,
            ``max_duration_seconds``).
    """
    spec = priors.fill(spec)
    objectives = check_objectives(spec)
    limit = get_settings().max_trials_per_sweep
    if spec.max_trials > limit:
        raise UserError(
            "too_many_trials",
            f"max_trials {spec.max_trials} is over this server's quota of {limit} "
            "trials per sweep (TUNEJOB_MAX_TRIALS_PER_SWEEP)",
            "max_trials",
        )
    floor = get_settings().min_sweep_duration_seconds
    if spec.max_duration_seconds is not None and spec.max_duration_seconds < floor:
        raise UserError(
            "budget_too_small",
            f"max_duration_seconds {spec.max_duration_seconds} is under one "
            f"evaluation's time, this server's minimum of {floor:g} s (TUNEJOB_MIN_SWEEP_DURATION_SECONDS)",
            "max_duration_seconds",
        )
    if spec.max_parallel_trials > spec.max_trials:
        raise UserError(
            "too_many_parallel_trials",
            f"max_parallel_trials {spec.max_parallel_trials} is over max_trials {spec.max_trials}",
            "max_parallel_trials",
        )
    spec = spec.model_copy(update={"objective": objectives[0], "objectives": objectives if spec.objectives else None})
    space = distributions(spec)
    search_space.check_models(spec)
    if spec.algorithm == "grid" and spec.max_trials > (size := search_space.check_grid(spec)) + spec.include_defaults:
        raise UserError(
            "grid_too_small",
            f"max_trials {spec.max_trials} is over the grid's {size} points"
            f"{' and the default trial' if spec.include_defaults else ''}: trials would repeat "
            "parameters",
            "max_trials",
        )
    return spec, space


def trial_template(spec: SweepCreate) -> JobCreate:
    """The job spec every trial shares: the sweep's job fields, its fixed hyperparameters, and
    ``metric_for_best_model`` set to the objective (so a trial keeps its best evaluation's weights)."""
    fields = spec.model_dump(include=set(JobCreate.model_fields))
    fields["hyperparameters"] = {**fields["hyperparameters"], "metric_for_best_model": spec.objective.metric}
    return JobCreate.model_validate(fields)


def trial_hyperparameters(fixed: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A trial's full hyperparameters (the sweep's ``fixed`` ones with the asked ``params``, but
    ``base_model``, which is the job's own field), as stored: checked whole as ``Hyperparameters`` first, so that no stored trial fails to be read back.

    Raises:
        UserError: 422 ``invalid_trial`` naming ``search_space.<name>`` and the asked value.
    """
    hyperparameters = {**fixed, **{k: v for k, v in params.items() if k != search_space.BASE_MODEL}}
    try:
        Hyperparameters.model_validate(hyperparameters)
    except ValidationError as e:
        name = str(e.errors()[0]["loc"][0]) if e.errors()[0]["loc"] else ""
        raise UserError(
            "invalid_trial",
            f"search_space.{name}: the trial asked {name}={params.get(name)!r}, which "
            f"is not a valid {name}: {e.errors()[0]['msg']}",
            f"search_space.{name}",
        ) from None
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
    """The sweep's ``early_stopping`` as an Optuna pruner, on the study's steps (``schedule_curve``:
    fractions of a trial's schedule). ASHA's rungs are at 1/100 of a schedule times powers of
    ``reduction_factor`` (what Optuna's "auto" estimates from a finished trial, here from the
    first trial on: the pruner is rebuilt for every decision); ``min_steps``, a trial's own
    optimizer steps, is ``shared.jobs.sweeps.should_prune``'s to hold."""
    es = spec.early_stopping
    if es.type == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=SCHEDULE // 100, reduction_factor=es.reduction_factor
        )
    if es.type == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=es.min_trials, n_min_trials=es.min_trials)
    return optuna.pruners.NopPruner()


# ----------------------------------------------------------------------------- the study, rebuilt


def curves(s: Session, job_ids: list[str], metric: str) -> dict[str, dict[int, float]]:
    """Each job's objective by optimizer step (its ``eval_<metric>`` rows; the first per step, as
    Optuna's ``Trial.report`` keeps; non-finite values left out). Not step 0's: an embedding job's
    zero-shot figures (``worker.embedding.score_zero_shot``) are the base model's, whose weights no
    trial keeps; counted, every embedding trial was worth at least the base model."""
    out: dict[str, dict[int, float]] = {job_id: {} for job_id in job_ids}
    rows = s.execute(
        select(JobMetric.job_id, JobMetric.step, JobMetric.value)
        .where(JobMetric.job_id.in_(job_ids), JobMetric.name == f"eval_{metric}", JobMetric.value.isnot(None))
        .where(JobMetric.step > 0)
        .order_by(JobMetric.id)
    )
    for job_id, step, value in rows:
        if value is not None:  # as the query asks: typed Optional, as the column is
            out[job_id].setdefault(step, value)
    return out


def best_value(curve: dict[int, float], spec: SweepCreate) -> float | None:
    """A trial's value: its objective at its best evaluation (None before any)."""
    if not curve:
        return None
    return (max if spec.objective.direction == "maximize" else min)(curve.values())


def schedule_curve(curve: dict[int, float], total_steps: int | None) -> dict[int, float]:
    """A trial's ``curve`` (optimizer step -> value) as the study's intermediate values: each step
    as the fraction of the trial's ``total_steps`` it had run, in millionths (``SCHEDULE``; see the
    module), the first value of a fraction kept as ``Trial.report`` keeps the first of a step. Empty
    for a trial whose ``total_steps`` is not known (one that has not started training)."""
    if not total_steps:
        return {}
    out: dict[int, float] = {}
    for step, value in sorted(curve.items()):
        out.setdefault(round(SCHEDULE * step / total_steps), value)
    return out


def params_of(job: Job, spec: SweepCreate) -> dict[str, Any]:
    """The trial's searched parameters (``base_model`` from the job's own field)."""
    return {
        name: job.base_model if name == search_space.BASE_MODEL else job.spec["hyperparameters"][name]
        for name in spec.search_space
    }


def more_curves(s: Session, spec: SweepCreate, job_ids: list[str]) -> dict[str, list[dict[int, float]]]:
    """Several objectives: each job's curves of the objectives after the first (``curves``), in order."""
    by_metric = [curves(s, job_ids, o.metric) for o in spec.all_objectives[1:]]
    return {job_id: [c[job_id] for c in by_metric] for job_id in job_ids}


def values_of(curve: dict[int, float], more: list[dict[int, float]], spec: SweepCreate) -> list[float | None]:
    """A trial's value of each objective: the first's at its best evaluation (``best_value``), each
    other's at that same evaluation, or its last one where it was not measured there (latency_ms:
    once, after the model is saved)."""
    first = best_value(curve, spec)
    if first is None:
        return [None] * (1 + len(more))
    kept = min(step for step, value in curve.items() if value == first)
    return [first, *(c.get(kept, c[max(c)]) if c else None for c in more)]


def frozen(
    job: Job,
    spec: SweepCreate,
    space: dict,
    curve: dict[int, float],
    state: TrialState | None = None,
    more: list[dict[int, float]] | None = None,
) -> FrozenTrial:
    """Trial ``job`` as Optuna sees it: with ``more`` (the other objectives' curves, ``more_curves``)
    a trial of a multi-objective study, else of a study of the first objective; its intermediate
    values ``schedule_curve``'s. Its job id is its user attribute ``job_id``. A pruned trial of a
    multi-objective study has no intermediate values: Optuna's TPE ranks pruned trials by their
    last one in the study's one ``direction``, and raises for a study of several (the pruner, which
    reads the curves, runs on the first objective's study)."""
    state = state or STATES[job.status]
    kept_curve = more is None or state != TrialState.PRUNED
    found = values_of(curve, more or [], spec) if state == TrialState.COMPLETE else []
    values = [v for v in found if v is not None] if None not in found else []
    if state == TrialState.COMPLETE and not values:  # succeeded without a finite evaluation (or latency)
        state = TrialState.FAIL
    return create_trial(
        state=state,
        values=values or None,
        params=params_of(job, spec),
        distributions=space,
        intermediate_values=schedule_curve(curve, job.total_steps) if kept_curve else {},
        system_attrs=job.trial_attrs or {},
        user_attrs={"job_id": job.id},
    )


def history(s: Session, spec: SweepCreate, space: dict, multi: bool = False) -> list[FrozenTrial]:
    """The warm start (``warm_start_from``): the earlier sweeps' succeeded and pruned trials, in
    their order and then by number, as Optuna trials of this space, with their values and curves
    (``curves``, of this sweep's objective, as ``schedule_curve``) and their ``job_id``,
    ``sweep_id`` and ``trial_number`` as user attributes. ``multi``: trials of the multi-objective study, with every objective's value
    (``values_of``). A trial whose parameters lie outside this space, or that succeeded without a
    value of every objective, is left out (an Optuna study holds no such trial)."""
    if not spec.warm_start_from:
        return []
    jobs = sorted(
        s.scalars(
            select(Job).where(
                Job.sweep_id.in_(spec.warm_start_from),
                Job.deleted_at.is_(None),
                Job.status.in_((JobStatus.SUCCEEDED, JobStatus.PRUNED)),
            )
        ),
        key=lambda j: (spec.warm_start_from.index(j.sweep_id or ""), j.trial_number or 0),
    )
    trial_curves = curves(s, [job.id for job in jobs], spec.objective.metric)
    more = more_curves(s, spec, [job.id for job in jobs]) if multi else {job.id: [] for job in jobs}
    out = []
    for job in jobs:
        curve, state = trial_curves[job.id], STATES[job.status]
        found = values_of(curve, more[job.id], spec) if state == TrialState.COMPLETE else []
        values = [v for v in found if v is not None]
        if len(values) < len(found):  # succeeded without a finite evaluation (or latency)
            continue
        try:
            out.append(
                create_trial(
                    state=state,
                    values=values or None,
                    distributions=space,
                    # as ``frozen``: no curve for a pruned trial of a multi-objective study
                    intermediate_values={}
                    if multi and state == TrialState.PRUNED
                    else schedule_curve(curve, job.total_steps),
                    params={
                        name: job.base_model
                        if name == search_space.BASE_MODEL
                        else job.spec["hyperparameters"].get(name)
                        for name in space
                    },
                    user_attrs={"job_id": job.id, "sweep_id": job.sweep_id, "trial_number": job.trial_number},
                )
            )
        except (ValueError, TypeError):  # outside this space
            continue
    return out


def study_of(
    spec: SweepCreate,
    space: dict,
    trials: list[Job],
    trial_curves: dict[str, dict[int, float]],
    asking: bool = False,
    more: dict[str, list[dict[int, float]]] | None = None,
    past: list[FrozenTrial] | None = None,
) -> optuna.Study:
    """An in-memory Optuna study holding the warm start's ``past`` trials (``history``) and then
    ``trials`` (in number order). Only a study ``asking`` for trials gets the sweep's sampler
    (``sampler``: a grid's is built from all its points); pruning and the report get a random one,
    which costs nothing to build.

    With ``more`` (``more_curves``), a multi-objective study (``directions``; ``past`` built with
    ``multi``); without, a study of the first objective alone: the one pruning decides on (Optuna's
    pruners and ``Trial.report`` take one objective; intermediate values are the first objective's
    either way)."""
    chosen = sampler(spec, len(trials)) if asking else optuna.samplers.RandomSampler(seed=spec.seed)
    directions = (
        [o.direction or "maximize" for o in spec.all_objectives]
        if more is not None
        else [spec.objective.direction or "maximize"]
    )
    study = optuna.create_study(directions=directions, sampler=chosen, pruner=pruner(spec))
    study.add_trials(past or [])
    for job in sorted(trials, key=lambda j: j.trial_number or 0):  # every trial has its number
        study.add_trial(frozen(job, spec, space, trial_curves[job.id], more=more[job.id] if more else None))
    return study


def multi_objective(spec: SweepCreate) -> bool:
    return len(spec.all_objectives) > 1


def default_params(spec: SweepCreate, space: dict[str, BaseDistribution]) -> dict[str, Any]:
    """The default trial's parameters (``include_defaults``): each searched field's fixed value (the
    spec's hyperparameter, or tunejob's default; a searched base_model: the spec's), taken to the nearest value its range holds (a
    bound; on a stepped range, the nearest step; a categorical's first choice when it holds no
    equal one; a range's low bound for a value left null), since every trial of an Optuna study lies inside its distributions."""
    fixed = {**spec.hyperparameters.model_dump(), search_space.BASE_MODEL: spec.base_model}
    params: dict[str, Any] = {}
    for name, d in space.items():
        value = fixed[name]
        if isinstance(d, CategoricalDistribution):
            params[name] = next(
                (c for c in d.choices if c == value and isinstance(c, bool) == isinstance(value, bool)), d.choices[0]
            )
            continue
        assert isinstance(d, (FloatDistribution, IntDistribution))  # the only kinds search_space builds
        value = d.low if value is None else min(max(value, d.low), d.high)  # None: e.g. eval_every_steps
        if d.step:
            value = min(d.low + round((value - d.low) / d.step) * d.step, d.high)
        params[name] = int(round(value)) if isinstance(d, IntDistribution) else float(value)
    return params


def ask(
    spec: SweepCreate,
    space: dict,
    trials: list[Job],
    trial_curves: dict,
    n: int,
    more: dict[str, list[dict[int, float]]] | None = None,
    past: list[FrozenTrial] | None = None,
) -> list[tuple[dict, dict]]:
    """The next ``n`` trials' (params, Optuna system attributes), each asked with the ones before it
    (and every queued or running trial) in the study as running. A sweep's first trial, with
    ``include_defaults``, is the default trial (``default_params``), enqueued through Optuna's
    ``enqueue_trial`` so that the sampler knows it as a fixed trial (``fixed_params``). ``past``:
    the warm start's trials (``history``). A sweep of several objectives asks with ``more``
    (``more_curves``; ``{}`` before any trial): TPE then runs as multi-objective TPE (MOTPE, Ozaki
    et al. 2020), random and grid as they are."""
    study = study_of(spec, space, trials, trial_curves, asking=True, more=more, past=past)
    if spec.include_defaults and not trials:
        study.enqueue_trial(default_params(spec, space))
    asked = []
    for _ in range(n):
        trial = study.ask(fixed_distributions=space)
        asked.append((trial.params, dict(study.get_trials(deepcopy=False)[trial.number].system_attrs)))
    return asked
