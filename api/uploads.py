"""Receiving a dataset upload: the multipart body is streamed to disk as it arrives (never spooled
in memory or in a temporary file first), with ``TUNEJOB_MAX_UPLOAD_BYTES`` enforced while reading,
then handed to ``shared.jobs.uploads.store_dataset`` to be checked and recorded. Both doors that take
files use it: ``POST /datasets`` and the OpenAI facade's ``POST /v1/files``."""

import hashlib
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from shared.data.formats import detect_format
from shared.errors import UserError
from shared.jobs import uploads
from shared.settings import get_settings
from shared.store import idempotency
from shared.store.rows import Dataset
from shared.store.tenancy import Caller

MULTIPART_OVERHEAD = 64 << 10  # bytes a multipart body may hold beyond its file (boundaries, part headers, fields)
MAX_FILENAME_CHARS = 255
MAX_FIELD_BYTES = 1024  # a non-file form field (e.g. /v1/files' ``purpose``)


def upload_body(**fields: dict) -> dict:
    """The OpenAPI ``requestBody`` of an upload route: a multipart ``file`` plus ``fields``
    (name -> JSON schema, all required)."""
    file = {
        "type": "string",
        "format": "binary",
        "description": "The dataset: .csv, .tsv, .jsonl (.ndjson, .json: JSON Lines), .parquet or .conll, "
        "UTF-8 text (a byte order mark is fine).",
    }
    return {
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {"type": "object", "required": ["file", *fields], "properties": {"file": file, **fields}}
                }
            },
        }
    }


@dataclass
class Received:
    """The ``file`` part of a multipart body as it streams to ``path``, and the body's other
    (small) form fields."""

    path: Path
    filename: str | None = None
    format: str | None = None
    size: int = 0
    sha256: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    done: bool = False
    fields: dict[str, str] = field(default_factory=dict)


async def store_upload(
    request: Request,
    caller: Caller,
    idempotency_key: str | None = None,
    required_fields: tuple[str, ...] = (),
    check_fields=None,
) -> Dataset | idempotency.Replay:
    """Receive the request's multipart ``file`` and store it as a dataset of ``caller``'s tenant.

    ``check_fields(fields)``, if given, may refuse the upload from its other form fields before
    the file is checked and recorded. With an ``idempotency_key``, the same file under the same
    name within 24 h gets the first response back (``Replay``) and is not stored again.

    Raises:
        UserError: 413 ``file_too_large`` (also at once from ``Content-Length``), 415
            ``unsupported_media_type``, ``invalid_request`` (no ``file`` part, a missing required
            field, a body that does not parse), ``invalid_filename``, ``unsupported_format``, what
            ``shared.store.idempotency.begin`` and ``shared.jobs.uploads.store_dataset`` raise.
    """
    settings = get_settings()
    limit = settings.max_upload_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
        raise _too_large(limit)
    tmp = settings.path("uploads", f".{uuid.uuid4().hex}.tmp")
    try:
        received = await _receive(request, tmp, limit)
        for name in required_fields:
            if name not in received.fields:
                raise UserError("invalid_request", f"{name}: the multipart field {name!r} is required", name)
        if check_fields is not None:
            check_fields(received.fields)
        sha256 = received.sha256.hexdigest()
        filename, format_ = received.filename, received.format
        assert filename is not None and format_ is not None  # set with the file part, which _receive requires

        def store(claim: idempotency.Claim | None) -> Dataset:
            return uploads.store_dataset(tmp, filename, format_, received.size, sha256, caller, claim)

        return await run_in_threadpool(
            idempotency.once,
            caller.tenant,
            "POST /datasets",
            idempotency_key,
            idempotency.fingerprint(filename, sha256),
            store,
        )
    finally:
        tmp.unlink(missing_ok=True)


async def _receive(request: Request, path: Path, limit: int) -> Received:
    """Parse the multipart body with python-multipart's streaming parser, writing the first part
    named ``file`` to ``path`` chunk by chunk and keeping other parts of up to ``MAX_FIELD_BYTES``."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or not params.get(b"boundary"):
        raise UserError(
            "unsupported_media_type", "upload the dataset as multipart/form-data with a field 'file'", "file", 415
        )
    received = Received(path)
    headers: dict[bytes, bytes] = {}
    state: dict[str, Any] = {"field": b"", "value": b"", "part": None, "data": b""}
    out = open(path, "wb")

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        headers[state["field"].strip().lower()] = state["value"].strip()
        state["field"] = state["value"] = b""

    def on_headers_finished() -> None:
        _, disposition = parse_options_header(headers.get(b"content-disposition", b""))
        name = disposition.get(b"name", b"").decode("utf-8", errors="replace")
        state["part"], state["data"] = name, b""
        if name == "file" and received.filename is None:
            received.filename = _filename(disposition.get(b"filename", b"upload"))
            received.format = detect_format(received.filename)  # refuse a wrong file type before reading it
        headers.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["part"] == "file" and not received.done:
            received.size += end - start
            if received.size > limit:
                raise _too_large(limit, received.filename)
            received.sha256.update(data[start:end])
            out.write(data[start:end])
        elif len(state["data"]) <= MAX_FIELD_BYTES:
            state["data"] += data[start:end]

    def on_part_end() -> None:
        if state["part"] == "file":
            received.done = True
        elif state["part"] and len(state["data"]) <= MAX_FIELD_BYTES:
            received.fields[state["part"]] = state["data"].decode("utf-8", errors="replace")
        state["part"] = None

    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit + MULTIPART_OVERHEAD:
                raise _too_large(limit, received.filename)
            parser.write(chunk)
        parser.finalize()
    except MultipartParseError as e:
        raise UserError("invalid_request", f"the multipart body could not be parsed ({e})", "file") from e
    finally:
        out.close()
    if not received.done:
        raise UserError("invalid_request", "file: the multipart field 'file' is required", "file")
    return received


def _filename(raw: bytes) -> str:
    """The uploader's file name without any directory part (never used as a path on the server)."""
    name = os.path.basename(raw.decode("utf-8", errors="replace").replace("\\", "/")) or "upload"
    if any(ord(c) < 32 for c in name) or len(name) > MAX_FILENAME_CHARS:
        raise UserError(
            "invalid_filename",
            f"the file name must be at most {MAX_FILENAME_CHARS} characters, without control characters",
            "file",
        )
    return name


def _too_large(limit: int, filename: str | None = None) -> UserError:
    what = repr(filename) if filename else "the upload"
    return UserError("file_too_large", f"{what} is larger than {limit} bytes (TUNEJOB_MAX_UPLOAD_BYTES)", "file", 413)
