r"""Hyperparameter sweeps: many trials of one job spec, each an ordinary training job, searched and
pruned by Optuna (samplers and pruners; Akiba et al. 2019, https://optuna.org).

    POST /sweeps --> sweep (running) + first trials (queued jobs)
    a trial ends (succeeded | pruned | failed | cancelled) --> in the same transaction: tell, ask the next
    max_trials asked and none active --> sweep succeeded (or failed: no trial succeeded, or over max_failed_trials)

The spec's checks and the study rebuilt from the rows are ``shared.jobs.search``; what ends a
trial and tops its sweep up is ``shared.jobs.trials`` (below ``shared.jobs.lifecycle``, which this
module builds on); here, the sweep's operations.

**Asking** happens in the transaction that ends a trial (``shared.jobs.trials.ended``, from ``shared.jobs.lifecycle``) or
creates the sweep, with the sweep's row locked (``SELECT … FOR UPDATE`` on PostgreSQL; SQLite's
``BEGIN IMMEDIATE`` single writer): trial numbers come from the rows (unique per sweep), never
exceed ``max_trials``, and survive a kill -9 of any process. Queued and running trials enter the
rebuilt study as RUNNING, so TPE's ``constant_liar`` keeps parallel trials apart; the sampler is
seeded with ``seed + trials so far`` (the same sweep asks the same trials). Later trials pass the
tenant's admission as jobs do (``shared.jobs.trials.admitted``): without room the sweep is
``paused``. The recovery loop also calls ``top_up_all`` (a sweep left short by an error, or paused
until room freed, goes on).

**Pruning**: at each evaluation the worker asks ``should_prune`` with the objective; the pruner
(``MedianPruner`` or ``SuccessiveHalvingPruner``) sees the other trials' stored curves, each at the
fractions of its own schedule (``shared.jobs.search.schedule_curve``). A trial's
value is its objective at its best evaluation, the one whose weights it keeps
(``metric_for_best_model`` is set to the objective).
"""

import math
from collections import Counter
from typing import Any

from optuna.trial import TrialState
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from shared.errors import Conflict, Deleted, NotFound, UserError, first_line
from shared.jobs import lifecycle
from shared.jobs.planning import check_spec, plan_job
from shared.jobs.search import (
    CANCELLED,
    ENDED,
    RUNNING,
    TRIAL_STATUSES,
    ask,
    best_value,
    check_sweep,
    curves,
    frozen,
    history,
    more_curves,
    multi_objective,
    params_of,
    spec_of,
    study_of,
    trial_template,
    values_of,
)
from shared.jobs.search_space import distribution_of, distributions
from shared.jobs.trials import ACTIVE, PAUSED, end_sweep, top_up
from shared.schemas.sweeps import LATENCY, BestTrial, History, ParetoTrial, SweepCreate, SweepOut, SweepPlan, TrialOut
from shared.settings import get_settings
from shared.store import idempotency
from shared.store.engine import keyset_page, read_session, session_scope
from shared.store.rows import Job, JobEvent, JobStatus, Sweep, new_id, utcnow
from shared.store.tenancy import Caller, lock_tenant

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
        check_warm_start(s, spec, caller)
        first = min(spec.max_parallel_trials, spec.max_trials)
        active = (
            s.scalar(select(func.count()).select_from(Job).where(Job.tenant == caller.tenant, Job.status.in_(ACTIVE)))
            or 0
        )
        limit = get_settings().max_active_jobs_per_tenant
        if active + first > limit:
            raise UserError(
                "too_many_active_jobs",
                f"tenant {caller.tenant!r} has {active} queued or running jobs; "
                f"{first} parallel trials would pass its maximum (TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT="
                f"{limit})",
                "max_parallel_trials",
                status=429,
                headers={"Retry-After": "60"},
            )
        sweep = Sweep(
            id=new_id("sweep"),
            tenant=caller.tenant,
            status=RUNNING,
            spec=spec.model_dump(mode="json"),
            label_names=checked.label_names,
        )
        s.add(sweep)
        s.flush()
        top_up(s, sweep)
        if claim is not None:
            idempotency.complete(s, claim, 201, to_out(s, sweep).model_dump(mode="json"))
        return sweep


