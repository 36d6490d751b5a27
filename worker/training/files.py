"""Directories written whole or not at all: checkpoints, saved weights and the model artifact."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_atomically(final_dir: Path, write: Callable[[Path], None]) -> None:
    """Write a directory under a temporary name (``write(tmp)``), fsync its files, then rename it
    into place (replacing ``final_dir``) and fsync its parent, so that a crash leaves either the old
    directory or the new one, never a part.

    Raises:
        OSError: the files cannot be written.
    """
    tmp = final_dir.with_name(f".{final_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(tmp, final_dir)
    dir_fd = os.open(final_dir.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
