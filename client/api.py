"""A typed, synchronous client for the tunejob REST API, on httpx.

Every failure, an error answer of the API or a server that cannot be reached, raises one
exception type, ``TunejobError``. Responses are parsed into the API's own pydantic schemas
(``shared.schemas``, which imports pydantic only: no torch, worker, pandas or job store).
"""

import json
import os
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from httpx_retries import Retry, RetryTransport
from httpx_sse import SSEError, connect_sse

from shared.schemas.aliases import AliasOut
from shared.schemas.jobs import (
    ArtifactOut,
    BaseModelOut,
    CheckpointOut,
    DatasetOut,
    EventOut,
    JobCreate,
    JobList,
    JobOut,
    MetricOut,
)
from shared.schemas.predictions import PredictionCreate, PredictionList, PredictionOut
from shared.schemas.sweeps import SweepCreate, SweepList, SweepOut, TrialOut
from shared.schemas.webhooks import DeliveryList, DeliveryOut, WebhookCreated, WebhookOut
from shared.store.manifest import MANIFEST, verify_manifest

DEFAULT_URL = "http://127.0.0.1:8000"
FINISHED = ("succeeded", "failed", "cancelled", "pruned")  # a sweep's pruned trial ends too
MODEL_ARCHIVES = ("model.tar", "model.tar.gz")  # model.tar.gz: servers from before the model.tar artifact
MAX_RECONNECTS = 5  # a stream that drops this many times in a row without a message gives up
METRICS_PAGE = 100_000  # the most rows GET /jobs/{id}/metrics returns at once
IDEMPOTENCY_HEADER = "Idempotency-Key"  # shared.idempotency.HEADER (the client imports no job store)
RETRY_STATUSES = (429, 503)  # too many requests; the job store busy: both mean nothing was done, both send Retry-After


def retrying(transport: httpx.BaseTransport | None = None, retries: int = 5) -> RetryTransport:
    """``transport`` (default httpx's own) wrapped by httpx-retries: an answer 429 or 503, to any
    method, is sent again up to ``retries`` times, after the answer's ``Retry-After`` seconds,
    else after an exponential backoff with full jitter (0.5 s x 2^attempt, at most 30 s; the AWS
    Architecture Blog's "Exponential Backoff And Jitter"). Both statuses mean the API did nothing
    (rate limit; the store's write lock not free), and every create carries an ``Idempotency-Key``,
    so a retried POST never makes two jobs. Errors without an answer (connection refused) are not
    retried here: ``Client.follow`` reconnects its stream itself."""
    retry = Retry(
        total=retries,
        status_forcelist=RETRY_STATUSES,
        retry_on_exceptions=(),
        allowed_methods=("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"),
        backoff_factor=0.5,
        backoff_jitter=1.0,
        max_backoff_wait=30.0,
        respect_retry_after_header=True,
    )
    return RetryTransport(transport=transport or httpx.HTTPTransport(), retry=retry)


def idempotency_key() -> dict[str, str]:
    """A new ``Idempotency-Key`` header for one create: the API answers a repeat of the same
    request (a retry) with the first answer and stores nothing again."""
    return {IDEMPOTENCY_HEADER: str(uuid.uuid4())}


