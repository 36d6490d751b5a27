"""The training step as CUDA graphs, captured once per worker process and reused by later jobs.

``CapturedSteps`` captures the two bodies of ``worker.steps.Steps`` with ``torch.cuda.graph``
(PyTorch docs, "CUDA Graphs": whole-network capture, ``graph_pool_handle``): one forward+backward
graph per bucket width for micro-batches of a fixed number of rows, reading static input buffers,
and one graph for the update (clip, fused capturable AdamW, zeroing the gradients), all sharing one
memory pool (they never run concurrently). A short micro-batch is topped up with filler rows (one
visible pad token, loss weight 0), so it contributes exactly what it would have on its own. The
learning rate is a device tensor that the scheduler fills in place, so warm-up and decay apply
under replay. Every captured tensor keeps its address for the life of the graphs: weights, moments
and gradients are only ever changed in place.

Before each capture the body runs ``WARMUP_RUNS`` times eagerly on a side stream (as the PyTorch
docs require); the micro-batch warm-ups see only filler rows (loss weight 0) and the update
warm-ups run with a non-finite loss, so the fused AdamW skips them: weights, AdamW moments and step
count do not move, gradients and sums are zeroed afterwards, and the RNG states are restored, so
a job trains the same whether its graphs were captured now or by an earlier job.

The graphs outlive the job: they are kept in a per-process cache (``TUNEJOB_CUDA_GRAPH_CACHE``
entries, least recently used evicted) keyed by what they bake in (model configuration, number of labels, trainable
parameters, task, micro-batch rows, precision, weight decay, input names). A later job with the
same key copies its initial weights into the captured parameters and its optimizer state into the
captured AdamW, in place, and captures only widths not captured before. Where a job cannot be
captured (fp16 GradScaler, gradient checkpointing, ``torch_compile``, ``token_budget`` batching,
or an error or out-of-memory during capture) it trains eagerly with the same bodies and says so in
an event.

Captured graphs are not trusted blindly: ``check_against_eager`` runs optimizer steps twice from
the same state, once replaying the graphs and once running the very same bodies eagerly on the
same static inputs and RNG state, and compares each step's loss and gradient norm and the updated
weights (``TOLERANCES``, looser for bf16). A new capture is checked over the job's first
``CHECK_STEPS`` steps under a warm-up learning-rate schedule with dropout on (what a one-step check
cannot see: a learning rate, AdamW step count or dropout RNG offset frozen into the graph), with
"two replays of the same micro-batch draw different dropout masks" on top, and every newly captured
width, including one a later job adds to cached graphs, by one optimizer step over one micro-batch
of that width before it is used. On a mismatch the capture is dropped and, like a capture that
raised, never tried again for that key in this process; the job trains eagerly and an event says why.

Both sides of a check run the same attention kernel on the same mask: the graph bodies pass a
prepared 4D boolean mask, which transformers uses as given (``masking_utils``: "If the mask is
already 4D, simply return as-is"), instead of a 2D one that transformers drops when it is all ones
in eager mode but keeps while capturing (``_ignore_bidirectional_mask_sdpa`` asks ``is_tracing()``,
which covers CUDA stream capture), and both run under ``CAPTURE_ATTENTION`` (``sdpa_kernel``).
Otherwise a batch without padding would run flash attention eagerly and the memory-efficient kernel
in the graph, which draw dropout numbers differently, and the check would fail good graphs.

A capture that fails restores the current stream, releases its hold on the pool and ends the
default CUDA generator's capture (``capture_graph``, ``settle_failed_capture``: torch's
``capture_end`` raises before doing either, and ``torch.cuda.graph.__exit__`` before it restores
the stream). All graphs share one memory pool and replay in any order (widths follow the data),
which PyTorch's notes call safe only when no tensor allocated during one capture is used after it:
``shared_tensors`` are every tensor the graphs share with each other or the host, and a capture
whose warm-ups or body rebinds or creates one of them is refused (``SharedPoolError``).

On devices other than CUDA (the tests), "capturing" runs the warm-ups and keeps the body, and
"replaying" calls it: everything but the capture and replay calls themselves runs there.
"""

