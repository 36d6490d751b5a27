"""Bad input is refused with a 4xx ``{"error": {code, message, param}}`` that names the problem, and
leaves nothing behind (no dataset row, no job row, no stored upload); good uploads in every format
are recorded exactly; the job list filters and pages. On every stack."""

import hashlib
import io
import json

import pandas as pd
import pytest

from tests.conftest import TINY_MODEL, wait_for_status
from tests.test_api_jobs import labelled_csv, upload

FINISHED = {"succeeded", "failed", "cancelled"}


# ----------------------------------------------------------------------------- helpers


def post_file(client, content: bytes, filename: str):
    return client.post("/datasets", files={"file": (filename, io.BytesIO(content), "application/octet-stream")})


def job_body(dataset_id: str, **overrides) -> dict:
    body = {
        "base_model": TINY_MODEL,
        "task": "classification",
        "training_dataset": dataset_id,
        "text_column": "text",
        "label_column": "label",
        "hyperparameters": {"epochs": 1, "batch_size": 8, "max_length": 32, "learning_rate": 1e-3},
    }
    body.update(overrides)
    return body


def assert_error(r, status: int, code: str | None = None, param: str | None = "<any>", *mentions: str) -> dict:
    """The response is ``status`` with the error envelope; returns the error object."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    payload = r.json()
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    openai = {"type"} if r.request.url.path.startswith("/v1/") else set()  # the /v1 facade adds OpenAI's `type`
    assert set(error) - openai in ({"code", "message", "param"}, {"code", "message", "param", "problems"}), error
    assert isinstance(error["message"], str) and error["message"], error
    if "problems" in error:  # a validation report: 1 to 20 problems, the first one also in the message
        assert 1 <= len(error["problems"]) <= 20, error
        assert all(set(p) == {"row", "column", "value", "message"} for p in error["problems"]), error
        assert error["problems"][0]["message"] in error["message"] or error["code"] == "unknown_label", error
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param != "<any>":
        assert error["param"] == param, error
    for text in mentions:
        assert text in error["message"], (text, error["message"])
    return error


def all_jobs(client, **params) -> list[dict]:
    """Every job, following cursors."""
    out, cursor = [], None
    while True:
        query = {"limit": 100, **params, **({"cursor": cursor} if cursor else {})}
        r = client.get("/jobs", params=query)
        assert r.status_code == 200, r.text
        page = r.json()
        out += page["data"]
        cursor = page["next_cursor"]
        if cursor is None:
            return out


class Snapshot:
    """Counts of datasets, jobs and stored upload files, to prove a refused request wrote nothing."""

    def __init__(self, stack):
        self.stack = stack
        self.datasets = self._datasets()
        self.jobs = [j["id"] for j in all_jobs(stack.client)]
        self.uploads = self._uploads()

    def _datasets(self) -> list[str]:
        r = self.stack.client.get("/datasets")
        assert r.status_code == 200
        return [d["id"] for d in r.json()["data"]]

    def _uploads(self) -> set[str]:
        folder = self.stack.data_dir / "uploads"
        return {p.name for p in folder.iterdir()} if folder.is_dir() else set()

    def assert_unchanged(self) -> None:
        assert self._datasets() == self.datasets
        assert [j["id"] for j in all_jobs(self.stack.client)] == self.jobs
        assert self._uploads() == self.uploads


@pytest.fixture(scope="module")
def train_ds(stack) -> dict:
    """A valid two-class training set (48 rows)."""
    return upload(stack.client, labelled_csv(rows=48, seed=1), "train.csv")


# ----------------------------------------------------------------------------- refused uploads


def test_non_utf8_csv_is_refused_naming_file_line_and_offset(stack):
    before = Snapshot(stack)
    content = b"text,label\nhello there,sports\ncaf\xe9 au lait,business\n"
    r = post_file(stack.client, content, "latin1.csv")
    offset = content.index(b"\xe9")
    error = assert_error(r, 422, "invalid_encoding", "file", "latin1.csv", "line 3", f"offset {offset}", "0xe9")
    assert "UTF-8" in error["message"]
    before.assert_unchanged()


def test_non_utf8_jsonl_is_refused(stack):
    before = Snapshot(stack)
    content = b'{"text": "ok", "label": "a"}\n{"text": "\xff\xfe", "label": "b"}\n'
    offset = content.index(b"\xff")
    assert_error(
        post_file(stack.client, content, "bad.jsonl"),
        422,
        "invalid_encoding",
        "file",
        "bad.jsonl",
        "line 2",
        f"offset {offset}",
    )
    before.assert_unchanged()


def test_non_utf8_byte_across_read_chunks_is_located_exactly(stack):
    """The file is checked in 1 MiB chunks: a bad sequence that starts at the end of one chunk must
    still be reported at its own offset, not at the next chunk's first byte."""
    before = Snapshot(stack)
    head = b"text,label\n"
    content = head + b"a" * ((1 << 20) - 1 - len(head)) + b"\xe2A,sports\nb,business\n"
    offset = content.index(b"\xe2")
    assert offset == (1 << 20) - 1
    assert_error(
        post_file(stack.client, content, "big.csv"),
        422,
        "invalid_encoding",
        "file",
        "big.csv",
        f"offset {offset}",
        "0xe2",
        "line 2",
    )
    before.assert_unchanged()


