"""The checks that guard the CUDA-graph path (issue 29), on the CPU stand-in of capture (``worker.training.graphs``:
"capture" runs the warm-ups and keeps the body, "replay" calls it). Where the real fault needs CUDA it
is injected: a replay that behaves as a CUDA graph would if something were frozen into it, a mask that
transformers keeps only while capturing, a ``capture_end`` that raises.

1. the eager reference runs the captured attention kernel on the same mask;
2. every newly captured width is checked, also one a later job adds to cached graphs;
3. several steps under a warm-up schedule, and fresh dropout masks per replay;
4. a failed capture restores the stream and releases its graph;
5. the transformers floor; 6. shared-pool safety; 7. fp32 accumulation of bf16 micro-batch gradients.
"""

import contextlib
import tomllib
from pathlib import Path

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.conftest import RecordingReporter, no_dropout
from tests.test_engine import make_job
from tests.test_steps import LADDER, empty_graph_cache  # noqa: F401  (autouse fixture)
from worker.training import batches, cuda_graph, graphs, recipe
from worker.training import capture as capturing
from worker.training.parity import CaptureMismatch, check_against_eager
from worker.training.recipe import Recipe
from worker.training.steps import Steps

CPU = torch.device("cpu")


def make_run(name: str, dropout: bool = False, reporter=None, **hyperparameters):
    torch.manual_seed(0)
    job, data = make_job(name, **hyperparameters)
    run = Recipe(job, CPU).setup(data, reporter or RecordingReporter())
    if not dropout:
        no_dropout(run.model)
    run.job_setup.collator.ladder = LADDER  # the bucket ladder a CUDA worker would use
    return run


def capture(run, widths=None):
    widths = widths or list(run.job_setup.plan.width_counts(LADDER, run.job_setup.hp.epochs))
    return run.capture(run.job_setup.hp.batch_size, widths)


def faulty_replays(monkeypatch, micro=None, update=None):
    """Make the stand-in's replays faulty: ``micro(self, width, replay)`` and ``update(self, replay)``
    return what replays instead. Eager bodies (the checks' reference) stay correct."""
    original = capturing.CapturedSteps._warm_up_and_capture

    def capture_with_fault(self, body, warm_up):
        replay = original(self, body, warm_up)
        pending = [w for w in self.inputs if w not in self.replays]  # the width being captured, if any
        if pending and micro:
            return micro(self, pending[0], replay)
        if not pending and update:
            return update(self, replay)
        return replay

    monkeypatch.setattr(capturing.CapturedSteps, "_warm_up_and_capture", capture_with_fault)


# ----------------------------------------------------------------------------- 1. same kernel, same mask


def test_eager_reference_runs_the_captured_attention_kernel_on_the_same_mask(engine_env, monkeypatch):
    """A micro-batch without padding: transformers drops an all-ones 2D mask in eager mode but keeps
    it while capturing (``is_tracing`` covers CUDA capture), so the graph and its eager reference
    would run different SDPA kernels. Injected: replays run as if capturing."""
    from transformers import masking_utils

    def as_if_capturing(self, width, replay):
        def run():
            with monkeypatch.context() as m:
                m.setattr(masking_utils, "is_tracing", lambda *args: True)
                replay()

        return run

    faulty_replays(monkeypatch, micro=as_if_capturing)
    run = make_run("mask", epochs=1, batch_size=8)
    capture(run)
    steps = run.steps
    batch = run.job_setup.collator([run.job_setup.train_set[i] for i in range(8)])  # 8 rows: no filler rows
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])  # no padding at all
    assert batch["input_ids"].shape[1] in steps.replays

    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        backends = (
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(),
            torch.backends.cuda.cudnn_sdp_enabled(),
        )
        side = "eager" if steps.replay_update == steps.update else "graph"
        calls.append((side, kwargs.get("attn_mask") is None, backends))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    parity = check_against_eager(steps, [([batch], 8)], [1e-3])
    assert parity.failures() == []
    eager = {(none, backends) for side, none, backends in calls if side == "eager"}
    graph = {(none, backends) for side, none, backends in calls if side == "graph"}
    assert eager and eager == graph  # the same mask handling and the same kernels on both sides
    assert eager == {(False, (False, True, True, False))}  # a mask; memory-efficient or math, never flash


def test_transformers_uses_a_4d_mask_as_given():
    """What the graph bodies rely on (``capturing.attention_4d``): no look at the mask's values, in
    eager mode or while capturing."""
    from transformers import BertConfig
    from transformers.masking_utils import create_bidirectional_mask

    config = BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    config._attn_implementation = "sdpa"
    mask = capturing.attention_4d(torch.tensor([[1, 1, 1], [1, 1, 0]]))
    assert mask.shape == (2, 1, 3, 3) and mask.dtype == torch.bool and not mask[1, 0, :, 2].any()
    assert create_bidirectional_mask(config=config, inputs_embeds=torch.zeros(2, 3, 8), attention_mask=mask) is mask


