"""Object store under one fsspec URL prefix, with the one operation the relay needs beyond GET/PUT:
a conditional commit of the manifest, so two publishers can never fork a run.

Three backends, chosen by protocol:
  * s3://   -- s3fs; the manifest commit is PutObject with If-None-Match: * (first) or If-Match:
               ETag (later); immutable objects are created with If-None-Match: *. The manifest is
               read with a plain GetObject (conditional on its ETag when polling), never a LIST,
               so s3fs's listing cache never serves a stale view.
  * file:// -- local paths; commit is an atomic rename under an flock, objects are created
               exclusively with link(2).
  * anything else fsspec knows (memory:// included) -- check-and-write under a process-wide
               lock. That is exact for memory:// (one process owns it); for other remote stores
               it only protects publishers inside this process, and says so in the log.

`storage_options` are handed to fsspec unchanged.
"""

from __future__ import annotations

import abc
import enum
import errno
import fcntl
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, Literal, Union, overload

import fsspec
import xxhash

from relay.files import create_exclusive, write_atomic
from relay.retry import Backoff

log = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]  # a chunk of a streamed object

MANIFEST_KEY = "manifest.json"
LAYOUT_PREFIXES = ("deltas/", "records/", "snapshots/")  # every immutable object lives under one of these
BODY_ATTEMPTS = 5  # S3 GETs whose body breaks off after the headers (s3fs retries only the request)
BODY_BACKOFF = Backoff(0.1, 2.0, 1.7)  # s3fs's own growth between those re-fetches
UNSURE_BACKOFF = Backoff(0.1, 2.0)  # before re-reading after a manifest write whose outcome was not told


class ConflictError(RuntimeError):
    """Another writer changed the run first (the manifest or an immutable object): this write lost."""


