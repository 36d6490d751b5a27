"""The floating dtype a precision setting means on a device: one rule for training
(``worker.training``) and prediction (``shared.inference``)."""

import torch

from shared.errors import UserError
from shared.settings import get_settings

PRECISION_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # compute dtype -> name


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon Sapphire Rapids and later), where bf16 and int8
    matrix products run on the tiles: bf16 trains and predicts faster than fp32 there, and slower
    on CPUs without them (docs/benchmarks.md, "Measurements behind the defaults").
    ``torch.cpu._is_amx_tile_supported`` is private: PyTorch has no public check."""
    return torch.cpu._is_amx_tile_supported()


def compute_dtype(precision: str, device: torch.device, param: str = "hyperparameters.precision") -> torch.dtype | None:
    """The dtype a model computes in for a precision setting, None for fp32 (and for prediction's
    ``int8``, whose float work around the int8 products is its own: ``shared.inference.int8``).
    bf16 runs on bf16 weights (training's bf16 copy beside fp32 master weights, prediction's bf16
    model); fp16 under ``torch.autocast`` (with a GradScaler in training); evaluations of the fp32
    master weights autocast to either.

    ``auto``: ``auto_precision``.

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
    return auto_precision(device)[0]


def auto_precision(device: torch.device) -> tuple[torch.dtype | None, str]:
    """What ``auto`` means on ``device``, and why in a few words (a job's ``precision`` event): bf16
    on GPUs that support it, fp16 on older GPUs, bf16 on CPUs with AMX (``cpu_has_amx``) and fp32
    (None) on other CPUs, where bf16 trained and predicted slower than fp32 (docs/benchmarks.md,
    "Measurements behind the defaults"); ``TUNEJOB_CPU_BF16`` sets the CPU's choice."""
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        return (torch.bfloat16 if bf16 else torch.float16), "a GPU " + ("with" if bf16 else "without") + " bf16"
    cpu_bf16 = get_settings().cpu_bf16
    if cpu_bf16 is not None:
        return (torch.bfloat16 if cpu_bf16 else None), "TUNEJOB_CPU_BF16"
    amx = cpu_has_amx()
    return (torch.bfloat16 if amx else None), "a CPU " + ("with" if amx else "without") + " AMX tiles"
