"""The FastAPI application: thin routers over ``shared``. On start-up it runs the migrations and
starts the recovery loop (reaper and sweeper, ``shared.jobs.recover``)."""

import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.errors import install_error_handlers
from api.routers import datasets, jobs, models
from shared.db import upgrade_database
from worker.celery_app import recovery_loop


@asynccontextmanager
async def lifespan(_: FastAPI):
    upgrade_database()
    stop = threading.Event()
    recovery = threading.Thread(target=recovery_loop, args=(stop,), name="tunejob-recover", daemon=True)
    recovery.start()
    yield
    stop.set()
    recovery.join(timeout=10)


def create_app() -> FastAPI:
    app = FastAPI(title="tunejob", version="0.1.0", lifespan=lifespan,
                  description="Fine-tune Hugging Face encoders for text classification and regression.")
    install_error_handlers(app)
    app.include_router(datasets.router)
    app.include_router(models.router)
    app.include_router(jobs.router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict:
        return {"status": "ok"}

    return app


app = create_app()