# ----------------------------------------------------------------------------- 2. every width


def test_every_new_width_is_checked_also_one_a_later_job_adds(engine_env, monkeypatch):
    """Injected: the graph of one width (not among the first steps' widths) computes another loss.
    The first job captures only the first steps' widths; a later job of the same shape adds the
    faulty width: its check fails before the width is used, and that job trains eagerly."""
    first = make_run("first", epochs=1, batch_size=8)
    first_widths = sorted(
        {p["input_ids"].shape[1] for pieces, _ in batches.first_steps(first.job_setup, first.state, 3) for p in pieces}
    )
    faulty = max(set(first.job_setup.plan.width_counts(LADDER, 1)) - set(first_widths))
    faulty_replays(
        monkeypatch,
        micro=lambda self, width, replay: (lambda: (replay(), self.step_loss.add_(0.5))) if width == faulty else replay,
    )
    message = capture(first, first_widths)
    assert faulty not in first.steps.replays and all(f"width {w}:" in message for w in first_widths)

    monkeypatch.setattr(recipe, "eager_reason", lambda *args: None)
    reporter = RecordingReporter()
    later = make_run("later", epochs=1, batch_size=8, reporter=reporter)
    later.warm_up(reporter)
    assert type(later.steps) is Steps and reporter.events[-1] == "cuda_graphs_off"
    assert f"(width {faulty})" in reporter.messages[-1] and "step 1: loss" in reporter.messages[-1]
    assert not graphs._cache  # the faulty graphs were dropped


def test_a_width_sample_has_that_width_and_comes_from_the_plan(engine_env):
    run = make_run("sample", epochs=2, batch_size=8)
    for width in run.job_setup.plan.width_counts(LADDER, 2):
        [piece], terms = batches.width_sample(run.job_setup, run.state.micro_split, width)
        assert piece["input_ids"].shape == (len(piece["labels"]), width) and terms == len(piece["labels"])
    with pytest.raises(ValueError, match="no micro-batch of width 17"):
        batches.width_sample(run.job_setup, run.state.micro_split, 17)


# ----------------------------------------------------------------------------- 3. several steps, dropout


def frozen_learning_rate(self, replay):
    """As a graph with the learning rate baked in at its first replay would step."""
    seen = []

    def run():
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        seen.extend([] if seen else [lr.clone() for lr in lrs])
        torch._foreach_copy_(lrs, seen)
        replay()

    return run


def frozen_adam_step(self, replay):
    """As a graph whose AdamW step count stays what it was at its first replay."""
    seen = []

    def run():
        counts = [s["step"] for s in self.optimizer.state.values()]
        seen.extend([] if seen else [c.clone() for c in counts])
        torch._foreach_copy_(counts, seen)
        replay()

    return run


def frozen_rng(self, width, replay):
    """As a graph whose dropout RNG offset does not advance between replays."""
    seen = []

    def run():
        seen.extend([] if seen else [torch.get_rng_state()])
        torch.set_rng_state(seen[0])
        replay()

    return run


@pytest.mark.parametrize("fault", ["learning_rate", "adam_step", "dropout_rng"])
def test_three_steps_under_warm_up_with_dropout_catch_what_one_step_cannot(engine_env, monkeypatch, fault):
    if fault == "dropout_rng":
        faulty_replays(monkeypatch, micro=frozen_rng)
    else:
        faulty_replays(monkeypatch, update=frozen_learning_rate if fault == "learning_rate" else frozen_adam_step)
    run = make_run(fault, dropout=True, epochs=1, batch_size=8)
    widths = list(run.job_setup.plan.width_counts(LADDER, 1))
    with pytest.raises(CaptureMismatch, match="the first 3 steps") as error:
        capture(run, widths)
    expected = {
        "learning_rate": "updated weights",
        "adam_step": "updated weights",
        "dropout_rng": "drew the same dropout masks",
    }[fault]
    assert expected in str(error.value)

    # The same faulty graphs pass a one-step check: what the first step alone could see.
    graphs._failed.clear()
    run = make_run(fault + "-one", dropout=True, epochs=1, batch_size=8)
    parts = graphs.uncaptured_parts(
        run.job_setup, run.model, run.forward_model, run.optimizer, run.scheduler, run.scaler, 8
    )
    steps = parts.steps
    steps.capture(widths)
    first = batches.first_steps(run.job_setup, run.state, 1)
    assert check_against_eager(steps, first, [run.job_setup.hp.learning_rate]).failures() == []