def test_truncated_utf8_sequence_at_end_is_located_at_its_first_byte(stack):
    before = Snapshot(stack)
    content = b"text,label\na,b\nx\xe2\x82"  # a 3-byte sequence cut after 2 bytes
    offset = content.index(b"\xe2")
    assert_error(
        post_file(stack.client, content, "cut.csv"),
        422,
        "invalid_encoding",
        "file",
        "cut.csv",
        f"offset {offset}",
        "0xe2",
        "line 3",
    )
    before.assert_unchanged()


def test_empty_file_is_refused(stack):
    before = Snapshot(stack)
    assert_error(post_file(stack.client, b"", "empty.csv"), 422, "empty_file", "file", "empty.csv")
    before.assert_unchanged()


@pytest.mark.parametrize(
    "filename, content",
    [
        ("header.csv", b"text,label\n"),
        ("header.tsv", b"text\tlabel\n"),
    ],
)
def test_header_only_file_is_refused(stack, filename, content):
    before = Snapshot(stack)
    error = assert_error(post_file(stack.client, content, filename), 422, "empty_file", "file", filename)
    assert "no data row" in error["message"]
    before.assert_unchanged()


@pytest.mark.parametrize("filename", ["data.xlsx", "data", "data.csv.exe", "notes.txt"])
def test_unsupported_extension_is_refused(stack, filename):
    before = Snapshot(stack)
    error = assert_error(
        post_file(stack.client, b"text,label\na,b\n", filename), 422, "unsupported_format", "file", filename
    )
    assert ".csv" in error["message"] and ".parquet" in error["message"]  # says what is accepted
    hint = {"data.xlsx": "save it as CSV"}.get(filename)
    assert hint is None or hint in error["message"], error
    before.assert_unchanged()


def test_a_compressed_file_is_refused_saying_so(stack):
    error = assert_error(post_file(stack.client, b"\x1f\x8b", "train.csv.gz"), 422, "unsupported_format", "file")
    assert "compressed: upload the file inside it" in error["message"]


def test_json_lines_named_json_is_read_and_a_json_array_refused_saying_how_to_write_it(stack):
    """``.json`` was refused outright: JSON Lines named ``.json`` (Hugging Face datasets' json
    loader reads them) is read; a JSON array is refused with how to write JSON Lines."""
    lines = b'{"text": "a b", "label": "x"}\n{"text": "c d", "label": "y"}\n'
    r = post_file(stack.client, lines, "train.json")
    assert r.status_code == 201 and r.json()["rows"] == 2 and r.json()["columns"] == ["text", "label"], r.text
    before = Snapshot(stack)
    error = assert_error(
        post_file(stack.client, b'[{"text": "a b", "label": "x"}]', "records.json"), 422, "invalid_file", "file"
    )
    assert "one JSON array, not JSON Lines" in error["message"] and "lines=True" in error["message"]
    before.assert_unchanged()


def test_unparseable_parquet_is_refused(stack):
    before = Snapshot(stack)
    assert_error(
        post_file(stack.client, b"this is not parquet at all", "x.parquet"), 422, "invalid_file", "file", "x.parquet"
    )
    before.assert_unchanged()


@pytest.mark.parametrize(
    "filename, content",
    [
        ("ragged.csv", b"text,label\na,b\nc,d,e,f\ng,h\n"),
        ("quote.csv", b'text,label\n"unterminated,b\n'),
        ("broken.jsonl", b'{"text": "a", "label": "b"}\n{"text": 1\n'),
        ("blank.csv", b"\n\n\n"),
    ],
)
def test_unparseable_text_file_is_refused(stack, filename, content):
    before = Snapshot(stack)
    assert_error(post_file(stack.client, content, filename), 422, "invalid_file", "file", filename)
    before.assert_unchanged()


