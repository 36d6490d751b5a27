"""The FastAPI application: thin routers over ``shared``. On start-up it runs the migrations and
starts the recovery loop (``shared.queue.recovery_loop``).

Swagger UI (``/docs``) and ReDoc (``/redoc``) load their scripts and styles from this service
(``/docs/static``, the files bundled in the fastapi-offline package), not from a CDN, so they work
on a machine without internet.

Every route requires an API key except those in ``api.auth.PUBLIC_PATHS`` (``/healthz``);
requests for a Host the server does not serve are refused (``api.security``). The dashboard is
mounted at ``/ui`` (``api.ui``): its pages need a browser session instead of a key.
"""

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi_offline import FastAPIOffline

from api.auth import authenticate
from api.body_limit import BodyLimit
from api.errors import install_error_handlers
from api.feeds import Feeds
from api.metrics import install_metrics, process_exiting
from api.openapi import install_openapi
from api.request_id import RequestId
from api.routers import aliases, datasets, inference, jobs, live, models, openai_v1, predictions, sweeps, webhooks
from api.security import HostAndOriginCheck, allowed_hosts
from api.ui import create_ui
from shared.jobs.positions import estimate_queued
from shared.jobs.webhook_delivery import deliver_due
from shared.queue import RecoveryThread
from shared.settings import get_settings
from shared.store import engine
from shared.store.engine import upgrade_database

DOCS_STATIC_URL = "/docs/static"  # Swagger UI and ReDoc assets, under the public /docs pages


@asynccontextmanager
async def lifespan(_: FastAPI):
    upgrade_database()
    recovery = RecoveryThread(extra=(estimate_queued,))  # the API plans queued jobs (shared.jobs.positions)
    # The API sends webhooks (why the API and not the workers: shared.jobs.webhooks)
    deliveries = RecoveryThread(
        chores=(deliver_due,), every=lambda: get_settings().webhooks_poll_seconds, name="tunejob-webhooks"
    )
    recovery.start()
    deliveries.start()
    yield
    deliveries.stop()
    recovery.stop()
    process_exiting()


def create_app(bound_host: str | None = None) -> FastAPI:
    """The application, for a server listening on ``bound_host`` (default ``TUNEJOB_HOST``)."""
    engine.PING_CONNECTIONS = False  # a stale connection costs one 503, not a round trip per request
    app = FastAPIOffline(
        title="tunejob",
        version="0.1.0",
        lifespan=lifespan,
        static_url=DOCS_STATIC_URL,
        dependencies=[Depends(authenticate)],
        description="Fine-tune Hugging Face encoders for text classification (single- and "
        "multi-label) and regression. "
        "Send `Authorization: Bearer <API key>` with every request but `/healthz`.",
    )
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(BodyLimit)
    app.add_middleware(HostAndOriginCheck, allowed_hosts=allowed_hosts(bound_host or get_settings().host))
    app.add_middleware(RequestId)  # added last: the outermost, so even a refused Host gets an id
    app.state.feeds = Feeds()  # one store reader for every streamed job (GET /jobs/{id}/stream, /ui)
    app.include_router(datasets.router)
    app.include_router(aliases.router)  # before models: /models/aliases is not a job id
    app.include_router(models.router)
    app.include_router(inference.router)
    app.include_router(jobs.router)
    app.include_router(live.router)
    app.include_router(predictions.router)
    app.include_router(sweeps.router)
    app.include_router(openai_v1.router)
    app.include_router(webhooks.router)
    install_metrics(app)
    app.mount("/ui", create_ui(app.state.feeds))

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict:
        """Liveness; needs no API key."""
        return {"status": "ok"}

    return app


app = create_app()
