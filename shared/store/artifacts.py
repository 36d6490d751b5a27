"""A job's files on disk: where they live, the model's manifest, and the model served as a tar stream.

Layout under the data directory (all server-chosen names, never a user's path)::

    checkpoints/<job>/step-<n>/   a running job's resumable checkpoints (weights, tokenizer, training_state.pt)
    checkpoints/<job>/best/       the best model so far (weights and config)
    checkpoints/<job>/final/      the weights after the last step, written while the final evaluation runs
    artifacts/<job>/model/        the finished model: Hugging Face files, metrics.json, evaluation.json,
                                  README.md (the model card), manifest.json
    cache/tokenized/<sha256>/     tokenized texts of the dataset whose file has that sha256

A finished job keeps one copy of its weights: the artifact is made by hard-linking the best or the
final weights, and a succeeded job's checkpoints are then deleted. ``model.tar`` is streamed from
the model directory on request (safetensors do not compress, so there is no ``.gz`` on disk).

No torch here: the API imports this module.
"""

import json
import os
import shutil
import tarfile
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import BinaryIO

import anyio

from shared.settings import get_settings
from shared.store import objects
from shared.store.manifest import MANIFEST, manifest_entries
from shared.store.objects import Remote, files_of, size_of

METRICS = "metrics.json"
EVALUATION = "evaluation.json"  # the evaluation report (worker.evaluation)
TRAINING_STATE = "training_state.pt"  # in checkpoints only; never part of a downloaded model
CHUNK = 1 << 20


def checkpoints_dir(job_id: str) -> Path:
    return get_settings().data_path / "checkpoints" / job_id


def artifacts_dir(job_id: str) -> Path:
    return get_settings().data_path / "artifacts" / job_id


def tokenized_cache_root() -> Path:
    """This host's tokenization caches: one folder per dataset content (``tokenized_cache_dir``)."""
    return get_settings().data_path / "cache" / "tokenized"


def tokenized_cache_dir(dataset_sha256: str) -> Path:
    """Cached tokenizations of a dataset's texts (``worker.data``), filed by the uploaded file's
    sha256 so that deleting the dataset deletes them."""
    return tokenized_cache_root() / dataset_sha256


def model_dir(job_id: str) -> Path:
    """The finished model of a job (exists once the job has succeeded)."""
    return artifacts_dir(job_id) / "model"


def local_model(job_id: str) -> Path | None:
    """The finished model of a job on this host: its directory, or with ``TUNEJOB_STORAGE_URL`` a
    copy in this host's cache, downloaded from the bucket and checked against its manifest. None
    when there is none (not succeeded, or its files were deleted).

    Raises:
        OSError: a download failed, or a file does not match the manifest's sha256.
    """
    store = objects.store()
    return store.local(store.ref(model_dir(job_id)))


def write_manifest(directory: Path, hashed: dict[str, dict] | None = None) -> dict:
    """Write ``manifest.json`` into a model directory: every other file's name, size in bytes and
    sha256, so that a download can be checked (``shared.store.manifest.verify_manifest``, or
    ``sha256sum``). Files in ``hashed`` (from ``manifest_entries``) are not read again. Returns the
    manifest."""
    hashed = hashed or {}
    files = files_of(directory, exclude=(MANIFEST,))
    entries = {**manifest_entries({n: p for n, p in files.items() if n not in hashed}), **hashed}
    manifest = {"files": [{"name": name, **entries[name]} for name in files]}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def listing(model: dict[str, Path | Remote]) -> dict[str, int]:
    """The downloadable artifacts of a finished model and their sizes in bytes: ``model.tar``,
    ``metrics.json`` and ``model/<name>`` for each file (``model``: ``shared.store.objects``'
    ``files`` of the model: local paths, or objects in the bucket)."""
    if not model:
        return {}
    sizes = {name: size_of(source) for name, source in model.items()}
    return (
        {"model.tar": tar_size(sizes)}
        | ({METRICS: sizes[METRICS]} if METRICS in sizes else {})
        | {f"model/{name}": size for name, size in sizes.items()}
    )


