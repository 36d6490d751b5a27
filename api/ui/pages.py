"""The dashboard's pages and its sign-in (see ``api.ui``). Each page reads through the ``shared``
helpers with the session's ``Caller``: another tenant's job or dataset is a 404 page, as it is a
404 answer of the API."""

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, get_args
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from markupsafe import Markup
from sse_starlette import EventSourceResponse

from shared.data.formats import CONLL_COLUMNS
from shared.data.problems import Problems
from shared.data.read import read_batches
from shared.errors import NotFound, UserError
from shared.jobs import aliases, lifecycle, models, predictions, sweeps, uploads
from shared.jobs.base_models import available_models
from shared.jobs.evaluation import read_report
from shared.schemas.hyperparameters import Hyperparameters
from shared.schemas.jobs import JobCreate, metric_text
from shared.schemas.sweeps import SweepOut
from shared.settings import get_settings
from shared.store import artifacts, keys, objects, ui_sessions
from shared.store.rows import JobStatus
from shared.store.tenancy import Caller

router = APIRouter()
templates = Jinja2Templates(directory=Path(__file__).parent / "templates")
PAGE_SIZE = 50
SAMPLE_ROWS = 10
MAX_COMPARED = 10
STATUSES = ("queued", "running", "succeeded", "failed", "cancelled", "pruned")
TASKS = get_args(JobCreate.model_fields["task"].annotation)


class SignInRequired(Exception):
    """The request has no live dashboard session: ``api.ui`` sends the browser to the sign-in page."""


@dataclass(frozen=True)
class Session:
    """The signed-in browser: its caller (tenant, admin) and the CSRF token its pages carry."""

    caller: Caller
    csrf: str


def session(request: Request) -> Session:
    """The request's dashboard session.

    Raises:
        SignInRequired: no cookie, or it names no live session (expired, signed out, key revoked).
    """
    found = ui_sessions.resolve(request.cookies.get(ui_sessions.COOKIE, ""))
    if found is None:
        raise SignInRequired()
    return Session(*found)


SessionDep = Annotated[Session, Depends(session)]


def login_url(request: Request) -> str:
    """The sign-in page, coming back to the page asked for."""
    return "/ui/login?" + urlencode({"next": request.url.path + (f"?{request.url.query}" if request.url.query else "")})


def render(request: Request, name: str, http_status: int = 200, **context) -> HTMLResponse:
    return templates.TemplateResponse(request=request, name=name, context=context, status_code=http_status)


def error_page(request: Request, status: int, message: str) -> HTMLResponse:
    title = {404: "Not found", 401: "Sign-in needed", 409: "Conflict"}.get(status, "Something is wrong")
    return render(request, "error.html", status, title=title, message=message, code=status)


def _safe_next(target: str | None) -> str:
    """Where to go after signing in: a dashboard path of this site only (no open redirect)."""
    return target if target and target.startswith("/ui/") and not target.startswith("//") else "/ui/jobs"


