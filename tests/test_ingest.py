"""Data ingestion on real and hostile files: each case that was misread, gave a 500, was accepted
and then retried, leaked a path or took unbounded memory, now read right or refused at upload or
submit with a 4xx validation report. On every stack."""

import csv
import io
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import wait_for_status
from tests.test_api_errors import FINISHED, Snapshot, assert_error, job_body, post_file
from tests.test_api_jobs import upload

TEXTS = ['she said "hi"\tand left', "two\nlines", '"quoted" start', "plain words", "comma, inside"]


def parquet_bytes(table: pa.Table, **kwargs) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **kwargs)
    return sink.getvalue()


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as a strict JSON parser does."""

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def problems_of(error: dict) -> list[dict]:
    return error.get("problems") or []


# ----------------------------------------------------------------------------- TSV and CSV


def text_column(stack, dataset: dict, fmt: str) -> list:
    """The ``text`` column of an uploaded classification dataset, as a job reads it."""
    from shared.data.columns import JobColumns
    from shared.data.labels import read_job_table

    path = stack.data_dir / "uploads" / f"{dataset['id']}.{fmt}"
    table, _ = read_job_table(path, fmt, dataset["filename"], JobColumns("classification", "text", None, "label"))
    return table["text"].tolist()


@pytest.mark.parametrize("writer", ["csv_module", "pandas"])
def test_quoted_tsv_with_tabs_newlines_and_quotes_is_read_exactly(stack, writer):
    labels = ["a", "b", "a", "b", "a"]
    if writer == "csv_module":
        out = io.StringIO()
        w = csv.writer(out, delimiter="\t", lineterminator="\n")
        w.writerow(["text", "label"])
        w.writerows(zip(TEXTS, labels))
        content = out.getvalue().encode()
    else:
        content = pd.DataFrame({"text": TEXTS, "label": labels}).to_csv(sep="\t", index=False).encode()
    dataset = upload(stack.client, content, "quoted.tsv")
    assert dataset["rows"] == 5 and dataset["columns"] == ["text", "label"]
    assert text_column(stack, dataset, "tsv") == TEXTS


def test_unquoted_tsv_keeps_quotes_as_text(stack):
    content = b'text\tlabel\n"Great movie" he said\tpos\nsay "hi" twice\tneg\n"ok"\tpos\nplain\tneg\n'
    dataset = upload(stack.client, content, "unquoted.tsv")
    assert dataset["rows"] == 4
    assert text_column(stack, dataset, "tsv") == ['"Great movie" he said', 'say "hi" twice', '"ok"', "plain"]


def test_excel_s_semicolon_separated_csv_is_read_exactly(stack):
    """Excel writes CSV with semicolons where a comma is the decimal separator: the header
    ``text;label`` read as one column, and every quoted text was refused ("',' expected after
    '\"'"). A header of one field holding a semicolon means semicolons; a comma in a text stays."""
    labels = ["a", "b", "a", "b", "a"]
    content = pd.DataFrame({"text": TEXTS, "label": labels}).to_csv(sep=";", index=False).encode("utf-8-sig")
    dataset = upload(stack.client, content, "excel.csv")
    assert dataset["rows"] == 5 and dataset["columns"] == ["text", "label"]
    assert text_column(stack, dataset, "csv") == TEXTS
    # a comma-separated file whose header holds a semicolon inside a field is still read by commas
    dataset = upload(stack.client, b'"a;b",label\nx,1\ny,2\n', "commas.csv")
    assert dataset["columns"] == ["a;b", "label"]


def test_utf8_bom_is_read_and_utf16_refused(stack):
    dataset = upload(stack.client, "\ufefftext,label\nhello,a\nworld,b\n".encode(), "bom.csv")
    assert dataset["columns"] == ["text", "label"]  # not "\ufefftext"
    before = Snapshot(stack)
    error = assert_error(
        post_file(stack.client, "text,label\nhello,a\n".encode("utf-16"), "wide.csv"),
        422,
        "invalid_encoding",
        "file",
        "wide.csv",
        "offset 0",
    )
    assert "UTF-16" in error["message"]
    before.assert_unchanged()


@pytest.mark.parametrize(
    "filename, content, problem",
    [
        (
            "ragged.csv",
            b"text,label\na,b\nc,d,e\nf,g\n",
            {"row": 2, "column": None, "value": "c,d,e", "message": "has 3 field(s) where the header has 2"},
        ),
        (
            "short.csv",
            b"text,label\na,b\nc\n",
            {"row": 2, "column": None, "value": "c", "message": "has 1 field(s) where the header has 2"},
        ),
        (
            "quote.csv",
            b'text,label\n"Great" film,a\n',
            {
                "row": 1,
                "column": None,
                "value": None,
                "message": "(line 2) does not parse: ',' expected after '\"' (a quote "
                "inside a field must be doubled, and the field quoted)",
            },
        ),
        (
            "long.csv",
            b"text,label\n" + b"x" * (1 << 20) + b"y,a\nok,b\n",
            {
                "row": 1,
                "column": None,
                "value": None,
                "message": "(line 2) does not parse: field larger than field limit (1048576)",
            },
        ),
        (
            "dup.csv",
            b"text,label,text\na,b,c\n",
            {"row": None, "column": "text", "value": None, "message": "is a duplicate column name (columns 1 and 3)"},
        ),
        (
            "arrays.jsonl",
            b'{"text": "a", "label": "x"}\n["b", "y"]\n',
            {
                "row": 2,
                "column": None,
                "value": '["b", "y"]',
                "message": "(line 2) is a JSON list, not an object "
                '(each line must be one {"column": value, ...} object)',
            },
        ),
        (
            "dupkey.jsonl",
            b'{"text": "a", "text": "b", "label": "x"}\n',
            {
                "row": 1,
                "column": None,
                "value": '{"text": "a", "text": "b", "label": "x"}',
                "message": "(line 1) has the key 'text' twice",
            },
        ),
        (
            "nan.jsonl",
            b'{"text": "a", "label": NaN}\n',
            {
                "row": 1,
                "column": None,
                "value": '{"text": "a", "label": NaN}',
                "message": "(line 1) holds NaN, which is not valid JSON (use null, or a number)",
            },
        ),
    ],
)
def test_structural_problems_are_refused_at_upload_with_a_report(stack, filename, content, problem):
    before = Snapshot(stack)
    error = assert_error(post_file(stack.client, content, filename), 422, "invalid_file", "file", filename)
    assert problems_of(error) == [problem]
    before.assert_unchanged()


def test_report_lists_at_most_20_problems_and_the_first_in_the_message(stack):
    rows = "".join(f"{'' if i % 2 else 'text ' + str(i)},label\n" for i in range(60))
    dataset = upload(stack.client, f"text,label\n{rows}".encode(), "holes.csv")
    before = Snapshot(stack)
    error = assert_error(
        stack.client.post("/jobs", json=job_body(dataset["id"])),
        422,
        "missing_value",
        "text_column",
        "'holes.csv' row 2: column 'text' is empty",
        "more problem(s)",
    )
    assert [p["row"] for p in error["problems"]] == list(range(2, 42, 2))  # 20, in row order
    assert all(p == {"row": p["row"], "column": "text", "value": "", "message": "is empty"} for p in error["problems"])
    before.assert_unchanged()


@pytest.mark.parametrize("dry_run", [True, False])
def test_report_lists_problems_in_row_order_not_column_by_column(stack, dry_run):
    """The text column is checked before the label, but users fix files top to bottom: row 1's
    label problem comes before row 2's text problem, and is the one the message names."""
    dataset = upload(stack.client, b"text,label\ngoal,\n,business\ncoach,sport\n", "order.csv")
    before = Snapshot(stack)
    r = stack.client.post("/jobs", params={"dry_run": dry_run}, json=job_body(dataset["id"]))
    error = assert_error(r, 422, "missing_value", "label_column", "'order.csv' row 1: column 'label' is empty")
    assert error["problems"] == [
        {"row": 1, "column": "label", "value": "", "message": "is empty"},
        {"row": 2, "column": "text", "value": "", "message": "is empty"},
    ]
    before.assert_unchanged()


def test_a_full_report_keeps_the_first_rows_problems(stack):
    """Text problems in 30 rows fill the report before the label is checked; row 1's label problem
    still makes it, in row 1's place, and row 20's text problem is the one left out."""
    rows = "".join(f",{'' if i == 0 else 'label'}\n" for i in range(30))
    dataset = upload(stack.client, f"text,label\n{rows}".encode(), "holes.csv")
    r = stack.client.post("/jobs", json=job_body(dataset["id"]))
    error = assert_error(r, 422, "missing_value", "text_column", "'holes.csv' row 1: column 'text' is empty", "19+")
    assert [(p["row"], p["column"]) for p in error["problems"]] == [(1, "text"), (1, "label")] + [
        (row, "text") for row in range(2, 20)
    ]


# ----------------------------------------------------------------------------- the six 500s


def test_metrics_after_a_step_beyond_64_bits_is_a_4xx(stack):
    dataset = upload(stack.client, b"text,label\ngoal,a\nbank,b\ncoach,a\nshares,b\n", "tiny.csv")
    job = stack.client.post("/jobs", json=job_body(dataset["id"], validation_split=0.5)).json()
    r = stack.client.get(f"/jobs/{job['id']}/metrics", params={"after_step": 9223372036854775808})
    assert_error(r, 422, "invalid_request", "after_step")
    assert stack.client.get(f"/jobs/{job['id']}/metrics", params={"after_step": 2**31 - 1}).json() == {"data": []}
    wait_for_status(stack.client, job["id"], FINISHED)


@pytest.mark.parametrize("dry_run", [True, False])
def test_jsonl_labels_that_are_objects_are_refused_at_submit(stack, dry_run):
    content = (
        b'{"text": "goal", "label": {"name": "sport"}}\n{"text": "bank", "label": "business"}\n'
        b'{"text": "vote", "label": ["politics"]}\n'
    )
    dataset = upload(stack.client, content, "nested.jsonl")
    before = Snapshot(stack)
    r = stack.client.post("/jobs", params={"dry_run": dry_run}, json=job_body(dataset["id"]))
    error = assert_error(r, 422, "invalid_label", "label_column", "nested.jsonl", "row 1", "nested value")
    assert [(p["row"], p["value"]) for p in error["problems"]] == [(1, "{'name': 'sport'}"), (3, "['politics']")]
    before.assert_unchanged()


def test_parquet_label_column_of_lists_is_refused_at_submit(stack):
    table = pa.table({"text": ["goal", "bank"], "label": [["sport"], ["business"]]})
    dataset = upload(stack.client, parquet_bytes(table), "lists.parquet")
    before = Snapshot(stack)
    for dry_run in (True, False):
        r = stack.client.post("/jobs", params={"dry_run": dry_run}, json=job_body(dataset["id"]))
        error = assert_error(r, 422, "invalid_column", "file", "lists.parquet", "'label'", "nested values")
        assert error["problems"][0]["column"] == "label" and error["problems"][0]["row"] is None
    before.assert_unchanged()


def test_labels_mixing_1_and_string_1_are_one_class(stack):
    """A label's class is its text, as in a CSV: JSON 1 and "1" are the class "1", true is "true"."""
    rows = [{"text": f"text {i}", "label": [1, "1", 2, "2", True][i % 5]} for i in range(30)]
    dataset = upload(stack.client, "".join(json.dumps(r) + "\n" for r in rows).encode(), "mixed.jsonl")
    r = stack.client.post("/jobs", params={"dry_run": True}, json=job_body(dataset["id"]))
    assert r.status_code == 200, r.text
    r = stack.client.post("/jobs", json=job_body(dataset["id"]))
    assert r.status_code == 201, r.text
    assert r.json()["label_names"] == ["1", "2", "true"]
    job = wait_for_status(stack.client, r.json()["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]


def test_bytes_text_column_is_refused_at_submit_and_in_the_dry_run(stack):
    table = pa.table({"text": pa.array([b"goal", b"\xff\xfe"], pa.binary()), "label": ["a", "b"]})
    dataset = upload(stack.client, parquet_bytes(table), "bytes.parquet")
    before = Snapshot(stack)
    for dry_run in (True, False):  # the dry run was a 500; the job was queued, then retried 4 times
        r = stack.client.post("/jobs", params={"dry_run": dry_run}, json=job_body(dataset["id"]))
        error = assert_error(r, 422, "invalid_text", "text_column", "bytes.parquet", "row 1", "bytes (binary)")
        assert [p["row"] for p in error["problems"]] == [1, 2]
    before.assert_unchanged()


# ----------------------------------------------------------------------------- labels and targets


@pytest.mark.parametrize(
    "target, message",
    [
        ("inf", "is not a finite number"),
        ("nan", "is not a finite number"),
        ("-inf", "is not a finite number"),
        ("1e38", "is larger than 1e+06"),
        ("1e39", "is not a finite number (float32)"),
        ("true", "is not a number"),
    ],
)
def test_regression_targets_must_be_finite_and_bounded(stack, target, message):
    content = f"text,score\ngoal,1.5\nbank,{target}\ncoach,0.5\nshares,2\n".encode()
    dataset = upload(stack.client, content, "targets.csv")
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(dataset["id"], task="regression", label_column="score"))
    error = assert_error(r, 422, "invalid_label", "label_column", "targets.csv", "row 2", message)
    assert error["problems"] == [
        {"row": 2, "column": "score", "value": target, "message": error["problems"][0]["message"]}
    ]
    before.assert_unchanged()


def test_json_true_is_not_a_regression_target(stack):
    dataset = upload(
        stack.client, b'{"text": "a", "y": 1.5}\n{"text": "b", "y": true}\n{"text": "c", "y": 2}\n', "bool.jsonl"
    )
    r = stack.client.post("/jobs", json=job_body(dataset["id"], task="regression", label_column="y"))
    assert_error(r, 422, "invalid_label", "label_column", "row 2", "a boolean, not a number")


def test_float_labels_are_refused_for_classification(stack):
    dataset = upload(stack.client, b'{"text": "a", "label": 0.5}\n{"text": "b", "label": 1}\n', "floats.jsonl")
    r = stack.client.post("/jobs", json=job_body(dataset["id"]))
    assert_error(r, 422, "invalid_label", "label_column", "row 1", "is a float", "regression")


def test_label_column_must_differ_from_the_text_column(stack):
    dataset = upload(stack.client, b"text,label\na,b\nc,d\n", "same.csv")
    r = stack.client.post("/jobs", json=job_body(dataset["id"], label_column="text"))
    error = assert_error(r, 422, "invalid_request", None, "label_column 'text' must differ")
    assert not error["message"].startswith("Value error"), error  # pydantic's prefix for a check of the whole body


def test_huge_targets_with_the_opt_out_fail_the_job_once_with_null_metrics(stack):
    """allow_large_targets lets 1e38 through; its loss overflows, the steps are skipped and flagged,
    the job fails at once (no retry), and no response holds Infinity or NaN."""
    rows = "".join(f"text number {i},{1e38 if i % 2 else -1e38}\n" for i in range(32))
    dataset = upload(stack.client, f"text,score\n{rows}".encode(), "huge.csv")
    body = job_body(dataset["id"], task="regression", label_column="score", allow_large_targets=True)
    body["hyperparameters"].update(max_nonfinite_steps=2, precision="fp32")
    r = stack.client.post("/jobs", json=body)
    assert r.status_code == 201, r.text
    job = wait_for_status(stack.client, r.json()["id"], FINISHED)
    assert job["status"] == "failed" and job["error"]["code"] == "nonfinite_loss", job
    assert job["attempts"] == 1
    for path in [f"/jobs/{job['id']}", f"/jobs/{job['id']}/metrics", f"/jobs/{job['id']}/events"]:
        strict_json(stack.client.get(path).text)
    losses = [m for m in stack.client.get(f"/jobs/{job['id']}/metrics").json()["data"] if m["name"] == "train_loss"]
    assert all(m["value"] is None and m["nonfinite"] for m in losses)  # those flushed before it failed


def test_nonfinite_metrics_are_stored_as_null_and_flagged(stack):
    """What the worker reports goes through ``lifecycle.record_progress``: NaN (which SQLite cannot store in a NOT
    NULL column) and Infinity become null, flagged ``nonfinite``; PostgreSQL's json gets no NaN."""
    from sqlalchemy import update

    from shared.jobs import lifecycle
    from shared.store.engine import session_scope
    from shared.store.rows import Job, utcnow

    dataset = upload(stack.client, b"text,label\ngoal,a\nbank,b\ncoach,a\nshares,b\n", "report.csv")
    job = stack.client.post("/jobs", json=job_body(dataset["id"], validation_split=0.5)).json()
    status = wait_for_status(stack.client, job["id"], FINISHED)["status"]
    with session_scope() as s:  # hold the finished job's lease as a worker would
        s.execute(update(Job).where(Job.id == job["id"]).values(status="running", lease_owner="test-worker"))
    now = utcnow()
    assert lifecycle.record_progress(
        job["id"],
        "test-worker",
        {"train_metrics": {"loss": float("nan"), "lr": 0.1}},
        [
            (1000, 9.0, "train_loss", float("inf"), now),
            (1000, 9.0, "grad_norm", float("nan"), now),
            (1000, 9.0, "learning_rate", 0.5, now),
        ],
    )
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job["id"]).values(status=status, lease_owner=None))
    got = strict_json(stack.client.get(f"/jobs/{job['id']}/metrics", params={"after_step": 999}).text)["data"]
    assert [(m["name"], m["value"], m["nonfinite"]) for m in got] == [
        ("train_loss", None, True),
        ("grad_norm", None, True),
        ("learning_rate", 0.5, False),
    ]
    assert strict_json(stack.client.get(f"/jobs/{job['id']}").text)["train_metrics"] == {"loss": None, "lr": 0.1}


