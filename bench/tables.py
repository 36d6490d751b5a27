"""The benchmark's tables: rows of cold runs summarized per data set, batch size and configuration
(medians over repeats), ratios against the peers, the issue's GPU targets, and the Markdown
sections of ``docs/benchmarks.md`` (text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``).

Runs saved with ``bench.train --json`` render together, as one table with the ratios between
them (configurations that must run in separate invocations, e.g. to fit a time limit each):

    python -m bench.tables /tmp/smart.json /tmp/trainer.json --markdown docs/benchmarks.md --section NAME
"""

import argparse
import json
import math
import re
import statistics
from pathlib import Path

from bench.corpora import CORPORA
from bench.measure import QUALITY, QUALITY_TITLES
from bench.peers import PEERS

# issue 9, on an H100 (bert-base shape, bf16, batch 32, 1 epoch): the engine's epoch (capture
# included) at most 1/N of each peer's train_runtime, and a steady-state MFU floor
TARGETS = {
    "rotten_tomatoes": {"trainer": 4, "trainer_cudnn_off": 2, "mfu_steady": 0.15},
    "bbc": {"trainer": 3, "trainer_cudnn_off": 2, "mfu_steady": 0.35},
}
ENGINE_DEFAULT = "smart"  # what a job runs unless it asks for another batching


def median_row(rows: list[dict]) -> dict:
    """One row for the runs (repeats and seeds) of a configuration: numbers as medians (lists
    element by element; whole numbers, alone or in lists, as the lower median), the held-out
    ``QUALITY`` figures as means with their per-run values in ``<name>_runs`` (ordered by seed),
    the rest as in the first run; ``repeats`` counts the runs."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, bool) or value is None:
            continue
        if key in QUALITY:
            values = [r[key] for r in sorted(rows, key=lambda r: r["seed"])]
            out[key], out[f"{key}_runs"] = statistics.mean(values), values
        elif isinstance(value, int):  # counts and sizes stay whole numbers
            out[key] = statistics.median_low(r[key] for r in rows)
        elif isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rows)
        elif isinstance(value, list) and value and isinstance(value[0], (int, float)):
            middle = statistics.median_low if isinstance(value[0], int) else statistics.median
            out[key] = [middle(v) for v in zip(*(r[key] for r in rows))]
    out["repeats"] = len(rows)
    out["seeds"] = sorted({r["seed"] for r in rows})
    del out["repeat"]
    return out


def quality(r: dict, key: str) -> str:
    """A held-out figure: the value of one run, or the mean over runs with its range and each run's value."""
    runs = r.get(f"{key}_runs") or []
    if len(runs) < 2:
        return fmt(r.get(key), ".4f")
    return f"{r[key]:.4f} (range {max(runs) - min(runs):.4f}: " + ", ".join(f"{v:.4f}" for v in runs) + ")"


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per (data set, batch size, configuration, job in its process), in run order, with
    each row's speed against the peers of its block (their first job): the peer's train time / this
    row's ("vs trainer", ...). Rows of failed processes are left out."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["dataset"], r["batch_size"], r["config"], r["job"]), []).append(r)
    summary = [median_row(g) for g in groups.values()]
    for r in summary:
        for peer in PEERS:
            ref = next(
                (
                    p
                    for p in summary
                    if (p["dataset"], p["batch_size"], p["config"], p["job"])
                    == (r["dataset"], r["batch_size"], peer, 1)
                ),
                None,
            )
            r[f"vs_{peer}"] = ref["train_seconds"] / r["train_seconds"] if ref else None
    return summary