def test_too_large_upload_is_refused_and_its_partial_file_removed(stack, monkeypatch):
    from shared.settings import get_settings

    monkeypatch.setattr(get_settings(), "max_upload_bytes", 100)
    before = Snapshot(stack)
    r = post_file(stack.client, labelled_csv(rows=20), "big.csv")
    assert_error(r, 413, "file_too_large", "file", "big.csv", "100 bytes")
    before.assert_unchanged()


def test_a_body_past_max_request_bytes_is_413_before_it_is_read_or_the_key_checked(stack, train_ds, monkeypatch):
    """Every body but an upload's is read whole into memory (FastAPI parses JSON before it checks
    the key), so past TUNEJOB_MAX_REQUEST_BYTES it is refused (``api.body_limit``): at once from
    ``Content-Length``, or as the bytes of a chunked body arrive; without a key too, so that no
    caller can make the API hold a body of any size. Nothing is stored. An upload streams to disk
    under its own limit (TUNEJOB_MAX_UPLOAD_BYTES) and passes."""
    from fastapi.testclient import TestClient

    from shared.settings import get_settings
    from tests.conftest import BASE_URL

    monkeypatch.setattr(get_settings(), "max_request_bytes", 1000)
    client, anonymous = stack.client, TestClient(stack.app, base_url=BASE_URL)
    before = Snapshot(stack)
    big = job_body(train_ds["id"], metadata={"note": "x" * 1000})
    for caller in (client, anonymous):
        assert_error(
            caller.post("/jobs", json=big), 413, "request_too_large", None, "1,000 bytes", "TUNEJOB_MAX_REQUEST_BYTES"
        )

    def chunked():  # no Content-Length: counted as it arrives
        yield json.dumps(big).encode()[:600]
        yield json.dumps(big).encode()[600:]

    r = client.post("/jobs", content=chunked(), headers={"Content-Type": "application/json"})
    assert_error(r, 413, "request_too_large", None, "1,000 bytes")
    too_many = {"model": TINY_MODEL, "input": ["a text"] * 200}
    r = client.post("/v1/embeddings", json=too_many)
    assert_error(r, 413, "request_too_large")
    assert r.json()["error"]["type"] == "invalid_request_error"  # the /v1 facade's errors are OpenAI's shape
    r = client.post(
        "/v1/embeddings", content=iter([json.dumps(too_many).encode()]), headers={"Content-Type": "application/json"}
    )
    assert "content-length" not in r.request.headers  # counted as it arrives
    assert_error(r, 413, "request_too_large")
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "type" not in client.post("/jobs", json=big).json()["error"]
    before.assert_unchanged()

    small = job_body(train_ds["id"], hyperparameters={"epochs": 0})
    assert_error(client.post("/jobs", json=small), 422, "invalid_request")  # under the limit: read and checked
    assert len(labelled_csv(rows=200)) > 1000
    assert post_file(client, labelled_csv(rows=200), "large.csv").status_code == 201


def test_missing_file_field_is_refused(stack):
    before = Snapshot(stack)
    r = stack.client.post("/datasets", files={"other": ("a.csv", io.BytesIO(b"text,label\na,b\n"), "text/csv")})
    assert_error(r, 422, "invalid_request", "file")
    before.assert_unchanged()


# ----------------------------------------------------------------------------- refused jobs


def test_missing_text_or_label_column_is_refused(stack, train_ds):
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], text_column="body"))
    assert_error(r, 422, "missing_column", "text_column", "'body'", "train.csv")
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], label_column="category"))
    assert_error(r, 422, "missing_column", "label_column", "'category'", "train.csv")
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], text_pair_column="second"))
    assert_error(r, 422, "missing_column", "text_pair_column", "'second'", "train.csv")
    before.assert_unchanged()


def test_missing_column_in_validation_file_names_that_file(stack, train_ds):
    val = upload(
        stack.client, pd.DataFrame({"content": ["goal"], "label": ["sports"]}).to_csv(index=False).encode(), "val.csv"
    )
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], validation_dataset=val["id"]))
    assert_error(r, 422, "missing_column", "text_column", "'text'", "val.csv")
    before.assert_unchanged()


