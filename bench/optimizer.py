"""The optimizer step alone: time and bytes moved per parameter of each way to clip and step AdamW,
after the backward, for a step of one micro-batch (issue 40, item 2).

    python -m bench.optimizer                         # tiny and MiniLM-size BERT, fp32 and bf16 copy
    python -m bench.optimizer --markdown docs/benchmarks.md

Models are built from a config (random weights; the optimizer sees only their tensors): ``tiny``
(the tests' shape) and ``minilm`` (all-MiniLM-L6-v2's shape, 22.7M parameters). Gradients are
random and put back before every timed step (outside the timing), as a backward would leave
them. Variants, all round-robin in one process, medians over ``--repeats``:

- ``fp32 before``: ``clip_grad_norm_`` (a norm pass, then a multiply pass over the gradients),
  fused AdamW, gradients freed (the recipe before issue 40);
- ``fp32 foreach``: the same with the for-each (unfused) AdamW;
- ``fp32 one-pass``: the norm pass, then the clip factor given to the fused kernel as its
  ``grad_scale`` (it divides each gradient as it reads it): no multiply pass (``Steps.update``);
- ``bf16 before``: a bf16 copy that computes and fp32 master weights: its gradients added into
  zeroed fp32 master gradients, the bf16 ones zeroed, clip, fused AdamW, the weights copied back
  to bf16, both gradient sets zeroed;
- ``bf16 copy, clip pass``: the bf16 gradients copied (not added) into the master gradients,
  which are then never zeroed, with ``clip_grad_norm_``;
- ``bf16 one-pass``: the same with the clip in the kernel.

Bytes per parameter are counted from the passes each variant makes (reads + writes), not measured.
"""

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, BertConfig

from bench.measure import machine
from bench.tables import update_markdown

SHAPES = {
    "tiny": dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32),
    "minilm": dict(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
    ),
}
# bytes per parameter: reads + writes of each pass (fp32 4, bf16 2)
BYTES = {
    "fp32 before": 4 + 8 + 28,  # norm; multiply; AdamW (param, grad, m, v read; param, m, v written)
    "fp32 foreach": 4 + 8 + 28,  # the same passes, unfused (several more over the moments in practice)
    "fp32 one-pass": 4 + 32,  # norm; AdamW with the unscaled gradient written back
    "bf16 before": 10 + 2 + 4 + 8 + 28 + 6 + 2 + 4,  # add; zero bf16; norm; multiply; AdamW; copy back; zero both
    "bf16 copy, clip pass": 6 + 4 + 8 + 28 + 6 + 2,  # copy; norm; multiply; AdamW; copy back; zero bf16
    "bf16 one-pass": 6 + 4 + 32 + 6 + 2,  # copy; norm; AdamW (+ write back); copy back; zero bf16
}


def adamw(params: list[torch.nn.Parameter], fused: bool) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=fused, foreach=not fused)


def variants(shape: str) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """Each variant as (put the gradients back, step); the step is what is timed."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(BertConfig(**SHAPES[shape], num_labels=3))
    grads = [torch.randn_like(p) * 1e-2 for p in model.parameters()]
    out = {}

    def fp32(name: str, fused: bool, in_kernel: bool) -> None:
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        opt = adamw(params, fused)
        scale = torch.ones(())

        def refill() -> None:
            for p, g in zip(params, grads):
                p.grad = g.clone()

        def step() -> None:
            if in_kernel:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
                opt.grad_scale = torch.clamp(norm + 1e-6, min=1.0, out=scale)
            else:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[name] = refill, step

    def bf16(name: str, one_pass: bool, in_kernel: bool = True) -> None:
        master = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        compute = [torch.nn.Parameter(p.detach().bfloat16()) for p in model.parameters()]
        for p in (*master, *compute):
            p.grad = torch.zeros_like(p)
        mg, cg = [p.grad for p in master], [p.grad for p in compute]
        bf16_grads = [g.bfloat16() for g in grads]
        opt, scale = adamw(master, True), torch.ones(())

        def refill() -> None:
            torch._foreach_copy_(cg, bf16_grads)

        def step() -> None:
            if one_pass:
                torch._foreach_copy_(mg, cg)
                if in_kernel:
                    norm = torch.nn.utils.get_total_norm(mg)
                    opt.grad_scale = torch.clamp(norm + 1e-6, min=1.0, out=scale)
                else:
                    torch.nn.utils.clip_grad_norm_(master, 1.0)
            else:
                torch._foreach_add_(mg, cg)
                torch._foreach_zero_(cg)
                torch.nn.utils.clip_grad_norm_(master, 1.0)
            opt.step()
            torch._foreach_copy_(compute, master)
            torch._foreach_zero_(cg)
            if not one_pass:
                torch._foreach_zero_(mg)

        out[name] = refill, step

    fp32("fp32 before", True, False)
    fp32("fp32 foreach", False, False)
    fp32("fp32 one-pass", True, True)
    bf16("bf16 before", False)
    bf16("bf16 copy, clip pass", True, in_kernel=False)
    bf16("bf16 one-pass", True)
    return out


def measure(shape: str, repeats: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) seconds of one optimizer step per variant, round-robin over ``repeats``
    (after 2 warm-ups). On a shared machine the fastest is the better estimate of the step's own
    cost: a descheduled thread adds hundreds of milliseconds to a step at random."""
    runs = variants(shape)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats + 2):
        for name, (refill, step) in runs.items():
            refill()
            start = time.perf_counter()
            with torch.no_grad():
                step()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny,minilm")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--markdown", default=None, help="write the table into this file's section 'optimizer'")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    where = machine(torch.device("cpu"))
    lines = [
        "| shape | parameters | variant | bytes / parameter | ms / step, fastest (median) | vs before, fastest |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for shape in args.shapes.split(","):
        n = sum(
            p.numel()
            for p in AutoModelForSequenceClassification.from_config(
                BertConfig(**SHAPES[shape], num_labels=3)
            ).parameters()
        )
        result = measure(shape, args.repeats)
        for name, (fastest, median) in result.items():
            before = result["bf16 before" if name.startswith("bf16") else "fp32 before"][0]
            lines.append(
                f"| {shape} | {n:,} | {name} | {BYTES[name]} | {fastest * 1e3:.3f} ({median * 1e3:.3f}) | "
                f"{before / fastest:.2f}x |"
            )
            print(lines[-1], flush=True)
    meta = (
        f"{where}; torch {torch.__version__}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python -m bench.optimizer "
        f"--shapes {args.shapes} --repeats {args.repeats} --threads {args.threads}`"
    )
    if args.markdown:
        update_markdown(Path(args.markdown), {"optimizer": meta + "\n\n" + "\n".join(lines)})
    print(meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
