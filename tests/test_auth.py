"""API keys, tenants, idempotency keys, caps and quotas, the store's 503, Host and Origin checks;
on every stack.

Tenant isolation is checked on every route of the app, from a table generated from ``app.routes``:
a new route is covered without being listed, and fails here if it forgets the key or the tenant
check. What a new route may need to add is explicit below: ``PUBLIC`` (a route anyone may call,
with the reason), ``PATH_VALUES`` (a value for a new path parameter) and ``REQUESTS`` (a body or
query a route needs).
"""

import io
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pandas as pd
import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from shared.logs import Outage
from shared.settings import get_settings
from tests.conftest import configure_stack, wait_for_status, wait_until
from tests.test_api_errors import assert_error, job_body
from tests.test_api_jobs import labelled_csv, submit, upload
from tests.test_sweeps import sweep_body, wait_for_sweep

# Routes that answer without a key, and why. A public route must also be in api.auth.PUBLIC_PATHS.
PUBLIC = {("GET", "/healthz"): "liveness probe for load balancers and `tunejob serve` callers; no tenant data"}

# Routes only admin keys may call (403 ``admin_key_required`` for a tenant's key), and why.
ADMIN_ONLY = {("GET", "/metrics"): "Prometheus metrics cover every tenant's jobs"}

# A value for each path parameter, from the owner's resources (``ids``: "job", "dataset", "prediction"). Every
# value must name something that exists, so that the owner's request shows the route works.
PATH_VALUES: dict[str, Callable[[dict], str]] = {
    "job_id": lambda ids: ids["job"],
    "prediction_id": lambda ids: ids["prediction"],
    "dataset_id": lambda ids: ids["dataset"],
    "file_id": lambda ids: ids["dataset"],  # /v1/files: a file is a dataset
    "name": lambda ids: "metrics.json",  # an artifact every succeeded job has
    "figure": lambda ids: "confusion_matrix.png",  # a picture of an evaluation report
    "filename": lambda ids: "config.json",  # a file of the model directory
    "step": lambda ids: "1",  # a checkpoint step
    "sweep_id": lambda ids: ids["sweep"],
    "report": lambda ids: "trials.csv",  # a sweep's report file
    "webhook_id": lambda ids: ids["webhook"],
    "alias": lambda ids: "prod",  # a model alias (issue 37)
}

# Extra request arguments (httpx keywords) for routes that need a body or a query, by (method, path).
REQUESTS: dict[tuple[str, str], Callable[[dict], dict]] = {
    ("POST", "/jobs"): lambda ids: {"json": job_body(ids["dataset"])},
    ("POST", "/predictions"): lambda ids: {"json": prediction_body(ids["job"], ids["dataset"])},
    ("POST", "/models/{job_id}/predict"): lambda ids: {"json": {"inputs": ["a good match"]}},
    ("POST", "/datasets"): lambda ids: {"files": {"file": ("t.csv", labelled_csv(rows=8), "text/csv")}},
    ("POST", "/v1/files"): lambda ids: {
        "files": {"file": ("t.csv", labelled_csv(rows=8), "text/csv")},
        "data": {"purpose": "fine-tune"},
    },
    ("POST", "/v1/fine_tuning/jobs"): lambda ids: {"json": {"model": "tiny-bert", "training_file": ids["dataset"]}},
    ("POST", "/sweeps"): lambda ids: {"json": sweep_body(ids["dataset"])},
    ("POST", "/webhooks"): lambda ids: {"json": {"url": WEBHOOK_URL, "events": ["job.succeeded"]}},
    ("PUT", "/models/aliases/{alias}"): lambda ids: {"json": {"job_id": ids["job"]}},
    ("POST", "/models/{job_id}/embed"): lambda ids: {"json": {"inputs": ["a good match"]}},
    ("POST", "/models/{job_id}/rerank"): lambda ids: {"json": {"query": "a match", "documents": ["a", "b"]}},
    ("POST", "/v1/embeddings"): lambda ids: {"json": {"model": "tiny-bert", "input": "a good match"}},
}
WEBHOOK_URL = "http://127.0.0.1:9/hook"  # nothing listens: deliveries fail, which these tests do not look at

# Routes whose owner's request is not sent (it would change what the other checks need).
OWNER_SKIPS = {"DELETE"}

