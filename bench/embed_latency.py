"""Latency of ``POST /models/{model}/embed`` for one short text (issue 36's target: p50 < 50 ms with
all-MiniLM-L6-v2 on the CPU), and where its time goes.

The app runs in this process (``api.main.create_app`` under Starlette's ``TestClient``, with a fresh
data directory: the embedded default, a tenant's API key, its lifespan), so that the wall time of each
request and the CPU time this process spent on it (all its threads: the route's worker thread
included) are measured on one clock. Besides the whole request, the same text through
``shared.inference.embed.embed_texts`` alone (what the route runs once the model is found) and through
``SentenceTransformer.encode`` alone: the difference is the HTTP, authentication and model look-up
cost. On a machine shared with other work, CPU time is the figure that load does not inflate.

    python -m bench.embed_latency [--model all-MiniLM-L6-v2] [--requests 60]

Prints one JSON object: p50 and p90 of wall and CPU milliseconds for each, torch's threads.
"""

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

TEXT = "How do volcanoes form?"


def percentiles(call: Callable[[], object], requests: int) -> dict[str, float]:
    """p50/p90 of wall and process-CPU milliseconds of ``call`` over ``requests`` calls, after 5 warm-ups."""
    for _ in range(5):
        call()
    wall, cpu = [], []
    for _ in range(requests):
        w, c = time.perf_counter(), time.process_time()
        call()
        wall.append((time.perf_counter() - w) * 1000)
        cpu.append((time.process_time() - c) * 1000)
    wall.sort()
    cpu.sort()
    at = lambda values, q: round(values[int(q * (len(values) - 1))], 1)  # noqa: E731
    return {"wall_p50": at(wall, 0.5), "wall_p90": at(wall, 0.9), "cpu_p50": at(cpu, 0.5), "cpu_p90": at(cpu, 0.9)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--requests", type=int, default=60)
    args = p.parse_args(argv)
    os.environ["TUNEJOB_DATA_DIR"] = tempfile.mkdtemp(prefix="bench-embed-")
    from fastapi.testclient import TestClient

    from api.main import create_app
    from api.routers.inference import embedder_cache
    from shared.store.keys import create_key

    with TestClient(create_app(), base_url="http://localhost") as client:
        client.headers["Authorization"] = f"Bearer {create_key('bench')[0]}"
        path, body = f"/models/{args.model}/embed", {"inputs": [TEXT]}

        def request() -> None:
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text

        result = {"request": percentiles(request, args.requests)}
        import torch

        from shared.inference.embed import embed_texts

        cached = next(iter(embedder_cache()._models.values()))
        result["embed_texts"] = percentiles(lambda: embed_texts(cached.loaded, [TEXT]), args.requests)
        result["encode"] = percentiles(
            lambda: cached.loaded.model.encode([TEXT], show_progress_bar=False), args.requests
        )
        result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
