r"""Hyperparameter sweeps: many trials of one job spec, each an ordinary training job, searched and
pruned by Optuna (samplers and pruners; Akiba et al. 2019, https://optuna.org).

    POST /sweeps --> sweep (running) + first trials (queued jobs)
    a trial ends (succeeded | pruned | failed | cancelled) --> in the same transaction: tell, ask the next
    max_trials asked and none active --> sweep succeeded (or failed: no trial succeeded, or over max_failed_trials)

**Where the study lives.** In tunejob's own rows, not in an Optuna storage: each decision rebuilds an
in-memory study (``optuna.create_study`` with its default ``InMemoryStorage``) from the sweep's trial
jobs: their parameters (``Job.spec``), their objective at every evaluation (the ``eval_<metric>``
rows of ``job_metrics``, which the worker streams anyway), their status, and the Optuna trial system
attributes their sampler and pruner keep (``Job.trial_attrs``: ``grid_id``, ASHA's rungs). So the
one job lease covers trials (Optuna's heartbeat does not cover ask/tell; Optuna's FAQ advises
against SQLite with concurrent writers), and the same code runs on SQLite and PostgreSQL.

**Asking** happens in the transaction that ends a trial (``trial_ended``, from ``shared.jobs.lifecycle``) or
creates the sweep, with the sweep's row locked (``SELECT … FOR UPDATE`` on PostgreSQL; SQLite's
``BEGIN IMMEDIATE`` single writer): trial numbers come from the rows (unique per sweep), never
exceed ``max_trials``, and survive a kill -9 of any process. Queued and running trials enter the
rebuilt study as RUNNING, so TPE's ``constant_liar`` keeps parallel trials apart; the sampler is
seeded with ``seed + trials so far`` (the same sweep asks the same trials). The recovery loop also
calls ``top_up_all`` (a sweep left short by an error goes on).

**Pruning**: at each evaluation the worker asks ``should_prune`` with the objective; the pruner
(``MedianPruner`` or ``SuccessiveHalvingPruner``) sees the other trials' stored curves. A trial's
value is its objective at its best evaluation, the one whose weights it keeps
(``metric_for_best_model`` is set to the objective).
"""

import logging
import math
from collections import Counter
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from shared.errors import Conflict, Deleted, NotFound, UserError
from shared.jobs import lifecycle, search_space, webhooks
from shared.jobs.planning import check_spec, plan_job
from shared.jobs.search_space import distributions
from shared.schemas.jobs import GREATER_IS_BETTER, TASK_METRICS, Hyperparameters, JobCreate
from shared.schemas.sweeps import BestTrial, SweepCreate, SweepOut, SweepPlan, TrialOut
from shared.settings import get_settings
from shared.store import idempotency, quotas
from shared.store.engine import keyset_page, read_session, session_scope
from shared.store.rows import Job, JobEvent, JobMetric, JobStatus, Sweep, new_id, utcnow
from shared.store.tenancy import Caller, lock_tenant, try_lock_tenant

optuna.logging.set_verbosity(optuna.logging.WARNING)
log = logging.getLogger(__name__)

RUNNING, SUCCEEDED, FAILED, CANCELLED = "running", "succeeded", "failed", "cancelled"  # sweep statuses stored
ENDED = (SUCCEEDED, FAILED, CANCELLED)
PAUSED = "trials_paused"  # a running sweep's error while its tenant has no room for its next trials
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
    canonical name, its direction) and the space as Optuna distributions.

    Raises:
        UserError: 422 naming the field (``search_space.<name>``, ``objective.metric``,
            ``objective.direction``, ``max_trials``, ``max_parallel_trials``).
    """
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
    if spec.algorithm == "grid" and spec.max_trials > (size := search_space.check_grid(spec)):
        raise UserError("grid_too_small", f"max_trials {spec.max_trials} is over the grid's {size} points: "
                        "trials would repeat parameters", "max_trials")
    return spec, space


def trial_template(spec: SweepCreate) -> JobCreate:
    """The job spec every trial shares: the sweep's job fields, its fixed hyperparameters, and
    ``metric_for_best_model`` set to the objective (so a trial keeps its best evaluation's weights)."""
    fields = spec.model_dump(include=set(JobCreate.model_fields))
    fields["hyperparameters"] = {**fields["hyperparameters"], "metric_for_best_model": spec.objective.metric}
    return JobCreate.model_validate(fields)


def _spec(sweep: Sweep) -> SweepCreate:
    return SweepCreate.model_validate(sweep.spec, strict=False)


def sampler(spec: SweepCreate, asked: int) -> optuna.samplers.BaseSampler:
    """The sampler for the next trials, seeded with ``seed + asked`` (the trials already asked): a
    rebuilt study asks what an uninterrupted one would, and never the same draw twice."""
    seed = (spec.seed + asked) % 2**32
    if spec.algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.algorithm == "grid":
        return optuna.samplers.GridSampler(search_space.grid(spec), seed=seed)
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True)


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


