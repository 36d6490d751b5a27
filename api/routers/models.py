from fastapi import APIRouter

from shared.jobs.base_models import available_models, model_type
from shared.schemas.jobs import BaseModelOut

router = APIRouter(tags=["models"])


@router.get("/models")
def list_models() -> dict[str, list[BaseModelOut]]:
    """The base models that can be fine-tuned."""
    return {
        "data": [
            BaseModelOut(name=name, source=source, model_type=model_type(path))
            for name, (path, source) in available_models().items()
        ]
    }