def _set_cookie(request: Request, response: RedirectResponse, token: str) -> RedirectResponse:
    settings = get_settings()
    secure = settings.cookie_secure if settings.cookie_secure is not None else request.url.scheme == "https"
    response.set_cookie(
        ui_sessions.COOKIE,
        token,
        max_age=int(settings.ui_session_hours * 3600),
        path="/",
        httponly=True,
        samesite="strict",
        secure=secure,
    )
    return response


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str | None = None):
    return render(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login", response_class=HTMLResponse)
def login(request: Request, key: Annotated[str, Form(max_length=128)], next: Annotated[str, Form()] = "/ui/jobs"):
    """Sign in with an API key: a session for the key's tenant and rights (the key is not kept)."""
    caller = keys.authenticate(key.strip())
    if caller is None:
        return render(
            request, "login.html", 401, next=_safe_next(next), error="That API key is not valid, or it was revoked."
        )
    return _set_cookie(request, RedirectResponse(_safe_next(next), status_code=303), ui_sessions.start(caller))


@router.get("/signin/{token}")
def signin_link(request: Request, token: str):
    """A one-time sign-in link (``tunejob serve`` prints one for its local key)."""
    session_token = ui_sessions.redeem(token)
    if session_token is None:
        return render(
            request,
            "login.html",
            401,
            next="/ui/jobs",
            error="That sign-in link was used already or has expired: sign in with an API key.",
        )
    return _set_cookie(request, RedirectResponse("/ui/jobs", status_code=303), session_token)


@router.post("/logout")
def logout(request: Request, csrf_token: Annotated[str, Form()] = ""):
    token = request.cookies.get(ui_sessions.COOKIE, "")
    found = ui_sessions.resolve(token)
    if found is not None and not ui_sessions.csrf_matches(found[1], csrf_token):
        raise UserError(
            "csrf_token_invalid", "the sign-out form is stale: reload the page and try again", "csrf_token", status=403
        )
    if found is not None:
        ui_sessions.end(token)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(ui_sessions.COOKIE, path="/", httponly=True, samesite="strict")
    return response


@router.get("/")
def home():
    return RedirectResponse("/ui/jobs", status_code=303)


@router.get("/jobs", response_class=HTMLResponse)
def jobs_page(
    request: Request,
    s: SessionDep,
    status: Annotated[str | None, Query()] = None,
    task: Annotated[str | None, Query()] = None,
    sweep: Annotated[str | None, Query(max_length=64)] = None,
    cursor: str | None = None,
):
    """Training jobs, newest first, PAGE_SIZE at a time, filtered by status, task and sweep."""
    status, task, sweep = status or None, task or None, (sweep or "").strip() or None
    if status not in (None, *STATUSES) or task not in (None, *TASKS):
        raise UserError("invalid_filter", f"unknown filter: status {status!r}, task {task!r}", "status", status=400)
    page, has_more = lifecycle.list_jobs(s.caller, PAGE_SIZE, cursor, status, param="cursor", task=task, sweep=sweep)
    rows = [lifecycle.to_out(j) for j in page]
    query = {k: v for k, v in {"status": status, "task": task, "sweep": sweep}.items() if v}
    next_url = f"/ui/jobs?{urlencode({**query, 'cursor': page[-1].id})}" if has_more else None
    return render(
        request,
        "jobs.html",
        s=s,
        jobs=rows,
        status=status,
        task=task,
        sweep=sweep,
        statuses=STATUSES,
        tasks=TASKS,
        next_url=next_url,
        first_url=f"/ui/jobs?{urlencode(query)}" if cursor else None,
        live=",".join(j.id for j in rows if j.status in (JobStatus.QUEUED, JobStatus.RUNNING)),
    )


@router.get(
    "/jobs/live",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "progress and end of each job"}},
)
def jobs_live(request: Request, s: SessionDep, ids: Annotated[str, Query(max_length=PAGE_SIZE * 40)]):
    """Server-sent ``progress`` (the job, as ``GET /jobs/{id}``) of each of the comma-separated
    ``ids`` (at most PAGE_SIZE) whenever its row changes, ``end`` (the job) once it finished, and
    ``gone`` (``{"id": ...}``) for an id that names none of the caller's jobs (any more); the answer
    ends after the last of them. What keeps the jobs page's queued and running rows live
    (``api.feeds``: no store reads of its own)."""
    job_ids = list(dict.fromkeys(i.strip() for i in ids.split(",") if i.strip()))[:PAGE_SIZE]
    owned = [i for i in job_ids if _owned(i, s)]
    return EventSourceResponse(
        request.app.state.feeds.watch(owned, gone=[i for i in job_ids if i not in owned]),
        ping=get_settings().stream_heartbeat_seconds,
    )


def _owned(job_id: str, s: Session) -> bool:
    try:
        lifecycle.get_job(job_id, s.caller)
    except NotFound:
        return False
    return True


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: str, s: SessionDep):
    job = lifecycle.to_out(lifecycle.get_job(job_id, s.caller))
    checkpoints = lifecycle.list_checkpoints(job_id, s.caller)
    files = models.model_files(job_id, s.caller) if job.status == JobStatus.SUCCEEDED else {}
    return render(
        request,
        "job.html",
        s=s,
        job=job,
        events=lifecycle.list_events(job_id, s.caller),
        checkpoints=checkpoints,
        artifacts=artifacts.listing(files) if files else {},
        report=_report(job),
        aliases=[a.alias for a in aliases.list_aliases(s.caller) if a.job_id == job_id],
        chart={
            "job": job.id,
            "status": job.status,
            "checkpoints": [c.step for c in checkpoints],
            "best_metric": job.hyperparameters.metric_for_best_model,
            "total_steps": job.progress.total_steps,
        },
    )


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, s: SessionDep, jobs_: Annotated[str, Query(alias="jobs")] = ""):
    """2 to MAX_COMPARED jobs side by side: curves overlaid, hyperparameters and final metrics."""
    ids = list(dict.fromkeys(i.strip() for i in jobs_.split(",") if i.strip()))
    if not 2 <= len(ids) <= MAX_COMPARED:
        raise UserError(
            "invalid_compare",
            f"compare 2 to {MAX_COMPARED} jobs (?jobs=job_a,job_b); got {len(ids)}",
            "jobs",
            status=400,
        )
    compared = [lifecycle.to_out(lifecycle.get_job(i, s.caller)) for i in ids]
    rows = _compare_rows(compared)
    return render(
        request,
        "compare.html",
        s=s,
        jobs=compared,
        rows=rows,
        chart={"jobs": ids},
        f1_rows=_f1_rows([_report(j) for j in compared]),
    )


