"""The dashboard in a real browser: Debian's chromium driven by Playwright (the driver only; no
browser download). The API of the embedded stack listens on a free port (uvicorn in a thread)
with the stack's worker behind it.

One walk through, as a user would: sign in, upload a dataset, plan and create a job from the
form, watch its loss chart gain points while it trains (no reload), cancel it, compare two jobs,
open another tenant's job (a 404 page). Every page must log no console error and request nothing
from another host. On a failure the page is saved as a screenshot (``TUNEJOB_UI_SCREENSHOTS``,
default the test's tmp_path) and its path is in the failure message.

Without chromium or the playwright package these tests skip, with the reason, unless
``TUNEJOB_REQUIRE_SERVICES=1`` (CI, whose ``.ci/run`` installs both) makes that a failure.
"""

import os
import re
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import REQUIRE_SERVICES, TINY_MODEL, wait_for_status
from tests.faults_support import free_port
from tests.test_api_jobs import labelled_csv
from tests.test_embedding import tiny_st  # noqa: F401  (the fixture: the tiny BERT as a sentence-transformers model)

LONG_NAME = "bbc_news_titles_to_articles_training_pairs.csv"  # a dataset's file name, as users name them
CHROMIUM = os.environ.get("TUNEJOB_CHROMIUM", "/usr/bin/chromium")
TIMEOUT_MS = 60_000


def browser_unavailable() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        return f"no chromium at {CHROMIUM} (apt-get install chromium, or set TUNEJOB_CHROMIUM)"
    return None


def test_a_stacks_set_up_keeps_the_screenshots_directory(monkeypatch, tmp_path):
    """``TUNEJOB_UI_SCREENSHOTS`` outlives ``configure`` (which drops the service's TUNEJOB_*
    variables), so the screenshots asked for are written there, not to a tmp_path."""
    from shared.settings import get_settings
    from tests.conftest import configure

    monkeypatch.setenv("TUNEJOB_UI_SCREENSHOTS", str(tmp_path / "shots"))
    monkeypatch.setenv("TUNEJOB_MAX_JOB_SECONDS", "5")  # a service setting of an earlier stack
    monkeypatch.setenv("TUNEJOB_DATA_DIR", str(tmp_path / "data"))  # recorded: teardown restores it
    try:
        configure({"TUNEJOB_DATA_DIR": str(tmp_path / "data")})
        assert os.environ["TUNEJOB_UI_SCREENSHOTS"] == str(tmp_path / "shots")
        assert "TUNEJOB_MAX_JOB_SECONDS" not in os.environ
    finally:
        get_settings.cache_clear()


