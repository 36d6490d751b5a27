"""The API view of a queued job's place in the queue (``shared.jobs.positions``)."""

from datetime import datetime

from pydantic import BaseModel, Field


class QueuePosition(BaseModel):
    position: int = Field(description="1 for the next job a free worker takes; counts every tenant's queued jobs")
    ahead: int = Field(description="queued jobs that start before this one")
    estimated_start_seconds: float | None = Field(
        description=(
            "seconds from now until a worker is expected to take it: from the running jobs' ETAs and the "
            "dry-run plan estimates of the jobs ahead, with as many workers as jobs run now (at least one); "
            "null while one of those is unknown (a job without a plan estimate yet, or no past job to "
            "estimate from)"
        )
    )
    estimated_start_at: datetime | None = Field(description="now + estimated_start_seconds")
