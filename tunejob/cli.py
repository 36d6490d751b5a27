# PYTHON_ARGCOMPLETE_OK (argcomplete's global activation completes the commands this module parses)
"""The ``tunejob`` command: ``serve`` (API + workers, the embedded default), ``api``, ``worker``,
``db upgrade|reseal``, ``keys create|list|revoke``, ``doctor``, ``completion``, and the HTTP client's ``datasets``,
``models``, ``jobs``, ``sweeps``, ``predict``, ``webhooks`` and ``health`` (``client.cli``); ``--version``."""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version

from client import cli as client_cli

# No gossip or mingle (Celery's worker-to-worker events and start-up sync, for remote control and
# revokes, which tunejob never uses: a cancel is a flag on the job row): a solo pool busy training
# answers no gossip, and its peers logged "Substantial drift ... clocks are out of sync" of it.
WORKER_ARGS = [
    "worker",
    "--pool=solo",
    "--concurrency=1",
    "--loglevel=INFO",
    "-Q",
    "tunejob",
    "--without-gossip",
    "--without-mingle",
]
# `serve` runs its worker at a lower CPU priority: on a shared CPU the API's requests (milliseconds
# each) come first, and training takes every cycle they leave.
SERVE_WORKER_NICENESS = 10


def prepare_api(host: str) -> None:
    """Before the API listens on ``host``: migrate the store, and make sure a key exists
    (``shared.store.keys.ensure_key_for``: a local key on loopback; no key beyond it is an error)."""
    from shared.store.engine import upgrade_database
    from shared.store.keys import NoKeyError, ensure_key_for

    upgrade_database()
    require_bucket("tunejob")
    require_secret_key("tunejob")
    try:
        path = ensure_key_for(host)
    except NoKeyError as e:
        sys.exit(f"tunejob: {e}")
    if path is not None:
        print(
            f"tunejob: no API key existed; created one for tenant 'default' in {path} (mode 0600). Send it as "
            "`Authorization: Bearer <key>`.",
            flush=True,
        )


def require_bucket(program: str) -> None:
    """Exit with the reason when ``TUNEJOB_STORAGE_URL``'s bucket does not answer these credentials
    (``shared.store.objects.bucket_problem``), before the process serves or takes a job."""
    from shared.settings import get_settings
    from shared.store.objects import bucket_problem

    problem = bucket_problem()
    if problem is not None:
        sys.exit(
            f"{program}: the object storage {get_settings().storage_url} cannot be used: {problem} (check "
            "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and that the bucket exists)"
        )


def require_secret_key(program: str) -> None:
    """Exit with the reason when ``TUNEJOB_SECRET_KEY`` is set but is no list of Fernet keys: the
    API started, and every webhook request answered 500."""
    from shared.settings import get_settings
    from shared.store.sealed import fernet

    if get_settings().secret_key:
        try:
            fernet()
        except ValueError as e:
            sys.exit(f"{program}: {e}")


def announce_dashboard(host: str, port: int, link: str | None) -> None:
    """Say where the dashboard is. The one-time sign-in ``link`` signs in as the local admin key, so
    it is printed only to a terminal; otherwise (stdout goes to a log, which log shippers copy) it
    is written to ``<data dir>/signin_link`` (mode 0600) and only that path is printed."""
    if link is None:
        print(f"tunejob: dashboard at http://{host}:{port}/ui (sign in with an API key)", flush=True)
        return
    if sys.stdout.isatty():
        print(
            f"tunejob: dashboard: {link} (signs one browser in, once, within 15 minutes; then sign in at "
            "/ui/login with an API key)",
            flush=True,
        )
        return
    from shared.settings import get_settings

    path = get_settings().data_path / "signin_link"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an older file's mode too
    with os.fdopen(fd, "w") as f:
        f.write(link + "\n")
    print(
        f"tunejob: dashboard at http://{host}:{port}/ui; a one-time sign-in link (15 minutes) is in {path}", flush=True
    )


