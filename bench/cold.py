"""One configuration in a fresh process, so that it starts cold: per-shape plans (the cuDNN attention
backend's, oneDNN's primitive cache, CUDA graphs, compiled kernels) are process-wide, and a
configuration measured after another would inherit the shapes that one warmed.

    python -m bench.cold SPEC_JSON OUT_JSON

Runs ``spec.jobs`` jobs of ``spec.config`` one after the other in this process (the second one
sees what a long-lived worker has kept from the first) and writes one JSON row per job to OUT_JSON.
``bench.train`` starts this once per configuration and repeat.
"""

import json
import os
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunSpec:
    """What one cold process runs: a configuration (an engine configuration, see ``bench.engine``,
    or a peer name, see ``bench.peers``) on one data set, and how."""

    dataset: str
    config: str
    model: str
    device: str  # auto, cpu or cuda (``worker.device.resolve_device``)
    precision: str  # auto, fp32, bf16 or fp16 (``shared.inference.precision.compute_dtype``)
    batch_size: int
    max_length: int
    train_size: int | None  # None: the whole 80% split
    val_size: int | None
    epochs: int = 1
    jobs: int = 1
    evaluate: bool = False  # held-out accuracy after the epochs
    learning_rate: float = 5e-5
    seed: int = 42
    cpu_memory: str = "reuse"  # reuse: the worker's allocator setting (worker.device.reuse_freed_cpu_memory)
    peak_flops: float | None = None
    repeat: int = 1


def import_model_code(model: str) -> None:
    """Import the model class's code before anything is timed: transformers imports it on first
    use (about 2 s on the 2-core CPU), which would land in the load time of the engine and not of
    the peers (importing ``Trainer`` brings most of it along)."""
    from transformers import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING,
        AutoConfig,
    )

    from shared.jobs.base_models import resolve_model

    config_class = type(AutoConfig.from_pretrained(resolve_model(model)))
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[config_class]
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[config_class]


def run(spec: RunSpec) -> list[dict]:
    """The rows of ``spec``'s jobs; call it in a fresh process."""
    from transformers import logging as hf_logging

    from bench.corpora import CORPORA, load_split
    from bench.engine import run_engine
    from bench.measure import before_job, environment, mfu, peak_memory_mib
    from bench.peers import PEERS, run_peer
    from shared.inference.precision import compute_dtype
    from worker.device import resolve_device, reuse_freed_cpu_memory

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    device, _ = resolve_device(spec.device)
    if device.type == "cpu" and spec.cpu_memory == "reuse":
        reuse_freed_cpu_memory()
    train, val = load_split(spec.dataset, spec.train_size, spec.val_size)
    task = CORPORA[spec.dataset].task
    # token_classification: tags of both parts, so that a held-out tag absent from training is scored
    labels = CORPORA[spec.dataset].label_names(train, *([val] if task == "token_classification" else []))
    dtype = compute_dtype(spec.precision, device)
    held_out = val if spec.evaluate else None
    import_model_code(spec.model)
    rows = []
    for job in range(1, spec.jobs + 1):
        before_job(device)
        if spec.config in PEERS:
            with tempfile.TemporaryDirectory() as out_dir:
                row = run_peer(spec.config, spec, train, held_out, labels, device, out_dir, task)
        else:
            row = run_engine(spec.config, spec, train, held_out, labels, device, task)
        row.update(
            asdict(spec),
            job=job,
            dtype=str(dtype).removeprefix("torch.") if dtype else "fp32",
            train_examples=len(train),
            val_examples=len(val) if spec.evaluate else 0,
            peak_memory_mib=peak_memory_mib(device),
            **mfu(row, row["flops_per_real_token"], spec.peak_flops),
            **environment(device),
        )
        rows.append(row)
        print(
            f"  job {job}: load {row['load_seconds']:.1f} s, epochs "
            + " + ".join(f"{s:.1f}" for s in row["epoch_seconds"])
            + " s, steady "
            + (f"{row['steady_tokens_per_second']:,.0f}" if row["steady_tokens_per_second"] else "n/a")
            + f" real tokens/s, peak {row['peak_memory_mib']:,.0f} MiB",
            flush=True,
        )
        for event in row.get("events", []):  # the engine's (e.g. how its steps run on CUDA)
            print(f"    {event['level']} {event['code']}: {event['message']}", flush=True)
    return rows


def main(argv: list[str]) -> int:
    spec, out = RunSpec(**json.loads(argv[0])), Path(argv[1])
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"  # nothing is downloaded
    with tempfile.TemporaryDirectory(prefix="tunejob-bench-") as data_dir:
        os.environ["TUNEJOB_DATA_DIR"] = data_dir  # the engine's checkpoint directory, never filled
        out.write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