class ObjectMissing(FileNotFoundError):
    """An object is not (yet) in the store: replication lag, a gc, or a crashed writer."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ObjectExists(FileExistsError):
    """A create-only write found the key already present."""


class NotModified(enum.Enum):
    """The type of NOT_MODIFIED: a one-member enum, so that a type checker narrows `got is NOT_MODIFIED`."""

    NOT_MODIFIED = "NOT_MODIFIED"

    def __repr__(self) -> str:
        return "NOT_MODIFIED"


NOT_MODIFIED: Final = NotModified.NOT_MODIFIED  # read_manifest's answer when the caller's ETag is still current
Unchanged = Literal[NotModified.NOT_MODIFIED]  # its type


@dataclass(frozen=True)
class ManifestRead:
    data: bytes
    etag: str


def content_tag(data: bytes) -> str:
    """Hex xxh3-128 of bytes: object integrity in the manifest and ETag for stores without one."""
    return xxhash.xxh3_128_hexdigest(data)


class Store(abc.ABC):
    """A run prefix in an object store. Keys are '/'-separated names relative to it ('deltas/12-0.drd').

    The contract every implementation keeps (tests/test_store_conformance.py checks it on every
    kind): `ObjectMissing` for an absent key, `ObjectExists` from a create-only write that found
    one, `ConflictError` from a conditional write that lost; any other exception is a store or
    network failure (`transient()` tells which a retry may cure) after which the state of a write
    is unknown. Nothing is ever partly written: a reader sees a whole object or none.
    """

    url: str

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes. ObjectMissing (with `.key`) if there is none."""

    @abc.abstractmethod
    def put_new(self, key: str, data: bytes) -> None:
        """Create `key` with `data`, atomically; ObjectExists if it is already there (its content left alone)."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete every key; absent keys are not an error. Raises (naming the keys) if any present key
        could not be deleted."""

    @abc.abstractmethod
    def list(self, prefix: str) -> dict[str, int]:
        """Key -> size for every object under `prefix` ({} if none); operators only, watchers never list.
        Never a cached view: a key written or deleted before the call is seen as such."""

    def list_run(self) -> dict[str, int]:
        """Key -> size of every object of the run's layout (PROTOCOL §2: deltas/, records/, snapshots/)."""
        out: dict[str, int] = {}
        for prefix in LAYOUT_PREFIXES:
            out.update(self.list(prefix))
        return out

    # Without an ETag to match, the answer is never NOT_MODIFIED.
    @overload
    def read_manifest(self, if_none_match: None = None) -> ManifestRead | None: ...

    @overload
    def read_manifest(self, if_none_match: str | None) -> ManifestRead | None | Unchanged: ...

    def read_manifest(self, if_none_match: str | None = None) -> ManifestRead | None | Unchanged:
        """The manifest and its ETag; None if the run has none; NOT_MODIFIED if `if_none_match` is
        still its ETag. Stores without ETags use the content tag; S3 overrides this with a conditional GET."""
        try:
            data = self.get(MANIFEST_KEY)
        except ObjectMissing:
            return None
        tag = content_tag(data)
        if if_none_match is not None and tag == if_none_match:
            return NOT_MODIFIED
        return ManifestRead(data, tag)

    @abc.abstractmethod
    def commit_manifest(self, data: bytes, expected_etag: str | None) -> str:
        """Write the manifest iff its current ETag is `expected_etag` (None: iff there is none); returns
        the new ETag. ConflictError when another writer got there first; the manifest is then unchanged."""

    # -- large objects: streamed, never whole in memory ------------------------------------------
    def put_new_stream(self, key: str, chunks: Iterable[Buffer], size: int) -> None:
        """Create `key` from `chunks` (exactly `size` bytes in all), atomically: a reader sees the whole
        object or none. ObjectExists if the key is present. Implementations hold a bounded amount of it
        in memory (a file buffer, a few multipart parts); this fallback joins the chunks."""
        data = b"".join(chunks)
        if len(data) != size:
            raise ValueError(f"{self.url}/{key}: the stream gave {len(data)} bytes, expected {size}")
        self.put_new(key, data)

    def put_immutable_stream(self, key: str, chunks: Callable[[], Iterable[Buffer]], size: int, xxh3: str) -> None:
        """put_immutable for a streamed object: `chunks()` gives its bytes (called once per attempt); an
        existing object is accepted only if its size and xxh3 (the content tag) are these, else ConflictError."""
        try:
            self.put_new_stream(key, chunks(), size)
        except ObjectExists:
            try:
                tag = self.content_tag_of(key)
            except ObjectMissing:
                tag = None
            if tag != (size, xxh3):
                raise ConflictError(
                    f"{self.url}/{key}: already exists with other content (another publisher is writing this step, "
                    f"or a crashed one left it; a resumed publisher that owns the run replaces leftovers above its "
                    f"head)") from None

    def content_tag_of(self, key: str) -> tuple[int, str]:
        """(size, xxh3) of a stored object, read in bounded memory; ObjectMissing if absent."""
        h = xxhash.xxh3_128()
        size = 0
        for chunk in self.iter_chunks(key):
            h.update(chunk)
            size += len(chunk)
        return size, h.hexdigest()

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        """The object's bytes in order, a bounded chunk at a time; ObjectMissing if absent. This fallback
        reads it whole."""
        yield self.get(key)

    def download(self, key: str, fd: int, size: int | None = None) -> int:
        """Write the object's bytes into the open file descriptor `fd` from offset 0 (positional writes,
        so large objects may arrive in parallel ranges); returns the byte count. ObjectMissing if absent;
        ValueError if `size` is given and the object has another size (nothing is trusted beyond it)."""
        offset = 0
        for chunk in self.iter_chunks(key):
            if size is not None and offset + len(chunk) > size:
                raise ValueError(f"{self.url}/{key}: larger than the expected {size} bytes")
            os.pwrite(fd, chunk, offset)
            offset += len(chunk)
        if size is not None and offset != size:
            raise ValueError(f"{self.url}/{key}: {offset} bytes, expected {size}")
        return offset

    def put_immutable(self, key: str, data: bytes) -> None:
        """Create `key`; accept an existing object only if it holds exactly these bytes (an idempotent
        retry), else ConflictError."""
        try:
            self.put_new(key, data)
        except ObjectExists:
            try:
                old = self.get(key)
            except ObjectMissing:
                old = None
            if old is None or content_tag(old) != content_tag(data):
                raise ConflictError(
                    f"{self.url}/{key}: already exists with other content (another publisher is writing this step, "
                    f"or a crashed one left it; a resumed publisher that owns the run replaces leftovers above its "
                    f"head)") from None


class LocalStore(Store):
    """file:// prefix: exclusive create via link(2), manifest swap via rename under flock."""

    def __init__(self, url: str, root: str) -> None:
        self.url = url
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None

    def put_new(self, key: str, data: bytes) -> None:
        try:
            create_exclusive(self._path(key), data)
        except FileExistsError:
            raise ObjectExists(f"{self.url}/{key}: exists") from None

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)
            parent = self._path(key).parent
            while parent != self.root:  # drop emptied snapshot directories
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def list(self, prefix: str) -> dict[str, int]:
        base = self._path(prefix)
        if not base.exists():
            return {}
        out = {}
        for p in base.rglob("*"):
            if p.is_file() and not p.name.startswith("."):  # temporaries and the lock: keys never start with '.'
                out[p.relative_to(self.root).as_posix()] = p.stat().st_size
        return out

    def commit_manifest(self, data: bytes, expected_etag: str | None) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".manifest.lock", "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            current = self.read_manifest()
            current_tag = None if current is None else current.etag
            if current_tag != expected_etag:
                raise ConflictError(f"{self.url}/{MANIFEST_KEY}: changed by another writer "
                                    f"(expected {expected_etag or 'no manifest'}, found {current_tag or 'none'})")
            write_atomic(self._path(MANIFEST_KEY), data)
        return content_tag(data)