def test_replays_draw_new_dropout_masks_and_the_checks_leave_no_trace(engine_env, monkeypatch):
    """With dropout on, the checks pass on good graphs, and the job then trains exactly as the same
    captured job whose checks were skipped: they restore weights, AdamW state and RNG state."""
    reporter = RecordingReporter()
    run = make_run("checked", dropout=True, epochs=1, batch_size=8, reporter=reporter)
    message = capture(run)
    assert "first steps: 3 step(s)" in message and "replays draw new dropout masks" in message
    run.train(reporter)

    graphs.clear_cache()
    monkeypatch.setattr(graphs, "check_new_capture", lambda *args: [])
    unchecked = RecordingReporter()
    run = make_run("unchecked", dropout=True, epochs=1, batch_size=8, reporter=unchecked)
    assert "checked" not in capture(run)
    run.train(unchecked)
    assert reporter.series("train_loss") == unchecked.series("train_loss")


# ----------------------------------------------------------------------------- 4. failed capture


class FakeCuda:
    """What torch 2.11's ``CUDAGraph`` does to the allocator and the default CUDA generator, without
    CUDA: ``capture_begin`` takes a hold on its pool and sets the generator capturing; a
    ``capture_end`` that succeeds ends both; one that raises (an invalidated capture) ends neither,
    and ``reset`` releases the pool only after a successful end (aten/src/ATen/cuda/CUDAGraph.cpp)."""

    def __init__(self, fail_end: bool):
        self.fail_end, self.holds, self.routing = fail_end, {}, set()
        self.generator_capturing, self.graphs = False, []

    def graph(self):
        cuda = self

        class Graph:
            def __init__(self):
                self.calls, self.pool, self.ended = [], None, False
                cuda.graphs.append(self)

            def capture_begin(self, pool=None, capture_error_mode="global"):
                self.pool = pool or f"private-{len(cuda.graphs)}"
                self.calls.append(("begin", pool))
                cuda.holds[self.pool] = cuda.holds.get(self.pool, 0) + 1
                cuda.routing.add(self.pool)
                cuda.generator_capturing = True

            def capture_end(self):
                self.calls.append("end")
                if cuda.fail_end and self is cuda.graphs[0]:  # the real capture fails, a probe does not
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                cuda.routing.discard(self.pool)
                cuda.generator_capturing, self.ended = False, True

            def reset(self):
                self.calls.append("reset")
                if self.ended:
                    cuda.holds[self.pool] -= 1
                    self.ended = False

        return Graph()

    def end_routing(self, device, pool):
        self.routing.discard(pool)

    def release(self, device, pool):
        self.holds[pool] -= 1

    def rand(self, *size, device=None):
        if self.generator_capturing:
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")
        return torch.zeros(size)


@pytest.mark.parametrize("failure", [None, "capture_end", "body", "body_and_capture_end"])
def test_a_failed_capture_restores_the_stream_the_pool_and_the_generator(monkeypatch, failure):
    """Item 4, and what the first GPU run showed (2026-11-26): after a capture whose ``capture_end``
    raised, the generator stayed capturing and the eager fallback's first dropout failed."""
    cuda = FakeCuda(fail_end=failure in ("capture_end", "body_and_capture_end"))
    current = ["default"]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cuda.graph)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", cuda.end_routing, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", cuda.release, raising=False)
    monkeypatch.setattr(torch, "rand", cuda.rand)
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *size, device=None: real_zeros(*size))
    cuda.holds["pool"] = 1  # the graphs captured before this one
    seen = []

    def body():
        seen.append(current[0])  # captured on the capture stream
        if failure in ("body", "body_and_capture_end"):
            raise RuntimeError("injected: operation not permitted when stream is capturing")

    if failure is None:
        graph = cuda_graph.capture_graph(body, "pool", "capture")
        assert graph.calls == [("begin", "pool"), "end"] and cuda.holds["pool"] == 2
    else:
        with pytest.raises(RuntimeError, match="previous error" if failure == "capture_end" else "injected"):
            cuda_graph.capture_graph(body, "pool", "capture")
        assert cuda.graphs[0].calls == [("begin", "pool"), "end", "reset"]  # capture ended, graph released
        assert cuda.holds["pool"] == 1  # the earlier graphs' hold, no more and no less
        assert not cuda.routing and not cuda.generator_capturing
        torch.rand(1, device="cuda")  # the eager fallback can draw dropout masks
    assert seen == ["capture"] and current == ["default"]  # the eager fallback runs on the default stream


def test_a_failed_check_releases_the_graphs(engine_env, monkeypatch):
    released = []
    monkeypatch.setattr(capturing.CapturedSteps, "release", lambda self: released.append(self))
    faulty_replays(monkeypatch, update=lambda self, replay: lambda: None)  # an update graph that does nothing
    run = make_run("release", epochs=1, batch_size=8)
    with pytest.raises(CaptureMismatch):
        capture(run)
    assert len(released) == 1 and not graphs._cache