# Routes whose owner's request answers a 4xx for the owner's (succeeded) job: (status, how the error's
# message starts, why).
OWNER_ERRORS = {
    ("GET", "/jobs/{job_id}/checkpoints/{step}/model.tar"): (
        404,
        "checkpoint ",
        "a succeeded job's checkpoints are deleted (tests/test_artifacts.py covers a running job's)",
    ),
    ("GET", "/models/aliases/{alias}"): (
        404,
        "alias ",
        "the alias is made by PUT, whose request comes after GET's in the walk",
    ),
    ("POST", "/models/{job_id}/embed"): (
        422,
        "model ",
        "the owner's job is a classifier; tests/test_embedding.py covers embedding jobs",
    ),
    ("POST", "/models/{job_id}/rerank"): (
        422,
        "job ",
        "the owner's job is a classifier; tests/test_reranking.py covers reranking jobs",
    ),
    ("GET", "/predictions/{prediction_id}/evaluation"): (
        404,
        "prediction ",
        "the owner's prediction has no label_column; tests/test_evaluation.py covers labelled test sets",
    ),
    ("GET", "/predictions/{prediction_id}/evaluation/{figure}"): (
        404,
        "prediction ",
        "the owner's prediction has no label_column; tests/test_evaluation.py covers labelled test sets",
    ),
}

# Routes that refuse the admin's request right after the owner's, by design: (status, code, why).
AGAIN_ERRORS = {
    ("POST", "/webhooks/{webhook_id}/ping"): (
        429,
        "ping_pending",
        "one pending ping per endpoint, and nothing listens at WEBHOOK_URL (issue 34)",
    ),
    ("PUT", "/models/aliases/{alias}"): (
        404,
        "not_found",
        "an alias names a job of its own tenant, an admin's too (issue 37)",
    ),
}


def api_routes(app) -> list[tuple[str, str]]:
    """Every (method, path template) the app serves through FastAPI routes. The documentation pages
    (/docs, /redoc, /openapi.json and their assets) are not API routes: they stay public."""
    return sorted(
        (method, context.path)
        for context in iter_route_contexts(app.routes)
        if isinstance(context.original_route, APIRoute) and context.original_route.include_in_schema
        for method in context.methods
    )


def request_args(method: str, path: str, ids: dict) -> tuple[str, dict]:
    """The concrete URL and httpx arguments of a route for the owner's resources ``ids``."""

    def value(match: re.Match) -> str:
        name = match.group(1).split(":")[0]
        assert name in PATH_VALUES, f"{method} {path}: add a value for path parameter {name!r} to PATH_VALUES"
        return PATH_VALUES[name](ids)

    return re.sub(r"\{([^}]+)\}", value, path), REQUESTS.get((method, path), lambda _: {})(ids)


def prediction_body(job_id: str, dataset_id: str) -> dict:
    return {"model": job_id, "dataset": dataset_id, "text_column": "text"}


@pytest.fixture(scope="module")
def owned(stack) -> dict:
    """A dataset, a finished job (metrics, events, checkpoints, artifacts), a finished prediction
    (events, results), a finished sweep of one trial and a webhook of ``stack.tenant``. Webhook URLs
    to loopback are allowed for the module (``WEBHOOK_URL``)."""
    finished = {"succeeded", "failed", "cancelled"}
    patch = pytest.MonkeyPatch()
    patch.setattr(get_settings(), "webhooks_allow_private_urls", True)
    dataset = upload(stack.client, labelled_csv(rows=24, seed=5))
    job = submit(stack.client, dataset["id"], epochs=1, save_every_steps=1)
    assert wait_for_status(stack.client, job["id"], finished)["status"] == "succeeded"
    prediction = stack.client.post("/predictions", json=prediction_body(job["id"], dataset["id"])).json()
    assert wait_for_status(stack.client, prediction["id"], finished, path="/predictions")["status"] == "succeeded"
    sweep = stack.client.post("/sweeps", json=sweep_body(dataset["id"], max_trials=1)).json()
    assert wait_for_sweep(stack.client, sweep["id"])["status"] == "succeeded"
    webhook = stack.client.post("/webhooks", json={"url": WEBHOOK_URL, "events": ["job.succeeded"]}).json()
    yield {
        "job": job["id"],
        "dataset": dataset["id"],
        "prediction": prediction["id"],
        "sweep": sweep["id"],
        "webhook": webhook["id"],
    }
    patch.undo()


@pytest.fixture(scope="module")
def other(stack):
    return stack.client_for("tenant-b")


@pytest.fixture(scope="module")
def admin(stack):
    return stack.client_for("ops", admin=True)


# ----------------------------------------------------------------------------- keys on every route


