"""Dataset file formats tunejob reads, and the limits every reader keeps to."""

from pathlib import Path

import numpy as np

from shared.errors import UserError

FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".conll": "conll",
}
TEXT_FORMATS = {"csv", "tsv", "jsonl", "conll"}
CONLL_COLUMNS = ("tokens", "tags")  # the columns of a CoNLL file
BATCH_BYTES = 1 << 20  # data per batch; also the longest row (JSONL line, Parquet row) or CSV field accepted
BATCH_ROWS = 65_536  # rows per batch at most (JSONL, Parquet)
MAX_PROBLEMS = 20  # problems listed in one validation report
MAX_CLASS_NAME_CHARS = 1000
MAX_REGRESSION_TARGET = 1e6  # |y| above this is refused unless JobCreate.allow_large_targets
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the worker trains on float32 targets
VALUE_CHARS = 80  # a problem's value is truncated to this many characters


def detect_format(filename: str) -> str:
    """Format from the file name's extension.

    Raises:
        UserError: ``unsupported_format`` for any other extension.
    """
    fmt = FORMATS.get(Path(filename).suffix.lower())
    if fmt is None:
        raise UserError(
            "unsupported_format",
            f"{filename!r}: unsupported file type; use one of {', '.join(sorted(FORMATS))}",
            "file",
        )
    return fmt
