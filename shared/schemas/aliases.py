"""Model alias request and response bodies (``api.routers.aliases``, ``shared.jobs.aliases``)."""

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class AliasIn(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"job_id": "job_0123456789abcdef"}]})

    job_id: str = Field(max_length=32, description="a succeeded training job of yours")


class AliasChangeOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    from_job_id: str | None = Field(description="None: the alias was created")
    to_job_id: str | None = Field(description="None: the alias was deleted")
    changed_by: str | None = Field(description="the id of the API key that made the change")
    changed_at: datetime


class AliasOut(BaseModel):
    alias: str
    job_id: str
    updated_at: datetime
    updated_by: str | None
    history: list[AliasChangeOut] = Field(description="every move of the alias, newest first")