import contextlib
import functools
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared.settings import get_settings
from worker.steps import (
    Steps,
    bf16_copy,
    make_optimizer,
    make_scheduler,
    uses_bf16_copy,
)

WARMUP_RUNS = 2  # eager runs of a body before its capture (the PyTorch docs' side-stream warm-up)
CHECK_STEPS = 3  # consecutive optimizer steps a new capture is checked over
# SDPA backends for capture and its eager reference: the memory-efficient kernel takes a mask and
# dropout and plans nothing per shape (cuDNN does: ../shared/gpu/README.md); math where it cannot run
# (and on the CPU). Flash attention takes no mask, so it never runs here.
CAPTURE_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

_cache: "OrderedDict[tuple, CapturedSteps]" = OrderedDict()
_failed: dict[tuple, str] = {}  # keys whose capture failed in this process: not tried again


def with_filler_rows(batch: dict[str, torch.Tensor], rows: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``batch`` (``[n, width]`` inputs, ``labels [n]`` or ``[n, labels]``) topped up to ``rows`` rows, plus
    ``weights [rows]``: 1.0 for its rows, 0.0 for the filler rows, which hold one visible
    ``pad_id`` token (an all-masked row could make attention produce NaN, and NaN * 0 is NaN).

    Raises:
        ValueError: ``batch`` has more than ``rows`` rows.
    """
    n, width = batch["input_ids"].shape
    if n > rows:
        raise ValueError(f"a micro-batch of {n} rows does not fit the {rows} captured rows")
    filler = rows - n
    out = {"weights": torch.cat([torch.ones(n), torch.zeros(filler)])}
    for name, tensor in batch.items():
        if name == "labels":  # [n] or, multi_label, [n, labels]
            extra = torch.zeros(filler, *tensor.shape[1:], dtype=tensor.dtype)
        elif name == "input_ids":
            extra = torch.full((filler, width), pad_id, dtype=tensor.dtype)
        elif name == "attention_mask":
            extra = torch.zeros(filler, width, dtype=tensor.dtype)
            extra[:, 0] = 1
        else:
            extra = torch.zeros(filler, width, dtype=tensor.dtype)
        out[name] = torch.cat([tensor, extra]) if filler else tensor
    return out


def capture_attention() -> contextlib.AbstractContextManager:
    """The SDPA backends (``CAPTURE_ATTENTION``) that captures, their replays on the CPU stand-in and
    the eager side of ``check_against_eager`` all run under (``torch.nn.attention.sdpa_kernel``)."""
    return sdpa_kernel(CAPTURE_ATTENTION)


def attention_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """``attention_mask [rows, width]`` (1 = real token) as the boolean ``[rows, 1, width, width]``
    mask SDPA takes (True = attend; an expanded view, no copy). transformers uses a 4D mask as given,
    so eager and captured forwards see the same mask whether or not a row has padding."""
    rows, width = attention_mask.shape
    return attention_mask.bool()[:, None, None, :].expand(rows, 1, width, width)


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
    marking the capture ended, so ``reset`` keeps its hold on the pool. Seen on an H100 (torch
    2.11, 2026-11-26, ``bench.engine_gpu_check``'s ``failed_capture``): every later random op
    outside capture, the eager fallback's first dropout included, raised "Offset increment outside
    graph capture encountered unexpectedly", which would fail every later job of the worker.

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
    workspace for each stream it has run on (about 66 MiB each on an H100, seen as reserved memory
    growing by that much per job in ``bench.engine_gpu_check``'s ``failed_capture``), which PyTorch
    never frees, and its stream pool hands out up to 32 different streams."""
    return torch.cuda.Stream(device)


class SharedPoolError(RuntimeError):
    """A capture rebound or created a tensor the graphs share: it would live in the shared pool,
    where a graph replayed out of capture order may overwrite it."""


class CapturedSteps(Steps):
    """``Steps`` replayed from CUDA graphs: micro-batches of at most ``rows`` rows, one graph per
    width captured by ``capture(widths)``; widths not captured run eagerly (same model, same
    gradients)."""

    def __init__(self, run, rows: int):
        super().__init__(run, static_grads=True)
        self.rows = rows
        self.input_names = input_names(run)
        self.pad_id = run.tokenizer.pad_token_id or 0
        self.label_dtype = torch.float32 if run.job.task in ("regression", "multi_label") else torch.long
        self.label_shape = (run.model.config.num_labels,) if run.job.task == "multi_label" else ()
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}  # width -> static input buffers
        self.replays: dict[int, Callable[[], None]] = {}  # width -> replays its forward+backward graph
        self.replay_update: Callable[[], None] | None = None
        self.graphs: list = []  # the CUDAGraph objects (their memory lives as long as they do)
        self.pool = torch.cuda.graph_pool_handle() if run.device.type == "cuda" else None
        self.mask_4d = getattr(run.model.config, "_attn_implementation", None) == "sdpa"

    def capture(self, widths: list[int]) -> list[int]:
        """Capture the update and each width not captured yet, in training mode (dropout on);
        returns the widths captured now. Weights, AdamW state and RNG states are as before;
        gradients and sums are zero."""
        new = [w for w in widths if w not in self.replays]
        rng = torch.get_rng_state(), torch.cuda.get_rng_state() if self.device.type == "cuda" else None
        self.model.train()
        self.forward_model.train()
        try:
            for width in new:
                self.inputs[width] = self._buffers(width)
                self.replays[width] = self._capture(self._micro_body(width), self._micro_body(width))
            if self.replay_update is None:
                self.replay_update = self._capture(self.update, self._skipped_update)
        finally:
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1])
            self.discard_step()
        return new

    def micro_step(self, batch: dict[str, torch.Tensor]) -> int:
        rows, width = batch["input_ids"].shape
        replay = self.replays.get(width)
        if replay is None or rows > self.rows:
            return super().micro_step(batch)
        buffers, cuda = self.inputs[width], self.device.type == "cuda"
        for name, tensor in with_filler_rows(batch, self.rows, self.pad_id).items():
            if cuda and not tensor.is_pinned():
                tensor = tensor.pin_memory()  # a copy from pageable memory would wait for the GPU
            buffers[name].copy_(tensor, non_blocking=True)
        replay()
        return (self.rows - rows) * width

    def finish_step(self) -> None:
        self.replay_update()

    @contextlib.contextmanager
    def eagerly(self) -> Iterator[None]:
        """Within: every captured body runs eagerly instead of replayed, on the same static input
        buffers (filler rows included) and under ``capture_attention``: the reference of
        ``check_against_eager``."""
        replays, replay_update = self.replays, self.replay_update
        self.replays = {width: self._micro_body(width) for width in replays}
        self.replay_update = self.update
        try:
            with capture_attention():
                yield
        finally:
            self.replays, self.replay_update = replays, replay_update

    def shared_tensors(self) -> dict[str, int]:
        """Address of every tensor the graphs share with each other or with the host: weights and
        gradients (master and bf16 copy), AdamW state and learning rates, the step's sums and values,
        the static inputs. All must be allocated outside the captures (``SharedPoolError``)."""
        named = {"n_examples": self.n_examples, "step_loss": self.step_loss, "found_inf": self.found_inf,
                 "values": self.values}
        for i, p in enumerate({id(p): p for p in [*self.master, *self.compute]}.values()):
            named[f"param.{i}"], named[f"grad.{i}"] = p, p.grad
        for i, p in enumerate(self.master):
            named.update({f"adamw.{i}.{k}": v for k, v in self.optimizer.state.get(p, {}).items()})
        named.update({f"lr.{i}": g["lr"] for i, g in enumerate(self.optimizer.param_groups)})
        named.update({f"input.{w}.{k}": v for w, buffers in self.inputs.items() for k, v in buffers.items()})
        return {name: t.data_ptr() if torch.is_tensor(t) else -1 for name, t in named.items()}

    def _buffers(self, width: int) -> dict[str, torch.Tensor]:
        """Static inputs for one width, holding filler rows (what the warm-ups train on)."""
        device = self.device
        filler = {name: torch.zeros(0, width, dtype=torch.long) for name in self.input_names}
        filler["labels"] = torch.zeros(0, *self.label_shape, dtype=self.label_dtype)
        return {name: t.to(device) for name, t in with_filler_rows(filler, self.rows, self.pad_id).items()}

    def _micro_body(self, width: int) -> Callable[[], None]:
        """Forward and backward of the static inputs of ``width``, with the attention mask in 4D
        (``attention_4d``) where the model uses SDPA."""
        buffers = self.inputs[width]

        def body() -> None:
            inputs = {name: buffers[name] for name in self.input_names}
            if self.mask_4d and "attention_mask" in inputs:
                inputs["attention_mask"] = attention_4d(inputs["attention_mask"])
            self.forward_backward(inputs, buffers["labels"], buffers["weights"])
        return body

    def _skipped_update(self) -> None:
        self.step_loss.fill_(math.nan)  # non-finite: the fused AdamW leaves weights and moments alone
        self.update()

    def _capture(self, body: Callable[[], None], warm_up: Callable[[], None]) -> Callable[[], None]:
        """Run ``warm_up`` ``WARMUP_RUNS`` times, then capture ``body`` (both under
        ``capture_attention``); returns what replays it.

        Raises:
            SharedPoolError: warm-ups or capture rebound or created a shared tensor.
        """
        before = self.shared_tensors()
        with capture_attention():
            replay = self._warm_up_and_capture(body, warm_up)
        moved = sorted(name for name, address in self.shared_tensors().items() if before.get(name) != address)
        if moved:
            raise SharedPoolError(f"capture rebound or created shared tensors {moved[:5]}: they would live in "
                                  "the graphs' shared pool")
        return replay

    def _warm_up_and_capture(self, body: Callable[[], None], warm_up: Callable[[], None]) -> Callable[[], None]:
        if self.device.type != "cuda":  # the stand-in: replaying calls the body, as captured
            for _ in range(WARMUP_RUNS):
                warm_up()

            def replay() -> None:
                with capture_attention():
                    body()
            return replay
        stream = side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                warm_up()
        torch.cuda.current_stream().wait_stream(stream)
        graph = capture_graph(body, self.pool, stream)
        self.graphs.append(graph)
        return graph.replay

    def release(self) -> None:
        """Drop every graph (their memory returns to the pool, and the pool to the allocator once
        no graph holds it): after a failed capture or check."""
        for graph in self.graphs:
            graph.reset()
        self.graphs.clear()
        self.replays.clear()
        self.replay_update = None