def test_empty_text_or_label_cell_is_refused_naming_row(stack):
    holes = upload(stack.client, b"text,label\ngoal,sports\nshares,business\n,sports\nbank,\n", "holes.csv")
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(holes["id"]))
    assert_error(r, 422, "missing_value", "text_column", "holes.csv", "row 3", "'text'")
    r = stack.client.post("/jobs", json=job_body(holes["id"], text_column="label", label_column="text"))
    error = assert_error(r, 422, "missing_value", "label_column", "holes.csv", "row 3", "'text'")
    assert [(p["row"], p["column"]) for p in error["problems"]] == [(3, "text"), (4, "label")]  # in row order
    before.assert_unchanged()


def test_regression_with_non_numeric_target_is_refused(stack, train_ds):
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], task="regression"))
    assert_error(r, 422, "invalid_label", "label_column", "train.csv", "row 1", "is not a number")
    before.assert_unchanged()


def test_unknown_base_model_is_refused(stack, train_ds):
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], base_model="bert-huge-9000"))
    error = assert_error(r, 422, "unknown_model", "base_model", "'bert-huge-9000'")
    assert TINY_MODEL in error["message"]  # lists what is available
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], base_model="google-bert/bert-huge-9000"))
    error = assert_error(r, 422, "unknown_model", "base_model", "TUNEJOB_MODELS_DIR", "'bert-huge-9000')")
    before.assert_unchanged()


def test_the_builtin_models_hugging_face_id_names_it(stack, train_ds):
    """``sentence-transformers/all-MiniLM-L6-v2``, the id users know, was refused (only
    ``all-MiniLM-L6-v2``): it names the built-in model, stored under tunejob's name."""
    from shared.schemas.jobs import JobCreate

    body = job_body(train_ds["id"], base_model="sentence-transformers/all-MiniLM-L6-v2")
    assert JobCreate.model_validate(body).base_model == "all-MiniLM-L6-v2"
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=body)
    assert r.status_code == 200 and r.json()["plan"]["total_steps"] >= 1, r.text


def test_single_class_label_is_refused(stack):
    one = upload(
        stack.client,
        pd.DataFrame({"text": ["a b", "c d", "e f"], "label": ["x", "x", "x"]}).to_csv(index=False).encode(),
        "one_class.csv",
    )
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(one["id"]))
    assert_error(r, 422, "single_class", "label_column", "one_class.csv", "'x'")
    before.assert_unchanged()


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", -1e-4),
        ("learning_rate", 0),
        ("epochs", 0),
        ("batch_size", 0),
        ("max_length", 4),
        ("precision", "fp8"),
        ("batching", "random"),
        ("warmup_ratio", 1.0),
    ],
)
def test_bad_hyperparameter_is_refused_naming_it(stack, train_ds, field, value):
    before = Snapshot(stack)
    body = job_body(train_ds["id"])
    body["hyperparameters"][field] = value
    error = assert_error(
        stack.client.post("/jobs", json=body),
        422,
        "invalid_request",
        f"hyperparameters.{field}",
        f"hyperparameters.{field}",
    )
    assert repr(value) in error["message"]  # the rejected value is quoted back
    before.assert_unchanged()


def test_unknown_training_dataset_is_refused(stack):
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body("ds_doesnotexist00"))
    assert_error(r, 422, "unknown_dataset", "training_dataset", "'ds_doesnotexist00'")
    before.assert_unchanged()


def test_unknown_validation_dataset_is_refused(stack, train_ds):
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], validation_dataset="ds_nope"))
    assert_error(r, 422, "unknown_dataset", "validation_dataset", "'ds_nope'")
    before.assert_unchanged()


def test_a_nul_character_is_refused_on_both_stacks_not_a_500(stack, train_ds):
    """PostgreSQL text and jsonb cannot hold NUL (0x00): ids holding one name nothing (a 4xx,
    as for any unknown id), and one in metadata is a 422 that says so; SQLite answers alike."""
    before = Snapshot(stack)
    assert_error(stack.client.post("/jobs", json=job_body("ds_\x00")), 422, "unknown_dataset", "training_dataset")
    r = stack.client.post("/v1/fine_tuning/jobs", json={"model": TINY_MODEL, "training_file": "\x00"})
    assert_error(r, 400, "unknown_dataset", "training_file")  # the OpenAI routes answer 400
    assert_error(stack.client.get("/jobs/job_%00"), 404, "not_found")
    assert_error(stack.client.get(f"/datasets/{train_ds['id']}%00"), 404, "not_found")
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], metadata={"note": "a\x00b"}))
    assert_error(r, 422, "invalid_request", "metadata", "'note'", "NUL")
    before.assert_unchanged()