def signin_link(host: str, port: int) -> str | None:
    """A one-time link that signs a browser in to the dashboard (``/ui``) with the local key of
    ``tunejob serve`` (``<data dir>/api_key``); None when there is no usable local key."""
    from shared.store import ui_sessions
    from shared.store.keys import authenticate, local_key_path

    path = local_key_path()
    caller = authenticate(path.read_text().strip()) if path.is_file() else None
    if caller is None or caller.key_id is None:
        return None
    shown = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else (f"[{host}]" if ":" in host else host)
    return f"http://{shown}:{port}/ui/signin/{ui_sessions.signin_link(caller.key_id)}"


def run_api(host: str, port: int, workers: int = 1) -> None:
    """The API in this process, or in ``workers`` processes (uvicorn's), which count their HTTP
    metrics in a fresh directory of their own (Prometheus multiprocess mode, ``api.metrics``),
    removed when they stop."""
    from api.server import run

    if workers == 1:
        from api.main import create_app

        run(create_app(bound_host=host), host, port)
        return
    os.environ["TUNEJOB_HOST"] = host  # each process makes `api.main.app`, which serves TUNEJOB_HOST
    with tempfile.TemporaryDirectory(prefix="tunejob-metrics-") as metrics_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        run("api.main:app", host, port, workers)


def proxy_options(proxy_headers: bool | None, forwarded_allow_ips: str | None) -> None:
    """``--proxy-headers`` and ``--forwarded-allow-ips`` given: they become the settings
    (``TUNEJOB_PROXY_HEADERS``, ``TUNEJOB_FORWARDED_ALLOW_IPS``) of this process and of the API
    processes it starts, as ``--host`` does (``run_api``)."""
    from shared.settings import get_settings

    if proxy_headers is not None:
        os.environ["TUNEJOB_PROXY_HEADERS"] = str(proxy_headers).lower()
    if forwarded_allow_ips is not None:
        os.environ["TUNEJOB_FORWARDED_ALLOW_IPS"] = forwarded_allow_ips
    get_settings.cache_clear()


def require_shared_rate_limits(api_workers: int) -> None:
    """Several API processes must share the rate-limit counters: with ``api_workers`` > 1 and
    counters in each process's memory (``TUNEJOB_RATE_LIMIT_STORAGE_URL=memory://``, the default),
    refuse to start rather than let each key make N times its rate.

    Raises:
        SystemExit: that refusal.
    """
    from shared.settings import get_settings

    settings = get_settings()
    if api_workers > 1 and settings.rate_limit_storage_url.startswith("memory://"):
        broker = settings.celery_broker_url
        example = broker if broker.startswith("redis") else "redis://HOST:6379/0"
        sys.exit(
            f"tunejob: {api_workers} API processes need rate-limit counters that they share, but "
            f"TUNEJOB_RATE_LIMIT_STORAGE_URL is {settings.rate_limit_storage_url!r} (each process's own memory, "
            f"so each key could make {api_workers} times its TUNEJOB_RATE_LIMIT). Set it to a Redis, e.g. "
            f"TUNEJOB_RATE_LIMIT_STORAGE_URL={example}, or run one API process."
        )


def serve_api(host: str, port: int, workers: int = 1) -> None:
    """``tunejob api``: ``workers`` API processes (``require_shared_rate_limits``)."""
    require_shared_rate_limits(workers)
    prepare_api(host)
    run_api(host, port, workers)


def serve(host: str, port: int, workers: int = 1, gpus: str | None = None, api_workers: int = 1) -> None:
    """Run the API (in ``api_workers`` processes, ``run_api``) and its worker processes
    (``worker_launches``); Ctrl-C (or SIGTERM) stops them all."""
    # uvicorn re-raises the signal that stopped it; as SystemExit it reaches the `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    require_shared_rate_limits(api_workers)
    launches = worker_launches(workers, gpus)
    prepare_api(host)  # before the workers start: they may refuse to start
    supervised = Workers(launches)
    announce_dashboard(host, port, signin_link(host, port))
    try:
        run_api(host, port, api_workers)
    finally:
        supervised.stop()