_PROCESS_LOCK = threading.Lock()


class FsspecStore(Store):
    """Any other fsspec filesystem; conditional writes are check-then-write under a process lock."""

    def __init__(self, url: str, fs: Any, root: str) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")
        if fs.protocol not in ("memory",) and "memory" not in (fs.protocol if isinstance(fs.protocol, tuple) else ()):
            log.warning("%s: store has no conditional write; manifest commits are only exclusive within this process",
                        url)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None

    def put_new(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with _PROCESS_LOCK:
            if self.fs.exists(path):
                raise ObjectExists(f"{self.url}/{key}: exists")
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # no-op on flat stores, needed on others
            self.fs.pipe_file(path, data)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.fs.rm_file(self._path(key))
            except FileNotFoundError:
                pass

    def list(self, prefix: str) -> dict[str, int]:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self._path(prefix), detail=True)
        except FileNotFoundError:
            return {}
        root = self.root.strip("/") + "/"
        return {p.lstrip("/")[len(root):]: int(info.get("size") or 0)
                for p, info in found.items() if info.get("type", "file") == "file"}

    def commit_manifest(self, data: bytes, expected_etag: str | None) -> str:
        with _PROCESS_LOCK:
            current = self.read_manifest()
            current_tag = None if current is None else current.etag
            if current_tag != expected_etag:
                raise ConflictError(f"{self.url}/{MANIFEST_KEY}: changed by another writer")
            self.fs.makedirs(self.root, exist_ok=True)
            self.fs.pipe_file(self._path(MANIFEST_KEY), data)
        return content_tag(data)


def _client_error(exc: BaseException) -> tuple[str, int]:
    """(error code, HTTP status) of the botocore ClientError behind an s3fs exception, if any."""
    cause: BaseException | None = exc
    for _ in range(3):
        if cause is None:
            break
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return str(err.get("Code", "")), int(status or 0)
        cause = cause.__cause__ or cause.__context__
    return "", 0


def transient(exc: BaseException) -> bool:
    """Whether a retry may cure a failed request: a 5xx, throttling, a reset or a timeout.

    A write that failed this way may still have been applied (the store answered after writing,
    or the answer was lost), so a caller that retries a conditional write re-reads first. Refusals
    (4xx: denied, missing, precondition) are not transient.
    """
    if isinstance(exc, (ConflictError, FileNotFoundError, FileExistsError, PermissionError)):
        return False
    code, status = _client_error(exc)
    if status:
        return status >= 500 or status == 429 or code in ("SlowDown", "Throttling", "RequestTimeout")
    if code:
        return code in ("InternalError", "ServiceUnavailable", "SlowDown", "Throttling", "RequestTimeout")
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    # botocore's connection-level failures (reset, read timeout, endpoint gone) and s3fs's EREMOTEIO
    return type(exc).__module__.startswith(("botocore", "aiobotocore", "aiohttp")) or (
        isinstance(exc, OSError) and exc.errno in (errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO)))


UNSURE_ATTEMPTS = 5  # re-reads after manifest writes whose outcome the store did not tell


def unsure_write(url: str, exc: Exception, tries: int) -> int:
    """Called in a conditional writer's `except`: re-raise `exc` unless it is transient and fewer
    than UNSURE_ATTEMPTS such failures came before; else back off and return tries + 1. The caller
    then re-reads the manifest, which tells whether the write landed."""
    if not transient(exc) or tries >= UNSURE_ATTEMPTS:
        raise exc
    log.warning("%s/%s: write failed (%s); re-reading to learn whether it landed", url, MANIFEST_KEY, exc)
    UNSURE_BACKOFF.sleep(tries + 1)
    return tries + 1


