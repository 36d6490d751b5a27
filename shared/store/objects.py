"""Where the files a job reads and writes are kept: the data directory (the default), or an
S3-compatible bucket when ``TUNEJOB_STORAGE_URL=s3://bucket/prefix`` is set.

Files are always written into the data directory first, under the layout of
``shared.store.artifacts`` (``uploads/``, ``checkpoints/<job>/step-<n>/``, ``artifacts/<job>/model/``),
then published (``publish``), and the store's rows hold what ``publish`` returns (a *ref*):

- ``LocalDir``: the file's absolute path, nothing moves (the layout of every release before this one).
- ``Bucket``: the path relative to the data directory is the object key under the prefix. The file
  (a directory: each file under it) is uploaded, multipart in ``PART_BYTES`` parts, before the row
  is written (an object without a row is an orphan ``shared.jobs.orphans`` collects; a row never
  points at nothing), then moved into this host's cache, ``<data>/cache/objects``. A process that
  needs a ref's files (``local``) finds them there or downloads them, streamed to disk, each file
  checked against the sha256 that the model's ``manifest.json`` (or the dataset row) records. The
  cache is bounded by ``TUNEJOB_STORAGE_CACHE_BYTES``, least recently used entries evicted first.

The client is obstore (Rust ``object_store`` bindings): one dependency-free wheel, streaming reads
and multipart writes from a file handle, presigned URLs, and the standard ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION`` read from the environment.

No torch here: the API imports this module.
"""

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from shared.settings import get_settings
from shared.store.manifest import MANIFEST

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig

CACHE = "cache/objects"
PART_BYTES = 16 << 20  # multipart upload part size
CHUNK = 1 << 20  # bytes a streamed download yields at a time
DELETE_BATCH = 1000  # keys per DeleteObjects request (the S3 maximum)
# object_store bounds a whole request by 30 s by default (``timeout``), which cuts off any
# download that takes longer (a large model over a slow link). A request is bounded by its
# silences instead (``read_timeout``); this only stands in for "no limit".
WHOLE_REQUEST = timedelta(days=1)


def client_config(timeout_s: float) -> tuple["ClientConfig", "RetryConfig"]:
    """obstore's client and retry options for ``TUNEJOB_STORAGE_TIMEOUT_SECONDS``: a request fails
    when it receives nothing for ``timeout_s`` seconds (reqwest's read timeout also runs while an
    upload's part is sent, so a part must go up and be answered within it: 16 MiB in 30 s needs
    about 0.6 MB/s), connecting within 5 s (object_store's default), and a failed request is tried
    again, with object_store's exponential backoff, for at most ``timeout_s`` (its default, 3
    minutes, kept an API request waiting on an unreachable bucket)."""
    return (
        {"read_timeout": timedelta(seconds=timeout_s), "timeout": WHOLE_REQUEST},
        {"max_retries": 4, "retry_timeout": timedelta(seconds=timeout_s)},
    )


@dataclass(frozen=True)
class Remote:
    """An object in the bucket, read on demand: ``size`` in bytes, its expected ``sha256`` (hex,
    from the manifest) if known."""

    bucket: "Bucket"
    key: str
    size: int
    mtime: float
    sha256: str | None = None

    def chunks(self) -> Iterator[memoryview]:
        """The object's bytes, streamed (``CHUNK`` bytes a chunk, each a view of obstore's buffer: no copy).

        Raises:
            OSError: the bytes do not match ``size`` or ``sha256``, raised in place of the last
                chunk, which is held back until they are checked: a streamed response is cut short,
                so the client sees an incomplete download (were the last chunk sent first, a body
                of the right length would look whole).
        """
        import obstore

        check, held = _Check(self), None
        for chunk in obstore.get(self.bucket.store, self.key).stream(min_chunk_size=CHUNK):
            if held is not None:
                yield held
            held = check(chunk)
        check.done()
        if held is not None:
            yield held

    async def achunks(self) -> AsyncIterator[memoryview]:
        """``chunks`` for the event loop: a StreamingResponse sends them with no thread hop per chunk
        (it moves each ``next`` of a sync iterator to a worker thread), which costs the API about a
        tenth of its CPU time per byte (docs/benchmarks.md, "Object storage"). The sha256 of a
        chunk runs on the loop (about 0.6 ms per MiB).

        Raises:
            OSError: as ``chunks``.
        """
        import obstore

        check, held = _Check(self), None
        async for chunk in (await obstore.get_async(self.bucket.store, self.key)).stream(min_chunk_size=CHUNK):
            if held is not None:
                yield held
            held = check(chunk)
        check.done()
        if held is not None:
            yield held


