"""Checks of the engine's CUDA-graph path that the CPU tests cannot make: run it on a GPU machine.

Drives the real recipe (``worker.training.recipe.Recipe``: ``setup``, ``warm_up``, ``train``) on
synthetic short texts and prints one JSON object: each check with ``ok`` and what it measured.

- ``captured``: ``warm_up`` captured graphs (event ``cuda_graphs``), weights and AdamW state did not
  move, and no cuDNN attention.
- ``matches_eager``: with dropout off, losses of the first steps with graphs match the same job
  trained eagerly (``TUNEJOB_CUDA_GRAPHS=false``) within bf16 rounding.
- ``no_syncs``: no synchronising CUDA call during the steady-state steps
  (``torch.cuda.set_sync_debug_mode("warn")``).
- ``reused``: a second job of the same shape reuses the graphs (no capture) and, dropout on,
  trains like the first (weights copied in, optimizer reset, RNG untouched; equal up to the
  nondeterminism of atomic adds in the backward: expect a relative difference near 0).
- ``resume``: a run stopped after a checkpoint and resumed (reusing the graphs) gives the
  uninterrupted run's losses.
- ``fallbacks``: fp16 and gradient checkpointing train eagerly and say so.
- ``timing``: warm_up seconds (capture) and training seconds of one epoch, graphs and eager.

The cases of issue 29 (the CPU tests inject these faults; here the real thing runs):

- ``checked``: a new capture is checked over 3 steps under a warm-up schedule with dropout on
  (dropout masks differ between two replays) and every width over one micro-batch; the figures of
  each check (``Parity.describe``) are in the event.
- ``no_padding``: texts all longer than ``max_length`` (no padding in any micro-batch): the check
  passes, no false alarm from flash attention on an all-ones mask (item 1).
- ``later_widths``: a job of short texts captures a few widths; a later job of the same shape with
  longer texts reuses them and adds widths, each checked before use (item 2).
- ``failed_capture``: a capture made to fail (a host sync inside the body) three times: the job
  trains eagerly on the default stream, and reserved memory does not grow (item 4).
- ``replay_order``: one step whose micro-batches replay every width in reverse capture order
  matches the eager step (item 6, the shared pool).
- ``accumulation``: with ``gradient_accumulation_steps=4`` and dropout off, graphs match the eager
  engine (item 7: fp32 master gradients, eager and captured alike).

Measured on an H100 (2026-11-26, torch 2.11, bert-base-rand, ``--examples 512``; docs/benchmarks.md,
issue 29): every ``ok`` true; loss differences 0 in the checks and 1.8e-3 relative over 17 steps
with dropout off (``matches_eager``); "replays draw new dropout masks" in ``checked``;
``failed_capture`` reserved memory flat at 6,430 MiB; capture 1.2-2.2 s for 4 widths; 17 steps
with graphs 0.14 s against 0.47 s eagerly.

The cases of issue 40 (packed micro-batches, ``worker.training.packing``):

- ``packed_matches_padded``: with dropout off and graphs off, a job with ``packing: true`` trains
  like the same job padded (losses within bf16 rounding), says so in an event, computes no
  padding, and reads nothing back per step (no synchronising call).
- ``packed_speed``: long texts at ``--long-length`` (BBC-like: most near the limit, some short),
  dropout on: training seconds and real tokens/s of eager steps padded and packed, and of packed
  steps on CUDA graphs (token buckets), with the peak memory of each.
- ``packed_graphs``: with dropout off, the packed job on CUDA graphs (captured per token bucket and
  checked) trains like the eager packed job (losses within bf16 rounding), with no synchronising
  call.

The one-command acceptance run (on the GPU machine, after ``source .device/gpu/on-device.sh``, see
../shared/gpu/README.md), this script then the whole-epoch benchmark, peers in the same lease:
    python -m bench.engine_gpu_check --model bert-base-rand --json $OUT/engine_gpu_check.json && \
    python -m bench.train --device cuda --precision bf16 --model bert-base-rand --dataset both \
        --configs smart,smart:packing=true,trainer,trainer_cudnn_off --repeats 2 --json $OUT/bench.json --markdown $OUT/bench.md && \
    python -m bench.train --device cuda --precision bf16 --model bert-base-rand --dataset mnli_size \
        --configs smart,smart:packing=true,trainer_cudnn_off --json $OUT/mnli.json --markdown $OUT/mnli.md \
        --section epochs-cuda-mnli-size
(the last: one whole epoch of 392,702 BBC News sentence pairs at 128, ``bench.corpora.bbc_sentence_pairs``,
the MNLI-size job of issue 40; unmeasured so far.)
``--device cpu --model <a local model>`` runs the same script on the CPU (graph checks are skipped),
to check the script itself.
"""