def test_nan_validation_metric_becomes_null_in_the_api_and_in_metrics_json(stack, tmp_path):
    """Pearson r of a constant validation set is NaN: it was written as NaN into metrics.json."""
    train = "".join(f"text number {i},{i % 7}\n" for i in range(24))
    train_ds = upload(stack.client, f"text,score\n{train}".encode(), "scores.csv")
    val_ds = upload(stack.client, b"text,score\na,1\nb,1\nc,1\n", "constant.csv")
    body = job_body(train_ds["id"], task="regression", label_column="score", validation_dataset=val_ds["id"])
    r = stack.client.post("/jobs", json=body)
    assert r.status_code == 201, r.text
    job = wait_for_status(stack.client, r.json()["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]
    got = strict_json(stack.client.get(f"/jobs/{job['id']}").text)
    assert got["validation_metrics"]["pearson_r"] is None
    metrics = strict_json(stack.client.get(f"/jobs/{job['id']}/artifacts/metrics.json").text)
    assert metrics["validation"]["pearson_r"] is None


# ----------------------------------------------------------------------------- memory and size


def test_parquet_bomb_is_refused_by_expanded_size(stack, monkeypatch):
    """A few KB of Parquet (one long string, dictionary-encoded a million times) that expands to
    200 MB is refused at upload, measured from its dictionary before anything is expanded."""
    from shared.settings import get_settings

    monkeypatch.setattr(get_settings(), "max_dataset_bytes", 50_000_000)
    n = 1_000_000
    table = pa.table(
        {
            "text": pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["x" * 200])),
            "label": pa.DictionaryArray.from_arrays(pa.array(np.arange(n, dtype=np.int32) % 2), pa.array(["a", "b"])),
        }
    )
    content = parquet_bytes(table, compression="zstd")
    assert len(content) < 200_000
    before = Snapshot(stack)
    error = assert_error(
        post_file(stack.client, content, "bomb.parquet"), 413, "dataset_too_large", "file", "bomb.parquet", "50,000,000"
    )
    assert "expands" in error["message"]
    before.assert_unchanged()