class S3Store(Store):
    """s3:// prefix through s3fs (same endpoint and credentials as the storage_options give)."""

    def __init__(self, url: str, fs: Any, root: str) -> None:
        self.url = url
        self.fs = fs
        self.root = root.strip("/")
        self.bucket, _, self.prefix = self.root.partition("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _get_object(self, key: str, **kw: Any) -> dict:
        return self.fs.call_s3("get_object", Bucket=self.bucket, Key=self._key(key), **kw)

    def _read_body(self, resp: dict) -> bytes:
        import fsspec.asyn

        async def read() -> bytes:
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

        return fsspec.asyn.sync(self.fs.loop, read)

    def _get_with_body(self, key: str, **kw: Any) -> tuple[dict, bytes]:
        """GetObject and its body. s3fs retries the request but not the body that follows it, so a body that
        breaks off (a reset, a truncated response, a read timeout) is fetched again here, with s3fs's backoff."""
        from s3fs.core import S3_RETRYABLE_ERRORS

        for attempt in range(BODY_ATTEMPTS):
            resp = self._get_object(key, **kw)
            try:
                return resp, self._read_body(resp)
            except S3_RETRYABLE_ERRORS as exc:
                if attempt == BODY_ATTEMPTS - 1:
                    raise
                log.info("%s/%s: the response body broke off (%s); fetching it again", self.url, key, exc)
                BODY_BACKOFF.sleep(attempt + 1)
        raise AssertionError("unreachable")

    def get(self, key: str) -> bytes:
        try:
            return self._get_with_body(key)[1]
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None

    def put_new(self, key: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._path(key), data, mode="create")
        except FileExistsError:
            raise ObjectExists(f"{self.url}/{key}: exists") from None
        except OSError as exc:
            code, status = _client_error(exc)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise ObjectExists(f"{self.url}/{key}: exists ({code or status})") from None
            raise

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            if batch:
                resp = self.fs.call_s3("delete_objects", Bucket=self.bucket,
                                       Delete={"Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True})
                failed = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if failed:  # a 200 response can still refuse some keys (AccessDenied, InternalError)
                    self.fs.invalidate_cache(self.root)
                    raise OSError(errno.EIO, f"{self.url}: could not delete {len(failed)} object(s): " + ", ".join(
                        f"{e.get('Key')} ({e.get('Code')}: {e.get('Message', '')})" for e in failed[:5]))
        self.fs.invalidate_cache(self.root)

    def list(self, prefix: str) -> dict[str, int]:
        self.fs.invalidate_cache(self.root)
        try:
            found = self.fs.find(self._path(prefix), detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(self.root) + 1:]: int(info.get("size") or 0) for p, info in found.items()
                if info.get("type", "file") == "file"}

    @overload
    def read_manifest(self, if_none_match: None = None) -> ManifestRead | None: ...

    @overload
    def read_manifest(self, if_none_match: str | None) -> ManifestRead | None | Unchanged: ...

    def read_manifest(self, if_none_match: str | None = None) -> ManifestRead | None | Unchanged:
        kw = {"IfNoneMatch": if_none_match} if if_none_match else {}
        try:
            resp, body = self._get_with_body(MANIFEST_KEY, **kw)
        except FileNotFoundError:
            return None
        except OSError as exc:
            code, status = _client_error(exc)
            if status == 304 or code in ("304", "NotModified"):
                return NOT_MODIFIED
            raise
        return ManifestRead(body, resp["ETag"])

    def commit_manifest(self, data: bytes, expected_etag: str | None) -> str:
        cond = {"IfMatch": expected_etag} if expected_etag else {"IfNoneMatch": "*"}
        try:
            resp = self.fs.call_s3("put_object", Bucket=self.bucket, Key=self._key(MANIFEST_KEY), Body=data,
                                   ContentType="application/json", **cond)
        except (OSError, FileExistsError) as exc:
            code, status = _client_error(exc)
            if isinstance(exc, FileExistsError) or status in (409, 412) or code in (
                    "PreconditionFailed", "ConditionalRequestConflict"):
                cond_text = f"If-Match {expected_etag}" if expected_etag else "If-None-Match *"
                raise ConflictError(f"{self.url}/{MANIFEST_KEY}: changed by another writer "
                                    f"({code or status} on {cond_text})") from None
            if isinstance(exc, FileNotFoundError) and expected_etag:  # If-Match on a deleted manifest
                raise ConflictError(f"{self.url}/{MANIFEST_KEY}: removed by another writer") from None
            raise
        self.fs.invalidate_cache(self._path(MANIFEST_KEY))
        return resp["ETag"]


def open_store(url: str, storage_options: dict | None = None) -> Store:
    """The Store for a run prefix such as 's3://bucket/run', 'file:///path/run' or 'memory://run'."""
    if "://" not in url:
        url = "file://" + os.path.abspath(url)
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    url = url.rstrip("/")
    if "s3" in protocols or "s3a" in protocols:
        return S3Store(url, fs, root)
    if "file" in protocols or "local" in protocols:
        return LocalStore(url, root)
    return FsspecStore(url, fs, root)


__all__ = ["Store", "open_store", "transient", "unsure_write", "UNSURE_ATTEMPTS", "ConflictError", "ObjectMissing",
           "ObjectExists", "ManifestRead", "NOT_MODIFIED", "NotModified", "MANIFEST_KEY", "content_tag"]