def test_validation_label_unseen_in_training_is_refused(stack, train_ds):
    val = upload(
        stack.client,
        pd.DataFrame({"text": ["goal", "vote", "film"], "label": ["sports", "politics", "arts"]})
        .to_csv(index=False)
        .encode(),
        "val_labels.csv",
    )
    before = Snapshot(stack)
    r = stack.client.post("/jobs", json=job_body(train_ds["id"], validation_dataset=val["id"]))
    assert_error(r, 422, "unknown_label", "validation_dataset", "val_labels.csv", "'arts'", "'politics'")
    before.assert_unchanged()


def test_validation_dataset_and_split_together_are_refused(stack, train_ds):
    before = Snapshot(stack)
    r = stack.client.post(
        "/jobs", json=job_body(train_ds["id"], validation_dataset=train_ds["id"], validation_split=0.2)
    )
    error = assert_error(r, 422, "invalid_request")
    assert "validation_dataset" in error["message"] and "validation_split" in error["message"]
    before.assert_unchanged()


@pytest.mark.parametrize(
    "where, field",
    [("top", "learning_rate"), ("top", "model"), ("hyperparameters", "lr"), ("hyperparameters", "optimizer")],
)
def test_unknown_fields_are_refused(stack, train_ds, where, field):
    before = Snapshot(stack)
    body = job_body(train_ds["id"])
    (body if where == "top" else body["hyperparameters"])[field] = 1
    param = field if where == "top" else f"hyperparameters.{field}"
    assert_error(stack.client.post("/jobs", json=body), 422, "invalid_request", param, param)
    before.assert_unchanged()


@pytest.mark.parametrize("content", [b"not json", b"[1, 2]", b"{}"])
def test_malformed_job_body_is_refused(stack, content):
    before = Snapshot(stack)
    r = stack.client.post("/jobs", content=content, headers={"content-type": "application/json"})
    assert_error(r, 422, "invalid_request")
    before.assert_unchanged()


def test_dry_run_stores_nothing_and_refuses_the_same_bad_input(stack, train_ds):
    before = Snapshot(stack)
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=job_body(train_ds["id"]))
    assert r.status_code == 200, r.text
    assert r.json()["dry_run"] is True and r.json()["plan"]["total_steps"] >= 1
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=job_body(train_ds["id"], label_column="category"))
    assert_error(r, 422, "missing_column", "label_column", "'category'", "train.csv")
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=job_body(train_ds["id"], base_model="nope"))
    assert_error(r, 422, "unknown_model", "base_model")
    before.assert_unchanged()


@pytest.fixture(scope="module")
def one_row(stack) -> dict:
    return upload(stack.client, b"text,score\nhello,1.5\n", "one_row.csv")


def test_dry_run_of_a_split_leaving_no_training_row_is_refused(stack, one_row):
    before = Snapshot(stack)
    body = job_body(one_row["id"], task="regression", label_column="score")
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=body)  # was a 500 (sklearn ValueError)
    assert_error(r, 422, "too_few_rows", "validation_split", "validation_split 0.1", "1 row")
    before.assert_unchanged()


def test_job_whose_split_leaves_no_training_row_fails_at_once_without_retries(stack, one_row):
    body = job_body(one_row["id"], task="regression", label_column="score")
    r = stack.client.post("/jobs", json=body)
    if r.status_code == 422:  # refused up front (the test below): better still
        assert_error(r, 422, "too_few_rows", "validation_split")
        return
    assert r.status_code == 201, r.text
    job = wait_for_status(stack.client, r.json()["id"], FINISHED)
    assert job["status"] == "failed"
    assert job["error"]["code"] == "too_few_rows", job["error"]  # a user error, not a retried crash
    assert job["attempts"] == 1


def test_job_whose_split_leaves_no_training_row_is_refused_at_submission(stack, one_row):
    before = Snapshot(stack)
    body = job_body(one_row["id"], task="regression", label_column="score")
    r = stack.client.post("/jobs", json=body)
    if r.status_code == 201:
        wait_for_status(stack.client, r.json()["id"], FINISHED)
    assert_error(r, 422, "too_few_rows", "validation_split")
    before.assert_unchanged()


