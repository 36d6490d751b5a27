"""Issue 26, item 7: ``jobs create --watch`` without a terminal prints progress lines between the
start and the end, and the training curves give validation panels a sensible range."""

import io
import math
from datetime import UTC, datetime
from types import SimpleNamespace

from rich.console import Console

from client import watch as watching
from shared.jobs import curves
from shared.schemas.jobs import JobOut

JOB = JobOut.model_config["json_schema_extra"]["examples"][0]


def job_at(step: int, status: str = "running") -> JobOut:
    progress = {"step": step, "total_steps": 10, "epoch": step / 10, "fraction": step / 10, "eta_seconds": 10 - step}
    return JobOut.model_validate({**JOB, "suffix": None, "timings": {}, "status": status, "progress": progress})


class FakeClient:
    """What ``watch`` reads: the job, then the messages of its stream."""

    def __init__(self, messages: list):
        self.messages = messages

    def get_of_kind(self, job_id, kind):
        return job_at(0, "queued")

    def follow(self, job_id, kind):
        yield from self.messages


def test_watch_without_a_terminal_prints_plain_progress_lines(monkeypatch):
    messages = [SimpleNamespace(event="progress", data=job_at(s)) for s in range(1, 10)]
    messages.append(SimpleNamespace(event="end", data=job_at(10, "succeeded")))
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    assert not console.is_terminal

    monkeypatch.setattr(watching, "PLAIN_EVERY_SECONDS", 0.0)
    assert watching.watch(FakeClient(messages), JOB["id"], console) == 0
    lines = [line for line in out.getvalue().splitlines() if line.startswith(JOB["id"])]
    assert lines[0].startswith(f"{JOB['id']} running 1/10 · epoch 0.10 · loss 0.4120")
    assert "ETA 0:09" in lines[0]
    assert len(lines) == 10 and lines[-1].startswith(f"{JOB['id']} succeeded 10/10")

    out.truncate(0)
    out.seek(0)
    monkeypatch.setattr(watching, "PLAIN_EVERY_SECONDS", 3600.0)  # in between: only when the status changes
    watching.watch(FakeClient(messages), JOB["id"], Console(file=out, force_terminal=False, width=200))
    lines = [line for line in out.getvalue().splitlines() if line.startswith(JOB["id"])]
    assert [line.split()[1] for line in lines] == ["running", "succeeded"]


def test_score_panels_span_zero_to_one_and_others_a_tenth_of_their_values():
    one_point = {"eval_accuracy": ([10], [0.5]), "eval_f1_macro": ([10], [0.4])}
    assert curves.panel_range(["eval_accuracy", "eval_f1_macro"], one_point) == (-0.02, 1.02)

    lo, hi = curves.panel_range(["eval_mse"], {"eval_mse": ([10], [2.0])})
    assert lo < 2.0 < hi and hi - lo >= 0.2  # not matplotlib's ±0.0005
    lo, hi = curves.panel_range(["eval_pearson_r"], {"eval_pearson_r": ([5, 10], [0.91, 0.912])})
    assert hi - lo >= 0.09
    lo, hi = curves.panel_range(["eval_mse"], {"eval_mse": ([5, 10], [1.0, 9.0])})
    assert lo < 1.0 and hi > 9.0 and hi - lo < 9.0
    assert curves.render_png({"eval_accuracy": ([10], [0.5])}, "a job").startswith(b"\x89PNG")


def test_a_diverged_value_stored_as_null_is_left_out_of_the_curves():
    """The store keeps a NaN or Infinity metric as null (``record_progress``): the plot and the
    artifact's curves leave it out, as they do a non-finite float, instead of failing."""
    now = datetime.now(UTC)
    rows = [(1, "train_loss", 0.7, now), (2, "train_loss", None, now), (3, "train_loss", math.inf, now)]
    rows.append((3, "eval_loss", 0.6, now))
    assert curves.series_of(rows) == {"train_loss": ([1], [0.7]), "eval_loss": ([3], [0.6])}


def test_the_artifacts_pictures_leave_a_null_value_out(tmp_path, caplog):
    """``worker.run_logs`` draws both pictures from rows with a null (a diverged loss in the store)."""
    from shared.store.rows import Job
    from worker.run_logs import write_run_logs

    now = datetime.now(UTC)
    rows = [(1, "train_loss", 0.7, now), (2, "train_loss", None, now), (2, "eval_loss", 0.6, now)]
    write_run_logs(tmp_path, Job(id="j", base_model="tiny-bert", spec={}), rows)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert (tmp_path / "training_curves.png").read_bytes().startswith(b"\x89PNG")
    assert len(list((tmp_path / "runs").glob("events.out.tfevents.*"))) == 1