@pytest.fixture(scope="module")
def server(stack):
    """The stack's API over real HTTP; yields its base URL."""
    import uvicorn

    reason = browser_unavailable()
    if reason is not None:
        if REQUIRE_SERVICES:
            pytest.fail(f"{reason}, and TUNEJOB_REQUIRE_SERVICES=1 makes the browser tests mandatory")
        pytest.skip(f"{reason}; set TUNEJOB_REQUIRE_SERVICES=1 to make this a failure")
    port = free_port()
    # the app's lifespan (migrations, recovery thread) already runs under the stack's TestClient
    uv = uvicorn.Server(uvicorn.Config(stack.app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        if uv.started:
            break
        threading.Event().wait(0.05)
    yield url
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-dev-shm-usage"])
        yield browser
        browser.close()


class Watched:
    """A page whose console errors, uncaught exceptions and requests to other hosts are recorded;
    as a context manager, it saves a screenshot if the block fails, and fails if anything was
    recorded."""

    def __init__(self, chromium, base_url: str, shot: Path):
        self.context = chromium.new_context(base_url=base_url, viewport={"width": 1280, "height": 900})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.host = urlsplit(base_url).netloc
        self.problems: list[str] = []
        self.allowed: list[str] = []  # console messages a step expects (a 404 page logs its status)
        self.shot = shot
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.problems.append(f"uncaught: {e}"))
        self.page.on("request", self._request)

    def _console(self, message) -> None:
        if message.type == "error" and not any(a in message.text for a in self.allowed):
            self.problems.append(f"console error on {self.page.url}: {message.text}")

    def _request(self, request) -> None:
        netloc = urlsplit(request.url).netloc
        if request.url.startswith(("http:", "https:", "ws:", "wss:")) and netloc != self.host:
            self.problems.append(f"request to another host: {request.method} {request.url}")

    def __enter__(self) -> "Watched":
        return self

    def __exit__(self, kind, error, _) -> None:
        try:
            if error is None and not self.problems:
                return
            self.page.screenshot(path=str(self.shot), full_page=True)
            if error is None:
                raise AssertionError(f"{self.problems} (screenshot: {self.shot})")
            raise AssertionError(f"{error} {self.problems or ''} (screenshot: {self.shot})") from error
        finally:
            self.context.close()


@pytest.fixture
def watched(chromium, server, tmp_path):
    """Opens a ``Watched`` page; screenshots go to ``TUNEJOB_UI_SCREENSHOTS`` (default tmp_path)."""
    shots = Path(os.environ.get("TUNEJOB_UI_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    return lambda name: Watched(chromium, server, shots / f"{name}-failure.png")


def points(page, selector: str) -> int:
    """The points drawn in a chart (its ``data-points``, set by app.js after each draw); 0 before one."""
    value = page.locator(selector).get_attribute("data-points") if page.locator(selector).count() else None
    return int(value or 0)


def wait_for_points(page, selector: str, more_than: int) -> int:
    """Wait until the chart ``selector`` has drawn more than ``more_than`` points; returns how many.
    (Checked from here: the pages' CSP refuses the string evaluation ``wait_for_function`` uses.)"""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while (n := points(page, selector)) <= more_than:
        assert time.monotonic() < deadline, f"{selector} still has {n} points after {TIMEOUT_MS} ms"
        page.wait_for_timeout(100)
    return n


def sign_in(page, tenant: str) -> str:
    """Sign ``page`` in with a new key of ``tenant``; returns the key (for API calls in setup)."""
    from shared.store.keys import create_key

    key, _ = create_key(tenant)
    page.goto("/ui/jobs")
    assert page.url.endswith("/ui/login?next=%2Fui%2Fjobs")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/ui/jobs")
    return key


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_train_watch_cancel_and_compare_in_the_browser(stack, server, watched, tmp_path, monkeypatch):
    from shared.settings import get_settings

    monkeypatch.setattr(get_settings(), "dry_run_rows", 100)  # the 400-row upload is planned from a sample
    with watched("walk") as w:
        walk(w.page, server, tmp_path)


def walk(page, server: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    key = sign_in(page, "ui-tenant")

    # upload, with the progress bar, then the dataset's page
    page.get_by_role("link", name="Datasets").click()
    csv = tmp_path / "reviews.csv"
    csv.write_bytes(labelled_csv(rows=400))
    page.get_by_label("A CSV, TSV").set_input_files(str(csv))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_url("**/ui/datasets/ds_*")
    assert page.locator("table.sample tbody tr").count() == 10

    # plan, then create a long job from the form
    page.get_by_label("Base model").select_option(TINY_MODEL)
    page.get_by_label("Epochs").fill("40")
    page.get_by_label("Batch size").fill("8")
    page.get_by_label("max_length (tokens)").fill("32")
    page.get_by_role("button", name="Plan (dry run)").click()
    page.locator("#plan-padding meter").first.wait_for()
    summary = page.locator("#plan-summary").inner_text()
    assert re.search(r"planned from \d+ of the 360 training examples", summary), summary
    page.get_by_role("button", name="Create job").click()
    page.wait_for_url("**/ui/jobs/job_*")
    job_id = page.url.rsplit("/", 1)[-1]

    # the loss chart gains points while the job trains, on the same page (no reload)
    page.evaluate("window.notReloaded = true")
    first = wait_for_points(page, "#chart-loss", 0)
    wait_for_points(page, "#chart-loss", first)
    assert page.evaluate("window.notReloaded === true")
    # the x axis runs to the job's last step from the first point (one evaluation at step 101
    # drew an axis to 200 beside a loss chart to 101)
    total = page.evaluate(f"fetch('/jobs/{job_id}').then(r => r.json()).then(j => j.progress.total_steps)")
    assert total > first and float(page.locator("#chart-loss").get_attribute("data-x-max")) == total
    assert page.locator("#chart-loss canvas").count() == 1
    assert page.locator("#events code", has_text="created").count() == 1, "each event is listed once"

    # cancel, confirming in the dialog
    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Yes").click()
    expect(page.locator("#job-status")).to_have_text("cancelled", timeout=TIMEOUT_MS)

    # a second, short job (through the API), then the two compared
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {key}"}) as api:
        spec = api.get(f"/jobs/{job_id}").json()
        body = {
            "base_model": TINY_MODEL,
            "task": "classification",
            "training_dataset": spec["training_dataset"],
            "hyperparameters": {"epochs": 1, "batch_size": 16, "max_length": 32},
        }
        other = api.post("/jobs", json=body).json()["id"]
        # the jobs page follows it through one stream until it succeeds: no reload, no polling
        fetched = []
        page.on("request", lambda request: fetched.append(urlsplit(request.url).path))
        page.goto("/ui/jobs")
        page.evaluate("window.notReloaded = true")
        expect(page.locator(f'tr[data-job="{other}"] .status')).to_have_text("succeeded", timeout=TIMEOUT_MS)
        expect(page.locator(f'tr[data-job="{other}"] .percent')).to_have_text("100%")
        assert page.evaluate("window.notReloaded === true") and fetched.count("/ui/jobs") == 1, fetched
        total = wait_for_status(api, other, {"succeeded"})["progress"]["total_steps"]
    # its one evaluation, at its last step, on an axis to that step (uPlot's padding of a single x
    # drew one to twice the step)
    page.goto(f"/ui/jobs/{other}")
    wait_for_points(page, "#chart-eval", 0)
    assert float(page.locator("#chart-eval").get_attribute("data-x-max")) == total
    page.goto("/ui/jobs")
    page.get_by_label(f"select {job_id} to compare").check()
    page.get_by_label(f"select {other} to compare").check()
    page.get_by_role("button", name="Compare selected (2)").click()
    page.wait_for_url(lambda url: url.endswith(f"/ui/compare?jobs={other},{job_id}"))  # newest first
    wait_for_points(page, "[data-metric=train_loss]", 0)
    assert page.locator("tr.differs th", has_text="hp.batch_size").count() == 1
    page.go_back()
    page.wait_for_url("**/ui/jobs")


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_another_tenants_job_is_a_404_page_in_the_browser(stack, server, watched):
    from shared.store.keys import create_key

    owner, _ = create_key("ui-owner")
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {owner}"}) as api:
        ds = api.post("/datasets", files={"file": ("t.csv", labelled_csv(rows=16), "text/csv")}).json()["id"]
        body = {
            "base_model": TINY_MODEL,
            "task": "classification",
            "training_dataset": ds,
            "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32},
        }
        job_id = api.post("/jobs", json=body).json()["id"]
    with watched("tenant") as w:
        sign_in(w.page, "ui-intruder")
        w.allowed.append("404 (Not Found)")  # chromium logs the page's own status
        response = w.page.goto(f"/ui/jobs/{job_id}")
        assert response.status == 404
        assert w.page.get_by_role("heading", name="Not found").is_visible()
        assert TINY_MODEL not in w.page.content()


@pytest.mark.parametrize("stack", ["embedded"], indirect=True)
def test_an_embedding_job_s_chart_draws_its_zero_shot_line(stack, server, watched, tiny_st, tmp_path):  # noqa: F811
    """The validation chart of an embedding job marks the base model's step-0 ``ndcg@10`` (the
    zero-shot figure) as a labelled horizontal line; screenshots at a phone's and a desktop's width
    (``TUNEJOB_UI_SCREENSHOTS``, default the test's tmp_path)."""
    from tests.test_embedding import TINY_ST, pairs

    shots = Path(os.environ.get("TUNEJOB_UI_SCREENSHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with watched("zero-shot") as w:
        key = sign_in(w.page, "ui-embedding")
        with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {key}"}) as api:
            ds = api.post("/datasets", files={"file": (LONG_NAME, pairs(48).to_csv(index=False).encode(), "text/csv")})
            body = {
                "base_model": TINY_ST,
                "task": "embedding",
                "training_dataset": ds.json()["id"],
                "validation_split": 0.25,
                "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32, "learning_rate": 2e-3},
            }
            job = wait_for_status(api, api.post("/jobs", json=body).json()["id"], {"succeeded", "failed"}, 600)
            assert job["status"] == "succeeded", job["error"]
            metrics = api.get(f"/jobs/{job['id']}/metrics").json()["data"]
        zero_shot = next(m["value"] for m in metrics if m["name"] == "eval_ndcg@10" and m["step"] == 0)
        for width in (390, 1280):
            w.page.set_viewport_size({"width": width, "height": 900})
            w.page.goto(f"/ui/jobs/{job['id']}")
            wait_for_points(w.page, "#chart-eval", 9)  # five metrics at step 0 (zero-shot) and after the epoch
            assert float(w.page.locator("#chart-eval").get_attribute("data-zero-shot")) == pytest.approx(zero_shot)
            w.page.locator("#chart-eval").scroll_into_view_if_needed()
            w.page.locator("#chart-eval").screenshot(path=str(shots / f"zero-shot-{width}.png"))
            # nothing wider than the window (the artifacts' long TensorBoard file name once was)
            assert w.page.evaluate("document.documentElement.scrollWidth") <= width
            assert "anchor_column" in w.page.locator("table.kv").first.inner_text()  # the task's own columns
            # the scoring form's options name the model's task and the dataset's file: a long one
            # widened the page to 492 px at 390
            w.page.goto("/ui/predictions")
            assert LONG_NAME in w.page.locator("#p-dataset").inner_text()
            assert w.page.evaluate("document.documentElement.scrollWidth") <= width
