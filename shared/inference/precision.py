"""The ``torch.autocast`` dtype a precision setting means on a device: one rule for training
(``worker.training``) and prediction (``shared.inference``)."""

import torch

from shared.errors import UserError


def autocast_dtype(
    precision: str, device: torch.device, param: str = "hyperparameters.precision"
) -> torch.dtype | None:
    """The ``torch.autocast`` dtype for a precision setting, None for fp32.

    ``auto`` picks bf16 on GPUs that support it, fp16 (with a GradScaler) on older GPUs, and fp32 on
    the CPU, where bf16 autocast trained slower than fp32 on the CI's CPU (docs/benchmarks.md,
    "Measurements behind the defaults").

    Raises:
        UserError: ``bf16`` on a GPU without bf16 support (naming ``param``).
    """
    if precision == "fp32":
        return None
    if precision == "fp16":
        return torch.float16
    if precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError("unsupported_precision", "this GPU does not support bf16; use fp16 or auto", param)
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return None
