"""Dataset file formats tunejob reads, and the limits every reader keeps to."""

from pathlib import Path

import numpy as np

from shared.errors import UserError

FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",  # JSON Lines named .json, as Hugging Face datasets' json loader reads it
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
    suffix = Path(filename).suffix.lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        hint = next((h for suffixes, h in UNSUPPORTED_HINTS if suffix in suffixes), "")
        raise UserError(
            "unsupported_format",
            f"{filename!r}: unsupported file type{hint}; use one of {', '.join(sorted(FORMATS))}",
            "file",
        )
    return fmt


# what to do with the files users most often try instead
UNSUPPORTED_HINTS = [
    ((".gz", ".zip", ".bz2", ".xz", ".zst", ".tar", ".tgz"), " (compressed: upload the file inside it)"),
    ((".xlsx", ".xls", ".ods"), " (a spreadsheet: save it as CSV)"),
]
