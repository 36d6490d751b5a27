"""A model directory's ``manifest.json``: each file's name, size in bytes and sha256, written by the
worker into every finished model (``shared.store.artifacts.write_manifest``) and checked by the client
after a download (``client.api.Client.download_model``).

Standard library only: the client imports this module and must start without the server stack.
"""

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def manifest_entries(files: dict[str, Path]) -> dict[str, dict]:
    """``{name: {"bytes", "sha256"}}`` of ``files``."""
    return {name: {"bytes": path.stat().st_size, "sha256": sha256_of(path)} for name, path in files.items()}


def verify_manifest(directory: Path) -> list[str]:
    """The names of files that are missing or differ from ``manifest.json`` (empty: all match).

    Raises:
        FileNotFoundError: ``directory`` has no ``manifest.json``.
    """
    manifest = json.loads((directory / MANIFEST).read_text())
    return [
        f["name"]
        for f in manifest["files"]
        if not (directory / f["name"]).is_file()
        or (directory / f["name"]).stat().st_size != f["bytes"]
        or sha256_of(directory / f["name"]) != f["sha256"]
    ]