def fmt(x, spec: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(x, spec) + suffix


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def provenance(meta: dict) -> str:
    return (
        f"_Measured {meta['date']} on {meta['device']} with `{meta['command']}` (torch {meta['torch']}, "
        f"transformers {meta['transformers']}, model {meta['model']}, precision {meta['dtype']}, "
        f"{meta['epochs']} epoch(s), {meta['repeats']} repeat(s), seed(s) "
        f"{', '.join(str(s) for s in meta.get('seeds', [42]))}"
        + (f", CPU memory {meta['cpu_memory']}" if meta["device_type"] == "cpu" else "")
        + ")._"
    )


def block_header(rows: list[dict]) -> str:
    r0 = rows[0]
    tokens = sorted({t for r in rows for t in r["epoch_real_tokens"]})
    same = (
        f"{tokens[0]:,} real tokens per epoch, the same for every configuration"
        if len(tokens) == 1
        else f"real tokens per epoch DIFFER between configurations: {', '.join(f'{t:,}' for t in tokens)}"
    )
    return (
        f"**{CORPORA[r0['dataset']].title} @{r0['max_length']}, batch {r0['batch_size']}**: "
        f"{r0['train_examples']:,} training texts, {same}; {r0['flops_per_real_token']:.3g} FLOPs per "
        f"real token (6 x {r0['non_embedding_params'] / 1e6:.1f}M non-embedding parameters + attention)."
    )


def render(summary: list[dict], meta: dict) -> str:
    """A Markdown section: the provenance line, then one table per (data set, batch size)."""
    shown = [name for name in QUALITY if any(r.get(name) is not None for r in summary)]  # means over seeds
    memory = "peak GPU MiB (allocated)" if meta["device_type"] == "cuda" else "peak RSS MiB (process)"
    parts = [provenance(meta)]
    for block in dict.fromkeys((r["dataset"], r["batch_size"]) for r in summary):
        rows = [r for r in summary if (r["dataset"], r["batch_size"]) == block]
        peers = [p for p in PEERS if any(r["config"] == p and r["job"] == 1 for r in rows)]
        header = [
            "configuration",
            "load s",
            "warm-up s (in epoch 1)",
            "epoch s (warm-up included)",
            "train s",
            *(f"vs {p}" for p in peers),
            "steady real tokens/s",
            "MFU epoch / steady",
            "padding efficiency (unrounded / padded)",
            memory,
            "process s",
            *(QUALITY_TITLES[name] for name in shown),
        ]
        body = []
        for r in rows:
            line = [
                r["config"] + (f" (job {r['job']} in its process)" if r["job"] > 1 else ""),
                f"{r['load_seconds']:.1f}",
                fmt(r.get("warmup_seconds"), ".1f"),
                " + ".join(f"{s:.1f}" for s in r["epoch_seconds"]),
                f"{r['train_seconds']:.1f}",
                *(fmt(r[f"vs_{p}"], ".2f", "x") for p in peers),
                fmt(r["steady_tokens_per_second"], ",.0f"),
                f"{fmt(r['mfu_epoch'], '.1%')} / {fmt(r['mfu_steady'], '.1%')}",
                f"{r['efficiency_unrounded']:.3f} / {r['efficiency_padded']:.3f}",
                f"{r['peak_memory_mib']:,.0f}",
                f"{r['process_seconds']:.0f}",
            ]
            body.append(line + [quality(r, name) for name in shown])
        parts += [block_header(rows), table(header, body)]
    targets = target_rows(summary)
    if meta["device_type"] == "cuda" and targets:
        parts += [
            "Targets of issue 9 (the engine as a job runs it: `smart`, its first job in a fresh process):",
            table(["target", "measured", "status"], targets),
        ]
    return "\n\n".join(parts)


def target_rows(summary: list[dict]) -> list[list[str]]:
    """The issue's GPU targets for the engine's default configuration, where this run measured them."""
    out = []
    for r in summary:
        goal = TARGETS.get(r["dataset"])
        if r["config"] != ENGINE_DEFAULT or r["job"] != 1 or goal is None:
            continue
        where = f"{CORPORA[r['dataset']].title} @{r['max_length']}, batch {r['batch_size']}"
        for peer in ("trainer", "trainer_cudnn_off"):
            if r[f"vs_{peer}"] is not None:
                out.append(
                    [
                        f"epoch <= 1/{goal[peer]} of {peer} train_runtime, {where}",
                        f"{r[f'vs_{peer}']:.2f}x",
                        "met" if r[f"vs_{peer}"] >= goal[peer] else "missed",
                    ]
                )
        if r["mfu_steady"] is not None:
            out.append(
                [
                    f"steady MFU >= {goal['mfu_steady']:.0%}, {where}",
                    f"{r['mfu_steady']:.1%}",
                    "met" if r["mfu_steady"] >= goal["mfu_steady"] else "missed",
                ]
            )
    return out


def update_markdown(path: Path, sections: dict[str, str]) -> list[str]:
    """Replace the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` for each
    section, appending (with its markers) a section the file lacks. Returns the names written."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    for name, body in sections.items():
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        block = f"{start}\n{body}\n{end}"
        pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _, block=block: block, text, count=1)
        else:
            text = text.rstrip() + f"\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return list(sections)


def render_saved(paths: list[Path]) -> str:
    """One Markdown section from the rows of several ``bench.train --json`` files: the provenance
    of the first, with every run's command and start (date and machine with its load average)."""
    runs = [json.loads(path.read_text()) for path in paths]
    rows = [r for run in runs for r in run["rows"] if "error" not in r]
    meta = {
        **runs[0]["meta"],
        "command": "; ".join(run["meta"]["command"] for run in runs),
        "device": "; ".join(f"{run['meta']['device']} ({run['meta']['date']})" for run in runs),
    }
    return render(summarize(rows), meta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", type=Path, help="files written by bench.train --json")
    p.add_argument("--markdown", type=Path, help="write the table into this file's section")
    p.add_argument("--section", default="epochs-cpu", help="the Markdown section's name")
    args = p.parse_args(argv)
    section = render_saved(args.json)
    print(section)
    if args.markdown:
        update_markdown(args.markdown, {args.section: section})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
