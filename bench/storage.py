"""Object storage throughput and memory (docs/benchmarks.md, "Object storage"): a model directory
with one ``SIZE_MB`` weights file is published to the bucket (multipart upload), downloaded into
a fresh cache (checked against its manifest), and served as ``model.tar`` by the API's own
response code (``api.routers.jobs._tar_response`` over ``shared.store.artifacts.TarStream``)
from a uvicorn server on 127.0.0.1 to ``curl``, another process (a client in this process would
share the server's GIL). Peak RSS is read after each phase: a model that were held whole in
memory would show as a jump of its size. CPU seconds per GB of this process (the API's share of
the work: obstore, sha256, uvicorn) are recorded too: on a loaded machine they compare code
versions better than wall-clock MB/s.

    AWS_ENDPOINT_URL=... AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    TUNEJOB_STORAGE_URL=s3://bucket/bench python -m bench.storage [SIZE_MB]

Prints one JSON object: seconds, MB/s and CPU s/GB of each phase, peak RSS (MiB) before and after.
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """CPU seconds (user + system) of this process so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(size_mb: int = 1024) -> dict:
    import uvicorn
    from fastapi import FastAPI

    from api.routers.jobs import _tar_response
    from shared.settings import get_settings
    from shared.store import artifacts, objects

    phases: dict[str, tuple[float, float]] = {}  # phase: (wall s, CPU s)

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

    start, cpu = time.perf_counter(), cpu_s()
    ref = store.publish(model)
    phases["upload"] = (time.perf_counter() - start, cpu_s() - cpu)
    result["rss_mib_after_upload"] = round(peak_rss_mib(), 1)

    os.environ["TUNEJOB_DATA_DIR"] = str(data / "b")  # another host: an empty cache
    get_settings.cache_clear()
    store = objects.store()
    start, cpu = time.perf_counter(), cpu_s()
    store.local(ref)
    phases["download"] = (time.perf_counter() - start, cpu_s() - cpu)
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
    start, cpu = time.perf_counter(), cpu_s()
    curl = subprocess.run(
        ["curl", "-sS", "--fail", "-o", "/dev/null", "-w", "%{size_download}", f"http://127.0.0.1:{port}/model.tar"],
        capture_output=True,
        text=True,
        check=True,
    )
    phases["model_tar"] = (time.perf_counter() - start, cpu_s() - cpu)
    server.should_exit = True
    result["rss_mib_after_model_tar"] = round(peak_rss_mib(), 1)
    gb = int(curl.stdout) / 1e9
    for phase, (wall, cpu) in phases.items():
        result.update(
            {
                f"{phase}_s": round(wall, 2),
                f"{phase}_mb_s": round(gb * 1e3 / wall, 1),
                f"{phase}_cpu_s_per_gb": round(cpu / gb, 2),
            }
        )
    result["load_average"] = round(os.getloadavg()[0], 1)
    store.remove(ref)
    objects.LocalDir().remove(str(data))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("size_mb", type=int, nargs="?", default=1024, help="the weights file's size (default 1024)")
    print(json.dumps(main(parser.parse_args().size_mb)))
