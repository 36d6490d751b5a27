"""Screenshots of the dashboard for the README and docs/guide/dashboard.md.

Starts ``tunejob serve`` on a free port with a fresh data directory and a tiny BERT (built here,
no download), signs in with the link it prints, uploads a dataset, plans and trains two short jobs,
scores a dataset, and saves each page, wide (1280 px) and narrow (390 px), light and dark, under
``docs/img``. Needs chromium and playwright, as tests/test_ui_browser.py does.

    HF_HUB_OFFLINE=1 python docs/img/capture.py [--out docs/img] [--work DIR]

``--work DIR`` keeps the data directory there; run again with the same DIR, it reuses the jobs
and only takes the pictures again (not the live one).
"""

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = {
    "sports": "goal match team coach league striker keeper season win cup".split(),
    "business": "market shares profit bank trade economy deal stock growth firm".split(),
}


def dataset_csv(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    lines = ["text,label"]
    for i in range(rows):
        label = list(WORDS)[i % 2]
        lines.append(f"{' '.join(rng.choices(WORDS[label], k=rng.randint(4, 40)))},{label}")
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    from playwright.sync_api import sync_playwright

    from worker.doctor import build_tiny_bert

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent))
    parser.add_argument("--work", help="data directory to keep, or to reuse")
    args = parser.parse_args()
    out = Path(args.out)
    work = Path(args.work or tempfile.mkdtemp(prefix="tunejob-shots-"))
    reuse = (work / "data" / "tunejob.db").exists()
    if not reuse:
        build_tiny_bert(work / "models" / "tiny-bert")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "TUNEJOB_DATA_DIR": str(work / "data"),
        "TUNEJOB_MODELS_DIR": str(work / "models"),
        "TUNEJOB_DEVICE": "cpu",
        "TUNEJOB_METRICS_FLUSH_SECONDS": "0.5",
        "PYTHONUNBUFFERED": "1",
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop `serve` (below) on a timeout too
    serve = subprocess.Popen(
        [sys.executable, "-m", "tunejob", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        link = None
        for line in serve.stdout:  # stdout is a pipe: the link goes to a 0600 file (tunejob.cli.announce_dashboard)
            if m := re.search(r"sign-in link .* is in (\S+)", line):
                link = Path(m[1]).read_text().strip()
                break
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        key = (work / "data" / "api_key").read_text().strip()
        api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium")
            context = browser.new_context(base_url=base, viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.goto(link)
            shots = existing(api) if reuse else run_jobs(page, api, work, out)
            shoot(browser, base, context.storage_state(), shots, out)
            browser.close()
    finally:
        serve.terminate()
        serve.wait(60)


def existing(api: httpx.Client) -> dict[str, str]:
    """The pages of the runs a previous capture made in the same data directory."""
    second, first = [j["id"] for j in api.get("/jobs", params={"limit": 2}).json()["data"]]
    dataset = api.get(f"/jobs/{first}").json()["training_dataset"]
    prediction = api.get("/predictions", params={"limit": 1}).json()["data"][0]["id"]
    return pages(dataset, first, second, prediction)


def pages(dataset: str, first: str, second: str, prediction: str) -> dict[str, str]:
    return {
        "dataset": f"/ui/datasets/{dataset}",
        "jobs": "/ui/jobs",
        "job": f"/ui/jobs/{first}",
        "compare": f"/ui/compare?jobs={first},{second}",
        "datasets": "/ui/datasets",
        "predictions": "/ui/predictions",
        "prediction": f"/ui/predictions/{prediction}",
    }


def run_jobs(page, api: httpx.Client, work: Path, out: Path) -> dict[str, str]:
    """Upload, plan and train two jobs (the first from the form, its page shot while it trains),
    score the dataset; returns the pages to shoot."""
    page.goto("/ui/datasets")
    page.get_by_label("A CSV, TSV").set_input_files(str(dataset_csv(work / "reviews.csv", 600)))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_url("**/ui/datasets/ds_*")
    dataset_url = page.url
    page.get_by_label("Base model").select_option("tiny-bert")
    page.get_by_label("Epochs").fill("4")
    page.get_by_label("max_length (tokens)").fill("64")
    page.get_by_label("Learning rate").fill("0.001")
    page.get_by_role("button", name="Plan (dry run)").click()
    page.locator("#plan-padding meter").first.wait_for()
    page.get_by_role("button", name="Create job").click()
    page.wait_for_url("**/ui/jobs/job_*")
    first = page.url.rsplit("/", 1)[-1]
    while int(page.locator("#chart-loss").get_attribute("data-points") or 0) < 60:  # part of the run, live
        page.wait_for_timeout(250)
    page.screenshot(path=str(out / "job-live-wide-light.png"), full_page=True)
    dataset = dataset_url.rsplit("/", 1)[-1]
    body = {
        "base_model": "tiny-bert",
        "training_dataset": dataset,
        "hyperparameters": {"epochs": 4, "max_length": 64, "learning_rate": 3e-4, "batch_size": 32},
    }
    second = api.post("/jobs", json=body).json()["id"]
    for job in (first, second):
        while api.get(f"/jobs/{job}").json()["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(1)
    prediction = api.post("/predictions", json={"model": first, "dataset": dataset, "text_column": "text"}).json()["id"]
    while api.get(f"/predictions/{prediction}").json()["status"] not in ("succeeded", "failed"):
        time.sleep(1)
    return pages(dataset, first, second, prediction)


def shoot(browser, base: str, state: dict, shots: dict[str, str], out: Path) -> None:
    """Each page wide and narrow, light and dark; the sign-in page."""
    for scheme in ("light", "dark"):
        for width, tag in ((1280, "wide"), (390, "narrow")):
            ctx = browser.new_context(
                base_url=base, viewport={"width": width, "height": 900}, color_scheme=scheme, storage_state=state
            )
            pg = ctx.new_page()
            for name, url in shots.items():
                pg.goto(url)
                if name == "dataset":
                    pg.get_by_role("button", name="Plan (dry run)").click()
                    pg.locator("#plan-padding meter").first.wait_for()
                pg.wait_for_timeout(1500)
                pg.screenshot(path=str(out / f"{name}-{tag}-{scheme}.png"), full_page=True)
            ctx.close()
    login = browser.new_page(base_url=base, viewport={"width": 1280, "height": 600})
    login.goto("/ui/login")
    login.screenshot(path=str(out / "login-wide-light.png"))


if __name__ == "__main__":
    main()