class TunejobError(Exception):
    """An error answer of the API, ``{"error": {"code", "message", "param"}}`` (plus ``problems``,
    the rows at fault in a dataset), with its HTTP ``status``; or an error found on this side
    (``status`` None): a server that cannot be reached (``"connection_error"``), a downloaded model
    that differs from its manifest (``"download_corrupt"``).

    Attributes:
        status: HTTP status (4xx, 5xx), None when no answer came.
        code: the API's stable error code, e.g. ``"not_found"``, ``"missing_column"``.
        message: what is wrong, as the API says it.
        param: the request field at fault, e.g. ``"label_column"``, or None.
        problems: ``[{"row", "column", "value", "message"}]`` for data validation reports, else None.
    """

    def __init__(
        self,
        status: int | None,
        code: str,
        message: str,
        param: str | None = None,
        problems: list[dict[str, Any]] | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.problems = status, code, message, param, problems

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        status = f"HTTP {self.status} " if self.status else ""
        return f"{status}{self.code}: {self.message}{where}"

    @classmethod
    def from_response(cls, response: httpx.Response) -> "TunejobError":
        """The error of an error response; a body that is not the API's error shape (a proxy's
        page, say) becomes ``http_error`` with the start of the body as its message."""
        try:
            body = response.json()
            error = body["error"]
            return cls(
                response.status_code,
                error["code"],
                error["message"],
                error.get("param"),
                error.get("problems", body.get("problems")),
            )
        except (ValueError, KeyError, TypeError):
            text = response.text.strip()[:200] or response.reason_phrase
            return cls(response.status_code, "http_error", text)


def default_api_key() -> str | None:
    """``TUNEJOB_API_KEY``, else the contents of ``<TUNEJOB_DATA_DIR or ~/.tunejob>/api_key`` (the
    key ``tunejob serve`` writes on loopback), else None (a server without keys)."""
    key = os.environ.get("TUNEJOB_API_KEY", "").strip()
    if key:
        return key
    path = Path(os.environ.get("TUNEJOB_DATA_DIR") or "~/.tunejob").expanduser() / "api_key"
    if not path.is_file():
        return None
    return path.read_text().strip() or None


@dataclass(frozen=True)
class Kind:
    """A kind of job and where the API keeps it: training jobs under ``/jobs`` (``JobOut``),
    prediction jobs under ``/predictions`` (``PredictionOut``). Both have the same lifecycle,
    events, stream and cancel."""

    path: str
    out: type[JobOut] | type[PredictionOut]


TRAINING, PREDICTION = Kind("/jobs", JobOut), Kind("/predictions", PredictionOut)


@dataclass
class StreamMessage:
    """One message of ``GET /jobs/{id}/stream`` (or ``/predictions/{id}/stream``).

    ``event`` is ``"progress"`` or ``"end"`` (``data``: the job, a ``JobOut`` or ``PredictionOut``),
    ``"metrics"`` (``data``: new metric rows, ``list[MetricOut]``) or ``"events"`` (``data``: new
    job events, ``list[EventOut]``). ``id`` is the stream position to resume from (``Last-Event-ID``).
    """

    event: str
    id: str | None
    data: Any  # by ``event``, as above

    @classmethod
    def parse(cls, event: str, id_: str | None, payload: Any, kind: Kind = TRAINING) -> "StreamMessage":
        if event in ("progress", "end"):
            return cls(event, id_, kind.out.model_validate(payload))
        rows = payload["data"]
        return cls(
            event,
            id_,
            [MetricOut.model_validate(r) for r in rows]
            if event == "metrics"
            else [EventOut.model_validate(r) for r in rows],
        )


class Client:
    """The tunejob REST API.

    Args:
        url: the server; default ``TUNEJOB_URL``, else ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer``; default ``default_api_key()``.
        timeout: seconds for connecting and for each read (uploads and downloads stream).
        transport: an httpx transport (tests pass ``httpx.MockTransport``).
        retries: how often an answer 429 or 503 is retried (``retrying``) before it raises; the
            stream of ``follow`` (``jobs watch``) goes through the same transport.

    Every method raises ``TunejobError`` on failure.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        retries: int = 5,
    ):
        self.url = (url or os.environ.get("TUNEJOB_URL") or DEFAULT_URL).rstrip("/")
        key = api_key if api_key is not None else default_api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, transport=retrying(transport, retries)
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _unreachable(self, e: httpx.TransportError) -> TunejobError:
        return TunejobError(None, "connection_error", f"cannot reach tunejob at {self.url}: {e or type(e).__name__}")

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """Send one request; return the response if it succeeded, else raise ``TunejobError``."""
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        if response.is_error:
            raise TunejobError.from_response(response)
        return response

    def _download(self, path: str, dest: Path) -> Path:
        """Stream ``path`` into the file ``dest``.

        Raises:
            TunejobError: ``connection_error`` (no answer), ``download_incomplete`` (the answer was
                cut short, as the API does on purpose when a stored file does not match its
                manifest; ``dest`` is removed, so no partial file passes for the whole), or the API's error.
        """
        try:
            with self.http.stream("GET", path) as response:
                if response.is_error:
                    response.read()
                    raise TunejobError.from_response(response)
                try:
                    with open(dest, "wb") as out:
                        for chunk in response.iter_bytes(1 << 20):
                            out.write(chunk)
                except httpx.TransportError as e:
                    dest.unlink(missing_ok=True)
                    size = response.headers.get("Content-Length")
                    raise TunejobError(
                        None,
                        "download_incomplete",
                        f"the download of {path} was cut short after {response.num_bytes_downloaded:,} bytes"
                        + (f" of {int(size):,}" if size and size.isdigit() else "")
                        + f" ({e or type(e).__name__}); nothing was kept. The server's log says why",
                    ) from e
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        return dest

    # ------------------------------------------------------------------ health, models, datasets

    def health(self) -> dict[str, Any]:
        """``GET /healthz``."""
        return self.request("GET", "/healthz").json()

    def wait_until_up(self, timeout: float) -> dict[str, Any]:
        """``health()``, asked every half second until the server answers or ``timeout`` s pass
        (a service that is starting)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except TunejobError as e:
                if e.status is not None or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def list_models(self) -> list[BaseModelOut]:
        """``GET /models``: the base models that can be fine-tuned."""
        return [BaseModelOut.model_validate(m) for m in self.request("GET", "/models").json()["data"]]

    def upload_dataset(self, path: str | Path) -> DatasetOut:
        """``POST /datasets``: upload a CSV, TSV, JSONL or Parquet file (the server checks it)."""
        path = Path(path)
        with open(path, "rb") as f:
            response = self.request("POST", "/datasets", files={"file": (path.name, f)}, headers=idempotency_key())
        return DatasetOut.model_validate(response.json())

    def list_datasets(self) -> list[DatasetOut]:
        """``GET /datasets``, newest first."""
        return [DatasetOut.model_validate(d) for d in self.request("GET", "/datasets").json()["data"]]

    def get_dataset(self, dataset_id: str) -> DatasetOut:
        return DatasetOut.model_validate(self.request("GET", f"/datasets/{dataset_id}").json())

    def delete_dataset(self, dataset_id: str) -> None:
        """``DELETE /datasets/{id}``."""
        self.request("DELETE", f"/datasets/{dataset_id}")

    # ------------------------------------------------------------------ jobs

    def create_job(self, spec: JobCreate | dict[str, Any]) -> JobOut:
        """``POST /jobs``: the server checks ``spec`` against its model and data, stores and queues it."""
        return JobOut.model_validate(self.request("POST", "/jobs", json=_body(spec), headers=idempotency_key()).json())

    def plan_job(self, spec: JobCreate | dict[str, Any]) -> dict[str, Any]:
        """``POST /jobs?dry_run=true``: the job's plan (token lengths, padding efficiency of each
        batching strategy, steps, estimated duration); nothing is stored or queued."""
        return self.request("POST", "/jobs", params={"dry_run": "true"}, json=_body(spec)).json()["plan"]

    def list_jobs(self, status: str | None = None, limit: int = 20, cursor: str | None = None) -> JobList:
        """``GET /jobs``, newest first; pass ``next_cursor`` back as ``cursor`` for the next page."""
        params = {"limit": limit, **({"status": status} if status else {}), **({"cursor": cursor} if cursor else {})}
        return JobList.model_validate(self.request("GET", "/jobs", params=params).json())

    def get_job(self, job_id: str) -> JobOut:
        return JobOut.model_validate(self.request("GET", f"/jobs/{job_id}").json())

    def get_of_kind(self, job_id: str, kind: Kind = TRAINING) -> JobOut | PredictionOut:
        """``GET /jobs/{id}`` or ``GET /predictions/{id}``, by ``kind``."""
        return kind.out.model_validate(self.request("GET", f"{kind.path}/{job_id}").json())

    def cancel_job(self, job_id: str) -> JobOut:
        """``POST /jobs/{id}/cancel``: a queued job never starts, a running one stops at its next step."""
        return JobOut.model_validate(self.request("POST", f"/jobs/{job_id}/cancel").json())

    def delete_job(self, job_id: str) -> None:
        """``DELETE /jobs/{id}``."""
        self.request("DELETE", f"/jobs/{job_id}")

    def job_metrics(self, job_id: str, after_step: int = -1) -> list[MetricOut]:
        """The whole metric series after ``after_step`` (all pages of ``GET /jobs/{id}/metrics``),
        ordered by step."""
        rows: list[MetricOut] = []
        while True:
            page = [
                MetricOut.model_validate(m)
                for m in self.request(
                    "GET", f"/jobs/{job_id}/metrics", params={"after_step": after_step, "limit": METRICS_PAGE}
                ).json()["data"]
            ]
            if len(page) < METRICS_PAGE:
                return rows + page
            # A full page may end inside a step: keep the whole steps, ask again from the cut one.
            last = page[-1].step
            rows += [m for m in page if m.step < last]
            after_step = last - 1

    def job_events(self, job_id: str, kind: Kind = TRAINING) -> list[EventOut]:
        """``GET /jobs/{id}/events`` (or ``/predictions/{id}/events``, by ``kind``)."""
        return [EventOut.model_validate(e) for e in self.request("GET", f"{kind.path}/{job_id}/events").json()["data"]]

    def job_checkpoints(self, job_id: str) -> list[CheckpointOut]:
        return [
            CheckpointOut.model_validate(c) for c in self.request("GET", f"/jobs/{job_id}/checkpoints").json()["data"]
        ]

    def list_artifacts(self, job_id: str) -> list[ArtifactOut]:
        return [ArtifactOut.model_validate(a) for a in self.request("GET", f"/jobs/{job_id}/artifacts").json()["data"]]

    def download_artifact(self, job_id: str, name: str, dest: str | Path) -> Path:
        """``GET /jobs/{id}/artifacts/{name}`` streamed into the file ``dest``."""
        return self._download(f"/jobs/{job_id}/artifacts/{name}", Path(dest))

    def download_model(self, job_id: str, directory: str | Path) -> Path:
        """The trained model, extracted into ``directory`` (created; it must not exist or be empty),
        ready for ``transformers.pipeline(model=directory)``. Downloads ``model.tar``, or
        ``model.tar.gz`` from servers that have no ``model.tar``; the archive is extracted with
        tarfile's ``data`` filter (no links or paths out of the directory) into a temporary
        directory beside ``directory``, checked against its ``manifest.json`` (each file's size and
        sha256; models from servers older than the manifest are not checked), then renamed into place.

        Raises:
            TunejobError: ``not_found`` (no such job), ``model_not_ready`` (it has not succeeded),
                ``model_files_deleted``, ``directory_not_empty``,
                ``download_corrupt`` (files missing or differing from the manifest; nothing is kept),
                ``download_incomplete`` (the answer was cut short; nothing is kept).
        """
        directory = Path(directory)
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise TunejobError(
                None, "directory_not_empty", f"{directory} exists and is not an empty directory", "output"
            )
        directory.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}.") as tmp:
            archive = Path(tmp) / "model.archive"
            for name in MODEL_ARCHIVES:
                try:
                    self.download_artifact(job_id, name, archive)
                    break
                except TunejobError as e:
                    if e.status != 404 or name == MODEL_ARCHIVES[-1]:
                        raise
                    self.get_job(job_id)  # a missing job is an error, not a reason to try the next name
            extracted = Path(tmp) / "model"
            with tarfile.open(archive) as tar:
                tar.extractall(extracted, filter="data")
            if (extracted / MANIFEST).is_file() and (bad := verify_manifest(extracted)):
                raise TunejobError(
                    None, "download_corrupt", f"the model of {job_id} differs from its manifest: {', '.join(bad)}", None
                )
            if directory.exists():
                directory.rmdir()
            os.replace(extracted, directory)
        return directory

    def plot_png(self, job_id: str) -> bytes:
        """``GET /jobs/{id}/plot.png``: loss and learning rate, evaluation metrics and tokens/s by
        step, drawn from the metric rows so far."""
        return self.request("GET", f"/jobs/{job_id}/plot.png").content

    # ------------------------------------------------------------------ predictions

    def create_sweep(self, spec: SweepCreate | dict[str, Any], idempotency_key: str | None = None) -> SweepOut:
        """``POST /sweeps``: the server checks the sweep, stores it and queues its first trials.
        With ``idempotency_key``, a retry returns the same sweep and queues nothing."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return SweepOut.model_validate(self.request("POST", "/sweeps", json=_body(spec), headers=headers).json())

    def plan_sweep(self, spec: SweepCreate | dict[str, Any]) -> dict[str, Any]:
        """``POST /sweeps?dry_run=true``: the search space as understood, the first trials, one
        trial's plan; nothing is stored or queued."""
        return self.request("POST", "/sweeps", params={"dry_run": "true"}, json=_body(spec)).json()

    def list_sweeps(self, limit: int = 20, cursor: str | None = None) -> SweepList:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        return SweepList.model_validate(self.request("GET", "/sweeps", params=params).json())

    def get_sweep(self, sweep_id: str) -> SweepOut:
        return SweepOut.model_validate(self.request("GET", f"/sweeps/{sweep_id}").json())

    def sweep_trials(self, sweep_id: str) -> list[TrialOut]:
        """``GET /sweeps/{id}/trials``: every trial by number (each is a job: ``get_job(t.job_id)``)."""
        return [TrialOut.model_validate(t) for t in self.request("GET", f"/sweeps/{sweep_id}/trials").json()["data"]]

    def cancel_sweep(self, sweep_id: str) -> SweepOut:
        """``POST /sweeps/{id}/cancel``: queued trials never start, running ones stop at their next step."""
        return SweepOut.model_validate(self.request("POST", f"/sweeps/{sweep_id}/cancel").json())

    def delete_sweep(self, sweep_id: str) -> None:
        """``DELETE /sweeps/{id}``: an ended sweep and all its trials (their models too)."""
        self.request("DELETE", f"/sweeps/{sweep_id}")

    def create_prediction(self, spec: PredictionCreate | dict[str, Any]) -> PredictionOut:
        """``POST /predictions``: score every row of a dataset with a model (a succeeded job of
        yours, or a base model with a classification head); the server checks, stores and queues it."""
        return PredictionOut.model_validate(
            self.request("POST", "/predictions", json=_body(spec), headers=idempotency_key()).json()
        )

    def plan_prediction(self, spec: PredictionCreate | dict[str, Any]) -> dict[str, Any]:
        """``POST /predictions?dry_run=true``: rows, tokens, texts truncated at ``max_length``,
        padding efficiency and estimated time; nothing is stored or queued."""
        return self.request("POST", "/predictions", params={"dry_run": "true"}, json=_body(spec)).json()["plan"]

    def list_predictions(self, status: str | None = None, limit: int = 20, cursor: str | None = None) -> PredictionList:
        """``GET /predictions``, newest first; pass ``next_cursor`` back as ``cursor`` for the next page."""
        params = {"limit": limit, **({"status": status} if status else {}), **({"cursor": cursor} if cursor else {})}
        return PredictionList.model_validate(self.request("GET", "/predictions", params=params).json())

    def get_prediction(self, prediction_id: str) -> PredictionOut:
        return PredictionOut.model_validate(self.request("GET", f"/predictions/{prediction_id}").json())

    def cancel_prediction(self, prediction_id: str) -> PredictionOut:
        """``POST /predictions/{id}/cancel``: a queued one never starts, a running one stops after its part."""
        return PredictionOut.model_validate(self.request("POST", f"/predictions/{prediction_id}/cancel").json())

    def delete_prediction(self, prediction_id: str) -> None:
        """``DELETE /predictions/{id}``: its results and events."""
        self.request("DELETE", f"/predictions/{prediction_id}")

    def download_predictions(self, prediction_id: str, dest: str | Path, format: str = "jsonl") -> Path:
        """``GET /predictions/{id}/results?format=`` (``jsonl``, ``csv`` or ``parquet``) streamed into
        the file ``dest``: one row per input row, in input order."""
        return self._download(f"/predictions/{prediction_id}/results?format={format}", Path(dest))

    def predict(self, job_id: str, inputs: list[str]) -> dict[str, Any]:
        """``POST /models/{job_id}/predict``: a few texts scored at once by the API process
        (``{"predictions": [...], "truncated", "max_length", ...}``)."""
        return self.request("POST", f"/models/{job_id}/predict", json={"inputs": inputs}).json()

    def embed(self, job_id: str, inputs: list[str]) -> dict[str, Any]:
        """``POST /models/{job_id}/embed``: a few texts embedded at once by the API process
        (``{"embeddings": [[...], ...], "dimensions", "tokens", "truncated", ...}``, unit length)."""
        return self.request("POST", f"/models/{job_id}/embed", json={"inputs": inputs}).json()

    def rerank(self, job_id: str, query: str, documents: list[str], top_n: int | None = None) -> dict[str, Any]:
        """``POST /models/{job_id}/rerank``: ``documents`` ordered by a reranking job's relevance to
        ``query`` (``{"results": [{"index", "relevance_score"}, ...]}``, best first; the best
        ``top_n`` only, when given)."""
        body = {"query": query, "documents": documents, **({"top_n": top_n} if top_n is not None else {})}
        return self.request("POST", f"/models/{job_id}/rerank", json=body).json()

    def job_evaluation(self, job_id: str) -> dict[str, Any]:
        """``GET /jobs/{id}/evaluation``: the evaluation report of a succeeded job's model."""
        return self.request("GET", f"/jobs/{job_id}/evaluation").json()

    def prediction_evaluation(self, prediction_id: str) -> dict[str, Any]:
        """``GET /predictions/{id}/evaluation``: the evaluation report of a prediction made with a
        ``label_column`` (a labelled test set)."""
        return self.request("GET", f"/predictions/{prediction_id}/evaluation").json()

    # ------------------------------------------------------------------ model aliases

    def set_alias(self, alias: str, job_id: str) -> AliasOut:
        """``PUT /models/aliases/{alias}``: point ``alias`` at a succeeded job (creating or moving it)."""
        return AliasOut.model_validate(self.request("PUT", f"/models/aliases/{alias}", json={"job_id": job_id}).json())

    def get_alias(self, alias: str) -> AliasOut:
        """``GET /models/aliases/{alias}``: the job it names and its history, newest first."""
        return AliasOut.model_validate(self.request("GET", f"/models/aliases/{alias}").json())

    def list_aliases(self) -> list[dict[str, Any]]:
        return self.request("GET", "/models/aliases").json()["data"]

    def delete_alias(self, alias: str) -> None:
        self.request("DELETE", f"/models/aliases/{alias}")

    # ------------------------------------------------------------------ webhooks

    def create_webhook(self, url: str, events: list[str], description: str | None = None) -> WebhookCreated:
        """``POST /webhooks``: the endpoint, with its ``secret`` (``whsec_…``, shown only this once)."""
        body = {"url": url, "events": events, **({"description": description} if description else {})}
        return WebhookCreated.model_validate(self.request("POST", "/webhooks", json=body).json())

    def list_webhooks(self) -> list[WebhookOut]:
        return [WebhookOut.model_validate(w) for w in self.request("GET", "/webhooks").json()["data"]]

    def delete_webhook(self, webhook_id: str) -> None:
        self.request("DELETE", f"/webhooks/{webhook_id}")

    def webhook_deliveries(self, webhook_id: str, limit: int = 20, cursor: int | None = None) -> DeliveryList:
        """``GET /webhooks/{id}/deliveries``, newest first; pass ``next_cursor`` back as ``cursor``."""
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        return DeliveryList.model_validate(
            self.request("GET", f"/webhooks/{webhook_id}/deliveries", params=params).json()
        )

    def ping_webhook(self, webhook_id: str) -> DeliveryOut:
        """``POST /webhooks/{id}/ping``: a signed ``webhook.ping`` event is sent to the endpoint."""
        return DeliveryOut.model_validate(self.request("POST", f"/webhooks/{webhook_id}/ping").json())

    # ------------------------------------------------------------------ following a job

    def stream(self, job_id: str, last_event_id: str | None = None, kind: Kind = TRAINING) -> Iterator[StreamMessage]:
        """One connection to ``GET /jobs/{id}/stream`` (or ``/predictions/{id}/stream``, by ``kind``;
        server-sent events), from the start or,
        with ``last_event_id``, from just after that message. Ends after the ``end`` message, or
        when the server closes the connection early (resume with the last message's id).

        Raises:
            TunejobError: the API's error (no such job, a bad ``last_event_id``), a lost
                connection (status None), or the stream's ``error`` message (status None).
        """
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        # The server sends a heartbeat every 15 s by default: a read timeout of 4x that means a dead connection.
        timeout = httpx.Timeout(self.http.timeout.connect, read=60.0)
        try:
            with connect_sse(
                self.http, "GET", f"{kind.path}/{job_id}/stream", headers=headers, timeout=timeout
            ) as source:
                if source.response.is_error:
                    source.response.read()
                    raise TunejobError.from_response(source.response)
                for sse in source.iter_sse():
                    if not sse.data:  # a heartbeat comment comes out as an empty event (the spec dispatches none)
                        continue
                    if sse.event == "error":  # the job was deleted, or the server could not read it
                        error = json.loads(sse.data)["error"]
                        raise TunejobError(None, error["code"], error["message"], error.get("param"))
                    yield StreamMessage.parse(sse.event, sse.id or None, json.loads(sse.data), kind)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e

    def follow(
        self, job_id: str, last_event_id: str | None = None, poll_seconds: float = 2.0, kind: Kind = TRAINING
    ) -> Iterator[StreamMessage]:
        """Everything the job (of ``kind``) reports until it ends, the ``end`` message last.

        From the stream, which is reconnected with ``Last-Event-ID`` when the connection drops,
        so every metric row and event still arrives exactly once (it gives up after
        ``MAX_RECONNECTS`` drops in a row). From a server without the stream (an HTTP error other
        than an unknown job, or not an event stream), by polling ``GET /jobs/{id}`` and its
        events every ``poll_seconds``: then there are ``progress``, ``events`` and ``end``
        messages, but no ``metrics``.
        """
        drops = 0
        while True:
            dropped = TunejobError(None, "stream_closed", f"the stream of job {job_id} closed before it ended")
            try:
                for message in self.stream(job_id, last_event_id, kind):
                    drops = 0
                    last_event_id = message.id or last_event_id
                    yield message
                    if message.event == "end":
                        return
            except TunejobError as e:
                if e.status is not None:
                    self.get_of_kind(job_id, kind)  # an unknown job raises here; anything else: no stream
                    yield from self.poll(job_id, poll_seconds, kind)
                    return
                dropped = e
            except SSEError:  # not an event stream: a server or proxy without it
                yield from self.poll(job_id, poll_seconds, kind)
                return
            drops += 1
            if drops > MAX_RECONNECTS:
                raise dropped
            time.sleep(min(0.5 * 2**drops, 15.0))

    def poll(self, job_id: str, interval: float = 2.0, kind: Kind = TRAINING) -> Iterator[StreamMessage]:
        """``follow`` for servers without the stream: the job and its new events every ``interval`` s."""
        seen = 0
        while True:
            job = self.get_of_kind(job_id, kind)
            events = self.job_events(job_id, kind)
            if len(events) > seen:
                yield StreamMessage("events", None, events[seen:])
                seen = len(events)
            if job.status in FINISHED:
                yield StreamMessage("end", None, job)
                return
            yield StreamMessage("progress", None, job)
            time.sleep(interval)


def _body(spec: JobCreate | PredictionCreate | SweepCreate | dict[str, Any]) -> dict[str, Any]:
    """The JSON body of a job spec. A dict goes as it is: the server checks it and names what is wrong."""
    return spec if isinstance(spec, dict) else spec.model_dump(mode="json", exclude_none=True)
