"""Captured steps checked against the same steps run eagerly, before a job uses them.

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
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.training.capture import CapturedSteps
from worker.training.steps import StepInputs

CHECK_STEPS = 3  # consecutive optimizer steps a new capture is checked over


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
TOLERANCES = {
    torch.float32: Tolerance(loss=1e-4, grad_norm=1e-3, update=1e-2),
    torch.bfloat16: Tolerance(loss=2e-2, grad_norm=5e-2, update=0.1),
}


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
                    out.append(
                        f"step {step}: {name} {graph:.6g} replayed vs {eager:.6g} eager "
                        f"(relative difference {diff:.2g} > {limit:g})"
                    )
        return out

    def describe(self) -> str:
        pairs = ", ".join(f"{g:.6g} vs {e:.6g}" for g, e in self.loss)
        norms = ", ".join(f"{g:.6g} vs {e:.6g}" for g, e in self.grad_norm)
        dropout = {None: "", True: "; replays draw new dropout masks", False: "; replays repeat dropout masks"}
        return (
            f"{len(self.loss)} step(s): loss {pairs}, gradient norm {norms}, updated weights differ by "
            f"{self.update:.2g} of the update{dropout[self.fresh_dropout]}"
        )


class CaptureMismatch(RuntimeError):
    """The replayed steps do not match the eager steps (``Parity.failures``)."""


def check_against_eager(
    steps: CapturedSteps, step_inputs: list[StepInputs], learning_rates: list[float], dropout_probe: bool = False
) -> Parity:
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
    return Parity(
        [(g[0], e[0]) for g, e in zip(graph_rows, eager_rows)],
        [(g[1], e[1]) for g, e in zip(graph_rows, eager_rows)],
        relative,
        TOLERANCES.get(steps.compute[0].dtype, TOLERANCES[torch.float32]),
        graph_fresh,
    )


def _run_steps(
    steps: CapturedSteps, step_inputs: list[StepInputs], learning_rates: list[float], saved: dict
) -> torch.Tensor:
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


def check_new_capture(
    steps: CapturedSteps,
    new_widths: list[int],
    new_update: bool,
    first_steps: Callable[[], list[StepInputs]],
    width_sample: Callable[[int], StepInputs],
    learning_rate: float,
) -> list[str]:
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
        if steps.key_of(pieces[0]) != width or width not in steps.replays:
            raise ValueError(f"no captured micro-batch of shape {width} to check")
        parity = check_against_eager(steps, [(pieces, n_examples)], [learning_rate])
        _raise_on_failures(parity, f"width {width}")
        out.append(f"width {width}: {parity.describe()}")
    return out


def _raise_on_failures(parity: Parity, what: str) -> None:
    if parity.failures():
        raise CaptureMismatch(
            f"the replayed step does not match the eager step ({what}): " + "; ".join(parity.failures())
        )