# ----------------------------------------------------------------------------- 5. transformers floor


def test_transformers_floor_has_capture_safe_bert_mask_preparation():
    """transformers 4.x prepares BERT's SDPA mask with ``torch.all(mask == 1)`` unless jit- or
    dynamo-tracing (``modeling_attn_mask_utils``, 4.46): a host sync that CUDA capture forbids.
    5.0 builds it in ``masking_utils``, which skips that look while capturing and takes a 4D mask
    as given (checked in the 5.0.0 wheel)."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    spec = next(
        SpecifierSet(d.removeprefix("transformers"))
        for d in pyproject["project"]["dependencies"]
        if d.startswith("transformers")
    )
    assert Version("4.46.0") not in spec and Version("4.57.0") not in spec
    assert Version("5.0.0") in spec and Version(transformers.__version__) in spec


# ----------------------------------------------------------------------------- 6. shared pool


def test_a_capture_that_rebinds_a_shared_tensor_is_refused(engine_env, monkeypatch):
    """All graphs share one pool and replay in data order, not capture order: safe only while every
    tensor they share was allocated outside the captures. Injected: a body that lets the backward
    allocate a fresh gradient (``set_to_none``), which the update graph would then read from the pool."""
    original = capturing.CapturedSteps._micro_body

    def rebinding(self, width):
        body = original(self, width)

        def run():
            self.compute[0].grad = None
            body()

        return run

    monkeypatch.setattr(capturing.CapturedSteps, "_micro_body", rebinding)
    monkeypatch.setattr(recipe, "eager_reason", lambda *args: None)
    reporter = RecordingReporter()
    run = make_run("rebind", epochs=1, batch_size=8, reporter=reporter)
    run.warm_up(reporter)
    assert type(run.steps) is Steps and "SharedPoolError" in reporter.messages[-1]
    assert "grad.0" in reporter.messages[-1]


def test_shared_tensors_keep_their_addresses_through_capture_and_training(engine_env):
    run = make_run("addresses", epochs=1, batch_size=8)
    parts = graphs.uncaptured_parts(
        run.job_setup, run.model, run.forward_model, run.optimizer, run.scheduler, run.scaler, 8
    )
    steps = parts.steps
    steps.capture(list(run.job_setup.plan.width_counts(LADDER, 1)))
    before = steps.shared_tensors()
    assert any(k.startswith("adamw.") for k in before) and any(k.startswith("input.") for k in before)
    run.steps, run.optimizer, run.scheduler = steps, parts.optimizer, parts.scheduler
    run.train(RecordingReporter())
    assert steps.shared_tensors() == before


# ----------------------------------------------------------------------------- 7. fp32 accumulation


def test_bf16_micro_batch_gradients_accumulate_in_fp32_master_gradients(engine_env):
    """Each micro-batch's bf16 gradients are added into the fp32 master gradients (the first of a
    step's copied), so a step's gradient is the fp32 sum of its micro-batches' bf16 gradients,
    never a running bf16 sum."""
    run = make_run("fp32-sum", precision="bf16", epochs=1, batch_size=8)
    run.warm_up()
    steps = run.steps
    run.model.train()
    run.forward_model.train()
    pieces = [run.job_setup.collator([run.job_setup.train_set[i] for i in range(j, j + 4)]) for j in range(0, 32, 4)]
    n = sum(len(p["labels"]) for p in pieces)

    expected = [torch.zeros_like(p) for p in steps.master]
    for piece in pieces:  # each micro-batch alone: its bf16 gradients, summed here in fp32
        steps.discard_step()
        steps.n_examples.fill_(n)
        steps.micro_step(piece)
        torch._foreach_add_(expected, [p.grad for p in steps.master])
    steps.discard_step()

    steps.n_examples.fill_(n)
    for piece in pieces:
        steps.micro_step(piece)
        assert all(torch.count_nonzero(p.grad) == 0 for p in steps.compute)  # moved on to the masters
    for name, (p, e) in enumerate(zip(steps.master, expected)):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, e, rtol=1e-6, atol=1e-9, msg=f"parameter {name}")
    steps.finish_step()
    # the next step's first micro-batch is copied over the masters (no zeroing, no add): the same
    # gradients as added into zeroed masters
    steps.n_examples.fill_(n)
    steps.micro_step(pieces[0])
    copied = [p.grad.clone() for p in steps.master]
    steps.copy_first_grads = False
    steps.discard_step()
    assert all(torch.count_nonzero(p.grad) == 0 for p in steps.master)
    steps.micro_step(pieces[0])
    for name, (p, c) in enumerate(zip(steps.master, copied)):
        torch.testing.assert_close(c, p.grad, rtol=0, atol=0, msg=f"parameter {name}")
