"""One CUDA graph captured on a side stream, with the failure path ``torch.cuda.graph`` lacks
(``capture_graph``, ``settle_failed_capture``), and the one side stream of a process
(``side_stream``). Used by ``worker.training.capture``."""

import contextlib
import functools
from collections.abc import Callable

import torch


def capture_graph(body: Callable[[], None], pool, stream) -> "torch.cuda.CUDAGraph":
    """Capture ``body`` on ``stream`` into a new CUDA graph drawing on memory pool ``pool``
    (``torch.cuda.graph`` without its failure path: its ``__exit__`` raises from ``capture_end``
    before it restores the current stream, so a failed capture would leave the eager fallback on
    the capture stream).

    Whatever fails, the current stream is restored; on failure the capture is ended (if it began)
    and the graph reset, and where ``capture_end`` never succeeded, ``settle_failed_capture``
    undoes what it left behind; then the first error is raised.

    Raises:
        Exception: what ``capture_begin``, ``body`` or ``capture_end`` raised (e.g.
            ``RuntimeError: operation not permitted when stream is capturing``).
    """
    graph = torch.cuda.CUDAGraph()
    previous = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda.set_stream(stream)
    began = ending = ended = False
    try:
        # thread_local: a DataLoader pin-memory thread may allocate pinned memory meanwhile
        graph.capture_begin(pool, capture_error_mode="thread_local")
        began = True
        body()
        ending = True
        graph.capture_end()
        ended = True
    except BaseException:
        if began and not ending:  # the body raised: end the capture
            with contextlib.suppress(Exception):  # the capture is invalid already: keep the first error
                graph.capture_end()
                ended = True
        graph.reset()
        if began and not ended:
            settle_failed_capture(pool, stream)
        raise
    finally:
        torch.cuda.set_stream(previous)
    return graph


def settle_failed_capture(pool, stream) -> None:
    """Undo what a capture whose ``capture_end`` raised leaves behind. ``CUDAGraph::capture_end``
    raises from ``cudaStreamEndCapture`` (an invalidated capture) before it ends the allocator's
    routing to ``pool``, before the default CUDA generator's ``capture_epilogue``, and without
    marking the capture ended, so ``reset`` keeps its hold on the pool. Left so, every later
    random op outside capture, the eager fallback's first dropout included, raises "Offset
    increment outside graph capture encountered unexpectedly", which would fail every later job of
    the worker (``bench.engine_gpu_check``'s ``failed_capture`` makes one).

    Here: the routing ended and the hold released (``_cuda_endAllocateToPool``,
    ``_cuda_releasePool``, as ``torch.cuda.memory.use_mem_pool`` ends its own), then a one-op
    capture on ``stream`` that succeeds, whose ``capture_begin``/``capture_end`` run the
    generator's prologue and epilogue, so it is no longer capturing; then released.

    Raises:
        RuntimeError: the generator still refuses an eager random draw (the worker cannot train
            with dropout any more; the job fails with this message, not a later mystery).
    """
    device = torch.cuda.current_device()
    torch._C._cuda_endAllocateToPool(device, pool)
    torch._C._cuda_releasePool(device, pool)
    scratch = torch.zeros(1, device="cuda")
    probe = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        probe.capture_begin(capture_error_mode="thread_local")
        scratch.add_(1)
        probe.capture_end()
    probe.reset()
    try:
        torch.rand(1, device="cuda")
    except RuntimeError as e:
        raise RuntimeError(f"after a failed CUDA graph capture the CUDA generator cannot draw: {e}") from e


@functools.cache
def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one stream of this process where warm-ups and captures run (captures need a stream other
    than the default one). One for every capture, not one per ``CapturedSteps``: cuBLAS keeps a
    workspace for each stream it has run on, which PyTorch never frees (reserved memory would grow
    with every job; ``docs/benchmarks.md``), and its stream pool hands out up to 32 different streams."""
    return torch.cuda.Stream(device)