def test_every_route_but_the_public_ones_needs_a_valid_key(stack, owned):
    anonymous = stack.client_for("unused")
    anonymous.headers.pop("Authorization")
    routes = api_routes(stack.app)
    assert ("GET", "/jobs/{job_id}") in routes and ("POST", "/datasets") in routes  # the table is not empty
    for method, path in routes:
        url, kwargs = request_args(method, path, owned)
        if (method, path) in PUBLIC:
            assert anonymous.request(method, url, **kwargs).status_code == 200, (method, path)
            continue
        r = anonymous.request(method, url, **kwargs)
        assert_error(r, 401, "missing_api_key", "Authorization")
        assert r.headers["www-authenticate"] == "Bearer", (method, path)
        r = anonymous.request(method, url, headers={"Authorization": "Bearer tj_not-a-key"}, **kwargs)
        assert_error(r, 401, "invalid_api_key", "Authorization")
    for page in ("/docs", "/redoc", "/openapi.json"):  # static, no tenant data: public
        assert anonymous.get(page).status_code == 200, page


def test_another_tenant_gets_404_on_every_route_and_sees_nothing(stack, owned, other, admin):
    """For every route: another tenant's request for the owner's resources is a 404 (a route
    without resources in its path must not show them either); the owner and an admin get them."""
    owner_ids = set(owned.values())
    for method, path in api_routes(stack.app):
        if (method, path) in PUBLIC:
            continue
        url, kwargs = request_args(method, path, owned)
        r = other.request(method, url, **kwargs)
        if "{" in path:  # 404; the model routes name it unknown_model, as for a job id that does not exist
            assert r.status_code == 404 and r.json()["error"]["code"] in ("not_found", "unknown_model"), r.text
        elif any(i in repr(kwargs) for i in owner_ids):  # a body naming the owner's resources (it may echo them)
            assert 400 <= r.status_code < 500, f"{method} {path} accepted another tenant's resources: {r.text[:300]}"
        else:
            assert not any(i in r.text for i in owner_ids), (
                f"{method} {path} shows another tenant's ids: {r.text[:300]}"
            )
        if method in OWNER_SKIPS:
            continue
        if (method, path) in ADMIN_ONLY:
            assert_error(stack.client.request(method, url, **kwargs), 403, "admin_key_required")
            assert admin.request(method, url, **kwargs).status_code == 200, (method, path)
            continue
        for who, client in (("owner", stack.client), ("admin", admin)):
            r = client.request(method, url, **kwargs)
            if (method, path) in OWNER_ERRORS:
                assert r.status_code == OWNER_ERRORS[method, path][0], f"{who}: {method} {url} -> {r.text[:300]}"
                assert r.json()["error"]["message"].startswith(OWNER_ERRORS[method, path][1]), r.text  # not the job's
            elif who == "admin" and (method, path) in AGAIN_ERRORS:
                assert_error(r, *AGAIN_ERRORS[method, path][:2])
            else:
                assert r.status_code < 400, f"{who}: {method} {url} -> {r.status_code} {r.text[:300]}"
    # Nothing the other tenant sent changed the owner's resources.
    assert stack.client.get(f"/jobs/{owned['job']}").json()["status"] == "succeeded"
    assert stack.client.get(f"/datasets/{owned['dataset']}").status_code == 200


def test_lists_hold_only_the_callers_rows_and_admins_see_all(stack, owned, other, admin):
    theirs = upload(other, labelled_csv(rows=8, seed=9))
    mine = {d["id"] for d in stack.client.get("/datasets").json()["data"]}
    assert owned["dataset"] in mine and theirs["id"] not in mine
    visible_to_other = {d["id"] for d in other.get("/datasets").json()["data"]}
    assert theirs["id"] in visible_to_other and not visible_to_other & mine
    everyone = {d["id"] for d in admin.get("/datasets").json()["data"]}
    assert {owned["dataset"], theirs["id"]} <= everyone
    assert owned["job"] in {j["id"] for j in admin.get("/jobs", params={"limit": 100}).json()["data"]}
    assert owned["job"] not in {j["id"] for j in other.get("/jobs", params={"limit": 100}).json()["data"]}
    # A cursor naming another tenant's job is refused like an unknown one.
    assert_error(other.get("/jobs", params={"cursor": owned["job"]}), 422, "invalid_cursor", "cursor")
    # Another tenant's dataset cannot be trained on, and the refusal does not confirm it exists.
    error = assert_error(
        other.post("/jobs", json=job_body(owned["dataset"])), 422, "unknown_dataset", "training_dataset"
    )
    assert "does not exist" in error["message"]