def plan_sweep(spec: SweepCreate, caller: Caller) -> SweepPlan:
    """``POST /sweeps?dry_run=true``: the checks of ``create_sweep``, and what it would queue first."""
    spec, space = check_sweep(spec)
    with read_session() as s:
        check_warm_start(s, spec, caller)
        past = history(s, spec, space, multi_objective(spec))
    first = ask(
        spec, space, [], {}, min(spec.max_parallel_trials, spec.max_trials), {} if multi_objective(spec) else None, past
    )
    return SweepPlan(
        max_trials=spec.max_trials,
        max_parallel_trials=spec.max_parallel_trials,
        search_space={name: distribution_of(d) for name, d in space.items()},
        objective=spec.objective,
        first_trials=[params for params, _ in first],
        trial_plan=plan_job(check_spec(trial_template(spec), caller)),
    )


def check_warm_start(s: Session, spec: SweepCreate, caller: Caller) -> None:
    """Each sweep of ``warm_start_from`` is the caller's tenant's, of the same task and base model.

    Raises:
        UserError: 422 ``invalid_warm_start`` naming ``warm_start_from[i]``, the sweep and the mismatch
            (another tenant's sweep reads as none: no sweep's existence leaks across tenants).
    """
    for i, sweep_id in enumerate(spec.warm_start_from):
        field = f"warm_start_from[{i}]"
        source = s.get(Sweep, sweep_id)
        if source is None or source.deleted_at is not None or source.tenant != caller.tenant:
            raise UserError("invalid_warm_start", f"{field}: tenant {caller.tenant!r} has no sweep {sweep_id!r}", field)
        theirs = spec_of(source)
        for name in ("task", "base_model"):
            if getattr(theirs, name) != getattr(spec, name):
                raise UserError(
                    "invalid_warm_start",
                    f"{field}: sweep {sweep_id!r} has {name} "
                    f"{getattr(theirs, name)!r}, this sweep {getattr(spec, name)!r}: its trials' values "
                    "say nothing about this one's",
                    field,
                )


def top_up_all() -> list[str]:
    """For the recovery loop: ``top_up`` every running sweep; returns the new trials' ids to send.

    Raises:
        SweepsFailed: one or more sweeps could not be topped up (tried again next turn); the
            others were, and its ``new`` holds their trials, to send all the same.
    """
    with read_session() as s:
        ids = s.scalars(select(Sweep.id).where(Sweep.status == RUNNING, Sweep.deleted_at.is_(None))).all()
    new: list[str] = []
    failed: list[tuple[str, Exception]] = []
    for sweep_id in ids:
        try:
            with session_scope() as s:
                sweep = s.get(Sweep, sweep_id, with_for_update=True, populate_existing=True)
                asked = [job.id for job in top_up(s, sweep)] if sweep is not None else []
        except (OperationalError, PoolTimeout):  # the store, not the sweep: every other sweep would wait on it too
            raise
        except Exception as e:  # one sweep's failure (an Optuna error, a bad spec) holds up no other
            failed.append((sweep_id, e))
        else:
            new += asked  # committed: a trial whose commit failed is never sent
    if failed:
        raise SweepsFailed(new, failed) from failed[0][1]
    return new


class SweepsFailed(Exception):
    """``top_up_all`` could not top up ``failed`` (sweep id, exception); ``new``: the trials it asked
    for the other sweeps."""

    def __init__(self, new: list[str], failed: list[tuple[str, Exception]]):
        sweep_id, e = failed[0]
        more = f" (and {len(failed) - 1} more sweeps)" if len(failed) > 1 else ""
        super().__init__(f"sweep {sweep_id}: {type(e).__name__}: {first_line(e)}{more}")
        self.new, self.failed = new, failed