def study_of(spec: SweepCreate, space: dict, trials: list[Job], trial_curves: dict[str, dict[int, float]],
             asking: bool = False) -> optuna.Study:
    """An in-memory Optuna study holding ``trials`` (in number order, so Optuna numbers them as we do).
    Only a study ``asking`` for trials gets the sweep's sampler (``sampler``: a grid's is built from
    all its points); pruning and the report get a random one, which costs nothing to build."""
    chosen = sampler(spec, len(trials)) if asking else optuna.samplers.RandomSampler(seed=spec.seed)
    study = optuna.create_study(direction=spec.objective.direction, sampler=chosen, pruner=pruner(spec))
    for job in sorted(trials, key=lambda j: j.trial_number):
        study.add_trial(frozen(job, spec, space, trial_curves[job.id]))
    return study


def ask(spec: SweepCreate, space: dict, trials: list[Job], trial_curves: dict, n: int) -> list[tuple[dict, dict]]:
    """The next ``n`` trials' (params, Optuna system attributes), each asked with the ones before it
    (and every queued or running trial) in the study as running."""
    study = study_of(spec, space, trials, trial_curves, asking=True)
    asked = []
    for _ in range(n):
        trial = study.ask(fixed_distributions=space)
        asked.append((trial.params, dict(study.get_trials(deepcopy=False)[trial.number].system_attrs)))
    return asked


# ----------------------------------------------------------------------------- lifecycle


def create_sweep(spec: SweepCreate, caller: Caller, claim: idempotency.Claim | None = None) -> Sweep:
    """Check the sweep, store it and queue its first ``min(max_parallel_trials, max_trials)`` trials,
    in one transaction (with an idempotency ``claim``, its response recorded there too). The caller
    then sends the trials' ids to the broker (``shared.queue.send_trials``).

    Raises:
        UserError: see ``check_sweep`` and ``shared.jobs.planning.check_spec``; 429 ``too_many_active_jobs``
            when the first trials would take the tenant over ``max_active_jobs_per_tenant``.
    """
    spec, _ = check_sweep(spec)
    checked = check_spec(trial_template(spec), caller)
    with lifecycle.admission(caller) as s:
        first = min(spec.max_parallel_trials, spec.max_trials)
        active = s.scalar(select(func.count()).select_from(Job).where(
            Job.tenant == caller.tenant, Job.status.in_(lifecycle.ACTIVE)))
        limit = get_settings().max_active_jobs_per_tenant
        if active + first > limit:
            raise UserError("too_many_active_jobs", f"tenant {caller.tenant!r} has {active} queued or running jobs; "
                            f"{first} parallel trials would pass its maximum (TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT="
                            f"{limit})", "max_parallel_trials", status=429, headers={"Retry-After": "60"})
        sweep = Sweep(id=new_id("sweep"), tenant=caller.tenant, status=RUNNING, spec=spec.model_dump(mode="json"),
                      label_names=checked.label_names)
        s.add(sweep)
        s.flush()
        top_up(s, sweep)
        if claim is not None:
            idempotency.complete(s, claim, 201, to_out(s, sweep).model_dump(mode="json"))
        return sweep


def plan_sweep(spec: SweepCreate, caller: Caller) -> SweepPlan:
    """``POST /sweeps?dry_run=true``: the checks of ``create_sweep``, and what it would queue first."""
    spec, space = check_sweep(spec)
    first = ask(spec, space, [], {}, min(spec.max_parallel_trials, spec.max_trials))
    return SweepPlan(max_trials=spec.max_trials, max_parallel_trials=spec.max_parallel_trials,
                     search_space={name: repr(d) for name, d in space.items()}, objective=spec.objective,
                     first_trials=[params for params, _ in first],
                     trial_plan=plan_job(check_spec(trial_template(spec), caller)))


