"""The FastAPI application: thin routers over ``shared``; migrations run on start-up."""

from contextlib import asynccontextmanager

from fastapi import FastAPI

from api.errors import install_error_handlers
from api.routers import datasets, jobs, models
from shared.db import upgrade_database


@asynccontextmanager
async def lifespan(_: FastAPI):
    upgrade_database()
    yield


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
