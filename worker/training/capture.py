"""The training step captured as CUDA graphs (``CapturedSteps``), and the capture itself.

``CapturedSteps`` captures the two bodies of ``worker.training.steps.Steps`` with ``torch.cuda.graph``
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

Both sides of a check run the same attention kernel on the same mask: the graph bodies pass a
prepared 4D boolean mask, which transformers uses as given (``masking_utils``: "If the mask is
already 4D, simply return as-is"), instead of a 2D one that transformers drops when it is all ones
in eager mode but keeps while capturing (``_ignore_bidirectional_mask_sdpa`` asks ``is_tracing()``,
which covers CUDA stream capture), and both run under ``CAPTURE_ATTENTION`` (``sdpa_kernel``).
Otherwise a batch without padding would run flash attention eagerly and the memory-efficient kernel
in the graph, which draw dropout numbers differently, and the check would fail good graphs.

A capture that fails restores the current stream, releases its hold on the pool and ends the
default CUDA generator's capture (``worker.training.cuda_graph``: torch's ``capture_end`` raises
before doing either, and ``torch.cuda.graph.__exit__`` before it restores the stream). All graphs share one memory pool and replay in any order (widths follow the data),
which PyTorch's notes call safe only when no tensor allocated during one capture is used after it:
``shared_tensors`` are every tensor the graphs share with each other or the host, and a capture
whose warm-ups or body rebinds or creates one of them is refused (``SharedPoolError``).

On devices other than CUDA (the tests), "capturing" runs the warm-ups and keeps the body, and
"replaying" calls it: everything but the capture and replay calls themselves runs there.
"""

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from worker.training.cuda_graph import capture_graph, side_stream
from worker.training.packing import pack_fixed, packed_of, token_bucket
from worker.training.steps import Steps

WARMUP_RUNS = 2  # eager runs of a body before its capture (the PyTorch docs' side-stream warm-up)
# SDPA backends for capture and its eager reference: the memory-efficient kernel takes a mask and
# dropout and plans nothing per shape (cuDNN plans each new shape); math where it cannot run
# (and on the CPU). Flash attention takes no mask, so it never runs here.
CAPTURE_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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


class SharedPoolError(RuntimeError):
    """A capture rebound or created a tensor the graphs share: it would live in the shared pool,
    where a graph replayed out of capture order may overwrite it."""