def test_parquet_whose_pages_declare_a_huge_expansion_is_refused_before_reading(stack):
    table = pa.table({"text": ["a" * (80 << 20)], "label": ["x"]})  # 80 MiB of one byte, zstd: a few KB
    content = parquet_bytes(table, compression="zstd", use_dictionary=False)
    assert len(content) < 100_000
    assert_error(post_file(stack.client, content, "zip.parquet"), 413, "dataset_too_large", "file", "decompress to")


def test_upload_over_the_limit_is_refused_from_its_content_length(stack, monkeypatch):
    from shared.settings import get_settings

    monkeypatch.setattr(get_settings(), "max_upload_bytes", 100)
    before = Snapshot(stack)
    r = post_file(stack.client, b"text,label\n" + b"x,y\n" * 50_000, "big.csv")
    error = assert_error(r, 413, "file_too_large", "file", "100 bytes")
    assert "big.csv" not in error["message"]  # refused from the header, before the part naming it was read
    before.assert_unchanged()


@pytest.mark.parametrize("content_type", ["application/json", "text/csv", "multipart/form-data"])
def test_upload_that_is_not_multipart_is_a_415(stack, content_type):
    r = stack.client.post("/datasets", content=b"text,label\na,b\n", headers={"content-type": content_type})
    assert_error(r, 415, "unsupported_media_type", "file")