def unsent_trials(sweep_id: str) -> list[str]:
    """The sweep's queued trials whose message was never sent (``shared.queue.send_trials``)."""
    with read_session() as s:
        return list(
            s.scalars(
                select(Job.id).where(
                    Job.sweep_id == sweep_id, Job.status == JobStatus.QUEUED, Job.enqueued_at.is_(None)
                )
            )
        )


def should_prune(job_id: str, step: int, metrics: dict[str, Any]) -> bool:
    """Whether trial ``job_id``, whose evaluation at optimizer ``step`` gave ``metrics``, should stop
    now: its sweep's pruner asked with the other trials' stored curves and this trial's (its
    earlier evaluations from the store, this one from ``metrics``), the warm start's history's
    among them (``shared.jobs.search.history``). The pruner's trial attributes
    (ASHA's rungs) are stored on the job. Not a trial, no finite objective, or a ``step`` before
    the sweep's ``min_steps``: False. The default trial (``include_defaults``) and a trial at its
    last step are asked too, for their pruner attributes, but never pruned: the sweep's best is
    then never worse than the default job, and stopping at the end saves nothing (and would throw
    the trial's model away)."""
    with read_session() as s:
        job = s.get(Job, job_id)
        sweep = s.get(Sweep, job.sweep_id) if job is not None and job.sweep_id else None
        if job is None or sweep is None:
            return False
        spec = spec_of(sweep)
        value = metrics.get(spec.objective.metric)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if step < spec.early_stopping.min_steps or not job.total_steps:
            return False
        others = [t for t in s.scalars(select(Job).where(Job.sweep_id == sweep.id, Job.id != job_id))]
        trial_curves = curves(s, [t.id for t in others] + [job_id], spec.objective.metric)
        space = distributions(spec)
        past = history(s, spec, space)
    study = study_of(spec, space, others, trial_curves, past=past)
    curve = trial_curves[job_id]
    curve.setdefault(step, float(value))
    study.add_trial(frozen(job, spec, space, curve, TrialState.RUNNING))
    trial = study.get_trials(deepcopy=False)[-1]
    prune = study.pruner.prune(study, trial)
    attrs = dict(study.get_trials(deepcopy=False)[-1].system_attrs)
    if attrs != (job.trial_attrs or {}):
        with session_scope() as s:
            if (row := s.get(Job, job_id)) is not None:
                row.trial_attrs = attrs
    kept = (spec.include_defaults and job.trial_number == 0) or step >= job.total_steps
    return bool(prune) and not kept  # a numpy bool from MedianPruner


def serving_precision(sweep_id: str) -> str | None:
    """The precision a trial of sweep ``sweep_id`` has its ``latency_ms`` measured at (the worker's
    ``worker.latency``, after the trial's model is saved); None when no objective is ``latency_ms``."""
    with read_session() as s:
        sweep = s.get(Sweep, sweep_id)
        spec = spec_of(sweep) if sweep is not None else None
    if spec is None or LATENCY not in {o.metric for o in spec.all_objectives}:
        return None
    return spec.serving_precision


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
    spec = spec_of(sweep)
    trials = list(s.scalars(select(Job).where(Job.sweep_id == sweep.id).order_by(Job.trial_number)))
    return spec, trials, curves(s, [t.id for t in trials], spec.objective.metric)