def test_split_train_validation_edges():
    import numpy as np

    from shared.data.split import split_train_validation
    from shared.errors import UserError

    def codes(n, classes):
        return np.arange(n, dtype=np.int32) % classes

    with pytest.raises(UserError) as e:
        split_train_validation(10, codes(10, 2), 0.95, 0)
    assert e.value.code == "too_few_rows" and e.value.param == "validation_split"
    # Too few rows per part to stratify 6 classes: split unstratified rather than crash.
    train, val = split_train_validation(12, codes(12, 6), 0.9, 0)
    assert (len(train), len(val)) == (1, 11)
    # Stratified where it can be: each of 5 classes keeps its share in validation.
    train, val = split_train_validation(200, codes(200, 5), 0.1, 0)
    assert np.bincount(codes(200, 5)[val]).tolist() == [4] * 5 and len(train) == 180
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(200))  # every row in exactly one part
    train, val = split_train_validation(5, codes(5, 2), 0.0, 0)
    assert val is None and train.tolist() == [0, 1, 2, 3, 4]
    # Seeded: the API's dry run and the worker hold out the same rows.
    assert (
        split_train_validation(200, codes(200, 5), 0.1, 7)[1].tolist()
        == split_train_validation(200, codes(200, 5), 0.1, 7)[1].tolist()
    )


def test_rows_that_share_a_query_are_held_out_together():
    """Reranking and embedding rows grouped by their query or anchor text (``text_groups``): a
    fraction of the distinct texts is held out whole, never a query on both sides."""
    import numpy as np

    from shared.data.split import split_train_validation, text_groups
    from shared.errors import UserError

    queries = [f"query {i % 10}" for i in range(37)]  # 10 queries of 3 or 4 rows, interleaved
    groups = text_groups(queries)
    assert (groups == text_groups(list(queries))).all() and len(np.unique(groups)) == 10
    train, val = split_train_validation(37, None, 0.2, 3, groups)
    held_out = {queries[i] for i in val}
    assert len(held_out) == 2 and not held_out & {queries[i] for i in train}  # ceil(0.2 x 10) whole queries
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(37))
    assert split_train_validation(37, None, 0.2, 3, groups)[1].tolist() == val.tolist()  # seeded
    with pytest.raises(UserError) as e:  # one query: nothing left to train on once it is held out
        split_train_validation(4, None, 0.1, 0, text_groups(["q"] * 4))
    assert e.value.code == "too_few_rows" and "1 distinct query or anchor text" in e.value.message


def test_unknown_job_and_dataset_are_404(stack):
    for path in [
        "/jobs/job_0123456789abcdef",
        "/jobs/job_0123456789abcdef/metrics",
        "/jobs/job_0123456789abcdef/events",
        "/jobs/job_0123456789abcdef/checkpoints",
        "/jobs/job_0123456789abcdef/artifacts",
        "/datasets/ds_0123456789abcdef",
    ]:
        error = assert_error(stack.client.get(path), 404, "not_found")
        assert "0123456789abcdef" in error["message"], path
    before = Snapshot(stack)
    assert_error(stack.client.post("/jobs/job_0123456789abcdef/cancel"), 404, "not_found")
    before.assert_unchanged()
    assert_error(stack.client.get("/no/such/route"), 404, "not_found")
    assert_error(stack.client.delete("/jobs"), 405, "method_not_allowed")


def test_bad_list_queries_are_refused(stack):
    assert_error(stack.client.get("/jobs", params={"status": "done"}), 422, "invalid_request", "status")
    assert_error(stack.client.get("/jobs", params={"limit": 0}), 422, "invalid_request", "limit")
    assert_error(stack.client.get("/jobs", params={"limit": 101}), 422, "invalid_request", "limit")
    assert_error(
        stack.client.get("/jobs", params={"cursor": "job_nope"}), 422, "invalid_cursor", "cursor", "'job_nope'"
    )


# ----------------------------------------------------------------------------- accepted uploads


FRAME = pd.DataFrame(
    {
        "text": [
            "goal by the striker",
            "shares fell, sharply",
            "la caf\u00e9 \u00e9t\u00e9 \u2013 \U0001f600",
            "coach",
        ],
        "label": ["sports", "business", "business", "sports"],
        "score": [1.5, -2.0, 0.25, 3.0],
    }
)


def encode(fmt: str, tmp_path) -> bytes:
    if fmt == "tsv":
        return FRAME.to_csv(sep="\t", index=False).encode()
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in FRAME.to_dict("records")).encode()
    path = tmp_path / "frame.parquet"
    FRAME.to_parquet(path, index=False)
    return path.read_bytes()