class TarStream:
    """An uncompressed tar of some files, streamed in chunks, its size known up front.

    Local files are opened when the stream is made, so a file deleted while it is being sent (a
    checkpoint rotated away) is still sent whole; objects in the bucket (``Remote``) are streamed
    when their turn comes, checked against the manifest's sha256 (a mismatch cuts the stream).
    Each file sits at the archive's top level under its name; headers come from ``tarfile`` (PAX
    format), the layout is what ``tarfile.open(mode="w")`` writes: header, data padded to 512
    bytes, two zero blocks, then zeros up to a 10 KiB record.

    Raises:
        OSError: a file cannot be opened.
    """

    def __init__(self, files: dict[str, Path | Remote]):
        self.members: list[tuple[bytes, BinaryIO | Remote, int]] = []  # (header, open file or Remote, size)
        sizes = {}
        try:
            for name, path in files.items():
                f: BinaryIO | Remote
                if isinstance(path, Remote):
                    f, size, mtime = path, path.size, path.mtime
                else:
                    f = open(path, "rb")
                    st = os.fstat(f.fileno())
                    size, mtime = st.st_size, st.st_mtime
                sizes[name] = size
                self.members.append((_header(name, size, int(mtime)), f, size))
        except OSError:
            self.close()
            raise
        self.size = tar_size(sizes)
        self._trailer = self.size - sum(len(header) + _padded(size) for header, _, size in self.members)

    def _parts(self) -> Iterator[bytes | tuple[BinaryIO | Remote, int]]:
        """The tar in order: bytes to send as they are (headers, padding), or a member's (file, size)."""
        for header, f, size in self.members:
            yield header
            yield f, size
            yield bytes(_padded(size) - size)
        yield bytes(self._trailer)

    def __iter__(self) -> Iterator[bytes | memoryview]:
        try:
            for part in self._parts():
                if isinstance(part, bytes):
                    yield part
                elif isinstance(part[0], Remote):
                    yield from part[0].chunks()  # raises when the object does not match its size or sha256
                else:
                    yield from _read(*part)
        finally:
            self.close()

    async def __aiter__(self) -> AsyncIterator[bytes | memoryview]:
        """The same chunks for the event loop (a StreamingResponse takes this one): objects are
        streamed with ``Remote.achunks`` (no thread hop per chunk), local files read in a thread."""
        try:
            for part in self._parts():
                if isinstance(part, bytes):
                    yield part
                elif isinstance(part[0], Remote):
                    async for view in part[0].achunks():
                        yield view
                else:
                    chunks = _read(*part)
                    while (chunk := await anyio.to_thread.run_sync(next, chunks, None)) is not None:
                        yield chunk
        finally:
            self.close()

    def close(self) -> None:
        for _, f, _ in self.members:
            if not isinstance(f, Remote):
                f.close()


def _read(f, size: int) -> Iterator[bytes]:
    """``size`` bytes of the open file ``f`` in ``CHUNK``s.

    Raises:
        OSError: the file has fewer bytes (it shrank while it was being sent).
    """
    left = size
    while left and (chunk := f.read(min(CHUNK, left))):
        left -= len(chunk)
        yield chunk
    if left:
        raise OSError(f"{f.name} shrank while it was being sent")


def tar_size(sizes: dict[str, int]) -> int:
    """Bytes of an uncompressed tar of files with these names and sizes (as ``TarStream`` writes it)."""
    body = sum(len(_header(name, size, 0)) + _padded(size) for name, size in sizes.items())
    return _padded(body + 2 * tarfile.BLOCKSIZE, tarfile.RECORDSIZE)


def _header(name: str, size: int, mtime: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, mtime, 0o644
    return info.tobuf(tarfile.PAX_FORMAT)


def _padded(size: int, block: int = tarfile.BLOCKSIZE) -> int:
    return -(-size // block) * block


def gzip_stream(chunks: Iterator[bytes | memoryview], level: int = 1) -> Iterator[bytes]:
    """Gzip ``chunks`` on the fly (``model.tar.gz`` for old clients: nothing is written to disk;
    level 1 because safetensors hardly compress)."""
    compressor = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    for chunk in chunks:
        if out := compressor.compress(chunk):
            yield out
    yield compressor.flush()


def link_or_copy_files(source: Path, target: Path) -> None:
    """Put every file of ``source`` into the existing directory ``target`` as a hard link (no second
    copy of the weights on disk), or as a copy where the file system cannot link."""
    for name, path in files_of(source).items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target / name)
        except OSError:
            shutil.copy2(path, target / name)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def disk_bytes(*paths: Path) -> int:
    """Bytes allocated on disk to the files under ``paths``, each hard-linked file counted once."""
    seen, total = set(), 0
    for root in paths:
        for p in root.rglob("*") if root.is_dir() else []:
            st = p.lstat()
            if p.is_file() and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