class _Check:
    """Counts and hashes a ``Remote``'s chunks as they pass; ``done`` raises ``OSError`` when they do
    not match its size or sha256."""

    def __init__(self, remote: Remote):
        self.remote, self.digest, self.n = remote, hashlib.sha256(), 0

    def __call__(self, chunk) -> memoryview:
        view = memoryview(chunk)
        self.digest.update(view)
        self.n += len(view)
        return view

    def done(self) -> None:
        r, digest = self.remote, self.digest.hexdigest()
        if self.n != r.size or (r.sha256 is not None and digest != r.sha256):
            raise OSError(f"object {r.key} does not match its manifest ({self.n} bytes, sha256 {digest})")


def files_of(directory: Path, exclude: tuple[str, ...] = ()) -> dict[str, Path]:
    """The regular files under ``directory`` by their relative POSIX name (``runs/events…`` in a
    subfolder), sorted, without hidden ones and ``exclude``; empty when the directory does not exist."""
    if not directory.is_dir():
        return {}
    files = {}
    for p in sorted(directory.rglob("*")):
        name = p.relative_to(directory).as_posix()
        if p.is_file() and not any(part.startswith(".") for part in name.split("/")) and name not in exclude:
            files[name] = p
    return files


def size_of(source: Path | Remote) -> int:
    return source.size if isinstance(source, Remote) else source.stat().st_size


class LocalDir:
    """Files stay where they are written, in the data directory shared by every process; a ref
    is the absolute path."""

    def ref(self, path: Path) -> str:
        return str(path)

    def publish(self, path: Path) -> str:
        return str(path)

    def local(self, ref: str, sha256: str | None = None) -> Path | None:
        path = Path(ref)
        return path if path.exists() else None

    def files(self, ref: str) -> dict[str, Path | Remote]:
        return dict[str, Path | Remote](files_of(Path(ref)))

    def remove(self, ref: str) -> None:
        _remove_local(Path(ref))

    def job_ids(self, folder: str) -> list[str]:
        """The names under ``<data>/<folder>`` (``checkpoints``, ``artifacts``: job ids)."""
        try:
            return [n for n in os.listdir(get_settings().data_path / folder) if not n.startswith(".")]
        except FileNotFoundError:
            return []

    def upload_refs(self) -> list[str]:
        """The refs of the uploaded files there are (``<data>/uploads``), as the dataset rows hold them."""
        folder = get_settings().data_path / "uploads"
        try:
            return [str(folder / n) for n in os.listdir(folder) if not n.startswith(".")]
        except FileNotFoundError:
            return []

    def folder_bytes(self, folder: str) -> int:
        """Bytes of the files under ``<data>/<folder>`` (a job's ``artifacts/<id>``)."""
        return self.tree_bytes(str(get_settings().data_path / folder))

    def tree_bytes(self, ref: str) -> int:
        """Bytes of the files under ``ref`` (0 if none). A file gone between listing and ``stat`` counts 0."""
        total = 0
        for root, _, files in os.walk(ref):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:
                    pass
        return total

    def presigned_url(self, source: "Path | Remote") -> str | None:
        return None