@pytest.mark.parametrize("fmt", ["tsv", "jsonl", "parquet"])
def test_upload_each_format_is_recorded_exactly(stack, fmt, tmp_path):
    content = encode(fmt, tmp_path)
    filename = f"My Data.{fmt.upper()}"  # the extension is case-insensitive
    before = Snapshot(stack)
    dataset = upload(stack.client, content, filename)
    assert dataset["format"] == fmt
    assert dataset["filename"] == filename
    assert dataset["rows"] == len(FRAME)
    assert dataset["columns"] == ["text", "label", "score"]
    assert dataset["bytes"] == len(content)
    assert dataset["sha256"] == hashlib.sha256(content).hexdigest()
    assert stack.client.get(f"/datasets/{dataset['id']}").json() == dataset
    listed = stack.client.get("/datasets").json()["data"]
    assert [d["id"] for d in listed] == [dataset["id"], *before.datasets]  # newest first

    stored = stack.data_dir / "uploads" / f"{dataset['id']}.{fmt}"
    assert stored.read_bytes() == content
    assert Snapshot(stack).uploads == before.uploads | {stored.name}  # no temporary file left over

    # The stored table is what a job reads: the non-ASCII text survives, and a job on it is accepted.
    from shared.data.columns import JobColumns
    from shared.data.labels import read_job_table

    table, _ = read_job_table(stored, fmt, filename, JobColumns("classification", "text", None, "label"))
    assert table["text"].tolist() == FRAME["text"].tolist()
    r = stack.client.post("/jobs", json=job_body(dataset["id"], validation_split=0.5))
    assert r.status_code == 201, r.text
    assert r.json()["label_names"] == ["business", "sports"]
    job = wait_for_status(stack.client, r.json()["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]


def test_label_codes_keep_their_spelling_across_formats(stack):
    """Labels are names: a CSV's "01"/"02" must not become 1/2, or a JSONL validation set that
    spells them the same way is refused for labels the training set "lacks"."""
    train = upload(stack.client, b"text,label\ngoal team,01\nbank sales,02\ncoach,01\nmarket,02\n", "codes.csv")
    val = upload(stack.client, b'{"text": "goal", "label": "01"}\n{"text": "bank", "label": "02"}\n', "codes.jsonl")
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=job_body(train["id"], validation_dataset=val["id"]))
    assert r.status_code == 200, r.text
    r = stack.client.post("/jobs", json=job_body(train["id"], validation_dataset=val["id"]))
    assert r.status_code == 201, r.text
    assert r.json()["label_names"] == ["01", "02"]
    job = wait_for_status(stack.client, r.json()["id"], FINISHED)
    assert job["status"] == "succeeded", job["error"]


def test_upload_path_in_filename_is_not_followed(stack):
    dataset = upload(stack.client, labelled_csv(rows=4), "../../../etc/evil.csv")
    assert dataset["filename"] == "evil.csv"
    assert (stack.data_dir / "uploads" / f"{dataset['id']}.csv").is_file()


# ----------------------------------------------------------------------------- listing jobs


def test_list_jobs_filters_by_status_and_pages_newest_first(stack):
    client = stack.client
    dataset = upload(client, labelled_csv(rows=16, seed=7), "small.csv")
    created = []
    for _ in range(3):
        r = client.post("/jobs", json=job_body(dataset["id"]))
        assert r.status_code == 201, r.text
        created.append(r.json()["id"])
    for job_id in created:
        assert wait_for_status(client, job_id, FINISHED)["status"] == "succeeded"

    everything = all_jobs(client)
    ids = [j["id"] for j in everything]
    assert len(ids) == len(set(ids))
    assert ids[:3] == created[::-1]  # newest first
    stamps = [j["created_at"] for j in everything]
    assert stamps == sorted(stamps, reverse=True)

    first = client.get("/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["data"]] == created[:0:-1]
    assert first["next_cursor"] == created[1]
    rest = client.get("/jobs", params={"limit": 2, "cursor": first["next_cursor"]}).json()
    assert rest["data"][0]["id"] == created[0]
    paged, cursor = [], None
    while True:
        page = client.get("/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        assert len(page["data"]) <= 2
        paged += [j["id"] for j in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert paged == ids  # every job exactly once, in order

    succeeded = all_jobs(client, status="succeeded")
    assert set(created) <= {j["id"] for j in succeeded}
    assert all(j["status"] == "succeeded" for j in succeeded)
    for status in ["queued", "running", "failed", "cancelled"]:
        listed = all_jobs(client, status=status)
        assert not set(created) & {j["id"] for j in listed}, status
        assert all(j["status"] == status for j in listed)
    page = client.get("/jobs", params={"status": "succeeded", "limit": 1}).json()
    assert [j["id"] for j in page["data"]] == [created[2]] and page["next_cursor"] == created[2]
    page = client.get("/jobs", params={"status": "succeeded", "limit": 1, "cursor": page["next_cursor"]}).json()
    assert [j["id"] for j in page["data"]] == [created[1]]


def test_max_length_beyond_the_models_positions_is_refused(stack):
    words = ["goal", "bank"]
    long_texts = pd.DataFrame(
        {
            "text": [" ".join([words[i % 2]] * 700) for i in range(8)],
            "label": [["sports", "business"][i % 2] for i in range(8)],
        }
    )
    dataset = upload(stack.client, long_texts.to_csv(index=False).encode(), "long.csv")
    before = Snapshot(stack)
    body = job_body(dataset["id"])
    body["hyperparameters"]["max_length"] = 1024
    r = stack.client.post("/jobs", json=body)
    if r.status_code == 201:  # the bug this guards against: accepted, then a RuntimeError in the worker
        job = wait_for_status(stack.client, r.json()["id"], FINISHED)
        pytest.fail(f"max_length 1024 was accepted; the job ended {job['status']}: {job['error']}")
    assert_error(r, 422, "max_length_too_long", "hyperparameters.max_length", "1024", "512", f"'{TINY_MODEL}'")
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=body)
    assert_error(r, 422, "max_length_too_long", "hyperparameters.max_length")
    before.assert_unchanged()
    body["hyperparameters"]["max_length"] = 512  # the model's own limit is accepted
    r = stack.client.post("/jobs", params={"dry_run": "true"}, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["plan"]["truncated_fraction"] == 1.0  # 700-word texts are all cut at 512


def test_a_full_disk_answers_507_and_stores_nothing(stack, train_ds, monkeypatch):
    """An upload whose file no longer fits, or a write SQLite finds no room for, was a 500
    ``internal_error`` (and SQLite's a 503 ``store_busy``, which a client retries in vain)."""
    import errno
    import sqlite3

    import psycopg
    from sqlalchemy.exc import OperationalError

    from api import uploads
    from shared.jobs import lifecycle

    class Full(io.BufferedWriter):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(uploads, "open", lambda path, mode: Full(io.FileIO(path, mode)), raising=False)
    before = Snapshot(stack)
    content = labelled_csv(rows=20, seed=12)
    r = stack.client.post("/datasets", files={"file": ("full.csv", io.BytesIO(content), "text/csv")})
    assert_error(r, 507, "insufficient_storage", None, "disk is full")
    before.assert_unchanged()
    monkeypatch.undo()

    for refusal in (
        sqlite3.OperationalError("database or disk is full"),
        psycopg.errors.DiskFull('could not extend file "base/16384/16385": No space left on device'),
    ):

        def full(*args, refusal=refusal, **kwargs):
            raise OperationalError("INSERT", {}, refusal)

        monkeypatch.setattr(lifecycle, "insert_queued", full)
        r = stack.client.post("/jobs", json=job_body(train_ds["id"]))
        assert_error(r, 507, "insufficient_storage", None, "disk is full")
        before.assert_unchanged()


def test_a_json_body_sent_as_a_form_names_the_content_type(stack):
    """``curl -d '{...}'`` without ``-H 'content-type: application/json'`` (as two examples of the
    docs did) answered "Input should be a valid dictionary or object to extract fields from" with
    no field named."""
    body = json.dumps({"inputs": ["a"]})
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "text/plain"}):
        r = stack.client.post("/jobs", content=body, headers=headers)
        assert_error(r, 422, "invalid_request", "Content-Type", "must be JSON", headers["Content-Type"])
    r = stack.client.post("/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.json()["error"]["param"] != "Content-Type"  # JSON, only not a job's
    r = stack.client.post("/jobs")  # no body at all: that is what it says, whatever the type
    assert r.status_code == 422 and r.json()["error"]["param"] != "Content-Type", r.text


def test_a_wrong_type_inside_a_union_names_the_item(stack):
    """``input: str | list[str]`` given ``["a", 3]``: every member's error is a wrong type, and the
    answer named ``input`` ("a valid string") instead of the item the list member stopped at."""
    r = stack.client.post("/v1/embeddings", json={"model": TINY_MODEL, "input": ["a", 3]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1", r.text
    assert r.json()["error"]["message"].startswith("input.1: Input should be a valid string"), r.text
    r = stack.client.post("/v1/embeddings", json={"model": TINY_MODEL, "input": 3})  # neither member: the field
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