# ----------------------------------------------------------------------------- captured against eager


@dataclass(frozen=True)
class Tolerance:
    """Largest relative differences between a replayed step and the same step run eagerly: the
    step's loss and gradient norm (|graph - eager| / |eager|), and the updated weights
    (||w_graph - w_eager|| / ||w_eager - w_before||, over all trainable fp32 master weights)."""

    loss: float
    grad_norm: float
    update: float


# Same kernels, inputs and RNG state on both sides: what may differ is the order of atomic adds in
# the backward (embedding and attention gradients), expected near 1e-6 relative in fp32 and a few
# bf16 ulps (2**-8) with the bf16 copy; reasoned, not yet measured on a GPU (``tunejob doctor``
# prints the figures). A wrong graph (stale input, a learning rate baked in, a missed update) is
# off by far more: a loss of another batch, a zero or doubled update.
TOLERANCES = {torch.float32: Tolerance(loss=1e-4, grad_norm=1e-3, update=1e-2),
              torch.bfloat16: Tolerance(loss=2e-2, grad_norm=5e-2, update=0.1)}


@dataclass(frozen=True)
class Parity:
    """How optimizer steps replayed from the graphs compared with the same steps run eagerly.

    ``loss`` and ``grad_norm`` hold one ``(graph, eager)`` pair per step; ``update`` is the relative
    difference of the weights after the last step; ``fresh_dropout``: whether two replays of the
    same micro-batch drew different dropout masks (None where two eager runs do not either: no
    dropout)."""

    loss: list[tuple[float, float]]
    grad_norm: list[tuple[float, float]]
    update: float
    tolerance: Tolerance
    fresh_dropout: bool | None = None

    def failures(self) -> list[str]:
        """What is out of tolerance (or not finite), in words; empty when the graphs are trusted."""
        out = []
        if not self.update <= self.tolerance.update:
            out.append(f"updated weights differ by {self.update:.2g} of the update (> {self.tolerance.update:g})")
        if self.fresh_dropout is False:
            out.append("two replays of the same micro-batch drew the same dropout masks (RNG frozen in the graph)")
        for name in ("loss", "grad_norm"):
            limit = getattr(self.tolerance, name)
            for step, (graph, eager) in enumerate(getattr(self, name), start=1):
                diff = abs(graph - eager) / max(abs(eager), 1e-12)
                if not diff <= limit:  # NaN fails too
                    out.append(f"step {step}: {name} {graph:.6g} replayed vs {eager:.6g} eager "
                               f"(relative difference {diff:.2g} > {limit:g})")
        return out

    def describe(self) -> str:
        pairs = ", ".join(f"{g:.6g} vs {e:.6g}" for g, e in self.loss)
        norms = ", ".join(f"{g:.6g} vs {e:.6g}" for g, e in self.grad_norm)
        dropout = {None: "", True: "; replays draw new dropout masks", False: "; replays repeat dropout masks"}
        return (f"{len(self.loss)} step(s): loss {pairs}, gradient norm {norms}, updated weights differ by "
                f"{self.update:.2g} of the update{dropout[self.fresh_dropout]}")