class Bucket:
    """An S3 bucket (``s3://bucket/prefix``) that holds every file under keys mirroring the data
    directory's layout, with a bounded download cache on this host (``<data>/cache/objects``).
    A ref that is an absolute path (a row written before the bucket was configured) is read and
    deleted on the disk, as ``LocalDir`` does."""

    def __init__(
        self,
        url: str,
        data_path: Path,
        cache_bytes: int,
        presigned_seconds: int | None = None,
        timeout_s: float = 30.0,
    ):
        from obstore.store import S3Store

        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        client, retry = client_config(timeout_s)
        self.store = S3Store.from_url(
            url, client_options={**client, "allow_http": endpoint.startswith("http://")}, retry_config=retry
        )
        self.data_path, self.cache_bytes, self.presigned_seconds = data_path, cache_bytes, presigned_seconds

    # ---------------------------------------------------------------- writing

    def publish(self, path: Path) -> str:
        """Upload the file or directory at ``path`` (under the data directory) to its key (objects
        under it that ``path`` does not have are deleted), then move it into the cache. Returns
        the key, the ref a row stores.

        Raises:
            obstore.exceptions.BaseError: an upload failed (the files stay where they are; nothing
                is cached). The API answers it 503 ``storage_unavailable``.
        """
        import obstore

        key = self.ref(path)
        files = {key: path} if path.is_file() else {f"{key}/{n}": p for n, p in files_of(path).items()}
        for name, file in files.items():
            with open(file, "rb") as f:
                obstore.put(self.store, name, f, chunk_size=PART_BYTES, max_concurrency=4)
        stale = [k for k, _, _ in self.listing(key) if k not in files]  # from an attempt that died: not ours
        if stale:
            obstore.delete(self.store, stale)
        entry = self._entry(key)
        _remove_local(entry)
        entry.mkdir(parents=True)
        os.replace(path, entry / path.name)
        self._evict(keep=entry)
        return key

    def remove(self, ref: str) -> None:
        """Delete the object ``ref`` or every object under it, and this host's copies."""
        import obstore

        if os.path.isabs(ref):  # a row written before the bucket: a file on the shared disk
            return LocalDir().remove(ref)
        keys = [ref, *(o["path"] for batch in obstore.list(self.store, prefix=ref) for o in batch)]
        for i in range(0, len(keys), DELETE_BATCH):
            obstore.delete(self.store, keys[i : i + DELETE_BATCH])  # a missing key is no error
        _remove_local(self.data_path / ref)
        _remove_local(self._entry(ref))

    # ---------------------------------------------------------------- reading

    def local(self, ref: str, sha256: str | None = None) -> Path | None:
        """The files of ``ref`` on this host: from the cache, or downloaded into it (a directory's
        files checked against its ``manifest.json`` when it has one, a single file against
        ``sha256`` when given). None when the bucket has no such object.

        Raises:
            OSError: a download does not match its manifest. obstore.exceptions.BaseError: a
                request to the bucket failed.
        """
        if os.path.isabs(ref):
            return LocalDir().local(ref)
        entry = self._entry(ref)
        found = entry / Path(ref).name
        if found.exists():
            os.utime(entry)  # most recently used
            return found
        sources = self.objects(ref)
        if not sources:
            return None
        tmp = entry.with_name(f".{entry.name}.{uuid.uuid4().hex}.tmp")
        try:
            target = tmp / Path(ref).name
            for name, source in sources.items():
                out = target if name == "" else target / name
                out.parent.mkdir(parents=True, exist_ok=True)
                expected = sha256 if name == "" else source.sha256
                with open(out, "wb") as f:
                    for chunk in Remote(self, source.key, source.size, source.mtime, expected).chunks():
                        f.write(chunk)
            try:
                os.rename(tmp, entry)
            except OSError:  # another process cached it first: use that copy
                pass
        finally:
            _remove_local(tmp)
        self._evict(keep=entry)
        return found

    def files(self, ref: str) -> dict[str, Path | Remote]:
        """The files of ``ref`` by name: ``objects``, or of a ref that is an absolute path (a row
        written before the bucket was configured) the files on the disk."""
        return LocalDir().files(ref) if os.path.isabs(ref) else dict[str, Path | Remote](self.objects(ref))

    def objects(self, ref: str) -> dict[str, Remote]:
        """The objects of ``ref`` by name under it (``""`` for a single object), each with its
        sha256 from the ``manifest.json`` among them, if any; empty when there are none."""
        import obstore

        try:
            meta = obstore.head(self.store, ref)
            return {"": Remote(self, ref, meta["size"], meta["last_modified"].timestamp())}
        except FileNotFoundError:
            pass
        found = {
            o["path"][len(ref) + 1 :]: Remote(self, o["path"], o["size"], o["last_modified"].timestamp())
            for batch in obstore.list(self.store, prefix=ref)
            for o in batch
        }
        if MANIFEST in found:
            manifest = json.loads(b"".join(found[MANIFEST].chunks()))
            hashes = {e["name"]: e["sha256"] for e in manifest["files"]}
            found = {n: Remote(self, r.key, r.size, r.mtime, hashes.get(n)) for n, r in found.items()}
        return dict(sorted(found.items()))

    def job_ids(self, folder: str) -> list[str]:
        import obstore

        prefixes = obstore.list_with_delimiter(self.store, folder)["common_prefixes"]
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in prefixes]

    def listing(self, folder: str) -> list[tuple[str, int, datetime]]:
        """Every object under ``folder``: (key, size in bytes, last modified)."""
        import obstore

        return [
            (o["path"], o["size"], o["last_modified"])
            for batch in obstore.list(self.store, prefix=folder)
            for o in batch
        ]

    def upload_refs(self) -> list[str]:
        """The refs of the uploaded files there are: the bucket's ``uploads/`` objects (one listing),
        and the files of rows written before the bucket, on the shared disk (``LocalDir``)."""
        return [key for key, _, _ in self.listing("uploads/")] + LocalDir().upload_refs()

    def folder_bytes(self, folder: str) -> int:
        """Bytes of the objects under ``<folder>/`` (a job's ``artifacts/<id>``: one listing of its own objects)."""
        return sum(size for _, size, _ in self.listing(f"{folder}/"))

    def presigned_url(self, source: "Path | Remote") -> str | None:
        """A URL that downloads ``source`` straight from the bucket for ``presigned_seconds``, when
        that setting is on (``TUNEJOB_STORAGE_PRESIGNED_SECONDS``); else None."""
        import obstore

        if self.presigned_seconds is None or not isinstance(source, Remote):
            return None
        return obstore.sign(self.store, "GET", source.key, timedelta(seconds=self.presigned_seconds))

    # ---------------------------------------------------------------- the cache

    def ref(self, path: Path) -> str:
        """The key of a path under the data directory (what a row stores)."""
        return path.resolve().relative_to(self.data_path).as_posix()

    def _entry(self, ref: str) -> Path:
        """The cache folder of ``ref``: named by a hash of the key, so that every entry sits at
        one level and evicting one is removing one folder."""
        return self.data_path / CACHE / hashlib.sha256(ref.encode()).hexdigest()[:32]

    def _evict(self, keep: Path) -> None:
        """Remove least recently used cache entries (by folder mtime: set when cached or used)
        until the cache holds at most ``cache_bytes``; ``keep`` (just cached or used) stays."""
        root = self.data_path / CACHE
        entries = []
        for entry in root.iterdir():
            if entry != keep and not entry.name.startswith("."):
                entries.append((entry.stat().st_mtime, entry, LocalDir().tree_bytes(str(entry))))
        total = LocalDir().tree_bytes(str(keep)) + sum(size for _, _, size in entries)
        for _, entry, size in sorted(entries):
            if total <= self.cache_bytes:
                break
            _remove_local(entry)
            total -= size