def test_a_revoked_key_fails_at_once(stack):
    """Revoking a key in another process (``tunejob keys revoke``) refuses its very next request,
    although the API has its caller cached (``shared.store.keys.key_cache``). On SQLite whether it
    still is when the revocation lands depends on the other writers of the store, so the cache's
    own rule is tested without them below; on PostgreSQL only key changes empty it, so the key is
    in the cache when it is revoked."""
    from shared.store.keys import create_key, hash_key, key_cache

    key, row = create_key("tenant-r")
    client = stack.client_for("unused")
    client.headers["Authorization"] = f"Bearer {key}"
    assert [client.get("/jobs").status_code for _ in range(2)] == [200, 200]
    if stack.name == "postgres+redis":  # cached once the notifications of the keys made above are in
        cache = key_cache(get_settings().sqlalchemy_url)
        wait_until(
            lambda: client.get("/jobs").status_code == 200 and hash_key(key) in cache.values, "the key is cached"
        )
    subprocess.run([sys.executable, "-m", "tunejob", "keys", "revoke", row.id], check=True, capture_output=True)
    assert_error(client.get("/jobs"), 401, "invalid_api_key")
    assert_error(client.get("/datasets"), 401, "invalid_api_key")


def test_cached_keys_keep_to_their_own_tenant(stack, owned, other):
    """The cache finds a caller by the hash of the whole key: requests of two tenants' keys,
    interleaved once both are cached, each get their own answer, and a forged key that shares a
    cached key's prefix is refused."""
    for _ in range(2):
        assert stack.client.get(f"/jobs/{owned['job']}").status_code == 200
        assert_error(other.get(f"/jobs/{owned['job']}"), 404, "not_found")
        assert_error(other.get(f"/jobs/{owned['job']}/metrics"), 404, "not_found")
    key = stack.client.headers["Authorization"].removeprefix("Bearer ")
    forged = stack.client_for("unused")
    forged.headers["Authorization"] = f"Bearer {key[:-4]}{'AAAA' if key[-4:] != 'AAAA' else 'BBBB'}"
    assert_error(forged.get(f"/jobs/{owned['job']}"), 401, "invalid_api_key")


def test_the_key_cache_drops_what_was_looked_up_before_a_commit(tmp_path):
    """A caller looked up before another connection's commit (which may have revoked the key) is
    not stored; one looked up after it is kept until the next commit."""
    from shared.store.cache import KEYS, SqliteCache
    from shared.store.tenancy import Caller

    path = tmp_path / "store.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("CREATE TABLE t (x)")
    cache = SqliteCache(str(path), KEYS.max_entries)
    _, before = cache.get("digest")
    writer.execute("INSERT INTO t VALUES (1)")  # e.g. `tunejob keys revoke`, during the lookup
    cache.put("digest", Caller("t"), before)
    caller, now = cache.get("digest")
    assert caller is None and now != before
    cache.put("digest", Caller("t"), now)
    assert cache.get("digest") == (Caller("t"), now)
    writer.execute("INSERT INTO t VALUES (2)")
    assert cache.get("digest")[0] is None


def test_postgres_key_caches_of_two_processes_drop_a_revoked_key_and_do_without_a_listener(tmp_path):
    """Two API processes' caches on one PostgreSQL store (two ``PostgresCache``, each with its
    own listening connection): a key revoked elsewhere leaves both, and a cache whose listening
    connection is lost empties and caches again only once it listens again."""
    import psycopg

    from shared.store.cache import KEYS, PostgresCache
    from shared.store.engine import upgrade_database
    from shared.store.keys import authenticate, create_key, hash_key, revoke_key
    from tests.conftest import POSTGRES_URL

    drop = configure_stack("postgres+redis", {"TUNEJOB_DATA_DIR": str(tmp_path)})
    try:
        upgrade_database()
        key, row = create_key("tenant-c")  # before the caches listen: no notification still to come
        caller, digest = authenticate(key), hash_key(key)
        conninfo = get_settings().sqlalchemy_url.replace("+psycopg", "")
        caches = [PostgresCache(conninfo, KEYS) for _ in range(2)]
        wait_until(lambda: all(c.get(digest)[1] is not None for c in caches), "both caches listen")
        for cache in caches:
            cache.put(digest, caller, cache.get(digest)[1])
            assert cache.get(digest)[0] == caller

        revoke_key(row.id)
        wait_until(lambda: all(c.get(digest)[0] is None for c in caches), "both caches drop the revoked key")
        assert authenticate(key) is None

        lost = caches[0]
        before = lost.get(digest)[1]
        lost.put(digest, caller, before)
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [lost.listener_pid])
        wait_until(lambda: lost.get(digest)[0] is None, "the cache empties when its listener is lost")
        lost.put(digest, caller, before)  # looked up before the loss: not kept
        assert lost.get(digest)[0] is None
        wait_until(lambda: lost.get(digest)[1] not in (None, before), "the cache listens again")
        lost.put(digest, caller, lost.get(digest)[1])
        assert lost.get(digest)[0] == caller
    finally:
        drop()


# ----------------------------------------------------------------------------- idempotency keys


