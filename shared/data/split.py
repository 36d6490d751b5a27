"""The train/validation split of a job without a validation file (scikit-learn's
``train_test_split``, stratified by class where it can be; ``GroupShuffleSplit`` where rows that
share a text belong together)."""

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from sklearn.model_selection import GroupShuffleSplit, train_test_split

from shared.errors import UserError


def validation_size(n: int, fraction: float, what: str = "row(s)") -> int:
    """Rows (or groups of rows, ``what``) ``validation_split`` holds out of ``n``, as scikit-learn sizes it.

    Raises:
        UserError: ``too_few_rows`` when that leaves none for training.
    """
    n_val = math.ceil(n * fraction)
    if fraction and n_val >= n:
        raise UserError(
            "too_few_rows",
            f"validation_split {fraction} of {n} {what} leaves none for training; upload more rows, "
            "lower validation_split (0 for none) or give a validation_dataset",
            "validation_split",
        )
    return n_val


def text_groups(texts: Sequence) -> np.ndarray:
    """``[len(texts)]`` uint64 keys, equal for equal texts (pandas' stable ``hash_array``): the groups
    of ``split_train_validation`` for tasks whose rows share texts (a reranking query's passages,
    an embedding anchor's positives), the same in the API's dry run and in the worker."""
    return pd.util.hash_array(np.asarray(texts, dtype=object))


def split_train_validation(
    n: int, codes: np.ndarray | None, fraction: float, seed: int, groups: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Hold out ``fraction`` of ``n`` rows for validation: row indices (sorted) of each part.

    Stratified by ``codes`` (classification: the class of each row) when every class has at
    least two rows and both parts can hold every class (scikit-learn ``train_test_split``).
    With ``groups`` (``[n]`` keys, ``text_groups``), ``fraction`` of the distinct groups are held
    out whole (scikit-learn ``GroupShuffleSplit``): every passage of a validation query is there to
    be ranked, and no query is both trained on and validated. Seeded by ``seed``, so the API's dry
    run and the worker split alike.

    Raises:
        UserError: ``too_few_rows`` when the held-out part would leave no row (group) for training.
    """
    rows = np.arange(n, dtype=np.int32)
    if not fraction:
        return rows, None
    if groups is not None:
        validation_size(len(np.unique(groups)), fraction, "distinct query or anchor text(s)")
        train, val = next(
            GroupShuffleSplit(n_splits=1, test_size=fraction, random_state=seed).split(rows, groups=groups)
        )
        return np.sort(rows[train]), np.sort(rows[val])
    n_val = validation_size(n, fraction)
    stratify = None
    if codes is not None:
        counts = np.bincount(codes)
        classes = int((counts > 0).sum())
        if counts[counts > 0].min() >= 2 and round(n * fraction) >= classes and n - n_val >= classes:
            stratify = codes
    train, val = train_test_split(rows, test_size=fraction, random_state=seed, stratify=stratify)
    return np.sort(train), np.sort(val)
