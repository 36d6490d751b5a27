"""The ``tunejob`` command: ``serve`` (API + one worker, the embedded default), ``api``, ``worker``,
``db upgrade``."""

import argparse
import os
import signal
import subprocess
import sys

from shared.settings import get_settings

WORKER_ARGS = ["worker", "--pool=solo", "--concurrency=1", "--loglevel=INFO", "-Q", "tunejob"]


def serve_api(host: str, port: int) -> None:
    import uvicorn

    from shared.db import upgrade_database

    upgrade_database()
    uvicorn.run("api.main:app", host=host, port=port, log_level="info")


def serve(host: str, port: int) -> None:
    """Run the API and one worker process; Ctrl-C (or SIGTERM) stops both."""
    # uvicorn re-raises the signal that stopped it; as SystemExit it reaches the `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    worker = subprocess.Popen([sys.executable, "-m", "shared.cli", "worker"])
    try:
        serve_api(host, port)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()


def run_worker(gpu: int | None) -> None:
    """One Celery worker running one job at a time (solo pool, prefetch 1), pinned to GPU ``gpu``."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # before torch is imported anywhere
    from worker.device import resolve_device, reuse_freed_cpu_memory

    settings = get_settings()
    try:
        device, note = resolve_device(settings.device)
    except RuntimeError as e:
        sys.exit(f"tunejob worker: {e}")
    if device.type == "cpu" and settings.cpu_reuse_freed_memory:
        reuse_freed_cpu_memory()
    print(f"tunejob worker: training on {device}" + (f" ({note})" if note else ""), flush=True)
    from shared.db import upgrade_database
    from worker.tasks import app

    upgrade_database()
    app.worker_main(WORKER_ARGS)


def main(argv: list[str] | None = None) -> None:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="tunejob", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("serve", "API and one worker on this machine"), ("api", "the API only")]:
        p = commands.add_parser(name, help=help_)
        p.add_argument("--host", default=settings.host)
        p.add_argument("--port", type=int, default=settings.port)
    p = commands.add_parser("worker", help="a training worker")
    p.add_argument("--gpu", type=int, default=None, help="pin to this CUDA device index")
    db = commands.add_parser("db", help="database maintenance").add_subparsers(dest="db_command", required=True)
    db.add_parser("upgrade", help="alembic upgrade head")
    args = parser.parse_args(argv)

    if args.command == "serve":
        serve(args.host, args.port)
    elif args.command == "api":
        serve_api(args.host, args.port)
    elif args.command == "worker":
        run_worker(args.gpu)
    elif args.command == "db":
        from shared.db import upgrade_database

        upgrade_database()
        print("database is at the latest revision")


if __name__ == "__main__":
    main()