def top_up(s: Session, sweep: Sweep) -> list[Job]:
    """In session ``s``, with the sweep's row locked: queue trials up to ``max_parallel_trials``
    active and ``max_trials`` in all; end the sweep once every trial has ended, or fail it once more
    than ``max_failed_trials`` failed. Returns the new trials (queued; their ids not yet sent)."""
    if sweep.status in ENDED:
        return []
    spec = _spec(sweep)
    trials = list(s.scalars(select(Job).where(Job.sweep_id == sweep.id)))
    counts = Counter(t.status for t in trials)
    active = counts[JobStatus.QUEUED] + counts[JobStatus.RUNNING]
    if counts[JobStatus.FAILED] > spec.max_failed_trials:
        end_sweep(s, sweep, FAILED, {"code": "too_many_failed_trials", "message": f"{counts[JobStatus.FAILED]} "
                                     f"trials failed, more than max_failed_trials {spec.max_failed_trials}"})
        return []
    wanted = min(spec.max_parallel_trials - active, spec.max_trials - len(trials))
    if wanted <= 0:
        if active == 0:
            ok = counts[JobStatus.SUCCEEDED] > 0
            end_sweep(s, sweep, SUCCEEDED if ok else FAILED,
                      None if ok else {"code": "no_trial_succeeded", "message": "no trial succeeded"})
        return []
    wanted = admitted(s, sweep, wanted)
    if wanted <= 0:
        return []
    space = distributions(spec)
    asked = ask(spec, space, trials, curves(s, [t.id for t in trials], spec.objective.metric), wanted)
    template = trial_template(spec).model_dump(mode="json")
    try:
        hyperparameters = [trial_hyperparameters(template["hyperparameters"], params) for params, _ in asked]
    except UserError as e:
        if not trials:  # the sweep's first trials: its creation is refused
            raise
        end_sweep(s, sweep, FAILED, {"code": e.code, "message": e.message})
        return []
    new = []
    for number, ((params, attrs), hp) in enumerate(zip(asked, hyperparameters), start=len(trials)):
        job = Job(id=new_id("job"), tenant=sweep.tenant, base_model=spec.base_model, task=spec.task,
                  training_dataset_id=spec.training_dataset, validation_dataset_id=spec.validation_dataset,
                  spec={**template, "hyperparameters": hp},
                  label_names=sweep.label_names, sweep_id=sweep.id, trial_number=number, trial_attrs=attrs)
        new.append(lifecycle.insert_queued(s, job, f"trial {number} of sweep {sweep.id} queued: {params}", None, None))
    return new


def admitted(s: Session, sweep: Sweep, wanted: int) -> int:
    """How many of ``wanted`` new trials the sweep's tenant may queue now: trials pass the same
    admission as jobs (the storage quota and the active-jobs maximum, ``shared.store.quotas``). With
    no room the sweep is paused: ``error`` says why (code ``trials_paused``) until the recovery loop's
    ``top_up_all`` finds room and clears it. 0 also while another transaction of the tenant holds its
    lock (taken without waiting: ``try_lock_tenant``), to be tried again."""
    if not try_lock_tenant(s, sweep.tenant):
        return 0
    limit = get_settings().max_active_jobs_per_tenant
    active = s.scalar(select(func.count()).select_from(Job).where(Job.tenant == sweep.tenant,
                                                                  Job.status.in_(lifecycle.ACTIVE)))
    why = (f"tenant {sweep.tenant!r} has {active} queued or running jobs, its maximum "
           f"(TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT={limit})") if active >= limit else None
    if why is None:
        try:
            quotas.check_storage(s, sweep.tenant)
        except UserError as e:
            why = e.message
    if why is not None:
        if (sweep.error or {}).get("code") != PAUSED:
            log.info("sweep %s paused: %s", sweep.id, why)
        sweep.error = {"code": PAUSED, "message": f"the next trials wait: {why}; they start when room frees"}
        return 0
    if (sweep.error or {}).get("code") == PAUSED:
        sweep.error = None
    return min(wanted, limit - active)


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


def trial_ended(s: Session, job: Job) -> None:
    """Trial ``job`` has just ended in transaction ``s``: lock its sweep and ``top_up`` it."""
    sweep = s.get(Sweep, job.sweep_id, with_for_update=True, populate_existing=True)
    if sweep is None:
        return
    try:
        with s.begin_nested():  # a failure to ask must not undo the trial's end: the recovery loop asks again
            top_up(s, sweep)
    except Exception:
        log.exception("sweep %s: asking for the next trials failed; the recovery loop tries again", sweep.id)