def _report(job) -> dict | None:
    """A succeeded job's evaluation report (``worker.evaluation``), None without one."""
    if job.status != JobStatus.SUCCEEDED or job.files_deleted_at is not None:
        return None
    return read_report(artifacts.model_dir(job.id) / artifacts.EVALUATION)


def _f1_rows(reports: list[dict | None]) -> list[tuple[str, list[float | None], list[float | None]]]:
    """Per class (label, entity type) of the compared jobs' reports: (name, each job's F1, each
    job's F1 minus the first job's; None where a job has no such class or no report)."""
    per_class = [(r.get("per_class") or r.get("per_label") or r.get("per_entity") or {}) if r else {} for r in reports]
    names = list(dict.fromkeys(n for classes in per_class for n in classes))
    rows = []
    for name in names:
        f1 = [classes[name]["f1"] if name in classes else None for classes in per_class]
        rows.append((name, f1, [None if v is None or f1[0] is None else v - f1[0] for v in f1]))
    return rows


def _compare_rows(compared: list) -> list[tuple[str, list, bool]]:
    """(name, one value per job, whether they differ) for each setting and final metric."""

    def flat(job) -> dict:
        spec = {
            "base_model": job.base_model,
            "task": job.task,
            "training_dataset": job.training_dataset,
            "status": job.status,
            **{f"hp.{k}": v for k, v in job.hyperparameters.model_dump().items()},
        }
        spec.update({f"val.{k}": v for k, v in (job.validation_metrics or {}).items()})
        # as the jobs list says how long a job ran (its start to its end); the wait in the queue apart
        ran = (job.finished_at - job.started_at).total_seconds() if job.finished_at and job.started_at else None
        spec["ran_s"], spec["queued_s"] = round(ran, 1) if ran is not None else None, job.timings.queued
        return spec

    flats = [flat(j) for j in compared]
    names = list(dict.fromkeys(n for f in flats for n in f))
    return [(n, vals := [f.get(n) for f in flats], len({repr(v) for v in vals}) > 1) for n in names]


@router.get("/datasets", response_class=HTMLResponse)
def datasets_page(request: Request, s: SessionDep):
    datasets, _ = uploads.list_datasets(s.caller)
    return render(request, "datasets.html", s=s, datasets=datasets, max_upload=get_settings().max_upload_bytes)


def likely_task(columns: list[str]) -> str:
    """The task the new-job form starts on: the first whose columns, by their default names, the
    dataset has (``anchor`` and ``positive``: embedding; ``query`` and ``passage``: reranking;
    ``tokens`` and ``tags``: token_classification), else classification (a pairs file started on
    classification, its text and label columns both ``anchor``)."""
    fields = JobCreate.model_fields
    named = {
        "embedding": (fields["anchor_column"].default, fields["positive_column"].default),
        "reranking": (fields["query_column"].default, fields["passage_column"].default),
        "token_classification": CONLL_COLUMNS,
    }
    return next((task for task, names in named.items() if set(names) <= set(columns)), "classification")


@router.get("/datasets/{dataset_id}", response_class=HTMLResponse)
def dataset_page(request: Request, dataset_id: str, s: SessionDep):
    """A dataset's columns and first rows, and the form that plans and creates a job on it."""
    dataset = uploads.get_dataset(dataset_id, s.caller)
    batch = next(
        read_batches(
            objects.dataset_file(dataset), dataset.format, dataset.filename, dataset.columns, Problems(dataset.filename)
        ),
        None,
    )
    sample = (
        []
        if batch is None
        else [[batch.values[c][i] for c in dataset.columns] for i in range(min(SAMPLE_ROWS, batch.size))]
    )
    defaults = Hyperparameters()
    return render(
        request,
        "dataset.html",
        s=s,
        dataset=dataset,
        sample=sample,
        tasks=TASKS,
        task=likely_task(dataset.columns),
        models=sorted(available_models()),
        defaults=defaults,
        best_metrics=get_args(Hyperparameters.model_fields["metric_for_best_model"].annotation),
        batchings=get_args(Hyperparameters.model_fields["batching"].annotation),
    )