class CaptureMismatch(RuntimeError):
    """The replayed steps do not match the eager steps (``Parity.failures``)."""


StepInputs = tuple[list[dict[str, torch.Tensor]], int]  # a step's padded micro-batches and its loss terms


def check_against_eager(steps: CapturedSteps, step_inputs: list[StepInputs], learning_rates: list[float],
                        dropout_probe: bool = False) -> Parity:
    """Consecutive optimizer steps over ``step_inputs`` (micro-batches padded as training pads them)
    run eagerly (``CapturedSteps.eagerly``) and replayed, each side from the same weights, AdamW state
    and RNG state, step ``i`` at ``learning_rates[i]`` (filled into the learning-rate tensor in place,
    as the scheduler does; a rising schedule shows a rate frozen into the graph, and a schedule's
    first rate may be 0, which would hide the update). ``dropout_probe``: also replay the first
    micro-batch twice and see that the dropout masks differ (``Parity.fresh_dropout``). Everything
    is restored afterwards: the job then trains as if no check had run.

    Memory: a copy of the trainable weights, their AdamW moments and the bf16 copy, on the device.

    Raises:
        torch.OutOfMemoryError: the copies do not fit (the caller trains eagerly).
    """
    saved = _saved_state(steps)
    try:
        with steps.eagerly():
            eager_values = _run_steps(steps, step_inputs, learning_rates, saved)
            eager_fresh = _draws_differ(steps, step_inputs[0][0][0], saved) if dropout_probe else None
        eager_weights = [p.detach().clone() for p in steps.master]
        _restore(steps, saved)
        graph_values = _run_steps(steps, step_inputs, learning_rates, saved)
        graph_fresh = _draws_differ(steps, step_inputs[0][0][0], saved) if eager_fresh else None
        update = torch.stack([torch.linalg.vector_norm(e - p0) for e, p0 in zip(eager_weights, saved["master"])])
        diff = torch.stack([torch.linalg.vector_norm(p.detach() - e) for p, e in zip(steps.master, eager_weights)])
        update_norm, diff_norm = torch.linalg.vector_norm(update).item(), torch.linalg.vector_norm(diff).item()
        graph_rows, eager_rows = graph_values.tolist(), eager_values.tolist()
    finally:
        _restore(steps, saved)
    relative = diff_norm / update_norm if update_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    return Parity([(g[0], e[0]) for g, e in zip(graph_rows, eager_rows)],
                  [(g[1], e[1]) for g, e in zip(graph_rows, eager_rows)], relative,
                  TOLERANCES.get(steps.compute[0].dtype, TOLERANCES[torch.float32]), graph_fresh)


