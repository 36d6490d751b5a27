"""The dashboard (``/ui``) over HTTP, without a browser: the vendored files, sign-in and its cookie,
sessions on the API with their CSRF token, tenant checks on pages, sign-out, revocation, the
one-time sign-in link, and what the pages show. On every stack. (tests/test_ui_browser.py drives
the same pages in chromium.)"""

import hashlib
import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.conftest import BASE_URL, wait_for_status
from tests.test_api_jobs import labelled_csv, submit, upload

VENDOR = Path(__file__).resolve().parent.parent / "api" / "ui" / "static" / "vendor"


def browser(stack) -> TestClient:
    """A client like a browser: no API key, cookies kept, redirects not followed."""
    return TestClient(stack.app, base_url=BASE_URL, follow_redirects=False)


def sign_in(stack, tenant: str | None = None) -> tuple[TestClient, str]:
    """A browser signed in with a new key of ``tenant`` (default: the stack's); returns it and the
    CSRF token of its pages."""
    from shared.store.keys import create_key

    key, _ = create_key(tenant or stack.tenant)
    client = browser(stack)
    r = client.post("/ui/login", data={"key": key, "next": "/ui/jobs"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
    return client, csrf_of(client.get("/ui/jobs").text)


def csrf_of(html: str) -> str:
    return re.search(r'<meta name="csrf-token" content="([^"]+)">', html)[1]


@pytest.fixture(scope="module")
def job(stack) -> dict:
    """A succeeded job of the stack's tenant."""
    dataset = upload(stack.client, labelled_csv(rows=24))
    return wait_for_status(stack.client, submit(stack.client, dataset["id"], epochs=1)["id"], {"succeeded"})


def test_vendored_files_are_the_pinned_ones():
    """Every file under static/vendor is listed in VERSIONS with its sha256, and matches it."""
    listed = {}
    for line in (VENDOR / "VERSIONS").read_text().splitlines():
        if line and not line.startswith("#"):
            digest, name = line.split()
            listed[name] = digest
    present = {str(p.relative_to(VENDOR)) for p in VENDOR.rglob("*") if p.is_file() and p.name != "VERSIONS"}
    assert present == set(listed), "every vendored file, and only those, must be in VERSIONS"
    for name, digest in listed.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, f"{name} is not the pinned file"
    assert any(n.endswith("LICENSE") for n in listed)


def test_pages_need_a_session_and_sign_in_sets_a_safe_cookie(stack, job):
    from shared.store.keys import create_key

    client = browser(stack)
    r = client.get(f"/ui/jobs/{job['id']}")
    assert r.status_code == 303 and r.headers["location"] == f"/ui/login?next=%2Fui%2Fjobs%2F{job['id']}"
    assert client.get("/ui/login").status_code == 200

    r = client.post("/ui/login", data={"key": "tj_not-a-key", "next": "/ui/jobs"})
    assert r.status_code == 401 and "not valid" in r.text and "set-cookie" not in r.headers
    r = client.post("/ui/login", data={"key": "x" * 200})
    assert r.status_code == 400 and "key" in r.text and r.headers["content-type"].startswith("text/html")

    key, _ = create_key(stack.tenant)
    r = client.post("/ui/login", data={"key": key, "next": "https://evil.example/ui/x"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", "no redirect off this site"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("tunejob_session=") and key not in cookie
    assert all(a in cookie for a in ("HttpOnly", "SameSite=strict", "Path=/", "Max-Age=43200")), cookie
    assert "Secure" not in cookie  # plain HTTP here; HTTPS adds it

    page = client.get("/ui/jobs")
    assert page.status_code == 200 and job["id"] in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert client.get(f"/ui/jobs/{job['id']}").status_code == 200


def test_the_session_uses_the_api_with_its_csrf_token(stack, job):
    client, csrf = sign_in(stack)
    assert client.get(f"/jobs/{job['id']}").json()["id"] == job["id"]  # the cookie stands for the key
    dataset = upload(stack.client, labelled_csv(rows=24))
    body = {
        "base_model": "tiny-bert",
        "task": "classification",
        "training_dataset": dataset["id"],
        "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
    }

    refused = client.post("/jobs", json=body)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "csrf_token_invalid"
    wrong = client.post("/jobs", json=body, headers={"X-CSRF-Token": csrf[:-1] + "x"})
    assert wrong.status_code == 403
    created = client.post("/jobs", json=body, headers={"X-CSRF-Token": csrf})
    assert created.status_code == 201, created.text
    cancelled = client.post(f"/jobs/{created.json()['id']}/cancel", headers={"X-CSRF-Token": csrf})
    assert cancelled.status_code == 200
    ended = wait_for_status(stack.client, created.json()["id"], {"cancelled", "succeeded"})
    # a job's page offers scoring with its model once it has one (a cancelled job's page offered it)
    page = client.get(f"/ui/jobs/{ended['id']}").text
    assert ("Score a dataset" in page) == (ended["status"] == "succeeded")
    assert "Score a dataset" in client.get(f"/ui/jobs/{job['id']}").text and "no points yet" not in page


def test_another_tenants_job_is_a_404_page(stack, job):
    client, csrf = sign_in(stack, "tenant-other")
    page = client.get(f"/ui/jobs/{job['id']}")
    assert page.status_code == 404 and "Not found" in page.text and job["base_model"] not in page.text
    assert client.get(f"/jobs/{job['id']}").status_code == 404
    assert client.get(f"/jobs/{job['id']}/stream").status_code == 404
    assert client.post(f"/jobs/{job['id']}/cancel", headers={"X-CSRF-Token": csrf}).status_code == 404
    assert client.get(f"/ui/compare?jobs={job['id']},{job['id']}x").status_code == 404
    assert job["id"] not in client.get("/ui/jobs").text


def test_sign_out_and_revoking_the_key_end_the_session(stack):
    from shared.store.keys import create_key, revoke_key

    client, csrf = sign_in(stack)
    assert client.post("/ui/logout", data={"csrf_token": "stale"}).status_code == 403
    r = client.post("/ui/logout", data={"csrf_token": csrf})
    assert r.status_code == 303 and 'tunejob_session=""' in r.headers["set-cookie"]
    token = client.cookies.get("tunejob_session")
    assert token is None
    assert client.get("/ui/jobs").status_code == 303

    key, row = create_key(stack.tenant)
    client = browser(stack)
    client.post("/ui/login", data={"key": key})
    session = client.cookies.get("tunejob_session")
    assert client.get("/jobs").status_code == 200
    revoke_key(row.id)
    r = client.get("/jobs")
    assert r.status_code == 401 and r.json()["error"]["code"] == "session_expired"
    assert client.get("/ui/jobs").status_code == 303
    # a signed-out token sent again is refused too
    fresh = browser(stack)
    fresh.cookies.set("tunejob_session", session)
    assert fresh.get("/jobs").status_code == 401


def test_a_sign_in_link_works_once(stack):
    from shared.store import ui_sessions
    from shared.store.keys import create_key

    _, row = create_key(stack.tenant)
    link = ui_sessions.signin_link(row.id)
    client = browser(stack)
    r = client.get(f"/ui/signin/{link}")
    assert r.status_code == 303 and client.get("/ui/jobs").status_code == 200
    again = browser(stack).get(f"/ui/signin/{link}")
    assert again.status_code == 401 and "used already" in again.text


def test_serve_prints_a_sign_in_link_for_its_local_key(stack):
    from shared.store.keys import create_key, local_key_path
    from tunejob.cli import signin_link

    key, _ = create_key(stack.tenant, name="local key (tunejob serve)")
    local_key_path().parent.mkdir(parents=True, exist_ok=True)
    local_key_path().write_text(key + "\n")
    try:
        link = signin_link("0.0.0.0", 8123)
        assert link.startswith("http://127.0.0.1:8123/ui/signin/") and key not in link
        client = browser(stack)
        assert client.get(link.removeprefix("http://127.0.0.1:8123")).status_code == 303
        assert stack.tenant in client.get("/ui/jobs").text
    finally:
        local_key_path().unlink()


def test_pages_show_the_tenants_data(stack, job):
    client, _ = sign_in(stack)
    dataset = job["training_dataset"]
    page = client.get(f"/ui/datasets/{dataset}").text
    assert '<th scope="col">text</th>' in page and '<th scope="col">label</th>' in page
    assert re.search(r"<td>(sports|business)</td>", page), "sample rows are shown"
    assert 'value="3.0"' in page, "the form shows the hyperparameters' defaults (epochs)"
    assert "<option selected>classification</option>" in page
    assert dataset in client.get("/ui/datasets").text
    # the form starts on the task its columns name: a pairs file started on classification
    from tests.test_api_jobs import upload

    for task, header, row in [("embedding", "anchor,positive", "a {0},b {0}"), ("reranking", "query,passage,label", "a {0},b {0},1")]:  # fmt: skip
        pairs = upload(stack.client, "\n".join([header, *(row.format(i) for i in range(4))]).encode())
        assert f"<option selected>{task}</option>" in client.get(f"/ui/datasets/{pairs['id']}").text, task

    jobs_page = client.get("/ui/jobs", params={"status": "succeeded", "task": "classification"}).text
    assert job["id"] in jobs_page
    assert job["id"] not in client.get("/ui/jobs", params={"task": "regression"}).text
    assert client.get("/ui/jobs", params={"status": "sleeping"}).status_code == 400

    detail = client.get(f"/ui/jobs/{job['id']}").text
    assert "model.tar" in detail and "learning_rate" in detail

    other = submit(stack.client, dataset, epochs=1, learning_rate=2e-3)
    compare = client.get(f"/ui/compare?jobs={job['id']},{other['id']}")
    assert compare.status_code == 200
    assert re.search(r'<tr class="differs"><th scope="row">hp.learning_rate', compare.text)
    assert not re.search(r'<tr class="differs"><th scope="row">hp.batch_size', compare.text)
    assert 'scope="row">ran_s' in compare.text and "duration_s" not in compare.text  # not the wait in the queue
    assert client.get(f"/ui/compare?jobs={job['id']}").status_code == 400
    wait_for_status(stack.client, other["id"], {"succeeded"})

    assert job["id"] in client.get("/ui/predictions").text  # a model to score with


def test_a_jobs_evaluation_and_aliases_on_its_page_and_per_class_f1_deltas_on_compare(stack, job):
    """The confusion-matrix heatmap holds the report's counts, coloured by its row-normalized
    shares; the mistakes table its mistakes; "promote" is the alias route with the page's CSRF
    token (refused without it); the compare page's F1 deltas are the reports' differences."""
    client, csrf = sign_in(stack)
    report = stack.client.get(f"/jobs/{job['id']}/evaluation").json()
    page = client.get(f"/ui/jobs/{job['id']}").text
    cells = re.findall(r'<td class="[^"]*" style="--share: ([0-9.]+)" title="[^"]*">(\d+)</td>', page)
    matrix = report["confusion_matrix"]
    assert [int(count) for _, count in cells] == [c for row in matrix["counts"] for c in row]
    assert [float(share) for share, _ in cells] == pytest.approx(
        [v for row in matrix["normalized"] for v in row], abs=1e-3
    )
    table = page.split('id="mistakes"')[1].split("</table>")[0] if report["mistakes"] else ""
    assert table.count("<tr>") == len(report["mistakes"]) + 1  # and the header
    assert 'id="promote-form"' in page and '<span class="none">none</span>' in page
    # each class's figures in a table (a token job's per_entity was a dict's repr in the metrics)
    per_class = page.split('id="per-class"')[1].split("</table>")[0]
    for name, figures in report["per_class"].items():
        assert f'<th scope="row">{name}</th><td>{figures["precision"]:.4f}</td>' in per_class
    metrics = page.split('id="final-metrics"')[1].split("</table>")[0]  # counts read as counts: 16, not 16.0000
    assert f"<td>{job['train_metrics']['micro_batch_size']:.0f}</td>" in metrics, metrics

    r = client.put("/models/aliases/ui-production", json={"job_id": job["id"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_token_invalid"
    r = client.put("/models/aliases/ui-production", json={"job_id": job["id"]}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200, r.text
    assert '<code class="alias">ui-production</code>' in client.get(f"/ui/jobs/{job['id']}").text
    stack.client.delete("/models/aliases/ui-production")

    other = wait_for_status(
        stack.client, submit(stack.client, job["training_dataset"], epochs=2, learning_rate=3e-3)["id"], {"succeeded"}
    )
    theirs = stack.client.get(f"/jobs/{other['id']}/evaluation").json()
    compare = client.get(f"/ui/compare?jobs={job['id']},{other['id']}").text
    assert compare.count('id="f1-deltas"') == 1 and compare.index("<main") < compare.index('id="f1-deltas"')
    deltas = compare.split('id="f1-deltas"')[1].split("</table>")[0]
    for name, figures in report["per_class"].items():
        row = deltas.split(f'<th scope="row">{name}</th>')[1].split("</tr>")[0]
        assert f"{figures['f1']:.4f}" in row and f"{theirs['per_class'][name]['f1'] - figures['f1']:+.4f}" in row


def test_the_new_job_form_has_the_columns_of_every_task(stack, job):
    """Embedding and reranking have their own column fields; each field names the tasks it shows for."""
    client, _ = sign_in(stack)
    page = client.get(f"/ui/datasets/{job['training_dataset']}").text
    tasks = dict(re.findall(r'<select id="f-(\w+)" name="\w+"(?: multiple size="3")? data-tasks="([\w ]+)"', page))
    assert set(tasks) == {
        "text_column",
        "label_column",
        "anchor_column",
        "positive_column",
        "negative_columns",
        "score_column",
        "query_column",
        "passage_column",
    }
    assert "embedding" not in tasks["text_column"].split() and "reranking" not in tasks["text_column"].split()
    assert "reranking" in tasks["label_column"].split() and "embedding" not in tasks["label_column"].split()
    assert tasks["anchor_column"] == tasks["negative_columns"] == "embedding"
    assert tasks["query_column"] == tasks["passage_column"] == "reranking"


def test_a_sweeps_trials_on_its_page(stack):
    from tests.test_sweeps import create, sweep_body, wait_for_sweep

    dataset = upload(stack.client, labelled_csv(rows=48, seed=5))
    sweep = wait_for_sweep(stack.client, create(stack.client, sweep_body(dataset["id"]))["id"])
    client, _ = sign_in(stack)
    assert sweep["id"] in client.get("/ui/sweeps").text
    page = client.get(f"/ui/sweeps/{sweep['id']}").text
    trials = stack.client.get(f"/sweeps/{sweep['id']}/trials").json()["data"]
    assert len(trials) == 2 and all(f'href="/ui/jobs/{t["job_id"]}"' in page for t in trials)
    assert '<th scope="col">learning_rate</th>' in page and '"metric": "accuracy"' in page
    best = sweep["best_trial"]
    assert f'<a href="/ui/jobs/{best["job_id"]}">trial {best["trial_number"]}' in page
    listed = client.get("/ui/jobs", params={"sweep": sweep["id"]}).text
    assert all(t["job_id"] in listed for t in trials) and dataset["id"] not in listed
    other, _ = sign_in(stack, "tenant-other")
    assert other.get(f"/ui/sweeps/{sweep['id']}").status_code == 404
    assert sweep["id"] not in other.get("/ui/sweeps").text


def test_the_jobs_page_follows_its_running_jobs_through_one_stream(stack, job):
    """The jobs page lists its queued and running jobs in ``data-live``, and ``/ui/jobs/live``
    streams their progress and end (``gone`` for an unknown job, or another tenant's), then ends."""
    from sqlalchemy import update

    from shared.store.engine import session_scope
    from shared.store.rows import Job, utcnow
    from tests.test_queue_position import add_job

    running = add_job(stack, job["training_dataset"], "running", step=5, total_steps=10)
    client, _ = sign_in(stack)
    assert f'data-live="{running}"' in client.get("/ui/jobs").text
    other, _ = sign_in(stack, "tenant-other")
    assert 'data-live=""' in other.get("/ui/jobs").text

    seen = []
    with client.stream("GET", "/ui/jobs/live", params={"ids": f"{running},{job['id']},job_nope"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                body = json.loads(line[len("data: ") :])
                seen.append((event, body["id"], body.get("status")))
                if (event, body["id"]) == ("progress", running) and body["status"] == "running":
                    assert body["progress"]["fraction"] == 0.5
                    with session_scope() as s:  # as its worker would, when it ends
                        s.execute(
                            update(Job)
                            .where(Job.id == running)
                            .values(status="succeeded", step=10, finished_at=utcnow(), updated_at=utcnow())
                        )
    assert ("end", job["id"], "succeeded") in seen and ("end", running, "succeeded") in seen
    assert seen[0] == ("gone", "job_nope", None) and {i for _, i, _ in seen[1:]} == {running, job["id"]}
    gone = other.get("/ui/jobs/live", params={"ids": running}).text  # not its job: gone, and done
    assert gone.replace("\r\n", "\n") == f'event: gone\ndata: {{"id": "{running}"}}\n\n'


def test_a_sign_in_link_is_redeemed_once_when_many_bring_it_at_once(stack):
    """Issue 34: redeeming is one DELETE ... RETURNING, so of 12 requests racing with one link only
    one gets a session (a read, then a delete, let several through on PostgreSQL)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from shared.store import ui_sessions
    from shared.store.keys import create_key

    _, row = create_key(stack.tenant)
    for _ in range(3):
        link, start = ui_sessions.signin_link(row.id), threading.Barrier(12)

        def redeem(_, link=link, start=start):
            start.wait()
            return ui_sessions.redeem(link)

        with ThreadPoolExecutor(12) as pool:
            sessions = [s for s in pool.map(redeem, range(12)) if s is not None]
        assert len(sessions) == 1, sessions


def test_without_a_terminal_serve_writes_the_sign_in_link_to_a_private_file(stack, capsys):
    """Issue 34: the link signs in as the local admin key; stdout that is no terminal often ends in
    a log shipper, so the link goes to ``<data dir>/signin_link`` (0600) and only its path is printed."""
    import stat

    from shared.settings import get_settings
    from tunejob.cli import announce_dashboard

    link = "http://127.0.0.1:8123/ui/signin/secret-token"
    announce_dashboard("127.0.0.1", 8123, link)
    printed = capsys.readouterr().out
    path = get_settings().data_path / "signin_link"
    assert "secret-token" not in printed and str(path) in printed, printed
    assert path.read_text().strip() == link and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_page_tells_a_full_disk_or_a_failed_store_or_bucket_as_the_api_does(stack, monkeypatch):
    """The dashboard had none of the API's handlers for failures of the services it depends on: a
    full PostgreSQL at sign-in, or the bucket down under a dataset's page, was a 500 "Internal Server
    Error" with two tracebacks. Now the API's status and words, as a page."""
    import errno

    import psycopg
    from obstore.exceptions import GenericError
    from sqlalchemy.exc import OperationalError

    from shared.jobs import uploads

    client, _ = sign_in(stack)
    for failure, status, words in (
        (OperationalError("INSERT", {}, psycopg.errors.DiskFull("could not extend file")), 507, "disk is full"),
        (OSError(errno.ENOSPC, "No space left on device"), 507, "disk is full"),
        (OperationalError("SELECT", {}, psycopg.OperationalError("connection refused")), 503, "job store is busy"),
        (GenericError("Generic S3 error: connection refused"), 502, "object storage"),
    ):

        def fail(*_, failure=failure, **__):
            raise failure

        monkeypatch.setattr(uploads, "list_datasets", fail)
        r = client.get("/ui/datasets")
        assert r.status_code == status and words in r.text and "text/html" in r.headers["content-type"], r.text
    monkeypatch.setattr(uploads, "list_datasets", lambda *_: (_ for _ in ()).throw(KeyError("a bug")))
    with pytest.raises(KeyError):  # anything else is still a 500 (the test client raises it)
        client.get("/ui/datasets")