def end_sweep(s: Session, sweep: Sweep, status: str, error: dict | None = None) -> None:
    """End the sweep ``status`` and cancel its queued and running trials; its ``sweep.<status>``
    webhook deliveries are stored in the same transaction (``shared.jobs.webhooks``)."""
    now = utcnow()
    sweep.status, sweep.finished_at, sweep.error = status, now, error
    webhooks.emit(s, sweep.tenant, f"sweep.{status}", f"evt_{sweep.id}_{status}",
                  {"id": sweep.id, "object": "sweep", "status": status, "error": error,
                   "finished_at": now.isoformat().replace("+00:00", "Z")})
    for job in s.scalars(select(Job).where(Job.sweep_id == sweep.id, Job.status.in_(lifecycle.ACTIVE))
                         .with_for_update()):
        lifecycle.cancel_in(s, job, now, f" (sweep {sweep.id} {status})")


def top_up_all() -> list[str]:
    """For the recovery loop: ``top_up`` every running sweep; returns the new trials' ids to send."""
    with read_session() as s:
        ids = s.scalars(select(Sweep.id).where(Sweep.status == RUNNING, Sweep.deleted_at.is_(None))).all()
    new = []
    for sweep_id in ids:
        with session_scope() as s:
            sweep = s.get(Sweep, sweep_id, with_for_update=True, populate_existing=True)
            new += [job.id for job in top_up(s, sweep)]
    return new


def unsent_trials(sweep_id: str) -> list[str]:
    """The sweep's queued trials whose message was never sent (``shared.queue.send_trials``)."""
    with read_session() as s:
        return list(s.scalars(select(Job.id).where(Job.sweep_id == sweep_id, Job.status == JobStatus.QUEUED,
                                                   Job.enqueued_at.is_(None))))