def _run_steps(steps: CapturedSteps, step_inputs: list[StepInputs], learning_rates: list[float],
               saved: dict) -> torch.Tensor:
    """The steps from the saved RNG state; ``[steps, 3]`` values (loss, gradient norm, skipped)."""
    _restore_rng(saved)
    values = []
    for (pieces, n_examples), lr in zip(step_inputs, learning_rates, strict=True):
        for group in steps.optimizer.param_groups:
            group["lr"].fill_(lr)
        values.append(steps.step(pieces, n_examples)[0])
    return torch.stack(values)


def _draws_differ(steps: CapturedSteps, piece: dict[str, torch.Tensor], saved: dict) -> bool:
    """Whether two forward+backward passes of ``piece`` in a row, from the same weights, give
    different losses: they do when dropout draws new masks each time. Gradients and sums are
    zeroed afterwards; the RNG continues from where it was."""
    losses = []
    for _ in range(2):
        steps.discard_step()
        steps.n_examples.fill_(1)
        steps.micro_step(piece)
        losses.append(steps.step_loss.clone())
    steps.discard_step()
    return not torch.equal(*losses)


def _saved_state(steps: CapturedSteps) -> dict:
    """Copies of what a step changes: weights (master and bf16 copy), AdamW state, learning rates, RNG."""
    with torch.no_grad():
        return {
            "master": [p.detach().clone() for p in steps.master],
            "compute": [p.detach().clone() for p in steps.compute] if steps.compute is not steps.master else None,
            "optimizer": [{k: v.clone() for k, v in steps.optimizer.state[p].items()} for p in steps.master],
            "lr": [g["lr"].clone() for g in steps.optimizer.param_groups],
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(steps.device) if steps.device.type == "cuda" else None,
            "device": steps.device,
        }