class Workers:
    """The worker processes of ``serve``, started again when one exits while ``serve`` runs: a
    worker killed by the kernel's out-of-memory killer (a job too large for the machine) or that
    crashed left ``serve`` accepting jobs that no worker would run. Its job is queued again once
    its lease (``TUNEJOB_LEASE_SECONDS``) lapses, and resumes from its last checkpoint.

    Each worker runs in a session of its own, so a terminal's Ctrl-C reaches ``serve`` only, which
    then stops them (``stop``: SIGTERM, each checkpoints its job and queues it again); a worker's
    exit is then never mistaken for a crash. A worker that exits within ``QUICK_EXIT_SECONDS`` of
    its start (one that cannot start: a broken install, a GPU gone) is started again after a delay
    that doubles up to ``MAX_RESTART_DELAY_SECONDS``, not in a busy loop.

    Args:
        launches: each worker's (command, environment) (``worker_launches``).
    """

    QUICK_EXIT_SECONDS = 30.0
    MAX_RESTART_DELAY_SECONDS = 60.0

    def __init__(self, launches: list[tuple[list[str], dict[str, str]]], poll_seconds: float = 1.0):
        self.launches, self.poll_seconds = launches, poll_seconds
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # no worker starts while stop() runs
        self.processes: list[subprocess.Popen | None] = [self._start(i) for i in range(len(launches))]
        self.started_at = [time.monotonic()] * len(launches)
        self.delays = [0.0] * len(launches)  # before the next start, after a quick exit
        self.due = [0.0] * len(launches)  # when a worker that exited starts again
        threading.Thread(target=self._watch, name="serve-workers", daemon=True).start()

    def _start(self, i: int) -> subprocess.Popen:
        args, env = self.launches[i]
        return subprocess.Popen(args, env=env, start_new_session=True)

    def _watch(self) -> None:
        while not self.stopping.wait(self.poll_seconds):
            with self.lock:
                if self.stopping.is_set():
                    return
                for i, process in enumerate(self.processes):
                    if process is not None and process.poll() is not None:
                        self._exited(i, process)
                    elif process is None and time.monotonic() >= self.due[i]:
                        self.processes[i], self.started_at[i] = self._start(i), time.monotonic()

    def _exited(self, i: int, dead: subprocess.Popen) -> None:
        """Say that worker ``i`` exited, and when it starts again."""
        lived = time.monotonic() - self.started_at[i]
        quick = lived < self.QUICK_EXIT_SECONDS
        self.delays[i] = min(self.MAX_RESTART_DELAY_SECONDS, max(1.0, 2 * self.delays[i])) if quick else 0.0
        self.processes[i], self.due[i] = None, time.monotonic() + self.delays[i]
        code = dead.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        oom = " (the kernel's out-of-memory killer sends SIGKILL)" if code == -signal.SIGKILL else ""
        print(
            f"tunejob: worker {i + 1} (pid {dead.pid}) {how}{oom} after {lived:.0f} s; starting another"
            + (f" in {self.delays[i]:.0f} s" if self.delays[i] else "")
            + "; a job it ran is queued again once its lease lapses",
            file=sys.stderr,
            flush=True,
        )

    def stop(self) -> None:
        """SIGTERM every worker and wait up to 60 s for each (then SIGKILL); none is started again."""
        with self.lock:
            self.stopping.set()
        running = [p for p in self.processes if p is not None]
        for process in running:
            process.terminate()
        for process in running:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def worker_launches(workers: int, gpus: str | None) -> list[tuple[list[str], dict[str, str]]]:
    """The (command, environment) of each worker ``serve`` starts: ``workers`` of them, or with
    ``gpus`` (``all``, or indices such as ``0,1``) one per GPU, each seeing only its own
    (``CUDA_VISIBLE_DEVICES``, read by CUDA when torch first touches it). Each runs one job at a time.

    Raises:
        SystemExit: ``gpus`` is not ``all`` or a list of indices, ``all`` finds no CUDA GPU, or an
            index is not a GPU of this machine.
    """
    args = [
        sys.executable,
        "-m",
        "tunejob",
        "worker",
        "--nice",
        str(SERVE_WORKER_NICENESS),
        "--parent",
        str(os.getpid()),
    ]
    if gpus is None:
        return [(args, dict(os.environ)) for _ in range(workers)]
    import torch

    count = torch.cuda.device_count()  # the GPUs of this machine, unless CUDA_VISIBLE_DEVICES hides some
    if gpus == "all":
        devices = [str(i) for i in range(count)]
        if not devices:
            sys.exit("tunejob serve: --gpus all found no CUDA GPU")
    else:
        devices = [d.strip() for d in gpus.split(",")]
        if not all(d.isdigit() for d in devices) or len(set(devices)) != len(devices):
            sys.exit(f"tunejob serve: --gpus {gpus!r}: give all, or distinct GPU indices such as 0,1")
        absent = [d for d in devices if int(d) >= count]
        if absent and "CUDA_VISIBLE_DEVICES" not in os.environ:  # a worker would train on the CPU instead
            sys.exit(
                f"tunejob serve: --gpus {gpus}: no CUDA GPU {', '.join(absent)} on this machine "
                f"(torch sees {count}{f', 0 to {count - 1}' if count else ''}); drop --gpus to train on the CPU"
            )
    # --gpu too: a worker pinned to a GPU it cannot see refuses to start (``run_worker``)
    return [([*args, "--gpu", d], {**os.environ, "CUDA_VISIBLE_DEVICES": d}) for d in devices]