def job_ids(client) -> set[str]:
    """The caller's jobs but sweeps' trials: the sweeps that the route checks above start go on
    adding trials while later tests run (which made these before/after comparisons flaky)."""
    return {j["id"] for j in client.get("/jobs", params={"limit": 100}).json()["data"] if j["sweep_id"] is None}


def test_idempotent_job_submission_replays_the_first_response(stack, owned):
    before = job_ids(stack.client)
    body = job_body(owned["dataset"], metadata={"run": "idempotent"})
    headers = {"Idempotency-Key": "submit-1"}
    first = stack.client.post("/jobs", json=body, headers=headers)
    assert first.status_code == 201, first.text
    again = stack.client.post("/jobs", json=body, headers=headers)
    assert again.status_code == 201 and again.json() == first.json()  # same id, same status, same body
    assert job_ids(stack.client) - before == {first.json()["id"]}

    # The same key with another body is refused and creates nothing.
    changed = {**body, "metadata": {"run": "changed"}}
    assert_error(
        stack.client.post("/jobs", json=changed, headers=headers), 422, "idempotency_key_reused", "Idempotency-Key"
    )
    # Keys belong to a tenant: another tenant's identical key is its own.
    other = stack.client_for("tenant-i")
    assert_error(other.post("/jobs", json=body, headers=headers), 422, "unknown_dataset")
    assert job_ids(stack.client) - before == {first.json()["id"]}
    stack.client.post(f"/jobs/{first.json()['id']}/cancel")


def test_a_refused_request_leaves_its_key_free(stack, owned):
    headers = {"Idempotency-Key": "retry-after-fix"}
    bad = job_body(owned["dataset"], label_column="nope")
    assert_error(stack.client.post("/jobs", json=bad, headers=headers), 422, "missing_column")
    good = stack.client.post("/jobs", json=job_body(owned["dataset"]), headers=headers)
    assert good.status_code == 201, good.text
    stack.client.post(f"/jobs/{good.json()['id']}/cancel")


def test_concurrent_duplicates_create_one_job(stack, owned):
    before = job_ids(stack.client)
    body, headers = job_body(owned["dataset"]), {"Idempotency-Key": "concurrent-1"}
    responses, barrier = [], threading.Barrier(6)

    def post() -> None:
        barrier.wait()
        responses.append(stack.client.post("/jobs", json=body, headers=headers))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(responses) == 6
    created = {r.json()["id"] for r in responses if r.status_code == 201}
    assert len(created) == 1, [r.text for r in responses]
    for r in responses:
        if r.status_code != 201:  # still in progress when it arrived (Stripe answers the same)
            assert_error(r, 409, "idempotency_key_in_use", "Idempotency-Key")
            assert r.headers["retry-after"] == "1"
    assert job_ids(stack.client) - before == created
    stack.client.post(f"/jobs/{created.pop()}/cancel")


def test_idempotent_upload_replays_and_refuses_another_file(stack):
    headers = {"Idempotency-Key": "upload-1"}
    content = labelled_csv(rows=10, seed=11)

    def post(data: bytes):
        return stack.client.post("/datasets", files={"file": ("d.csv", io.BytesIO(data), "text/csv")}, headers=headers)

    first = post(content)
    assert first.status_code == 201, first.text
    uploads = set((stack.data_dir / "uploads").iterdir())
    again = post(content)
    assert again.status_code == 201 and again.json() == first.json()
    assert_error(post(labelled_csv(rows=10, seed=12)), 422, "idempotency_key_reused")
    assert set((stack.data_dir / "uploads").iterdir()) == uploads  # neither stored a file
    assert [d["id"] for d in stack.client.get("/datasets").json()["data"]].count(first.json()["id"]) == 1


def test_idempotency_key_is_documented_in_openapi(stack):
    operations = stack.client.get("/openapi.json").json()["paths"]
    for path in ("/jobs", "/datasets"):
        names = {p["name"] for p in operations[path]["post"]["parameters"] if p["in"] == "header"}
        assert "Idempotency-Key" in names, path


# ----------------------------------------------------------------------------- caps and quotas


@pytest.mark.parametrize(
    "metadata, mentions",
    [
        ({f"k{i}": "v" for i in range(17)}, "17 keys; at most 16"),
        ({"k" * 65: "v"}, "65 characters; at most 64"),
        ({"k": "v" * 513}, "513 characters; at most 512"),
        ({"k": {"nested": "object"}}, "string"),
    ],
)
def test_metadata_caps(stack, owned, metadata, mentions):
    before = job_ids(stack.client)
    error = assert_error(
        stack.client.post("/jobs", json=job_body(owned["dataset"], metadata=metadata)), 422, "invalid_request"
    )
    assert error["param"].startswith("metadata") and mentions in error["message"], error
    assert job_ids(stack.client) == before


