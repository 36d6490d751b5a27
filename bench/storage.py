"""Object storage throughput and memory (docs/benchmarks.md, "Object storage"): a model directory
with one ``SIZE_MB`` weights file is published to the bucket (multipart upload), downloaded into
a fresh cache (checked against its manifest), and served as ``model.tar`` by the API's own
response code (``api.routers.jobs._tar_response`` over ``shared.store.artifacts.TarStream``)
from a uvicorn server on 127.0.0.1 to an httpx client that streams it. Peak RSS is read after
each phase: a model that were held whole in memory would show as a jump of its size.

    AWS_ENDPOINT_URL=... AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    TUNEJOB_STORAGE_URL=s3://bucket/bench python -m bench.storage [SIZE_MB]

Prints one JSON object: seconds and MB/s of each phase, peak RSS (MiB) before and after.
"""

import json
import os
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(size_mb: int = 1024) -> dict:
    import httpx
    import uvicorn
    from fastapi import FastAPI

    from api.routers.jobs import _tar_response
    from shared.settings import get_settings
    from shared.store import artifacts, objects

    data = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    os.environ["TUNEJOB_DATA_DIR"] = str(data / "a")
    get_settings.cache_clear()
    store = objects.store()
    model = data / "a" / "artifacts" / "job_bench" / "model"
    model.mkdir(parents=True)
    with open(model / "model.safetensors", "wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))
    artifacts.write_manifest(model)
    result = {"size_mb": size_mb, "rss_mib_start": round(peak_rss_mib(), 1)}

    start = time.perf_counter()
    ref = store.publish(model)
    result["upload_s"] = round(time.perf_counter() - start, 2)
    result["rss_mib_after_upload"] = round(peak_rss_mib(), 1)

    os.environ["TUNEJOB_DATA_DIR"] = str(data / "b")  # another host: an empty cache
    get_settings.cache_clear()
    store = objects.store()
    start = time.perf_counter()
    store.local(ref)
    result["download_s"] = round(time.perf_counter() - start, 2)
    result["rss_mib_after_download"] = round(peak_rss_mib(), 1)

    app = FastAPI()
    app.get("/model.tar")(lambda: _tar_response(artifacts.TarStream(store.files(ref)), "model.tar"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    start, received = time.perf_counter(), 0
    with httpx.stream("GET", f"http://127.0.0.1:{port}/model.tar", timeout=600) as r:
        for chunk in r.iter_raw(1 << 20):
            received += len(chunk)
    result["model_tar_s"] = round(time.perf_counter() - start, 2)
    server.should_exit = True
    result["rss_mib_after_model_tar"] = round(peak_rss_mib(), 1)
    mb = received / 1e6
    result.update(model_tar_bytes=received, upload_mb_s=round(mb / result["upload_s"], 1),
                  download_mb_s=round(mb / result["download_s"], 1),
                  model_tar_mb_s=round(mb / result["model_tar_s"], 1))
    store.remove(ref)
    objects.LocalDir().remove(str(data))
    return result


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:2]))))