def to_out(s: Session, sweep: Sweep) -> SweepOut:
    """The API view of a sweep: its search space (as the dry run's plan shows it: priors filled in,
    ``distribution_of``), counts by trial status, the best trial (the best value among succeeded
    trials: their kept weights are their best evaluation's; with several objectives, the front's,
    ``front_best``), timings."""
    spec, trials, trial_curves = trials_of(s, sweep)
    counts = Counter(t.status for t in trials)
    more = more_curves(s, spec, [t.id for t in trials])
    pareto = pareto_trials(spec, trials, trial_curves, more) if multi_objective(spec) else []
    best = front_best(pareto, spec.objective.direction) if pareto else best_succeeded(spec, trials, trial_curves)
    default = next(
        (trial_out(t, spec, trial_curves, more) for t in trials if t.trial_number == 0 and spec.include_defaults), None
    )
    started = [t.started_at for t in trials if t.started_at is not None]
    status = sweep.status if sweep.status != RUNNING or started else "queued"
    status = "paused" if sweep.status == RUNNING and (sweep.error or {}).get("code") == PAUSED else status
    return SweepOut(
        id=sweep.id,
        status=status,
        base_model=spec.base_model,
        task=spec.task,
        objective=spec.objective,
        algorithm=spec.algorithm,
        early_stopping=spec.early_stopping.type,
        max_trials=spec.max_trials,
        max_parallel_trials=spec.max_parallel_trials,
        objectives=spec.all_objectives,
        serving_precision=spec.serving_precision,
        search_space={name: distribution_of(d) for name, d in distributions(spec).items()},
        trials={name: counts[name] for name in TRIAL_STATUSES},
        best_trial=best,
        default_trial=default,
        pareto_trials=pareto,
        history=history_out(s, spec),
        created_at=sweep.created_at,
        started_at=min(started, default=None),
        finished_at=sweep.finished_at,
        error=sweep.error,
    )


def pareto_trials(
    spec: SweepCreate,
    trials: list[Job],
    trial_curves: dict[str, dict[int, float]],
    more: dict[str, list[dict[int, float]]],
) -> list[ParetoTrial]:
    """A sweep of several objectives: its Pareto front, the succeeded trials that no other beats on
    every objective, by number: Optuna's ``Study.best_trials`` of the multi-objective study rebuilt
    from the rows (``shared.jobs.search.study_of``; ``more``: ``more_curves``). The warm start's
    history is not on it (not this sweep's trials)."""
    study = study_of(spec, distributions(spec), trials, trial_curves, more=more)
    by_id = {t.id: t for t in trials}
    front = sorted(
        (
            (by_id[trial.user_attrs["job_id"]], trial.values)
            for trial in study.best_trials
            if trial.user_attrs.get("job_id") in by_id
        ),
        key=lambda pair: pair[0].trial_number or 0,
    )
    return [
        ParetoTrial(job_id=t.id, trial_number=t.trial_number, params=params_of(t, spec), value=values[0], values=values)
        for t, values in front
    ]


def best_succeeded(spec: SweepCreate, trials: list[Job], trial_curves: dict[str, dict[int, float]]) -> BestTrial | None:
    """The succeeded trial with the best value of the (first) objective (the earliest of equals)."""
    best = None
    for t in trials:
        value = best_value(trial_curves[t.id], spec)
        if (
            t.status == JobStatus.SUCCEEDED
            and value is not None
            and (best is None or (value > best.value if spec.objective.direction == "maximize" else value < best.value))
        ):
            best = BestTrial(job_id=t.id, trial_number=t.trial_number, params=params_of(t, spec), value=value)
    return best


def front_best(front: list[ParetoTrial], direction: str | None) -> BestTrial | None:
    """The trial of the Pareto ``front`` (by number) best on the first objective, going in
    ``direction``; None for an empty front (a sweep of one objective). Among the trials that tie on
    the first objective only the cheapest on the others is on the front, so a sweep never names as
    its best a trial that another beats at no loss (trial 0's defaults tied at twice the latency)."""
    pick = max if direction == "maximize" else min
    best = pick(front, key=lambda trial: trial.value, default=None)  # the earliest of equals
    return best and BestTrial(job_id=best.job_id, trial_number=best.trial_number, params=best.params, value=best.value)


def history_out(s: Session, spec: SweepCreate) -> History | None:
    """The warm start as ``GET /sweeps/{id}`` shows it (``shared.jobs.search.history``); None without one."""
    if not spec.warm_start_from:
        return None
    past = history(s, spec, distributions(spec))
    pick = max if spec.objective.direction == "maximize" else min
    best = pick((t for t in past if t.value is not None), key=lambda t: t.value or 0.0, default=None)
    return History(
        sweeps=spec.warm_start_from,
        trials=len(past),
        best=best
        and BestTrial(
            job_id=best.user_attrs["job_id"],
            trial_number=best.user_attrs["trial_number"],
            params=best.params,
            value=best.value,
        ),
    )


