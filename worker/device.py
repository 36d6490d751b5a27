"""Which device and precision a job trains with, and how the CPU allocator serves its tensors."""

import ctypes
import ctypes.util

import torch

from shared.data.batching import job_ladder


def resolve_device(setting: str) -> tuple[torch.device, str | None]:
    """The device a job (training or prediction) runs on for ``TUNEJOB_DEVICE`` (``auto``, ``cuda`` or ``cpu``).

    Returns:
        (device, note): ``note`` says why ``auto`` fell back to the CPU, else None.

    Raises:
        RuntimeError: ``cuda`` was asked for and no CUDA GPU is visible.
    """
    if setting == "cpu":
        return torch.device("cpu"), None
    if torch.cuda.is_available():
        return torch.device("cuda", 0), None
    if setting == "cuda":
        raise RuntimeError("TUNEJOB_DEVICE=cuda but no CUDA GPU is visible (check CUDA_VISIBLE_DEVICES and drivers)")
    return torch.device("cpu"), "TUNEJOB_DEVICE=auto found no CUDA GPU: running on the CPU"


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index or 0} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def padding_ladder(hp, device: torch.device) -> list[int]:
    """The widths this job's micro-batches are padded to on ``device`` (``shared.data.batching.job_ladder``)."""
    return job_ladder(hp.max_length, hp.pad_to_multiple_of, hp.torch_compile, device.type == "cuda")


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, glibc <malloc.h>


def reuse_freed_cpu_memory() -> bool:
    """Make glibc malloc serve large CPU tensors from its heap and keep freed memory for reuse.

    By default glibc gives every allocation over 32 MiB its own ``mmap`` and returns it to the
    kernel when freed, so each training step faults in its large tensors page by page again (the
    dense ``[vocab, hidden]`` embedding gradient; at max_length 512 the ``[batch, heads, 512, 512]``
    attention scores, softmax and dropout masks). ``mallopt(M_MMAP_MAX, 0)`` and a 2 GiB
    ``M_TRIM_THRESHOLD`` stop that, the effect of the ``jemalloc``/``tcmalloc`` preload that the
    PyTorch CPU performance tuning guide recommends, without a library to install. Measured on the
    2-core CPU (all-MiniLM-L6-v2, smart batching, fp32; docs/benchmarks.md, "CPU memory"): BBC
    News at max_length 512 trained 1.44x (batch 16) and 1.33x (batch 32) more real tokens/s, peak
    RSS 9,682 MiB instead of 6,659 MiB at batch 16 (freed memory is kept); on short Rotten Tomatoes texts
    (tensors under 32 MiB) the difference was within noise.

    Process-wide and irreversible; ``TUNEJOB_CPU_REUSE_FREED_MEMORY=false`` keeps the defaults.
    Returns False where the C library is not glibc (nothing changes there).
    """
    mallopt = glibc_function("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def glibc_function(name: str):
    """A function of the C library through ``ctypes`` (e.g. ``mallopt``, ``malloc_trim``), or None
    where the C library has no such function (not glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