import argparse
import gc
import json
import math
import os
import random
import tempfile
import time
import traceback
import uuid
import warnings
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pandas as pd
import torch

from worker.reporter import (
    MemoryReporter,  # settings are read at run time, after main sets TUNEJOB_DATA_DIR
)

WORDS = "the a film story plot actor scene great bad dull fun long short music ending end cast".split()


class Recorder(MemoryReporter):
    """The engine's reporter without a job store (``worker.reporter.MemoryReporter``), with the
    training losses by step and the events as (code, message) pairs."""

    @property
    def losses(self) -> dict[int, float]:
        return self.series("train_loss")

    @property
    def said(self) -> list[tuple[str, str]]:
        return list(zip(self.events, self.messages))


def texts(n: int, seed: int, words: tuple[int, int] = (3, 60)) -> pd.DataFrame:
    """Review-like texts of ``words`` words (default 3-60, about Rotten Tomatoes' lengths), two labels."""
    rng = random.Random(seed)
    rows = [
        {"text": " ".join(rng.choices(WORDS, k=rng.randint(*words))), "label": ["fresh", "rotten"][i % 2]}
        for i in range(n)
    ]
    return pd.DataFrame(rows)


def make_run(args, device, reporter, checkpoint=None, dropout=True, words=(3, 60), **hyperparameters):
    from shared.schemas.jobs import JobCreate
    from shared.store.rows import Job
    from worker.data import JobData
    from worker.training.recipe import Recipe

    hp = {
        "epochs": 1,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "learning_rate": 5e-5,
        "precision": args.precision,
        "seed": 42,
        "eval_every_steps": 10**9,
        "save_every_steps": 10**9,
        **hyperparameters,
    }
    spec = JobCreate(base_model=args.model, training_dataset="check", validation_split=0.0, hyperparameters=hp)
    job = Job(
        id=f"check-{uuid.uuid4().hex[:8]}",
        task="classification",
        base_model=args.model,
        label_names=["fresh", "rotten"],
        spec=spec.model_dump(mode="json"),
    )
    df = texts(args.examples, seed=0, words=words)
    run = Recipe(job, device).setup(JobData(df, None), reporter, checkpoint)
    if not dropout:
        for module in run.model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return run


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def state_of(run) -> dict[str, torch.Tensor]:
    """Copies of the job's weights (``w.<name>``) and AdamW state (``o.<index>.<name>``)."""
    state = {f"w.{n}": p.detach().clone() for n, p in run.model.named_parameters()}
    for i, p in enumerate(p for g in run.optimizer.param_groups for p in g["params"]):
        for k, v in run.optimizer.state.get(p, {}).items():
            state[f"o.{i}.{k}"] = v.clone()
    return state