def test_largest_allowed_metadata_is_accepted(stack, owned):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    job = stack.client.post("/jobs", json=job_body(owned["dataset"], metadata=metadata))
    assert job.status_code == 201 and job.json()["metadata"] == metadata
    stack.client.post(f"/jobs/{job.json()['id']}/cancel")


def test_too_many_columns_is_refused(stack):
    table = pd.DataFrame({f"c{i}": ["x"] for i in range(257)})
    error = assert_error(
        stack.client.post("/datasets", files={"file": ("wide.csv", table.to_csv(index=False).encode(), "text/csv")}),
        422,
        "too_many_columns",
        "file",
        "wide.csv",
        "257 columns",
        "at most 256",
    )
    assert "TUNEJOB_MAX_COLUMNS" in error["message"]


def test_too_many_classes_is_refused(stack):
    rows = pd.DataFrame({"text": [f"text {i}" for i in range(1001)], "label": [f"class-{i}" for i in range(1001)]})
    dataset = upload(stack.client, rows.to_csv(index=False).encode(), "many.csv")
    assert_error(
        stack.client.post("/jobs", json=job_body(dataset["id"], validation_split=0.0)),
        422,
        "too_many_classes",
        "label_column",
        "1001 classes",
        "at most 1000",
    )


def test_active_jobs_per_tenant_are_capped(stack, monkeypatch):
    monkeypatch.setattr(get_settings(), "max_active_jobs_per_tenant", 1)
    client = stack.client_for("tenant-q")
    dataset = upload(client, labelled_csv(rows=24, seed=6))
    running = submit(client, dataset["id"], epochs=500)
    r = client.post("/jobs", json=job_body(dataset["id"]))
    assert_error(r, 429, "too_many_active_jobs", None, "TUNEJOB_MAX_ACTIVE_JOBS_PER_TENANT=1")
    assert int(r.headers["retry-after"]) > 0
    # Other tenants are not held back by this one's jobs.
    neighbour = stack.client_for("tenant-q2")
    other = neighbour.post("/jobs", json=job_body(upload(neighbour, labelled_csv(rows=24))["id"]))
    assert other.status_code == 201, other.text
    neighbour.post(f"/jobs/{other.json()['id']}/cancel")
    client.post(f"/jobs/{running['id']}/cancel")
    wait_for_status(client, running["id"], {"cancelled", "succeeded"})
    again = client.post("/jobs", json=job_body(dataset["id"]))
    assert again.status_code == 201, again.text
    client.post(f"/jobs/{again.json()['id']}/cancel")


def test_storage_per_tenant_is_capped(stack, monkeypatch):
    client = stack.client_for("tenant-s")
    content = labelled_csv(rows=20, seed=7)
    monkeypatch.setattr(get_settings(), "max_storage_bytes_per_tenant", int(len(content) * 1.5))
    dataset = upload(client, content)
    uploads = set((stack.data_dir / "uploads").iterdir())
    r = client.post("/datasets", files={"file": ("more.csv", io.BytesIO(content), "text/csv")})
    assert_error(r, 413, "storage_quota_exceeded", "file", "tenant-s", "TUNEJOB_MAX_STORAGE_BYTES_PER_TENANT")
    assert set((stack.data_dir / "uploads").iterdir()) == uploads  # nothing left behind
    assert len(client.get("/datasets").json()["data"]) == 1
    # Full: no new job either.
    monkeypatch.setattr(get_settings(), "max_storage_bytes_per_tenant", len(content) - 1)
    assert_error(client.post("/jobs", json=job_body(dataset["id"])), 413, "storage_quota_exceeded")


def test_request_rate_per_key(stack, monkeypatch, mid_minute):
    monkeypatch.setattr(get_settings(), "rate_limit", "3/minute")
    client, neighbour = stack.client_for("tenant-l"), stack.client_for("tenant-l")
    assert [client.get("/datasets").status_code for _ in range(3)] == [200] * 3
    r = client.get("/datasets")
    assert_error(r, 429, "rate_limited", "Authorization", "3 per 1 minute")
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert neighbour.get("/datasets").status_code == 200  # per key, not per tenant


@pytest.fixture
def mid_minute(monkeypatch):
    """Stop ``limits``' in-memory clock mid-minute: its sliding window counter weighs the previous
    minute's count by the part of it still in the window, and floors the sum, so three requests
    just before a minute's end and a fourth just after count as 2.99 -> 2, and it passes."""
    import limits.aio.storage.memory

    now = time.time()
    monkeypatch.setattr(limits.aio.storage.memory, "time", SimpleNamespace(time=lambda: now - now % 60 + 30))


