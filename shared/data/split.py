"""The train/validation split of a job without a validation file (scikit-learn's
``train_test_split``, stratified by class where it can be)."""

import math

import numpy as np
from sklearn.model_selection import train_test_split

from shared.errors import UserError


def validation_size(n: int, fraction: float) -> int:
    """Rows ``validation_split`` holds out of ``n``, as scikit-learn sizes it.

    Raises:
        UserError: ``too_few_rows`` when that leaves no row for training.
    """
    n_val = math.ceil(n * fraction)
    if fraction and n_val >= n:
        raise UserError(
            "too_few_rows",
            f"validation_split {fraction} of {n} row(s) leaves no row for training; upload more rows, "
            "lower validation_split (0 for none) or give a validation_dataset",
            "validation_split",
        )
    return n_val


def split_train_validation(
    n: int, codes: np.ndarray | None, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Hold out ``fraction`` of ``n`` rows for validation: row indices (sorted) of each part.

    Stratified by ``codes`` (classification: the class of each row) when every class has at
    least two rows and both parts can hold every class (scikit-learn ``train_test_split``);
    seeded by ``seed``, so the API's dry run and the worker split alike.

    Raises:
        UserError: ``too_few_rows`` when the held-out part would leave no row for training.
    """
    rows = np.arange(n, dtype=np.int32)
    if not fraction:
        return rows, None
    n_val = validation_size(n, fraction)
    stratify = None
    if codes is not None:
        counts = np.bincount(codes)
        classes = int((counts > 0).sum())
        if counts[counts > 0].min() >= 2 and round(n * fraction) >= classes and n - n_val >= classes:
            stratify = codes
    train, val = train_test_split(rows, test_size=fraction, random_state=seed, stratify=stratify)
    return np.sort(train), np.sort(val)