def largest_difference(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest relative difference between two loss series over the same steps (inf if the steps differ)."""
    if a.keys() != b.keys() or not a:
        return math.inf
    return max(abs(a[s] - b[s]) / max(abs(b[s]), 1e-6) for s in a)


def captured_message(recorder: "Recorder") -> str:
    """The ``cuda_graphs`` event's message ('' when the job trained eagerly)."""
    return next((m for c, m in recorder.said if c == "cuda_graphs"), "")


def issue_29_cases(args, device) -> dict[str, dict]:
    """The CUDA-graph cases of issue 29 (module docstring), each with ``ok`` and what it saw; a case
    that raises is ``ok: false`` with its traceback, and the others still run."""
    out = {}
    for case in (checked_and_replay_order, no_padding, later_widths, failed_capture, accumulation, packed_cases):
        try:
            out.update(case(args, device))
        except Exception:
            out[case.__name__] = {"ok": False, "error": traceback.format_exc()[-2000:]}
    return out


def train_counting_syncs(run, rec: Recorder) -> list[str]:
    """Train ``run`` with CUDA's sync debug mode on; returns the synchronising calls it warned of."""
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(rec)
    torch.cuda.set_sync_debug_mode("default")
    return [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]


def packed_cases(args, device) -> dict[str, dict]:
    """``packed_matches_padded`` and ``packed_speed`` (module docstring)."""
    from shared.settings import get_settings

    out, trained = {}, {}
    get_settings().cuda_graphs = False
    try:
        for packing in (False, True):
            rec = Recorder()
            run = make_run(args, device, rec, dropout=False, packing=packing)
            run.warm_up(rec)
            trained[packing] = rec, run.state, train_counting_syncs(run, rec)
        (padded, _, _), (packed, state, syncs) = trained[False], trained[True]
        difference = largest_difference(packed.losses, padded.losses)
        steps = len(packed.losses)
        out["packed_matches_padded"] = {
            "ok": difference < 2e-2
            and state.padded_tokens == state.real_tokens
            and len(syncs) <= steps // 20 + 2
            and any(c == "packing" and m.startswith("packed") for c, m in packed.said),
            "largest_relative_difference": difference,
            "steps": steps,
            "sync_warnings": len(syncs),
            "sync_examples": syncs[:3],
            "events": [m for c, m in packed.said if c == "packing"],
        }

        get_settings().cuda_graphs = True
        rec = Recorder()
        run = make_run(args, device, rec, dropout=False, packing=True)
        run.warm_up(rec)
        graph_syncs = train_counting_syncs(run, rec)
        difference = largest_difference(rec.losses, packed.losses)
        message = captured_message(rec)
        out["packed_graphs"] = {
            "ok": "packed micro-batches" in message
            and difference < 2e-2
            and len(graph_syncs) <= len(rec.losses) // 20 + 2,
            "largest_relative_difference": difference,
            "sync_warnings": len(graph_syncs),
            "event": message,
        }

        long_args = argparse.Namespace(**{**vars(args), "max_length": args.long_length})
        speed = {}
        for packing in ("padded", "packed", "packed_graphs"):
            get_settings().cuda_graphs = packing == "packed_graphs"
            rec = Recorder()
            run = make_run(
                long_args, device, rec, words=(args.long_length // 4, args.long_length), packing=packing != "padded"
            )
            _, warm_seconds = timed(lambda run=run, rec=rec: run.warm_up(rec))
            torch.cuda.reset_peak_memory_stats()
            _, seconds = timed(lambda run=run, rec=rec: run.train(rec))
            st = run.state
            speed[packing] = {
                "warm_up_s": round(warm_seconds, 3),
                "train_s": round(seconds, 3),
                "steps": st.step,
                "real_tokens": st.real_tokens,
                "computed_tokens": st.padded_tokens,
                "real_tokens_per_s": round(st.real_tokens / seconds),
                "peak_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20),
                "events": [m for c, m in rec.said if c in ("packing", "cuda_graphs", "cuda_graphs_off")],
            }
        out["packed_speed"] = {
            "ok": speed["packed"]["computed_tokens"] == speed["packed"]["real_tokens"],
            "max_length": args.long_length,
            "speedup": round(speed["padded"]["train_s"] / speed["packed"]["train_s"], 3),
            "graphs_speedup": round(speed["padded"]["train_s"] / speed["packed_graphs"]["train_s"], 3),
            **speed,
        }
    finally:
        get_settings().cuda_graphs = True
    return out


def checked_and_replay_order(args, device) -> dict[str, dict]:
    """``checked`` and ``replay_order`` (module docstring)."""
    from worker.training import batches, graphs, parity

    out = {}
    graphs.clear_cache()
    rec = Recorder(stop_after_step=3, stop_reason="cancelled")
    run = make_run(args, device, rec)  # dropout on
    run.warm_up(rec)
    message = captured_message(rec)
    out["checked"] = {
        "ok": "first steps: 3 step(s)" in message
        and "replays draw new dropout masks" in message
        and all(f"width {w}:" in message for w in run.steps.replays),
        "event": message,
    }

    # replay_order: every width of this capture in one step, in reverse capture order
    widths = list(run.steps.replays)[::-1]
    samples = [batches.width_sample(run.job_setup, run.state.micro_split, w) for w in widths]
    pieces, n = [p for ps, _ in samples for p in ps], sum(t for _, t in samples)
    seen = parity.check_against_eager(run.steps, [(pieces, n)], [run.job_setup.hp.learning_rate])
    out["replay_order"] = {
        "ok": not seen.failures(),
        "widths": widths,
        "parity": seen.describe(),
        "failures": seen.failures(),
    }
    run.train(rec)
    return out


def no_padding(args, device) -> dict[str, dict]:
    """``no_padding``: every text longer than max_length (item 1)."""
    from worker.training import batches, graphs

    graphs.clear_cache()
    rec = Recorder(stop_after_step=3, stop_reason="cancelled")
    run = make_run(args, device, rec, words=(args.max_length + 8, args.max_length + 40))
    run.warm_up(rec)
    first = batches.first_steps(run.job_setup, run.state, 1)[0][0][0]
    return {
        "no_padding": {"ok": bool(captured_message(rec)) and bool(first["attention_mask"].all()), "events": rec.said}
    }


def later_widths(args, device) -> dict[str, dict]:
    """``later_widths``: short texts first, then longer texts of the same shape (item 2)."""
    from worker.training import graphs

    graphs.clear_cache()
    short, longer = (
        Recorder(stop_after_step=2, stop_reason="cancelled"),
        Recorder(stop_after_step=2, stop_reason="cancelled"),
    )
    run = make_run(args, device, short, words=(3, 12))
    run.warm_up(short)
    before = set(run.steps.replays)
    run = make_run(args, device, longer, words=(3, 90))
    run.warm_up(longer)
    message = captured_message(longer)
    added = sorted(set(run.steps.replays) - before)
    return {
        "later_widths": {
            "ok": "reused" in message and bool(added) and all(f"width {w}:" in message for w in added),
            "first": sorted(before),
            "added": added,
            "event": message,
        }
    }


def accumulation(args, device) -> dict[str, dict]:
    """``accumulation``: gradient_accumulation_steps=4, graphs against the eager engine, dropout off (item 7)."""
    from shared.settings import get_settings
    from worker.training import graphs

    graphs.clear_cache()
    losses = {}
    for name, on in (("graphs", True), ("eager", False)):
        get_settings().cuda_graphs = on
        rec = Recorder(stop_after_step=5, stop_reason="cancelled")
        run = make_run(args, device, rec, dropout=False, batch_size=args.batch_size // 4, gradient_accumulation_steps=4)
        run.warm_up(rec)
        run.train(rec)
        losses[name] = rec.losses
    get_settings().cuda_graphs = True
    difference = largest_difference(losses["graphs"], losses["eager"])
    return {"accumulation": {"ok": difference < 2e-2, "largest_relative_difference": difference}}


def failed_capture(args, device) -> dict[str, dict]:
    """Three captures made to fail by a host sync in the forward+backward body: each job trains
    eagerly on the default stream, and reserved memory does not grow from one failure to the next."""
    from worker.training import graphs
    from worker.training.capture import CapturedSteps

    original = CapturedSteps._micro_body

    def syncing(self, width):
        body = original(self, width)
        return lambda: (body(), self.step_loss.item())  # a host sync: not permitted while capturing

    reserved, events, streams = [], [], []
    CapturedSteps._micro_body = syncing
    try:
        for _ in range(3):
            graphs.clear_cache()
            graphs._failed.clear()
            rec = Recorder(stop_after_step=2, stop_reason="cancelled")
            run = make_run(args, device, rec)
            run.warm_up(rec)
            streams.append(torch.cuda.current_stream() == torch.cuda.default_stream())
            run.train(rec)
            events.append([m[:200] for c, m in rec.said if c == "cuda_graphs_off"])
            del run
            gc.collect()
            torch.cuda.empty_cache()
            reserved.append(torch.cuda.memory_reserved() / 2**20)
    finally:
        CapturedSteps._micro_body = original
    return {
        "failed_capture": {
            "ok": all(streams) and all(events) and reserved[-1] <= reserved[0] + 1,
            "default_stream_after": streams,
            "reserved_mib": reserved,
            "events": events,
        }
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-base-rand")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--examples", type=int, default=1024)
    parser.add_argument("--long-length", type=int, default=512, help="max_length of packed_speed's long texts")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("TUNEJOB_DATA_DIR", tempfile.mkdtemp(prefix="engine-check-"))
    from shared.settings import get_settings
    from worker.training import graphs
    from worker.training.capture import CapturedSteps

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    results: dict[str, dict] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "model": args.model,
    }

    try:  # the engine cases depend on each other; a crash is recorded and issue 29's cases still run
        # captured: warm_up captures and moves nothing
        rec = Recorder()
        run = make_run(args, device, rec, dropout=False)
        before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
        _, warm_seconds = timed(lambda: run.warm_up(rec))
        after = state_of(run)
        moved = [n for n, p in before.items() if not torch.equal(after[f"w.{n}"], p)]
        fresh = all(torch.count_nonzero(v) == 0 for k, v in after.items() if k.startswith("o."))
        results["captured"] = {
            "ok": (not cuda or isinstance(run.steps, CapturedSteps))
            and not moved
            and fresh
            and not (cuda and torch.backends.cuda.cudnn_sdp_enabled()),
            "steps": type(run.steps).__name__,
            "events": rec.said,
            "warm_up_seconds": warm_seconds,
            "moved_weights": moved[:5],
            "optimizer_state_zero": fresh,
        }

        # no_syncs (steady state) and the losses with graphs
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, graph_seconds = timed(lambda: run.train(rec))
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]
        steps = len(rec.losses)
        results["no_syncs"] = {
            "ok": len(syncs) <= steps // 20 + 2,
            "steps": steps,
            "sync_warnings": len(syncs),
            "examples": syncs[:3],
        }
        graph_losses = rec.losses

        # matches_eager
        get_settings().cuda_graphs = False
        eager = Recorder()
        erun = make_run(args, device, eager, dropout=False)
        _, eager_warm = timed(lambda: erun.warm_up(eager))
        _, eager_seconds = timed(lambda: erun.train(eager))
        get_settings().cuda_graphs = True
        difference = largest_difference(graph_losses, eager.losses)
        results["matches_eager"] = {
            "ok": difference < 2e-2,
            "largest_relative_difference": difference,
            "eager_events": eager.said,
            "first_losses": {
                "graphs": [graph_losses[s] for s in sorted(graph_losses)[:5]],
                "eager": [eager.losses[s] for s in sorted(eager.losses)[:5]],
            },
        }
        results["timing"] = {
            "graphs": {"warm_up_s": warm_seconds, "train_s": graph_seconds},
            "eager": {"warm_up_s": eager_warm, "train_s": eager_seconds},
            "steps": steps,
        }

        # reused: two jobs of the same shape, dropout on, train identically; the second captures nothing
        first, second = Recorder(), Recorder()
        graphs.clear_cache()
        run = make_run(args, device, first)
        run.warm_up(first)
        run.train(first)
        run = make_run(args, device, second)
        _, reuse_seconds = timed(lambda: run.warm_up(second))
        run.train(second)
        reused = any(code == "cuda_graphs" and "reused" in message for code, message in second.said)
        difference = largest_difference(second.losses, first.losses)  # attention/embedding backward use atomics
        results["reused"] = {
            "ok": (reused or not cuda) and difference < 1e-2,
            "warm_up_seconds": reuse_seconds,
            "events": second.said,
            "largest_relative_difference": difference,
        }

        # resume: stop after a third of the steps (checkpoint), resume, compare with the uninterrupted run above
        stopped = Recorder(stop_after_step=max(1, steps // 3))
        run = make_run(args, device, stopped)
        run.warm_up(stopped)
        run.train(stopped)
        resumed = Recorder()
        run = make_run(args, device, resumed, checkpoint=stopped.checkpoints[-1][1])
        run.warm_up(resumed)
        run.train(resumed)
        tail = {s: v for s, v in first.losses.items() if s > stopped.checkpoints[-1][0]}
        difference = largest_difference(resumed.losses, tail)
        results["resume"] = {
            "ok": difference < 1e-2,
            "largest_relative_difference": difference,
            "resumed_steps": len(resumed.losses),
        }

        # fallbacks: features that cannot be captured train eagerly and say so
        fallbacks = {}
        for name, hp in {
            "fp16": {"precision": "fp16"},
            "gradient_checkpointing": {"gradient_checkpointing": True},
        }.items():
            rec = Recorder(stop_after_step=3, stop_reason="cancelled")
            run = make_run(args, device, rec, **hp)
            run.warm_up(rec)
            outcome = run.train(rec)
            said = [m for c, m in rec.said if c == "cuda_graphs_off"]
            fallbacks[name] = {
                "outcome": outcome,
                "event": said,
                "finite": all(map(math.isfinite, rec.losses.values())),
            }
        results["fallbacks"] = {
            "ok": all(
                f["outcome"] == "cancelled" and f["finite"] and (f["event"] or not cuda) for f in fallbacks.values()
            ),
            **fallbacks,
        }
    except Exception:
        results["crashed"] = {"ok": False, "error": traceback.format_exc()[-3000:]}

    if cuda:
        results.update(issue_29_cases(args, device))

    results["ok"] = all(v["ok"] for v in results.values() if isinstance(v, dict) and "ok" in v)
    text = json.dumps(results, indent=1, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