def _restore_rng(saved: dict) -> None:
    torch.set_rng_state(saved["rng"])
    if saved["cuda_rng"] is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"], saved["device"])


def _restore(steps: CapturedSteps, saved: dict) -> None:
    """Copy ``saved`` back in place (captured graphs hold these tensors' addresses); gradients and
    sums to zero."""
    with torch.no_grad():
        torch._foreach_copy_(steps.master, saved["master"])
        if saved["compute"] is not None:
            torch._foreach_copy_(steps.compute, saved["compute"])
        for p, state in zip(steps.master, saved["optimizer"]):
            for name, tensor in state.items():
                steps.optimizer.state[p][name].copy_(tensor)
        for group, lr in zip(steps.optimizer.param_groups, saved["lr"]):
            group["lr"].copy_(lr)
    _restore_rng(saved)
    steps.discard_step()


# ----------------------------------------------------------------------------- which jobs, which graphs


def eager_reason(run) -> str | None:
    """Why this job trains eagerly, or None when its steps can be captured as CUDA graphs."""
    if run.device.type != "cuda":
        return f"{run.device.type} trains eagerly"
    hp = run.hp
    if not get_settings().cuda_graphs:
        return "TUNEJOB_CUDA_GRAPHS is off"
    if run.scaler.is_enabled():
        return "fp16 with a GradScaler (its scale and skip decisions are host-side)"
    if hp.gradient_checkpointing:
        return "gradient_checkpointing (recomputation inside a captured backward is untested)"
    if hp.torch_compile:
        return "torch_compile (it makes its own graphs)"
    if hp.batching == "token_budget":
        return "token_budget batching (micro-batches vary in rows)"
    if run.job.task == "token_classification":
        return "token_classification (the captured step takes one label per row)"
    if run.job.task == "embedding":
        return "embedding (its loss compares the rows of a micro-batch: filler rows would be negatives)"
    tokens, most = mean_padded_tokens(run), get_settings().cuda_graphs_max_tokens
    if tokens >= most:
        return (f"micro-batches of {tokens:,.0f} padded tokens on average keep the GPU busy, where eager steps "
                f"are as fast and need no capture (TUNEJOB_CUDA_GRAPHS_MAX_TOKENS={most})")
    return None


