"""A model's serving cost, for a sweep's ``latency_ms`` objective: the median wall time of predicting
one fixed batch of texts through the very code the sync predict endpoint runs
(``shared.inference.loop``: ``load_for_inference`` at a precision, then ``predict_texts``).

Cheap and bounded: one batch of at most ``TEXTS`` texts, one untimed warm-up call (first-call
allocations; int8's compile), then ``REPEATS`` timed calls. ``predict_texts`` copies its outputs to
the CPU, so each timed call includes the device's work (no separate synchronisation needed).
"""

import statistics
import time
from pathlib import Path

import torch

from shared.inference.loop import load_for_inference, predict_texts

TEXTS = 32  # the batch: the first validation texts
REPEATS = 5  # timed predictions of it; latency_ms is their median


def latency_ms(
    model_dir: Path, device: torch.device, precision: str, texts: list[str], pairs: list[str] | None = None
) -> float:
    """The median milliseconds over ``REPEATS`` calls of ``predict_texts`` on ``texts[:TEXTS]`` (with
    ``pairs``), the model in ``model_dir`` loaded on ``device`` at ``precision`` (fp32, bf16, int8),
    at its own ``max_length`` as sync predict does.

    Raises:
        UserError: see ``load_for_inference`` (e.g. int8 on a GPU).
    """
    loaded = load_for_inference(model_dir, device, precision)
    texts, pairs = texts[:TEXTS], pairs[:TEXTS] if pairs is not None else None
    predict_texts(loaded, texts, pairs)  # warm-up, not timed
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        predict_texts(loaded, texts, pairs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000
