"""Reading and validating uploaded datasets (CSV, TSV, JSONL, Parquet) and a job spec against them.

Used by the API (to refuse bad input with a 4xx before anything is stored or queued) and by the
worker (to load the same table the API validated).
"""

import codecs
import math
from pathlib import Path

import pandas as pd
from sklearn.model_selection import train_test_split

from shared.errors import UserError

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
TEXT_FORMATS = {"csv", "tsv", "jsonl"}


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


def check_utf8(path: Path, filename: str) -> None:
    """Raise ``UserError(invalid_encoding)`` naming the line and byte offset of the first non-UTF-8 byte
    (the first byte of the invalid or truncated sequence)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes read so far
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            # The decoder holds back an incomplete sequence from the previous chunk and decodes it
            # together with this one, so e.start counts from the first held-back byte.
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                _raise_encoding_error(path, filename, offset - pending + e.start)
            offset += len(chunk)
    pending = len(decoder.getstate()[0])
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:  # the file ends inside a multi-byte sequence
        _raise_encoding_error(path, filename, offset - pending)


def _raise_encoding_error(path: Path, filename: str, position: int) -> None:
    with open(path, "rb") as f:
        head = f.read(position + 1)
    line = head.count(b"\n") + 1
    raise UserError(
        "invalid_encoding",
        f"{filename!r} is not valid UTF-8: byte 0x{head[position]:02x} at offset {position} (line {line})",
        "file",
    )


def read_table(path: Path, fmt: str, filename: str | None = None) -> pd.DataFrame:
    """Parse a dataset file into a DataFrame with string column names.

    Raises:
        UserError: ``invalid_file`` if it does not parse, ``empty_file`` if it has no row.
    """
    name = filename or path.name
    if path.stat().st_size == 0:
        raise UserError("empty_file", f"{name!r} is empty", "file")
    if fmt in TEXT_FORMATS:
        check_utf8(path, name)
    try:
        # Every CSV/TSV cell is read as text, as written: labels are names ("01" stays "01", as it
        # does in JSONL), and regression targets are converted by ``regression_targets``.
        if fmt == "csv":
            df = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
        elif fmt == "tsv":
            df = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False, na_values=[""], quoting=3)
        elif fmt == "jsonl":
            df = pd.read_json(path, lines=True, dtype=False)
        else:
            df = pd.read_parquet(path)
    except (ValueError, pd.errors.ParserError, OSError, ImportError) as e:
        raise UserError("invalid_file", f"{name!r} could not be parsed as {fmt}: {e}", "file") from e
    except Exception as e:  # pyarrow and the C parser raise their own types
        raise UserError("invalid_file", f"{name!r} could not be parsed as {fmt}: {e}", "file") from e
    if len(df) == 0:
        raise UserError("empty_file", f"{name!r} has a header but no data row", "file")
    df.columns = [str(c) for c in df.columns]
    return df


def _require_column(df: pd.DataFrame, column: str, param: str, filename: str) -> None:
    if column not in df.columns:
        raise UserError(
            "missing_column",
            f"column {column!r} ({param}) not found in {filename!r}; its columns are {list(df.columns)}",
            param,
        )
    missing = df[column].isna()
    if missing.any():
        row = int(missing.to_numpy().argmax()) + 1
        raise UserError("missing_value", f"{filename!r} row {row}: column {column!r} is empty", param)


def label_names(values: pd.Series) -> list[str]:
    """Sorted class names (numerically when every label is a number)."""
    unique = pd.unique(values)
    numeric = pd.to_numeric(pd.Series(unique), errors="coerce")
    if not numeric.isna().any():
        unique = [u for _, u in sorted(zip(numeric, unique))]
    else:
        unique = sorted(unique, key=str)
    return [str(u) for u in unique]


def regression_targets(values: pd.Series, filename: str, column: str) -> pd.Series:
    numeric = pd.to_numeric(values, errors="coerce")
    if numeric.isna().any():
        row = int(numeric.isna().to_numpy().argmax())
        raise UserError(
            "invalid_label",
            f"{filename!r} row {row + 1}: label {values.iloc[row]!r} in column {column!r} is not a number",
            "label_column",
        )
    return numeric.astype("float32")


def validate_job_data(
    task: str,
    text_column: str,
    text_pair_column: str | None,
    label_column: str,
    train: tuple[pd.DataFrame, str],
    validation: tuple[pd.DataFrame, str] | None,
) -> list[str] | None:
    """Check a job's columns and labels against its data; return the class names (None for regression).

    ``train`` and ``validation`` are (table, file name) pairs.

    Raises:
        UserError: ``missing_column``, ``missing_value``, ``single_class``, ``unknown_label`` or
            ``invalid_label``, naming the file, row, column or value.
    """
    tables = [train] + ([validation] if validation is not None else [])
    for df, filename in tables:
        _require_column(df, text_column, "text_column", filename)
        if text_pair_column:
            _require_column(df, text_pair_column, "text_pair_column", filename)
        _require_column(df, label_column, "label_column", filename)
    if task == "regression":
        for df, filename in tables:
            regression_targets(df[label_column], filename, label_column)
        return None
    train_df, train_name = train
    names = label_names(train_df[label_column])
    if len(names) < 2:
        raise UserError(
            "single_class",
            f"label column {label_column!r} in {train_name!r} has a single class ({names[0]!r}); "
            "classification needs at least 2",
            "label_column",
        )
    if validation is not None:
        val_df, val_name = validation
        unseen = sorted(set(val_df[label_column].astype(str)) - set(names))
        if unseen:
            raise UserError(
                "unknown_label",
                f"{val_name!r} has labels the training set lacks: {unseen[:10]}",
                "validation_dataset",
            )
    return names


def split_train_validation(
    df: pd.DataFrame, label_column: str, fraction: float, seed: int, stratify: bool
) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """Hold out ``fraction`` of ``df`` for validation, stratified by label when every class has
    at least two rows and both parts can hold every class (scikit-learn ``train_test_split``).

    Raises:
        UserError: ``too_few_rows`` when the held-out part would leave no row for training.
    """
    if not fraction:
        return df, None
    n = len(df)
    n_val = math.ceil(n * fraction)  # as scikit-learn sizes the held-out part
    if n_val >= n:
        raise UserError(
            "too_few_rows",
            f"validation_split {fraction} of {n} row(s) leaves no row for training; upload more rows, "
            "lower validation_split (0 for none) or give a validation_dataset",
            "validation_split",
        )
    labels = df[label_column].astype(str)
    classes = labels.nunique()
    can_stratify = (stratify and labels.value_counts().min() >= 2 and round(n * fraction) >= classes
                    and n - n_val >= classes)
    train, val = train_test_split(
        df, test_size=fraction, random_state=seed, stratify=labels if can_stratify else None
    )
    return train, val
