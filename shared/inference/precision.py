"""The ``torch.autocast`` dtype a precision setting means on a device: one rule for training
(``worker.training``) and prediction (``shared.inference``)."""

import torch

from shared.errors import UserError
from shared.settings import get_settings

PRECISION_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # autocast dtype -> name


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon Sapphire Rapids and later), where bf16 and int8
    matrix products run on the tiles: bf16 trains and predicts faster than fp32 there, and slower
    on CPUs without them (docs/benchmarks.md, "Measurements behind the defaults").
    ``torch.cpu._is_amx_tile_supported`` is private: PyTorch has no public check."""
    return torch.cpu._is_amx_tile_supported()


def autocast_dtype(
    precision: str, device: torch.device, param: str = "hyperparameters.precision"
) -> torch.dtype | None:
    """The ``torch.autocast`` dtype for a precision setting, None for fp32 (and for prediction's
    ``int8``, whose float work around the int8 products is its own: ``shared.inference.int8``).

    ``auto`` picks bf16 on GPUs that support it, fp16 (with a GradScaler) on older GPUs, bf16 on
    CPUs with AMX (``cpu_has_amx``) and fp32 on other CPUs, where bf16 trained and predicted slower
    than fp32 (docs/benchmarks.md, "Measurements behind the defaults"); ``TUNEJOB_CPU_BF16`` sets
    the CPU's choice.

    Raises:
        UserError: ``bf16`` on a GPU without bf16 support (naming ``param``).
    """
    if precision in ("fp32", "int8"):
        return None
    if precision == "fp16":
        return torch.float16
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError("unsupported_precision", "this GPU does not support bf16; use fp16 or auto", param)
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    cpu_bf16 = get_settings().cpu_bf16
    return torch.bfloat16 if (cpu_has_amx() if cpu_bf16 is None else cpu_bf16) else None


def auto_reason(device: torch.device) -> str:
    """Why ``auto`` means what it does on ``device``, in a few words (a job's ``precision`` event)."""
    if device.type == "cuda":
        return "a GPU " + ("with" if torch.cuda.is_bf16_supported() else "without") + " bf16"
    if get_settings().cpu_bf16 is not None:
        return "TUNEJOB_CPU_BF16"
    return "a CPU " + ("with" if cpu_has_amx() else "without") + " AMX tiles"