def test_a_shared_rate_store_that_hangs_is_counted_in_memory_instead(stack, monkeypatch, mid_minute, caplog):
    """Redis holding the rate counts (``TUNEJOB_RATE_LIMIT_STORAGE_URL``, several API processes)
    stops answering: requests go on, counted in each process's memory (the limit still holds), after
    one wait of at most the store's timeout, and the outage is logged once. Every request was a 500
    while Redis was down, and would have waited forever for one that hung."""
    import socket

    from api import auth

    silent = socket.socket()  # the kernel accepts connections to it; nothing ever answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    monkeypatch.setattr(get_settings(), "rate_limit", "3/minute")
    monkeypatch.setattr(get_settings(), "rate_limit_storage_url", f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
    monkeypatch.setattr(auth, "SHARED_TIMEOUT_SECONDS", 0.2)
    monkeypatch.setattr(auth, "_shared", Outage(auth.log, "the rate-limit store", traceback=False, per_error=False))
    client = stack.client_for("tenant-r")
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(3) as pool:  # three at once, all waiting on the silent store
            assert list(pool.map(lambda _: client.get("/datasets").status_code, range(3))) == [200] * 3
        assert time.monotonic() - started < 3  # redis-py retries the read a few times, each 0.2 s
        assert_error(client.get("/datasets"), 429, "rate_limited", "Authorization", "3 per 1 minute")
    finally:
        silent.close()
    outage = [r for r in caplog.records if r.name == "api.auth"]
    assert [r.levelname for r in outage] == ["WARNING"], outage  # once, however many requests saw it
    assert "each API process counts in its own memory" in outage[0].getMessage()
    assert "Timeout" in outage[0].getMessage(), outage[0].getMessage()


def test_the_shared_rate_store_is_used_again_once_it_answers(stack, monkeypatch, caplog):
    """After a failure the shared counters are tried again (``SHARED_RETRY_SECONDS``): once Redis
    answers (``_hit``, here without a Redis), requests are counted there again and the end of the
    outage is logged."""
    from api import auth

    monkeypatch.setattr(get_settings(), "rate_limit", "1000/minute")
    monkeypatch.setattr(get_settings(), "rate_limit_storage_url", "redis://127.0.0.1:1/0")
    failing = Outage(auth.log, "the rate-limit store", traceback=False, per_error=False)
    failing.failed(ConnectionError("Connection refused"), "counting in memory")
    monkeypatch.setattr(auth, "_shared", failing)
    monkeypatch.setattr(auth, "_shared_tried_at", time.monotonic() - auth.SHARED_RETRY_SECONDS)
    caplog.clear()
    hits = []
    monkeypatch.setattr(auth, "_hit", lambda *args: hits.append(args) or None)
    assert stack.client_for("tenant-q").get("/datasets").status_code == 200
    assert len(hits) == 1 and not auth._shared.down
    said = [r.getMessage() for r in caplog.records if r.name == "api.auth"]
    assert len(said) == 1 and said[0].startswith("the rate-limit store works again, after "), said


def test_counting_requests_in_memory_starts_no_thread(stack, monkeypatch):
    """The in-memory rate counts (``memory://``) expire on the event loop: ``limits``' thread-safe
    memory storage started a timer thread on the request that followed its last timer's end (10 ms),
    and ``Thread.start`` holds up the event loop until the new thread runs."""
    import threading

    started = []  # a timer not started is not alive: the old storage made one on every request
    monkeypatch.setattr(threading.Timer, "start", lambda timer: started.append(timer))
    client = stack.client_for("tenant-t")
    assert [client.get("/datasets").status_code for _ in range(3)] == [200] * 3
    assert started == []


# ----------------------------------------------------------------------------- the store under a held lock


def test_a_held_write_lock_answers_503_and_reads_go_on(stack, owned, monkeypatch):
    if stack.name != "embedded":
        pytest.skip("SQLite's single write lock; PostgreSQL keeps its row locks")
    monkeypatch.setattr(get_settings(), "sqlite_busy_timeout_seconds", 0.2)
    uploads = set((stack.data_dir / "uploads").iterdir())
    holder = sqlite3.connect(stack.data_dir / "tunejob.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process holding the write lock
    try:
        assert stack.client.get(f"/jobs/{owned['job']}").status_code == 200  # WAL: readers never wait
        assert stack.client.get(f"/jobs/{owned['job']}/metrics", params={"after_step": 1}).status_code == 200
        for r in (
            stack.client.post(f"/jobs/{owned['job']}/cancel"),
            stack.client.post("/datasets", files={"file": ("t.csv", labelled_csv(rows=8), "text/csv")}),
        ):
            assert_error(r, 503, "store_busy")
            assert r.headers["retry-after"] == "1"
    finally:
        holder.rollback()
        holder.close()
    assert set((stack.data_dir / "uploads").iterdir()) == uploads
    assert stack.client.post(f"/jobs/{owned['job']}/cancel").status_code == 200


# ----------------------------------------------------------------------------- Host and Origin


def test_foreign_host_is_refused_even_without_a_key(stack):
    for path in ("/healthz", "/jobs"):
        error = assert_error(stack.client.get(path, headers={"Host": "attacker.example"}), 400, "invalid_host", "Host")
        assert "TUNEJOB_ALLOWED_HOSTS" in error["message"]
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
        assert stack.client.get("/healthz", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_setting_adds_names(stack, monkeypatch):
    from fastapi.testclient import TestClient

    from api.main import create_app

    monkeypatch.setattr(get_settings(), "allowed_hosts", ["tunejob.internal", "*.corp.example"])
    client = TestClient(create_app(), base_url="http://tunejob.internal")
    assert client.get("/healthz").status_code == 200
    assert client.get("/healthz", headers={"Host": "api.corp.example"}).status_code == 200
    assert client.get("/healthz", headers={"Host": "corp.example.evil"}).status_code == 400


def test_cross_site_writes_are_refused(stack, owned):
    url = f"/jobs/{owned['job']}/cancel"
    assert_error(
        stack.client.post(url, headers={"Origin": "https://attacker.example"}), 403, "cross_origin_request", "Origin"
    )
    assert_error(stack.client.post(url, headers={"Origin": "null"}), 403, "cross_origin_request")
    assert stack.client.post(url, headers={"Origin": "http://localhost:8000"}).status_code == 200
    # Reads are not state-changing; the key still guards them.
    assert stack.client.get(f"/jobs/{owned['job']}", headers={"Origin": "https://attacker.example"}).status_code == 200


def test_the_storage_quota_sums_recorded_bytes_of_the_files_kept(stack, monkeypatch):
    """The job files' share of the quota is summed from the rows (each checkpoint's bytes, each
    ended job's artifact bytes), as recorded when the files were written, with no walk of the
    disk or listing of the bucket: a checkpoint rotated away, a job whose files were deleted
    (retention) or the job itself (DELETE), and other tenants' jobs count nothing."""
    from shared.jobs import lifecycle
    from shared.store import objects, quotas
    from shared.store.engine import read_session, session_scope
    from shared.store.rows import Job, JobStatus, utcnow
    from tests.test_queue_position import add_job

    def used() -> int:
        with read_session() as s:
            return quotas.job_files_bytes(s, stack.tenant)

    monkeypatch.setattr(objects.LocalDir, "tree_bytes", lambda *_: pytest.fail("walked the disk"))
    monkeypatch.setattr(stack, "tenant", "tenant-quota")  # no other test's jobs (add_job writes for it)
    dataset = upload(stack.client, labelled_csv())["id"]
    failed = add_job(stack, dataset, JobStatus.FAILED, files_bytes=700)
    kept = add_job(stack, dataset, JobStatus.SUCCEEDED, files_bytes=50_000)
    assert used() == 50_700
    for step, size in ((10, 1_000), (20, 2_000), (30, 4_000)):  # the newest two are kept
        lifecycle.record_checkpoint(failed, step, f"/nowhere/step-{step}", None, keep=2, size=size)
    assert used() == 50_700 + 6_000
    with session_scope() as s:
        s.get(Job, kept).files_deleted_at = utcnow()  # retention removed its files
    assert used() == 700 + 6_000
    with session_scope() as s:
        s.get(Job, failed).deleted_at = utcnow()
    assert used() == 0
    monkeypatch.setattr(stack, "tenant", "tenant-elsewhere")
    add_job(stack, dataset, JobStatus.SUCCEEDED, files_bytes=9_999)
    monkeypatch.setattr(stack, "tenant", "tenant-quota")
    assert used() == 0


def test_a_dataset_over_2_gib_is_recorded_and_counted(stack, monkeypatch):
    """``datasets.bytes`` was a 4-byte integer, which PostgreSQL caps at 2 GiB - 1, below the default
    largest upload (``TUNEJOB_MAX_UPLOAD_BYTES``, 2 GiB): recording such an upload failed."""
    from shared.store.engine import session_scope
    from shared.store.rows import Dataset

    client = stack.client_for("tenant-big")
    dataset = upload(client, labelled_csv(rows=20, seed=8))["id"]
    size = 3 * 1024**3
    assert size > get_settings().max_upload_bytes
    with session_scope() as s:
        s.get(Dataset, dataset).bytes = size
    monkeypatch.setattr(get_settings(), "max_storage_bytes_per_tenant", size - 1)
    r = client.post("/jobs", json=job_body(dataset))
    assert_error(r, 413, "storage_quota_exceeded", None, f"stores {size:,} bytes")
