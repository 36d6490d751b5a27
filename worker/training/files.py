"""Directories written whole or not at all: checkpoints, saved weights and the model artifact;
a tokenizer's files written as new files into one (``save_tokenizer``)."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(final_dir: Path, write: Callable[[Path], None]) -> None:
    """Write a directory under a temporary name (``write(tmp)``), fsync its files, then rename it
    into place (replacing ``final_dir``) and fsync its parent, so that a crash leaves either the old
    directory or the new one, never a part. A write that fails removes its part (a full disk kept
    a failed job's 42 MB of half-written weights, and the disk full, until the job was deleted).

    Raises:
        OSError: the files cannot be written (or what ``write`` raised).
    """
    tmp = final_dir.with_name(f".{final_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(tmp, final_dir)
    dir_fd = os.open(final_dir.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_tokenizer(tokenizer, directory: Path) -> set[str]:
    """Write ``tokenizer``'s files into ``directory``, each as a new file, and return their names.

    New files, not writes into the ones there: ``directory`` may hold hard links to another
    directory's files (a checkpoint's to the best weights, the artifact's to the final ones), and
    a sentence-transformers model saves its own tokenizer beside its weights, so an in-place write
    would change the other directory's file, and a hash already taken of it (the artifact's
    manifest: the caller drops those names' entries and they are hashed again).
    """
    with tempfile.TemporaryDirectory(dir=directory) as staging:
        saved = [Path(p) for p in tokenizer.save_pretrained(staging)]
        names = {p.name for p in saved if p.is_file()}
        for name in names:
            os.replace(Path(staging) / name, directory / name)
    return names