def exit_with_parent(parent: int) -> None:
    """SIGTERM this process once process ``parent`` is no longer its parent: ``tunejob serve``
    killed with SIGKILL cannot stop its workers, which would otherwise train on beside the workers
    of the next ``serve``. The worker then stops as on ``serve``'s own Ctrl-C: its job checkpointed
    and queued again (``worker.tasks``). A daemon thread compares ``os.getppid()`` (an orphan is
    re-parented) with ``parent`` each second, from the start: ``serve`` passes its pid, so a
    ``serve`` that died before the worker got here counts too."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def run_worker(gpu: int | None, niceness: int = 0, parent: int | None = None) -> None:
    """One Celery worker running one job at a time (solo pool, prefetch 1), pinned to GPU ``gpu``,
    at CPU priority ``niceness`` (added to its nice value, before any thread starts); given
    ``parent`` (a pid), it stops once that process is gone (``exit_with_parent``)."""
    if niceness:
        os.nice(niceness)
    if parent is not None:
        exit_with_parent(parent)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # before torch is imported anywhere
    from shared.settings import get_settings
    from worker.device import resolve_device, reuse_freed_cpu_memory

    settings = get_settings()
    try:
        device, note = resolve_device(settings.device)
    except RuntimeError as e:
        sys.exit(f"tunejob worker: {e}")
    if gpu is not None and device.type != "cuda":  # pinned to a GPU it cannot see: not a CPU worker
        sys.exit(f"tunejob worker: --gpu {gpu}: torch sees no such CUDA GPU here (nvidia-smi lists the GPUs)")
    if device.type == "cpu" and settings.cpu_reuse_freed_memory:
        reuse_freed_cpu_memory()
    print(f"tunejob worker: training on {device}" + (f" ({note})" if note else ""), flush=True)
    from shared.store.engine import upgrade_database
    from worker.tasks import app

    upgrade_database()
    require_bucket("tunejob worker")
    # a node name of its own (Celery's default, celery@<host>, is every worker's on a host: its
    # remote control and `celery inspect` would take two workers of one box for one)
    name = f"tunejob-{'cpu' if gpu is None else f'gpu{gpu}'}-{os.getpid()}@%h"
    app.worker_main([*WORKER_ARGS, "--hostname", name])


def manage_keys(args: argparse.Namespace) -> None:
    """``tunejob keys create|list|revoke``: the new key alone on stdout (shown once), the rest on stderr."""
    from shared.errors import UserError
    from shared.store import keys
    from shared.store.engine import upgrade_database

    upgrade_database()
    try:
        if args.keys_command == "create":
            key, row = keys.create_key(args.tenant, args.admin, args.name)
            print(key)
            print(
                f"created {row.id} for tenant {row.tenant!r}{' (admin: sees every tenant)' if row.admin else ''}; "
                "the key is shown only this once",
                file=sys.stderr,
            )
        elif args.keys_command == "list":
            print(f"{'id':22} {'prefix':12} {'tenant':20} {'admin':5} {'created (UTC)':19} {'revoked (UTC)':19} name")
            for k in keys.list_keys():
                revoked = f"{k.revoked_at:%Y-%m-%d %H:%M:%S}" if k.revoked_at else "-"
                print(
                    f"{k.id:22} {k.prefix:12} {k.tenant:20} {'yes' if k.admin else 'no':5} "
                    f"{k.created_at:%Y-%m-%d %H:%M:%S} {revoked:19} {k.name or ''}"
                )
        else:
            row = keys.revoke_key(args.key_id)
            print(
                f"revoked {row.id} ({row.prefix}…, tenant {row.tenant!r}) at {row.revoked_at:%Y-%m-%d %H:%M:%S} UTC",
                file=sys.stderr,
            )
    except UserError as e:
        sys.exit(f"tunejob keys: {e.message}")


COMPLETION_SHELLS = ("bash", "zsh", "fish")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (argcomplete's protocol)
        import argcomplete

        argcomplete.autocomplete(parser())  # answers from the whole parser, client commands included, and exits
    if argv[:1] and argv[0] in client_cli.COMMANDS:  # the client starts without the server stack
        sys.exit(client_cli.main(argv))
    whole = parser()
    args = whole.parse_args(argv)
    from sqlalchemy.exc import OperationalError

    try:
        run_command(whole, args)
    except OperationalError as e:  # at start (a running API answers 503, a worker retries): one line, no traceback
        from sqlalchemy.engine import make_url

        from shared.settings import get_settings

        url = make_url(get_settings().sqlalchemy_url).render_as_string(hide_password=True)
        sys.exit(f"tunejob {args.command}: the job store {url} cannot be used: {str(e.orig).splitlines()[0]}")
    except BrokenPipeError:  # `tunejob completion bash | head`: the reader left (as the client commands)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error as Python exits
        sys.exit(1)


def run_command(whole: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Run one of the server commands (``serve``, ``api``, ``worker``, ``keys``, ``doctor``,
    ``completion``, ``db``) as parsed by ``whole``."""
    if args.command in ("serve", "api"):
        proxy_options(args.proxy_headers, args.forwarded_allow_ips)
    if args.command == "serve":
        if args.workers < 1 or args.api_workers < 1:
            whole.error("serve: --workers and --api-workers must be at least 1")
        serve(args.host, args.port, args.workers, args.gpus, args.api_workers)
    elif args.command == "api":
        if args.workers < 1:
            whole.error("api: --workers must be at least 1")
        serve_api(args.host, args.port, args.workers)
    elif args.command == "worker":
        run_worker(args.gpu, args.nice, args.parent)
    elif args.command == "keys":
        manage_keys(args)
    elif args.command == "doctor":
        from worker.doctor import run_doctor

        sys.exit(run_doctor(args.json))
    elif args.command == "completion":
        import argcomplete

        print(argcomplete.shellcode(["tunejob"], shell=args.shell), flush=True)  # a closed pipe raises here
    elif args.command == "db":
        from shared.store.engine import database_revision, upgrade_database

        before = database_revision()
        upgrade_database()
        after = database_revision()
        print(
            f"database upgraded from {before or 'empty'} to {after}"
            if before != after
            else f"database already at {after}, the latest revision"
        )
        if args.db_command == "reseal":
            from shared.jobs.webhooks import reseal_secrets

            require_secret_key("tunejob db reseal")  # with no endpoint to read, a malformed key went unnoticed
            try:
                print(f"{reseal_secrets()} webhook endpoints' secrets encrypted with the first key")
            except ValueError as e:  # not the key the secrets were sealed with
                sys.exit(f"error: {e}")