def mean_padded_tokens(run) -> float:
    """Padded tokens (rows x bucket width) of the job's average micro-batch over its first
    ``ceil(epochs)`` epochs, the quantity that decides whether graphs pay (``eager_reason``).

    Measured on an H100 (bert-base, bf16, batch 32, one cold epoch, ``docs/benchmarks.md``): on
    Rotten Tomatoes @128 (about 1,100 padded tokens a micro-batch) graphs train 2.7x the eager
    steady tokens/s and the epoch takes 2.4 s against 3.3 s; on BBC News @512 (about 13,800) the
    eager epoch takes 2.8 s against 4.6 s (2.4 s of them capturing), and eager steady state is no
    slower. The default threshold, 8,192, lies between those and above 32 x 128 = 4,096, where the
    floor (``../shared/gpu/README.md``) shows graphs at 13 ms a step against 36 ms eagerly."""
    counts = run.plan.width_counts(run.collator.ladder, run.hp.epochs)
    batches = sum(counts.values())
    return run.hp.batch_size * sum(width * n for width, n in counts.items()) / max(1, batches)


def input_names(run) -> list[str]:
    """The model inputs of the job's micro-batches (``input_ids``, ``attention_mask``, and
    ``token_type_ids`` when the tokenizer makes them), as its collator makes them."""
    return [name for name in run.collator([run.train_set[0]]) if name != "labels"]


def graph_key(run, rows: int) -> tuple:
    """What captured graphs bake in: a later job with an equal key can replay them."""
    config = run.model.config.to_dict()
    for name in ("id2label", "label2id", "_name_or_path", "transformers_version"):
        config.pop(name, None)
    trainable = tuple(p.requires_grad for p in run.model.parameters())
    decay = tuple(g["weight_decay"] for g in run.optimizer.param_groups)
    return (type(run.model).__name__, json.dumps(config, sort_keys=True, default=str), run.model.config.num_labels,
            trainable, run.job.task, rows, str(run.dtype), decay, tuple(input_names(run)), str(run.device))


def capture_steps(run, rows: int, widths: list[int], first_steps: Callable[[], list[StepInputs]],
                  width_sample: Callable[[int], StepInputs]) -> tuple[CapturedSteps, str]:
    """The job's steps as CUDA graphs for micro-batches of ``rows`` rows and these ``widths``:
    from the cache when an earlier job captured them (its weights and optimizer state copied in),
    else captured now. ``run``'s model, optimizer, scheduler and forward model become the captured
    ones. Before the graphs are used they are checked against eager steps (``check_against_eager``):
    a new capture over ``first_steps()`` (the job's first ``CHECK_STEPS`` steps, padded as training
    pads them) under a warm-up schedule, with the dropout probe; and every width captured now, this
    job's or added to cached graphs, over ``width_sample(width)`` (one micro-batch of that width).
    Returns the steps and a sentence for the job's events.

    Raises:
        CaptureMismatch: a replayed step does not match the eager one.
        Exception: whatever capture or the checks raised (including ``torch.OutOfMemoryError`` and
            ``SharedPoolError``). In every case the graphs are released, the key is not tried again
            in this process, and ``run`` is left ready to train eagerly (its initial weights and
            optimizer state in place).
    """
    key = graph_key(run, rows)
    if key in _failed:
        raise RuntimeError(f"capture failed earlier in this worker: {_failed[key]}")
    steps = _cache.pop(key, None)
    if steps is not None:
        adopt(steps, run)
    else:
        while len(_cache) >= max(1, get_settings().cuda_graph_cache):
            _cache.popitem(last=False)  # least recently used: frees its graphs, model and optimizer
        use_capturable_optimizer(run)
        if uses_bf16_copy(run):
            run.forward_model = bf16_copy(run.model)
        steps = CapturedSteps(run, rows)
    try:
        new_update = steps.replay_update is None
        new = steps.capture(widths)
        checks = check_new_capture(steps, new, new_update, first_steps, width_sample, run.hp.learning_rate)
    except Exception as e:
        _failed[key] = f"{type(e).__name__}: {e}"
        steps.release()
        raise
    _cache[key] = steps
    old = sorted(set(widths) - set(new))
    return steps, (f"CUDA graphs for micro-batches of {rows} rows: captured widths {new or 'none'}"
                   + (f", reused {old} from an earlier job" if old else "") + f" (cache of {len(_cache)})"
                   + (f"; checked against eager steps: {'; '.join(checks)}" if checks else ""))