# ----------------------------------------------------------------------------- no server paths


def test_no_server_path_in_errors(stack):
    """Reader errors (pyarrow's name the file they read) reach the client without the path."""
    data_dir = str(stack.data_dir)
    table = pq.ParquetFile(io.BytesIO(parquet_bytes(pa.table({"text": ["a"], "label": ["b"]}))))
    truncated = parquet_bytes(pa.table({"text": ["a"] * 100, "label": ["b"] * 100}))
    for filename, content in [
        ("junk.parquet", b"PAR1" + b"\0" * 64 + b"PAR1"),
        ("cut.parquet", truncated[:-30]),
        ("cut2.parquet", truncated[40:]),
    ]:
        r = post_file(stack.client, content, filename)
        assert_error(r, 422, "invalid_file", "file", filename)
        assert data_dir not in r.text and "/uploads" not in r.text and ".tmp" not in r.text, r.text
    assert table.metadata.num_rows == 1


# ----------------------------------------------------------------------------- the worker's view


def test_worker_reads_the_table_the_api_checked_and_fails_bad_data_as_a_user_error(tmp_path):
    from shared.data.columns import JobColumns
    from shared.data.labels import read_job_table
    from shared.errors import UserError

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "1"}\n{"text": "c", "label": false}\n')
    table, summary = read_job_table(path, "jsonl", "d.jsonl", JobColumns("classification", "text", None, "label"))
    assert table["label"].tolist() == ["1", "1", "false"] and summary.names == ["1", "false"]
    assert summary.codes.tolist() == [0, 0, 1]
    path.write_text('{"text": "a", "label": 1.5}\n{"text": "b", "label": Infinity}\n')
    with pytest.raises(UserError) as e:  # a file changed on disk fails the job at once, never retried
        read_job_table(path, "jsonl", "d.jsonl", JobColumns("regression", "text", None, "label"))
    assert e.value.code == "invalid_file" and "Infinity" in e.value.message


