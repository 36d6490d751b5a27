"""CoNLL-style text: a token and its tag per line (the last field is the tag), a blank line
between sentences, ``-DOCSTART-`` lines skipped; read sentence by sentence."""

from collections.abc import Iterator
from pathlib import Path

from shared.data.formats import BATCH_BYTES, BATCH_ROWS, CONLL_COLUMNS
from shared.data.problems import Problems
from shared.data.readers.base import Batch

# -- CoNLL


def conll_batches(
    path: Path, fmt: str, filename: str, columns: list[str] | None, problems: Problems
) -> Iterator[Batch]:
    """CoNLL-style text (CoNLL-2003, WNUT): one token per line with its tag in the last
    whitespace-separated field (fields between, such as POS and chunk tags, are ignored), a blank
    line between sentences, ``-DOCSTART-`` lines skipped; tags as written (IOB/BIO). Each sentence
    is a row with the columns ``tokens`` and ``tags`` (``CONLL_COLUMNS``)."""
    values: dict[str, list] = {name: [] for name in columns or []}
    start = size = nbytes = 0
    keys: tuple[str, ...] = CONLL_COLUMNS  # handed out with the first batch
    for sentence in _conll_sentences(path, problems, lambda: start + size + 1):  # noqa: B023 (the row now)
        for name, cells in values.items():
            cells.append(sentence[CONLL_COLUMNS.index(name)] if name in CONLL_COLUMNS else None)
        size += 1
        nbytes += sum(map(len, sentence[0]))
        if problems.full:
            return
        if size >= BATCH_ROWS or nbytes >= BATCH_BYTES:
            yield Batch(start, size, values, keys)
            values, keys = {name: [] for name in columns or []}, ()
            start, size, nbytes = start + size, 0, 0
    if size or keys:
        yield Batch(start, size, values, keys)


def _conll_sentences(path: Path, problems: Problems, row) -> Iterator[tuple[list[str], list[str]]]:
    """(tokens, tags) of each sentence of a CoNLL file; a line without a tag, or longer than
    ``BATCH_BYTES``, is a problem of its sentence (``row()``: its 1-based number)."""
    tokens, tags, line_number = [], [], 0
    with open(path, encoding="utf-8-sig") as f:
        while line := f.readline(BATCH_BYTES + 1):
            line_number += 1
            fields = line.split()
            if len(line) > BATCH_BYTES:
                problems.add(row(), None, None, f"(line {line_number}) is longer than {BATCH_BYTES >> 20} MiB")
                return
            if fields and fields[0] != "-DOCSTART-":
                if len(fields) < 2:
                    problems.add(
                        row(),
                        CONLL_COLUMNS[1],
                        line.strip(),
                        f"(line {line_number}) has a token but no "
                        "tag: each line is a token and its tag, separated by whitespace",
                        "missing_value",
                    )
                tokens.append(fields[0])
                tags.append(fields[-1])
            elif tokens:  # a blank or -DOCSTART- line ends the sentence
                yield tokens, tags
                tokens, tags = [], []
    if tokens:
        yield tokens, tags