def check_new_capture(steps: CapturedSteps, new_widths: list[int], new_update: bool,
                      first_steps: Callable[[], list[StepInputs]], width_sample: Callable[[int], StepInputs],
                      learning_rate: float) -> list[str]:
    """The checks ``capture_steps`` makes before graphs are used: with a new update graph, the first
    ``CHECK_STEPS`` steps at rates rising to ``learning_rate`` (a warm-up) with the dropout probe;
    each of ``new_widths`` over one micro-batch of that width. Returns what each check saw.

    Raises:
        CaptureMismatch: a check failed (its width or steps named).
        ValueError: a width's sample is not of that width, or the width was not captured.
    """
    out = []
    if new_update:
        step_inputs = first_steps()[:CHECK_STEPS]
        rates = [learning_rate * (i + 1) / len(step_inputs) for i in range(len(step_inputs))]
        parity = check_against_eager(steps, step_inputs, rates, dropout_probe=True)
        _raise_on_failures(parity, f"the first {len(step_inputs)} steps")
        out.append(f"first steps: {parity.describe()}")
    for width in new_widths:
        pieces, n_examples = width_sample(width)
        if pieces[0]["input_ids"].shape[1] != width or width not in steps.replays:
            raise ValueError(f"no captured micro-batch of width {width} to check")
        parity = check_against_eager(steps, [(pieces, n_examples)], [learning_rate])
        _raise_on_failures(parity, f"width {width}")
        out.append(f"width {width}: {parity.describe()}")
    return out


def _raise_on_failures(parity: Parity, what: str) -> None:
    if parity.failures():
        raise CaptureMismatch(f"the replayed step does not match the eager step ({what}): "
                              + "; ".join(parity.failures()))


def adopt(steps: CapturedSteps, run) -> None:
    """Point ``steps`` (captured by an earlier job) at ``run``: copy the job's initial weights and
    optimizer state into the captured model and AdamW, in place, and make them, with the job's
    model configuration (its label names), the job's."""
    with torch.no_grad():
        steps.model.load_state_dict(run.model.state_dict())  # copy_ into the captured parameters
        if steps.compute_model is not None:
            steps.compute_model.load_state_dict(steps.model.state_dict())
    steps.model.config = run.model.config  # equal but for label names and paths (``graph_key``)
    run.optimizer = move_optimizer_state(run, steps.optimizer)
    run.model, run.forward_model = steps.model, steps.forward_model
    steps.scaler, steps.pad_id = run.scaler, run.tokenizer.pad_token_id or 0
    steps.discard_step()


def use_capturable_optimizer(run) -> None:
    """Replace the job's AdamW with a capturable one whose learning rate is a device tensor (a
    Python float would be baked into the graph), carrying over its state and schedule."""
    run.optimizer = move_optimizer_state(run, make_optimizer(run.model, run.hp, run.device, capturable=True))


def move_optimizer_state(run, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Copy ``run.optimizer``'s moments, step counts and learning rate into ``optimizer`` (same
    parameter order) in place, and give ``run`` a scheduler over it at the same point of the
    schedule. Returns ``optimizer``."""
    source, source_schedule = run.optimizer, run.scheduler.state_dict()
    for group in optimizer.param_groups:
        group["initial_lr"] = run.hp.learning_rate  # the scheduler's base; another job's may be there
    run.scheduler = make_scheduler(optimizer, run.hp, run.total_steps)  # sets the lr to step 0's
    run.scheduler.load_state_dict(source_schedule)
    with torch.no_grad():
        for src_group, dst_group in zip(source.param_groups, optimizer.param_groups, strict=True):
            dst_group["lr"].fill_(src_group["lr"])
            for src, dst in zip(src_group["params"], dst_group["params"], strict=True):
                state, dst_state = source.state.get(src, {}), optimizer.state[dst]
                if not dst_state:
                    dst_state.update(step=torch.zeros((), dtype=torch.float32, device=dst.device),
                                     exp_avg=torch.zeros_like(dst), exp_avg_sq=torch.zeros_like(dst))
                for name, tensor in dst_state.items():
                    if name in state:
                        tensor.copy_(state[name])
                    else:
                        tensor.zero_()
    return optimizer


def clear_cache() -> None:
    """Drop every cached graph (and the models and optimizers they hold); e.g. after an
    out-of-memory error."""
    _cache.clear()