# ----------------------------------------------------------------------------- the OpenAPI schema


def test_openapi_documents_the_error_body_for_every_4xx_and_the_dry_run_plan(stack):
    schema = stack.client.get("/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(schema)
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            errors = {s: r for s, r in operation["responses"].items() if s.startswith("4")}
            # the /v1 facade answers in OpenAI's error shape, documented for every client error ("4XX")
            body = "OpenAIErrorResponse" if path.startswith("/v1/") else "ErrorBody"
            if body == "OpenAIErrorResponse":
                assert "4XX" in errors, (method, path)
            elif operation.get("parameters") or operation.get("requestBody"):
                assert "422" in errors, (method, path)
            if "{" in path:
                assert "404" in errors, (method, path)
            for status, response in errors.items():
                assert response["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}, (
                    method,
                    path,
                    status,
                )
    assert schema["paths"]["/datasets"]["post"]["responses"].keys() >= {"201", "413", "415", "422"}
    dry_run = schema["paths"]["/jobs"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert dry_run == {"$ref": "#/components/schemas/DryRunOut"}
    components = schema["components"]["schemas"]
    for name in ["JobCreate", "JobOut", "DatasetOut", "DryRunOut", "ErrorBody", "MetricOut"]:
        example = components[name]["examples"][0]
        assert "string" not in json.dumps(example), name
    assert components["JobCreate"]["examples"][0]["base_model"] == "all-MiniLM-L6-v2"


def test_library_messages_lose_their_server_paths():
    from shared.errors import without_paths

    assert (
        without_paths("[Errno 2] No such file or directory: '/data/uploads/ds_1.csv'")
        == "[Errno 2] No such file or directory: '<path>'"
    )
    assert (
        without_paths("Could not open Parquet input source '/root/.tunejob/uploads/.1a2b.tmp': bad")
        == "Could not open Parquet input source '<path>': bad"
    )
    assert without_paths("see http://host/a/b, ratio 3/4") == "see http://host/a/b, ratio 3/4"