def history_points(sweep_id: str, caller: Caller) -> list[dict[str, Any]]:
    """The warm start's succeeded trials as the sweep page draws them, grey, beside the sweep's own
    (as the report's pictures do, ``shared.jobs.sweep_report``): each one's ``sweep``, its
    ``number`` there, ``value`` (the first objective's), with several objectives ``values``
    (every objective's), and ``params`` (inside this sweep's search space), in the history's
    order: the trials the sweep's study holds (``shared.jobs.search.history``, with every
    objective's value when there are several, as the sampler asks from them; one read); at most
    TUNEJOB_MAX_TRIALS_PER_SWEEP, as many as the sweep's own trials may be. Raises: NotFound, Deleted."""
    with read_session() as s:
        spec = spec_of(owned_sweep(s, sweep_id, caller))
        multi = multi_objective(spec)
        past = [t for t in history(s, spec, distributions(spec), multi) if t.values is not None]
    return [
        {
            "sweep": t.user_attrs["sweep_id"],
            "number": t.user_attrs["trial_number"],
            "value": t.values[0],
            "values": t.values if multi else None,
            "params": t.params,
        }
        for t in past[: get_settings().max_trials_per_sweep]
    ]


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


def trial_out(
    t: Job, spec: SweepCreate, trial_curves: dict[str, dict[int, float]], more: dict[str, list[dict[int, float]]]
) -> TrialOut:
    """The API view of trial ``t`` (``default``: trial 0 of a sweep with ``include_defaults``;
    ``values``: each objective's, from ``trial_curves`` and ``more``, ``more_curves``)."""
    return TrialOut(
        number=t.trial_number,
        job_id=t.id,
        status=t.status,
        params=params_of(t, spec),
        default=spec.include_defaults and t.trial_number == 0,
        value=best_value(trial_curves[t.id], spec),
        values=values_of(trial_curves[t.id], more[t.id], spec),
        steps=t.step,
        started_at=t.started_at,
        finished_at=t.finished_at,
    )


def list_trials(sweep_id: str, caller: Caller) -> list[TrialOut]:
    """The sweep's trials by number. Raises: NotFound, Deleted."""
    with read_session() as s:
        spec, trials, trial_curves = trials_of(s, owned_sweep(s, sweep_id, caller))
        more = more_curves(s, spec, [t.id for t in trials])
        return [trial_out(t, spec, trial_curves, more) for t in trials]


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
        active = s.scalar(select(func.count()).select_from(Job).where(Job.sweep_id == sweep_id, Job.status.in_(ACTIVE)))
        if sweep.status not in ENDED or active:
            raise Conflict(
                "sweep_not_finished",
                f"sweep {sweep_id!r} is {sweep.status} with {active} active "
                f"trials; cancel it (POST /sweeps/{sweep_id}/cancel), then delete it once they stopped",
            )
        sweep.deleted_at = utcnow()
        trial_ids = list(s.scalars(select(Job.id).where(Job.sweep_id == sweep_id, Job.deleted_at.is_(None))))
    for job_id in trial_ids:
        lifecycle.delete_job(job_id, Caller(sweep.tenant, admin=True))


def events_since(sweep_id: str, caller: Caller, after_id: int) -> list[tuple[int, str, JobEvent, int | None]]:
    """For ``GET /sweeps/{id}/stream``: the trials' events after event id ``after_id``, as
    ``(event id, job id, event, trial number)``. Raises: NotFound, Deleted."""
    with read_session() as s:
        owned_sweep(s, sweep_id, caller)
        rows = s.execute(
            select(JobEvent, Job.trial_number)
            .join(Job, Job.id == JobEvent.job_id)
            .where(Job.sweep_id == sweep_id, JobEvent.id > after_id)
            .order_by(JobEvent.id)
        )
        return [(e.id, e.job_id, e, number) for e, number in rows]