def should_prune(job_id: str, step: int, metrics: dict[str, Any]) -> bool:
    """Whether trial ``job_id``, whose evaluation at optimizer ``step`` gave ``metrics``, should stop
    now: its sweep's pruner asked with the other trials' stored curves and this trial's (its
    earlier evaluations from the store, this one from ``metrics``). The pruner's trial attributes
    (ASHA's rungs) are stored on the job. Not a trial, or no finite objective: False."""
    with read_session() as s:
        job = s.get(Job, job_id)
        sweep = s.get(Sweep, job.sweep_id) if job is not None and job.sweep_id else None
        if sweep is None:
            return False
        spec = _spec(sweep)
        value = metrics.get(spec.objective.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        others = [t for t in s.scalars(select(Job).where(Job.sweep_id == sweep.id, Job.id != job_id))]
        trial_curves = curves(s, [t.id for t in others] + [job_id], spec.objective.metric)
    space = distributions(spec)
    study = study_of(spec, space, others, trial_curves)
    curve = trial_curves[job_id]
    curve.setdefault(step, float(value))
    study.add_trial(frozen(job, spec, space, curve, TrialState.RUNNING))
    trial = study.get_trials(deepcopy=False)[-1]
    prune = study.pruner.prune(study, trial)
    attrs = dict(study.get_trials(deepcopy=False)[-1].system_attrs)
    if attrs != (job.trial_attrs or {}):
        with session_scope() as s:
            s.get(Job, job_id).trial_attrs = attrs
    return prune


# ----------------------------------------------------------------------------- reading


def owned_sweep(s: Session, sweep_id: str, caller: Caller, for_update: bool = False) -> Sweep:
    """The sweep if ``caller`` may see it. Raises: NotFound (also another tenant's), Deleted."""
    sweep = s.get(Sweep, sweep_id, with_for_update=for_update or None)
    if sweep is None or not caller.sees(sweep.tenant):
        raise NotFound("sweep", sweep_id)
    if sweep.deleted_at is not None:
        raise Deleted("sweep", sweep_id, sweep.deleted_at)
    return sweep


def trials_of(s: Session, sweep: Sweep) -> tuple[SweepCreate, list[Job], dict[str, dict[int, float]]]:
    """The sweep's spec, its trials by number, and their objective curves (``curves``)."""
    spec = _spec(sweep)
    trials = list(s.scalars(select(Job).where(Job.sweep_id == sweep.id).order_by(Job.trial_number)))
    return spec, trials, curves(s, [t.id for t in trials], spec.objective.metric)


def to_out(s: Session, sweep: Sweep) -> SweepOut:
    """The API view of a sweep: counts by trial status, the best trial (the best value among
    succeeded trials: their kept weights are their best evaluation's), timings."""
    spec, trials, trial_curves = trials_of(s, sweep)
    counts = Counter(t.status for t in trials)
    best = None
    for t in trials:
        value = best_value(trial_curves[t.id], spec)
        if t.status == JobStatus.SUCCEEDED and value is not None and (
                best is None or (value > best.value if spec.objective.direction == "maximize" else value < best.value)):
            best = BestTrial(job_id=t.id, trial_number=t.trial_number, params=params_of(t, spec), value=value)
    started = [t.started_at for t in trials if t.started_at is not None]
    status = sweep.status if sweep.status != RUNNING or started else "queued"
    status = "paused" if sweep.status == RUNNING and (sweep.error or {}).get("code") == PAUSED else status
    return SweepOut(id=sweep.id, status=status, base_model=spec.base_model, task=spec.task, objective=spec.objective,
                    algorithm=spec.algorithm, early_stopping=spec.early_stopping.type, max_trials=spec.max_trials,
                    max_parallel_trials=spec.max_parallel_trials,
                    trials={name: counts[name] for name in TRIAL_STATUSES}, best_trial=best,
                    created_at=sweep.created_at, started_at=min(started, default=None),
                    finished_at=sweep.finished_at, error=sweep.error)


def get_sweep(sweep_id: str, caller: Caller) -> SweepOut:
    """Raises: NotFound (no such sweep, or another tenant's), Deleted."""
    with read_session() as s:
        return to_out(s, owned_sweep(s, sweep_id, caller))


def list_sweeps(caller: Caller, limit: int, after: str | None = None) -> tuple[list[SweepOut], bool]:
    """The caller's sweeps (an admin's: all), newest first. Raises: UserError ``invalid_cursor``."""
    mine = select(Sweep).where(Sweep.deleted_at.is_(None))
    if not caller.admin:
        mine = mine.where(Sweep.tenant == caller.tenant)
    with read_session() as s:
        page, more = keyset_page(s, mine, Sweep, after, limit, param="cursor", within=mine)
        return [to_out(s, sweep) for sweep in page], more


def list_trials(sweep_id: str, caller: Caller) -> list[TrialOut]:
    """The sweep's trials by number. Raises: NotFound, Deleted."""
    with read_session() as s:
        spec, trials, trial_curves = trials_of(s, owned_sweep(s, sweep_id, caller))
        return [TrialOut(number=t.trial_number, job_id=t.id, status=t.status, params=params_of(t, spec),
                         value=best_value(trial_curves[t.id], spec), steps=t.step, started_at=t.started_at,
                         finished_at=t.finished_at) for t in trials]


def cancel_sweep(sweep_id: str, caller: Caller) -> SweepOut:
    """End the sweep ``cancelled``: its queued trials never start, its running ones stop at their
    next optimizer step. An ended sweep is left as it is. Raises: NotFound, Deleted."""
    with session_scope() as s:
        lock_tenant(s, caller.tenant)
        sweep = owned_sweep(s, sweep_id, caller, for_update=True)
        if sweep.status not in ENDED:
            end_sweep(s, sweep, CANCELLED)
        s.flush()
        return to_out(s, sweep)


def delete_sweep(sweep_id: str, caller: Caller) -> None:
    """Delete an ended sweep and every trial of it (``shared.jobs.lifecycle.delete_job``); its id then answers 404.

    Raises:
        NotFound, Deleted; Conflict (409) ``sweep_not_finished``: cancel it first.
    """
    with session_scope() as s:
        sweep = owned_sweep(s, sweep_id, caller, for_update=True)
        active = s.scalar(select(func.count()).select_from(Job).where(Job.sweep_id == sweep_id,
                                                                      Job.status.in_(lifecycle.ACTIVE)))
        if sweep.status not in ENDED or active:
            raise Conflict("sweep_not_finished", f"sweep {sweep_id!r} is {sweep.status} with {active} active "
                           f"trials; cancel it (POST /sweeps/{sweep_id}/cancel), then delete it once they stopped")
        sweep.deleted_at = utcnow()
        trial_ids = list(s.scalars(select(Job.id).where(Job.sweep_id == sweep_id, Job.deleted_at.is_(None))))
    for job_id in trial_ids:
        lifecycle.delete_job(job_id, Caller(sweep.tenant, admin=True))


def events_since(sweep_id: str, caller: Caller, after_id: int) -> list[tuple[int, str, JobEvent, int]]:
    """For ``GET /sweeps/{id}/stream``: the trials' events after event id ``after_id``, as
    ``(event id, job id, event, trial number)``. Raises: NotFound, Deleted."""
    with read_session() as s:
        owned_sweep(s, sweep_id, caller)
        rows = s.execute(select(JobEvent, Job.trial_number).join(Job, Job.id == JobEvent.job_id)
                         .where(Job.sweep_id == sweep_id, JobEvent.id > after_id).order_by(JobEvent.id))
        return [(e.id, e.job_id, e, number) for e, number in rows]