class CapturedSteps(Steps):
    """``Steps`` replayed from CUDA graphs: micro-batches of at most ``rows`` rows, one graph per
    shape captured by ``capture(widths)``; shapes not captured run eagerly (same model, same
    gradients). The parts are ``Steps``'s (with an optimizer made ``capturable``);
    ``input_names``: the model inputs of a micro-batch (``labels`` aside); ``pad_id``: the
    tokenizer's pad token, for filler rows.

    A shape (``key_of``) is a padded micro-batch's bucket width, or with ``packing`` its token
    bucket (``packing.token_bucket``): the micro-batch is laid out by ``packing.pack_fixed`` into
    that many tokens, ``rows`` classifier rows and filler sequences of at most ``max_length``."""

    copy_first_grads = False  # one captured body serves every micro-batch of a step: it adds

    def __init__(
        self,
        model: torch.nn.Module,
        forward_model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        *,
        dtype: torch.dtype | None,
        device: torch.device,
        task: str,
        rows: int,
        input_names: list[str],
        pad_id: int,
        packing: bool = False,
        max_length: int = 0,
        pos_weight: float | None = None,
    ):
        super().__init__(
            model,
            forward_model,
            optimizer,
            scaler,
            dtype=dtype,
            device=device,
            task=task,
            static_grads=True,
            packing=packing,
            pos_weight=pos_weight,
        )
        self.rows, self.input_names, self.pad_id, self.max_length = rows, input_names, pad_id, max_length
        self.label_dtype = torch.float32 if task in ("regression", "multi_label", "reranking") else torch.long
        self.label_shape = (model.config.num_labels,) if task == "multi_label" else ()
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}  # width -> static input buffers
        self.replays: dict[int, Callable[[], None]] = {}  # width -> replays its forward+backward graph
        self.replay_update: Callable[[], None] | None = None
        self.graphs: list = []  # the CUDAGraph objects (their memory lives as long as they do)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.mask_4d = getattr(model.config, "_attn_implementation", None) == "sdpa"

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

    def key_of(self, batch: dict[str, torch.Tensor]) -> int:
        """The captured shape a padded micro-batch (on the host) replays: its width, or with
        ``packing`` its token bucket."""
        if self.packing:
            return token_bucket(int(batch["attention_mask"].sum()), len(batch["input_ids"]), self.rows, self.max_length)
        return batch["input_ids"].shape[1]

    def micro_step(self, batch: dict[str, torch.Tensor]) -> int:
        key = self.key_of(batch)
        replay = self.replays.get(key)
        if replay is None or len(batch["input_ids"]) > self.rows:
            return super().micro_step(batch)
        buffers, cuda = self.inputs[key], self.device.type == "cuda"
        for name, tensor in self._fill(batch, key).items():
            if cuda and not tensor.is_pinned():
                tensor = tensor.pin_memory()  # a copy from pageable memory would wait for the GPU
            buffers[name].copy_(tensor, non_blocking=True)
        replay()
        return (key if self.packing else self.rows * key) - batch["input_ids"].numel()

    def _fill(self, batch: dict[str, torch.Tensor], key: int) -> dict[str, torch.Tensor]:
        """``batch`` laid out as the graph of shape ``key`` reads it (static input buffers' names and shapes)."""
        if self.packing:
            token_labels = self.task == "token_classification"
            filled = pack_fixed(
                packed_of(batch, self.position_offset, token_labels),
                self.rows,
                key,
                self.max_length,
                self.position_offset,
                self.pad_id,
                token_labels,
            )
            filled.pop("max_length_q")
            return filled
        return with_filler_rows(batch, self.rows, self.pad_id)

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
        named = {
            "n_examples": self.n_examples,
            "step_loss": self.step_loss,
            "found_inf": self.found_inf,
            "clip": self.clip,
            "values": self.values,
        }
        for i, p in enumerate({id(p): p for p in [*self.master, *self.compute]}.values()):
            named[f"param.{i}"], named[f"grad.{i}"] = p, p.grad
        for i, p in enumerate(self.master):
            named.update({f"adamw.{i}.{k}": v for k, v in self.optimizer.state.get(p, {}).items()})
        named.update({f"lr.{i}": g["lr"] for i, g in enumerate(self.optimizer.param_groups)})
        named.update({f"input.{w}.{k}": v for w, buffers in self.inputs.items() for k, v in buffers.items()})
        return {name: t.data_ptr() if torch.is_tensor(t) else -1 for name, t in named.items()}

    def _buffers(self, key: int) -> dict[str, torch.Tensor]:
        """Static inputs for one shape, holding filler rows only (what the warm-ups train on)."""
        width = 1 if self.packing else key
        filler = {name: torch.zeros(0, width, dtype=torch.long) for name in self.input_names}
        filler["labels"] = torch.zeros(0, *self.label_shape, dtype=self.label_dtype)
        return {name: t.to(self.device) for name, t in self._fill(filler, key).items()}

    def _micro_body(self, key: int) -> Callable[[], None]:
        """Forward and backward of the static inputs of shape ``key``: padded, with the attention
        mask in 4D (``attention_4d``) where the model uses SDPA; or packed, with ``max_length_q``
        fixed at ``max_length`` (the kernel sizes its grid by it)."""
        buffers = self.inputs[key]

        def body() -> None:
            if self.packing:
                inputs = {name: t for name, t in buffers.items() if name not in ("labels", "weights")}
                inputs["max_length_q"] = self.max_length
            else:
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
            raise SharedPoolError(
                f"capture rebound or created shared tensors {moved[:5]}: they would live in the graphs' shared pool"
            )
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