def _remove_local(path: Path) -> None:
    """Remove a file or a folder, first renamed away so that no reader finds half of it."""
    if path.is_dir() and not path.is_symlink():
        gone = path.with_name(f".{path.name}.{uuid.uuid4().hex}.gone")
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@lru_cache
def _store_for(url: str | None, data_path: Path, cache_bytes: int, presigned_seconds: int | None, timeout_s: float):
    return LocalDir() if url is None else Bucket(url, data_path, cache_bytes, presigned_seconds, timeout_s)


def bucket_problem() -> str | None:
    """Why ``TUNEJOB_STORAGE_URL``'s bucket cannot be used, in one line (obstore's first, which
    names the request and the status: 403 for credentials it refuses, 404 for a bucket that does
    not exist), or None when it lists the prefix (one request, needing the listing permission that
    tunejob uses anyway) or no bucket is set. For a process's start and ``tunejob doctor``: a
    worker with a wrong key would otherwise take every job and fail each."""
    import obstore
    from obstore.exceptions import BaseError

    bucket = store()
    if not isinstance(bucket, Bucket):
        return None
    try:
        next(iter(obstore.list(bucket.store, chunk_size=1)), None)
    except BaseError as e:
        return str(e).splitlines()[0].split(": <?xml")[0]  # the status line, without the XML body's first line
    return None


def store() -> "LocalDir | Bucket":
    """Where files are kept, by the settings (one client per process and configuration)."""
    s = get_settings()
    return _store_for(
        s.storage_url, s.data_path, s.storage_cache_bytes, s.storage_presigned_seconds, s.storage_timeout_seconds
    )


def remove_job_files(job_id: str, *folders: str) -> None:
    """Delete a job's ``checkpoints`` or ``artifacts`` folders: on disk, and their objects in the bucket."""
    s = store()
    for folder in folders:
        s.remove(s.ref(get_settings().data_path / folder / job_id))


def dataset_file(dataset) -> Path:
    """The readable file of a ``Dataset`` row on this host (downloaded into the cache from the
    bucket and checked against the row's sha256 when it is not there yet). A file that is gone
    is returned as the row's path, which raises ``FileNotFoundError`` when read, as before.

    Raises:
        OSError: a download failed or does not match the row's sha256.
    """
    return store().local(dataset.path, dataset.sha256) or Path(dataset.path)