@router.get("/predictions", response_class=HTMLResponse)
def predictions_page(request: Request, s: SessionDep, cursor: str | None = None):
    page, has_more = lifecycle.list_jobs(s.caller, PAGE_SIZE, cursor, param="cursor", kind=predictions.KIND)
    succeeded, _ = lifecycle.list_jobs(s.caller, 200, status=JobStatus.SUCCEEDED)
    datasets, _ = uploads.list_datasets(s.caller)
    return render(
        request,
        "predictions.html",
        s=s,
        predictions=[predictions.to_out(j) for j in page],
        models=succeeded,
        datasets=datasets,
        next_url=f"/ui/predictions?cursor={quote(page[-1].id)}" if has_more else None,
    )


@router.get("/predictions/{prediction_id}", response_class=HTMLResponse)
def prediction_page(request: Request, prediction_id: str, s: SessionDep):
    prediction = predictions.to_out(lifecycle.get_job(prediction_id, s.caller, kind=predictions.KIND))
    return render(
        request,
        "prediction.html",
        s=s,
        p=prediction,
        events=lifecycle.list_events(prediction_id, s.caller, kind=predictions.KIND),
    )


@router.get("/sweeps", response_class=HTMLResponse)
def sweeps_page(request: Request, s: SessionDep, cursor: str | None = None):
    page, more = sweeps.list_sweeps(s.caller, PAGE_SIZE, cursor)
    return render(
        request, "sweeps.html", s=s, sweeps=page, next_url=f"/ui/sweeps?cursor={quote(page[-1].id)}" if more else None
    )


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
def sweep_page(request: Request, sweep_id: str, s: SessionDep):
    """A sweep's trials: a table, the objective by trial, each parameter against the objective (on
    a log axis where its range is ``log``, ticked at the choices of a numeric categorical one, both
    read from ``SweepOut.search_space``); with several objectives, the Pareto front among every
    trial's point. A warm start's history is drawn grey beside them (``history``), on neither the
    front nor the best."""
    sweep = sweeps.get_sweep(sweep_id, s.caller)
    trials = sweeps.list_trials(sweep_id, s.caller)
    history = sweeps.history_points(sweep_id, s.caller) if sweep.history else []
    params = list(dict.fromkeys(k for t in trials for k in t.params))
    front = [p.trial_number for p in sweep.pareto_trials]
    return render(
        request,
        "sweep.html",
        s=s,
        sweep=sweep,
        trials=trials,
        params=params,
        front=front,
        chart={
            "metric": sweep.objective.metric,
            "params": params,
            "log": [name for name, d in sweep.search_space.items() if d.log],  # drawn on log axes
            "choices": numeric_choices(sweep),  # an axis ticked at each choice
            "front": front,
            "objectives": [o.metric for o in sweep.objectives],
            "trials": [
                {"number": t.number, "status": t.status, "value": t.value, "values": t.values, "params": t.params}
                for t in trials
            ],
            "history": history,
        },
    )


def numeric_choices(sweep: SweepOut) -> dict[str, list[float]]:
    """Each categorical parameter of numbers only (a ``batch_size`` of 16 or 32) and its choices, in
    order: the sweep page ticks its chart's x axis at the choices and nowhere else (a linear axis
    ticked 20, 25, 30 labelled neither 16 nor 32)."""
    return {
        name: sorted(set(d.choices))
        for name, d in sweep.search_space.items()
        if d.type == "categorical"
        and d.choices
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d.choices)
    }


def age(when: datetime | None, until: datetime | None = None) -> str:
    """``when`` to ``until`` (default now) as '3 s', '4 min', '2 h', '5 d'."""
    if when is None:
        return "–"
    seconds = max(0.0, ((until or datetime.now(UTC)) - when).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


templates.env.filters["age"] = age
templates.env.filters["metric"] = metric_text
templates.env.globals["csrf_header"] = ui_sessions.CSRF_HEADER
templates.env.globals["app_css"] = Markup((Path(__file__).parent / "static" / "app.css").read_text())