def parser() -> argparse.ArgumentParser:
    """The whole ``tunejob`` command line: the server commands and the client's (``client.cli``)."""
    from shared.settings import get_settings

    settings = get_settings()
    parser = argparse.ArgumentParser(prog="tunejob", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('tunejob')}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("serve", "API and its workers on this machine"), ("api", "the API only")]:
        p = commands.add_parser(name, help=help_)
        p.add_argument("--host", default=settings.host)
        p.add_argument("--port", type=int, default=settings.port)
        p.add_argument(
            "--proxy-headers",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="trust X-Forwarded-For/-Proto from --forwarded-allow-ips (default: TUNEJOB_PROXY_HEADERS, on)",
        )
        p.add_argument(
            "--forwarded-allow-ips",
            default=None,
            metavar="IPS",
            help="comma-separated proxy addresses, or * (default: TUNEJOB_FORWARDED_ALLOW_IPS, 127.0.0.1)",
        )
    serving = commands.choices["serve"]
    commands.choices["api"].add_argument(
        "--workers",
        type=int,
        default=1,
        help="API processes (more than 1 needs TUNEJOB_RATE_LIMIT_STORAGE_URL=redis://…)",
    )
    workers = serving.add_mutually_exclusive_group()
    workers.add_argument("--workers", type=int, default=1, help="worker processes, each running one job at a time")
    workers.add_argument("--gpus", help="one worker per GPU: all, or indices such as 0,1 (each sees only its own)")
    serving.add_argument(
        "--api-workers",
        type=int,
        default=1,
        help="API processes (more than 1 needs TUNEJOB_RATE_LIMIT_STORAGE_URL=redis://…)",
    )
    p = commands.add_parser("worker", help="a training worker")
    p.add_argument("--gpu", type=int, default=None, help="pin to this CUDA device index")
    p.add_argument("--nice", type=int, default=0, help="lower the worker's CPU priority by this much (serve: 10)")
    p.add_argument(
        "--parent",
        type=int,
        default=None,
        metavar="PID",
        help="stop (as on SIGTERM) once process PID, its parent, is gone (serve passes its own)",
    )
    db = commands.add_parser("db", help="database maintenance").add_subparsers(dest="db_command", required=True)
    db.add_parser("upgrade", help="alembic upgrade head")
    db.add_parser("reseal", help="encrypt the stored webhook secrets again with the first key of TUNEJOB_SECRET_KEY")
    k = commands.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    p = k.add_parser("create", help="a new key, printed once")
    p.add_argument("--tenant", required=True, help="the tenant whose datasets and jobs the key reaches")
    p.add_argument("--admin", action="store_true", help="the key sees every tenant's datasets and jobs")
    p.add_argument("--name", help="a label for people")
    k.add_parser("list", help="every key: id, prefix, tenant, admin, created, revoked")
    p = k.add_parser("revoke", help="requests with the key fail from now on")
    p.add_argument("key_id", help="the key's id (key_…) or prefix (tj_…), as `keys list` shows")
    p = commands.add_parser(
        "doctor", help="check this machine's device and the training fast path (exit 1 on a failure)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p = commands.add_parser(
        "completion",
        help="print the shell code that completes tunejob's commands and options",
        description='bash: eval "$(tunejob completion bash)" in ~/.bashrc (argcomplete)',
    )
    p.add_argument("shell", choices=COMPLETION_SHELLS)
    client_cli.add_commands(commands)  # listed in --help; run by main before this parser is built
    return parser
