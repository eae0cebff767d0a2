"""Object store under one fsspec URL prefix, with the one operation the relay needs beyond GET/PUT:
a conditional commit of the manifest, so two publishers can never fork a run.

Three backends, chosen by protocol:
  * s3://   -- s3fs; the manifest commit is PutObject with If-None-Match: * (first) or If-Match:
               ETag (later); immutable objects are created with If-None-Match: * (large ones by a
               multipart upload whose completion carries it). What the store honours of these is
               probed before the first write (relay.s3probe, docs/STORES.md): If-Match in the form
               it takes; where a completion is not create-only, large objects are spooled to a local
               file and created by one create-only PutObject. The manifest is read with a plain
               GetObject (conditional on its ETag when polling), never a LIST, so s3fs's listing
               cache never serves a stale view. Large objects are read in ranged GETs If-Match
               the first answer's ETag.
  * file:// -- local paths; commit is an atomic rename under an flock, objects are created
               exclusively with link(2) of a fsynced temporary.
  * anything else fsspec knows (memory:// included) -- check-and-write under a process-wide
               lock. That is exact for memory:// (one process owns it); for other remote stores
               it only protects publishers inside this process, and says so in the log.

Large objects (put_new_stream, put_immutable_stream, iter_chunks, download) never sit whole in
memory; `Transfer` bounds what they hold (docs/PROTOCOL.md §3). `storage_options` are handed to
fsspec unchanged, except the relay's own key "transfer" (the fields of a Transfer).
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import enum
import errno
import fcntl
import hashlib
import io
import logging
import os
import re
import stat
import tempfile
import threading
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, BinaryIO, Final, Literal, Union, overload

import fsspec
import xxhash

from relay.files import write_all
from relay.retry import Backoff
from relay.s3probe import Capabilities, StoreCapabilityError, capabilities

log = logging.getLogger(__name__)

Buffer = Union[bytes, bytearray, memoryview]  # a chunk of a streamed object

MANIFEST_KEY = "manifest.json"
# The most of a mutable object (manifest, announcement, ledger entry) read_object reads: every parser
# refuses more (relay.manifest.MAX_MANIFEST_BYTES), so a larger object comes back cut at one byte past it,
# which the parser refuses by its size without the whole object having been read into memory.
MAX_MUTABLE_BYTES = 64 << 20
LAYOUT_PREFIXES = ("deltas/", "records/", "snapshots/")  # every immutable object lives under one of these
BODY_ATTEMPTS = 5  # S3 GETs whose body breaks off after the headers (s3fs retries only the request)
BODY_BACKOFF = Backoff(0.1, 2.0, 1.7)  # s3fs's own growth between those re-fetches
UNSURE_BACKOFF = Backoff(0.1, 2.0)  # before re-reading after a manifest write whose outcome was not told
PART_ATTEMPTS = 5  # uploads of one multipart part (on top of s3fs's and botocore's own retries of the request)
PART_BACKOFF = Backoff(0.2, 5.0)
MiB = 1 << 20
S3_MIN_PART = 5 * MiB  # S3's limits on multipart uploads: every part but the last at least this
S3_MAX_PART = 5 << 30  # ... at most this (also the largest single PutObject)
S3_MAX_PARTS = 10_000
S3_MAX_OBJECT = 5 << 40


class ConflictError(RuntimeError):
    """Another writer changed the run first (the manifest or an immutable object): this write lost."""


class ObjectMissing(FileNotFoundError):
    """An object is not (yet) in the store: replication lag, a gc, or a crashed writer."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ObjectExists(FileExistsError):
    """A create-only write found the key already present."""


class ObjectChanged(OSError):
    """An object changed between the ranged reads of one download (someone replaced an immutable key):
    what was read is discarded. A new read sees one version whole, which the caller verifies as always."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


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


@dataclass(frozen=True)
class Transfer:
    """How large objects move, so that memory stays bounded whatever their size.

    S3 creates an object larger than `multipart_threshold` by a multipart upload of `part_size` parts
    (raised when 10,000 parts would not hold it), `threads` at a time, at most `threads + 1` parts in
    memory (one being filled); it downloads one in ranges of `part_size`, `threads` at a time. Every
    read holds at most `chunk_size` bytes per thread, and `iter_chunks` yields pieces of that size.
    Set per store with `open_store(..., transfer=Transfer(...))` or the storage option
    `{"transfer": {"part_size": ...}}` (taken out before the options reach fsspec).
    """

    multipart_threshold: int = 64 * MiB
    part_size: int = 64 * MiB
    threads: int = 4
    chunk_size: int = 8 * MiB

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int:  # bool is an int subclass, and refused here
                raise ValueError(f"transfer option {f.name}: an integer, not {value!r}")
        if not 0 <= self.multipart_threshold <= S3_MAX_PART:
            raise ValueError(f"transfer option multipart_threshold: 0 to {S3_MAX_PART} bytes (S3's largest single "
                             f"PutObject), not {self.multipart_threshold}")
        if not S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ValueError(f"transfer option part_size: {S3_MIN_PART} to {S3_MAX_PART} bytes (S3's part limits), "
                             f"not {self.part_size}")
        if not 1 <= self.threads <= 64:
            raise ValueError(f"transfer option threads: 1 to 64, not {self.threads}")
        if not 4096 <= self.chunk_size <= 1 << 30:
            raise ValueError(f"transfer option chunk_size: 4096 bytes to 1 GiB, not {self.chunk_size}")

    @classmethod
    def from_options(cls, value: object) -> Transfer:
        """The Transfer a storage option `{"transfer": {...}}` asks for; ValueError naming a bad field."""
        if not isinstance(value, dict):
            raise ValueError(f"storage option 'transfer': an object of {sorted(f.name for f in fields(cls))}, "
                             f"not {value!r}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"storage option 'transfer': unknown field(s) {unknown}; known: "
                             f"{sorted(f.name for f in fields(cls))}")
        return cls(**value)

    def part_size_for(self, size: int) -> int:
        """The part size of a multipart upload of `size` bytes: `part_size`, raised in whole MiB until
        S3's 10,000 parts hold the object (at most 525 MiB, for S3's largest object of 5 TiB);
        ValueError past that limit."""
        if size > S3_MAX_OBJECT:
            raise ValueError(f"{size} bytes: larger than S3's largest object ({S3_MAX_OBJECT} bytes)")
        part = self.part_size
        if size > part * S3_MAX_PARTS:
            part = -(-size // (S3_MAX_PARTS * MiB)) * MiB
        return part


DEFAULT_TRANSFER = Transfer()


def _as_bytes_view(chunk: Buffer) -> memoryview:
    """A chunk as a flat memoryview of bytes (a tensor's buffer may come typed or shaped)."""
    view = memoryview(chunk)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise ValueError("a streamed chunk must be a contiguous buffer")
        view = view.cast("B")
    return view


class _Checked:
    """The chunks of a stream as byte views, held to the size its writer declared (and, when `hashed`, to
    its xxh3): a stream that runs past `size` stops at the first chunk beyond it; `finish()` refuses one
    that ended short or whose bytes hash to another tag. A writer creates nothing before `finish()`."""

    def __init__(self, where: str, chunks: Iterable[Buffer], size: int, xxh3: str | None, hashed: bool) -> None:
        if size < 0:
            raise ValueError(f"{where}: a negative size ({size})")
        self.where, self.chunks, self.size, self.xxh3 = where, chunks, size, xxh3
        self.count = 0
        self.hash = xxhash.xxh3_128() if hashed and xxh3 is not None else None

    def __iter__(self) -> Iterator[memoryview]:
        for chunk in self.chunks:
            view = _as_bytes_view(chunk)
            self.count += len(view)
            if self.count > self.size:
                raise ValueError(f"{self.where}: the stream gave more than the declared {self.size} bytes; "
                                 f"nothing was created")
            if self.hash is not None:
                self.hash.update(view)
            yield view

    def finish(self, digest: str | None = None) -> None:
        """Raise unless the whole declared stream came (and hashed, here or as `digest`, to the declared tag)."""
        if self.count != self.size:
            raise ValueError(f"{self.where}: the stream gave {self.count} bytes, declared {self.size}; "
                             f"nothing was created")
        got = digest if digest is not None else (self.hash.hexdigest() if self.hash is not None else None)
        if self.xxh3 is not None and got is not None and got != self.xxh3:
            raise ValueError(f"{self.where}: the stream's bytes hash to {got}, declared {self.xxh3} (the source "
                             f"changed while it was read?); nothing was created")


def _pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    """os.pwrite of every byte (a positional write may take only part of it)."""
    view = _as_bytes_view(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if not n:
            raise OSError(errno.EIO, f"fd {fd}: a write at offset {offset} took no bytes")
        view, offset = view[n:], offset + n


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

    def get_at_most(self, key: str, limit: int) -> bytes:
        """The object's bytes, cut after `limit` if it is larger; ObjectMissing if there is none. A reader
        that knows an object's size asks for one byte more and refuses a longer answer: a store that holds
        a huge object under the key costs it `limit` bytes, not the object."""
        return self._read_capped(key, limit)

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
    def has_container(self) -> bool:
        """Whether the bucket (or directory) the URL names exists, so that a reader finding no manifest can
        tell an operator which of the two is missing. Stores that cannot tell answer True."""
        return True

    @overload
    def read_manifest(self, if_none_match: None = None) -> ManifestRead | None: ...

    @overload
    def read_manifest(self, if_none_match: str | None) -> ManifestRead | None | Unchanged: ...

    def read_manifest(self, if_none_match: str | None = None) -> ManifestRead | None | Unchanged:
        """The manifest and its ETag; None if the run has none; NOT_MODIFIED if `if_none_match` is
        still its ETag (read_object on MANIFEST_KEY)."""
        return self.read_object(MANIFEST_KEY, if_none_match)

    def commit_manifest(self, data: bytes, expected_etag: str | None) -> str:
        """Write the manifest iff its current ETag is `expected_etag` (None: iff there is none); returns
        the new ETag. ConflictError when another writer got there first; the manifest is then unchanged."""
        return self.commit_object(MANIFEST_KEY, data, expected_etag)

    # -- mutable objects: the manifest, and the few region-local objects other writers keep (a
    # region's snapshot announcement, the fleet ledger). Each is replaced only by compare-and-swap.
    @overload
    def read_object(self, key: str, if_none_match: None = None) -> ManifestRead | None: ...

    @overload
    def read_object(self, key: str, if_none_match: str | None) -> ManifestRead | None | Unchanged: ...

    def read_object(self, key: str, if_none_match: str | None = None) -> ManifestRead | None | Unchanged:
        """A mutable object's bytes and ETag; None if there is none; NOT_MODIFIED if `if_none_match` is
        still its ETag. Stores without ETags use the content tag; S3 overrides this with a conditional GET.
        At most MAX_MUTABLE_BYTES + 1 bytes are read: a larger object's bytes come back cut there."""
        try:
            data = self._read_mutable(key)
        except ObjectMissing:
            return None
        tag = content_tag(data)
        if if_none_match is not None and tag == if_none_match:
            return NOT_MODIFIED
        return ManifestRead(data, tag)

    def _read_mutable(self, key: str) -> bytes:
        """A mutable object's bytes for read_object, at most MAX_MUTABLE_BYTES + 1; ObjectMissing if absent."""
        return self._read_capped(key, MAX_MUTABLE_BYTES + 1)

    @abc.abstractmethod
    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """Write `key` iff its current ETag is `expected_etag` (None: iff there is none); returns the new
        ETag. ConflictError when another writer got there first; the object is then unchanged."""

    # -- large objects: streamed, never whole in memory ------------------------------------------
    # Every backend overrides these with bounded-memory versions (tests/test_store_conformance.py);
    # the fallbacks below, for other Store implementations, hold the object whole.
    transfer: Transfer = DEFAULT_TRANSFER

    def put_new_stream(self, key: str, chunks: Iterable[Buffer], size: int, *, xxh3: str | None = None) -> None:
        """Create `key` from `chunks` (exactly `size` bytes in all), atomically: a reader sees the whole
        object or none. ObjectExists if the key is present (then the stream may not be read at all).
        ValueError, creating nothing, if the stream gives another number of bytes or (with `xxh3`) bytes
        of another content tag: what is created is exactly what was declared. Implementations hold a
        bounded amount of it in memory (a file buffer, a few multipart parts); this fallback joins the chunks."""
        checked = _Checked(f"{self.url}/{key}", chunks, size, xxh3, hashed=True)
        data = b"".join(bytes(view) for view in checked)
        checked.finish()
        self.put_new(key, data)

    def put_immutable_stream(self, key: str, chunks: Callable[[], Iterable[Buffer]], size: int, xxh3: str) -> None:
        """put_immutable for a streamed object: `chunks()` gives its bytes (called once per attempt); the
        object is created only if they are `size` bytes hashing to `xxh3` (ValueError otherwise); an
        existing object is accepted only if its size and xxh3 (the content tag) are these, else ConflictError."""
        try:
            self.put_new_stream(key, chunks(), size, xxh3=xxh3)
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

    def _read_capped(self, key: str, limit: int) -> bytes:
        """The object's first `limit` bytes at most (all of them if it is no larger), in chunks."""
        out = bytearray()
        limit = max(limit, 0)
        chunks = self.iter_chunks(key)
        try:
            for chunk in chunks:
                out += memoryview(chunk)[: limit - len(out)]
                if len(out) >= limit:
                    break
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        return bytes(out)

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        """The object's bytes in order, at most `transfer.chunk_size` at a time; ObjectMissing (at the first
        next()) if absent; an error, never a short object, if the read cannot be completed. This fallback
        reads it whole."""
        yield self.get(key)

    def download(self, key: str, fd: int, size: int | None = None) -> int:
        """Write the object's bytes into the open file descriptor `fd` (opened for writing, not O_APPEND)
        from offset 0 (positional writes, so large objects may arrive in parallel ranges); returns the byte
        count. ObjectMissing if absent; ValueError if `size` is given and the object has another size,
        raised before any byte past `size` is written. On any error `fd` holds an unspecified prefix:
        the caller discards the file. The caller verifies the content (its xxh3) as for any read."""
        offset = 0
        for chunk in self.iter_chunks(key):
            if size is not None and offset + len(chunk) > size:
                raise ValueError(f"{self.url}/{key}: larger than the expected {size} bytes")
            _pwrite_all(fd, chunk, offset)
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
            try:  # one byte past ours is enough to tell: whatever sits there costs no more than our object
                old = self.get_at_most(key, len(data) + 1)
            except ObjectMissing:
                old = None
            if old is None or content_tag(old) != content_tag(data):
                raise ConflictError(
                    f"{self.url}/{key}: already exists with other content (another publisher is writing this step, "
                    f"or a crashed one left it; a resumed publisher that owns the run replaces leftovers above its "
                    f"head)") from None


class UnsafeStorePath(OSError):
    """A file:// key whose path under the store root is not plain directories down to a regular file: a
    symbolic link (planted by whoever can write the store directory), or a FIFO or device. Never followed or
    opened, so no key operation reads, writes or unlinks outside the root; not transient."""


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO in place of an object is opened at once (then refused), not waited on
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LocalStore(Store):
    """file:// prefix: exclusive create via link(2), manifest swap via rename under flock.

    The root may be reached through links; nothing under it is. Every key is resolved one name at a time
    from the root's open directory (openat with O_NOFOLLOW), so a link planted anywhere under the root, in
    place of a directory or of an object, is refused (UnsafeStorePath, naming it) by every operation: a `gc` run
    by a more privileged user never unlinks, and no reader opens, a file outside the store."""

    def __init__(self, url: str, root: str, *, transfer: Transfer = DEFAULT_TRANSFER) -> None:
        self.url = url
        self.root = Path(root)
        self.transfer = transfer

    def _path(self, key: str) -> Path:
        return self.root / key

    def has_container(self) -> bool:
        return self.root.is_dir()

    def _refused(self, key: str, parts: list[str], dir_fd: int) -> UnsafeStorePath:
        """The refusal of `key` at `parts` (a link, or neither a directory nor a regular file), naming what is there."""
        try:
            what = f"a symbolic link to {os.readlink(parts[-1], dir_fd=dir_fd)}"
        except OSError:
            what = "neither a directory nor a regular file"
        return UnsafeStorePath(f"{self.url}/{key}: {self.root.joinpath(*parts)} is {what}: refused (a file:// store "
                               f"follows no link under its root)")

    def _dirs(self, key: str, names: list[str], *, create: bool = False) -> list[int]:
        """Open directories: the root, then each of `names` under it (created when `create`), none reached
        through a link. The caller closes them. ObjectMissing if one is absent (or a file)."""
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        try:
            fds = [os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None
        try:
            for i, name in enumerate(names):
                if create:
                    try:
                        os.mkdir(name, dir_fd=fds[-1])
                    except FileExistsError:
                        pass
                try:
                    fds.append(os.open(name, _OPEN_DIR, dir_fd=fds[-1]))
                except FileNotFoundError:
                    raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None
                except OSError as exc:  # ENOTDIR for a link too (O_DIRECTORY | O_NOFOLLOW)
                    if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    if stat.S_ISLNK(os.stat(name, dir_fd=fds[-1], follow_symlinks=False).st_mode):
                        raise self._refused(key, names[: i + 1], fds[-1]) from None
                    if create:
                        raise
                    raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _parts(self, key: str) -> list[str]:
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise UnsafeStorePath(f"{self.url}/{key}: not a key (an empty, '.' or '..' name)")
        return parts

    def _open(self, key: str) -> BinaryIO:
        *names, name = self._parts(key)
        fds = self._dirs(key, names)
        try:
            try:
                fd = os.open(name, _OPEN_FILE, dir_fd=fds[-1])
            except FileNotFoundError:
                raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._refused(key, [*names, name], fds[-1]) from None
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise self._refused(key, [*names, name], fds[-1])
        finally:
            for d in fds:
                os.close(d)
        return open(fd, "rb", buffering=0)

    def _write(self, key: str, write: Callable[[BinaryIO], object], *, replace: bool, mode: int) -> None:
        """Create (link(2): FileExistsError if present) or replace (rename(2)) `key` with what `write` puts into
        a dot-named temporary beside it, fsynced first and the directory after: the relay.files scheme, done
        from the opened directory so that no link under the root is followed. The temporary goes on failure."""
        *names, name = self._parts(key)
        fds = self._dirs(key, names, create=True)
        d = fds[-1]
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=d)
            try:
                with open(fd, "r+b", buffering=0) as f:
                    os.fchmod(f.fileno(), mode)
                    write(f)
                    os.fsync(f.fileno())
                if replace:
                    os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
                else:
                    os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
            finally:
                try:
                    os.unlink(tmp, dir_fd=d)
                except FileNotFoundError:
                    pass
            os.fsync(d)
        finally:
            for dfd in fds:
                os.close(dfd)

    def get(self, key: str) -> bytes:
        with self._open(key) as f:
            return f.read()

    def get_at_most(self, key: str, limit: int) -> bytes:
        with self._open(key) as f:
            out = bytearray()
            while len(out) < limit:  # in chunks: a limit from a claimed size is no allocation
                data = f.read(min(limit - len(out), self.transfer.chunk_size))
                if not data:
                    break
                out += data
            return bytes(out)

    def put_new(self, key: str, data: bytes) -> None:
        try:
            self._write(key, lambda f: write_all(f, data), replace=False, mode=0o644)
        except FileExistsError:
            raise ObjectExists(f"{self.url}/{key}: exists") from None

    def put_new_stream(self, key: str, chunks: Iterable[Buffer], size: int, *, xxh3: str | None = None) -> None:
        """Written chunk by chunk into a dot-named temporary file, fsynced, then link(2)ed into place (as
        put_new): memory holds one chunk; the temporary is removed on any failure."""
        try:  # the authoritative check is link(2)'s; this one spares reading the stream
            self._open(key).close()
        except ObjectMissing:
            pass
        else:
            raise ObjectExists(f"{self.url}/{key}: exists")
        checked = _Checked(f"{self.url}/{key}", chunks, size, xxh3, hashed=True)

        def write(f: BinaryIO) -> None:
            for view in checked:
                write_all(f, view)
            checked.finish()

        try:
            self._write(key, write, replace=False, mode=0o644)
        except FileExistsError:
            raise ObjectExists(f"{self.url}/{key}: exists") from None

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        with self._open(key) as f:
            size = os.fstat(f.fileno()).st_size
            done = 0
            while done < size:
                data = os.pread(f.fileno(), min(self.transfer.chunk_size, size - done), done)
                if not data:
                    raise OSError(errno.EIO, f"{self.url}/{key}: ended after {done} of {size} bytes "
                                             f"(truncated while read)")
                done += len(data)
                yield data

    def download(self, key: str, fd: int, size: int | None = None) -> int:
        """A kernel copy (copy_file_range: no user-space buffer, a reflink where the filesystem can) of the
        size the object has when opened; pread/pwrite in chunks where the kernel cannot copy."""
        with self._open(key) as f:
            src = f.fileno()
            total = os.fstat(src).st_size
            if size is not None and total != size:
                raise ValueError(f"{self.url}/{key}: {total} bytes, expected {size}")
            done = 0
            kernel = hasattr(os, "copy_file_range")
            while done < total:
                n = 0
                if kernel:
                    try:
                        n = os.copy_file_range(src, fd, total - done, done, done)
                    except OSError as exc:
                        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP,
                                             errno.EBADF, errno.EPERM):
                            raise
                        kernel = False
                        continue
                else:
                    data = os.pread(src, min(self.transfer.chunk_size, total - done), done)
                    _pwrite_all(fd, data, done)
                    n = len(data)
                if not n:
                    raise OSError(errno.EIO, f"{self.url}/{key}: ended after {done} of {total} bytes "
                                             f"(truncated while read)")
                done += n
        return total

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            *names, name = self._parts(key)
            try:
                fds = self._dirs(key, names)
            except ObjectMissing:
                continue
            try:
                try:
                    if stat.S_ISLNK(os.stat(name, dir_fd=fds[-1], follow_symlinks=False).st_mode):
                        raise self._refused(key, [*names, name], fds[-1])
                    os.unlink(name, dir_fd=fds[-1])
                except FileNotFoundError:
                    pass
                for i in range(len(names), 0, -1):  # drop emptied snapshot directories
                    try:
                        os.rmdir(names[i - 1], dir_fd=fds[i - 1])
                    except OSError:
                        break
            finally:
                for fd in fds:
                    os.close(fd)

    def list(self, prefix: str) -> dict[str, int]:
        names = self._parts(prefix.rstrip("/")) if prefix.strip("/") else []
        try:
            fds = self._dirs(prefix, names)
        except ObjectMissing:
            return {}
        out: dict[str, int] = {}

        def walk(fd: int, parts: list[str]) -> None:
            with os.scandir(fd) as it:
                entries = list(it)
            for e in entries:
                if e.name.startswith("."):  # temporaries and the locks: keys never start with '.'
                    continue
                where = [*parts, e.name]
                try:
                    if e.is_symlink():
                        raise self._refused("/".join(where), where, fd)
                    if e.is_dir(follow_symlinks=False):
                        sub = os.open(e.name, _OPEN_DIR, dir_fd=fd)
                        try:
                            walk(sub, where)
                        finally:
                            os.close(sub)
                    elif e.is_file(follow_symlinks=False):
                        out["/".join(where)] = e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:  # deleted meanwhile
                    continue

        try:
            walk(fds[-1], names)
        finally:
            for fd in fds:
                os.close(fd)
        return out

    def _lock(self, key: str) -> int:
        """An open flock file that serialises compare-and-swap on `key`, in the root (dot-named: never listed as
        a key; a link there is refused as under any key)."""
        name = ".manifest.lock" if key == MANIFEST_KEY else f".cas-{key.replace('/', '%')}.lock"
        fds = self._dirs(key, [], create=True)
        try:
            return os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fds[0])
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._refused(key, [name], fds[0]) from None
            raise
        finally:
            os.close(fds[0])

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        lock = self._lock(key)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self.read_object(key)
            current_tag = None if current is None else current.etag
            if current_tag != expected_etag:
                raise ConflictError(f"{self.url}/{key}: changed by another writer "
                                    f"(expected {expected_etag or 'no object'}, found {current_tag or 'none'})")
            self._write(key, lambda f: write_all(f, data), replace=True, mode=0o600)
        finally:
            os.close(lock)
        return content_tag(data)


_PROCESS_LOCK = threading.Lock()


class FsspecStore(Store):
    """Any other fsspec filesystem; conditional writes are check-then-write under a process lock."""

    def __init__(self, url: str, fs: Any, root: str, *, transfer: Transfer = DEFAULT_TRANSFER) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")
        self.transfer = transfer
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

    def put_new_stream(self, key: str, chunks: Iterable[Buffer], size: int, *, xxh3: str | None = None) -> None:
        """Streamed into a dot-named temporary object (fs.open, the filesystem's own buffering), checked,
        then moved into place after an exists-check under the process lock (as put_new). On memory:// the
        object lives in RAM anyway, and the move copies it once."""
        path = self._path(key)
        if self.fs.exists(path):
            raise ObjectExists(f"{self.url}/{key}: exists")
        checked = _Checked(f"{self.url}/{key}", chunks, size, xxh3, hashed=True)
        parent, _, name = path.rpartition("/")
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp"  # never listed (list skips dot-names), never a key
        self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(tmp, "wb") as f:
                for view in checked:
                    f.write(view)
            checked.finish()
            stored = int(self.fs.info(tmp).get("size") or 0)
            if stored != size:
                raise OSError(errno.EIO, f"{self.url}/{key}: the store took {stored} of {size} bytes; nothing was "
                                         f"created")
            with _PROCESS_LOCK:
                if self.fs.exists(path):
                    raise ObjectExists(f"{self.url}/{key}: exists")
                self.fs.mv(tmp, path)
        finally:
            try:
                self.fs.rm_file(tmp)
            except FileNotFoundError:
                pass

    def _size(self, key: str) -> int:
        try:
            return int(self.fs.info(self._path(key)).get("size") or 0)
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        """Ranged reads (cat_file with start/end) of the size the object had at the first read."""
        yield from self._chunks(key, self._size(key))

    def get_at_most(self, key: str, limit: int) -> bytes:
        """Ranged reads stopping at `limit`: never more than `limit` bytes fetched."""
        return b"".join(self._chunks(key, min(self._size(key), max(limit, 0))))

    def _read_mutable(self, key: str) -> bytes:
        """One read of the whole object (capped at MAX_MUTABLE_BYTES + 1): ranged reads could straddle a
        compare-and-swap and return bytes of two versions, which no writer stored."""
        try:
            if self._size(key) > MAX_MUTABLE_BYTES:
                return b"".join(self._chunks(key, MAX_MUTABLE_BYTES + 1))  # refused by its reader for its size
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None

    def download(self, key: str, fd: int, size: int | None = None) -> int:
        """iter_chunks written at their offsets, after the object's size is checked against `size`."""
        total = self._size(key)
        if size is not None and total != size:
            raise ValueError(f"{self.url}/{key}: {total} bytes, expected {size}")
        offset = 0
        for chunk in self._chunks(key, total):
            _pwrite_all(fd, chunk, offset)
            offset += len(chunk)
        return total

    def _chunks(self, key: str, size: int) -> Iterator[bytes]:
        path = self._path(key)
        done = 0
        while done < size:
            end = min(done + self.transfer.chunk_size, size)
            try:
                data = self.fs.cat_file(path, start=done, end=end)
            except FileNotFoundError:
                raise ObjectMissing(f"{self.url}/{key}: removed while read", key) from None
            if len(data) != end - done:
                raise ObjectChanged(f"{self.url}/{key}: bytes {done}-{end - 1} of {size} came as {len(data)} bytes "
                                    f"(changed while read)")
            done = end
            yield data

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
        root = self.root.strip("/")
        cut = len(root) + 1 if root else 0  # a store at the filesystem's root ("memory://") has no prefix to cut
        return {p.lstrip("/")[cut:]: int(info.get("size") or 0) for p, info in found.items()
                if info.get("type", "file") == "file" and not p.rpartition("/")[2].startswith(".")}

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        path = self._path(key)
        with _PROCESS_LOCK:
            current = self.read_object(key)
            current_tag = None if current is None else current.etag
            if current_tag != expected_etag:
                raise ConflictError(f"{self.url}/{key}: changed by another writer")
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(path, data)
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


_RESENDABLE = ("BadDigest", "IncompleteBody", "XAmzContentSHA256Mismatch", "InvalidChecksum")  # a part arrived damaged
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class _PartBody(io.RawIOBase):
    """A part's buffer as a seekable file, so botocore and aiohttp read it in small pieces (a bytes body is
    copied whole two or three times on its way to the socket) and rewind it for a retry."""

    def __init__(self, buf: bytearray) -> None:
        super().__init__()
        self._view = memoryview(buf)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._view)

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = min(max(base + offset, 0), len(self._view))
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(self._pos + size, len(self._view))
        out = bytes(self._view[self._pos:end])
        self._pos = end
        return out


class _BodyEnded(Exception):
    """A response body ended before the bytes its headers promised."""


def _multipart_etag(part_etags: list[str]) -> str | None:
    """The ETag S3 gives a multipart object (MD5 of the parts' MD5s, '-', the count), when every part's ETag
    is an MD5; None otherwise (SSE-KMS, other stores)."""
    digests = [e.strip('"') for e in part_etags]
    if not digests or not all(re.fullmatch(r"[0-9a-f]{32}", d) for d in digests):
        return None
    return f'"{hashlib.md5(bytes.fromhex("".join(digests)), usedforsecurity=False).hexdigest()}-{len(digests)}"'


class S3Store(Store):
    """s3:// prefix through s3fs (same endpoint and credentials as the storage_options give)."""

    def __init__(self, url: str, fs: Any, root: str, *, transfer: Transfer = DEFAULT_TRANSFER) -> None:
        self.url = url
        self.fs = fs
        self.root = root.strip("/")
        self.bucket, _, self.prefix = self.root.partition("/")
        self.transfer = transfer

    def has_container(self) -> bool:
        """HeadBucket: False on 404 (NoSuchBucket); any other failure is raised."""
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except FileNotFoundError:
            return False
        except OSError as exc:
            code, status = _client_error(exc)
            if status == 404 or code in ("404", "NoSuchBucket"):
                return False
            raise
        return True

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _get_object(self, key: str, **kw: Any) -> dict:
        return self.fs.call_s3("get_object", Bucket=self.bucket, Key=self._key(key), **kw)

    def _read_body(self, resp: dict, limit: int | None = None) -> bytes:
        """The response's body, or its first `limit` bytes (the rest is not read: the connection is closed)."""
        import fsspec.asyn

        async def read() -> bytes:
            try:
                if limit is None:
                    return await resp["Body"].read()
                out = bytearray()
                while len(out) < limit:
                    chunk = await resp["Body"].read(min(limit - len(out), self.transfer.chunk_size))
                    if not chunk:
                        break
                    out += chunk
                return bytes(out)
            finally:
                resp["Body"].close()

        return fsspec.asyn.sync(self.fs.loop, read)

    def _get_with_body(self, key: str, limit: int | None = None, **kw: Any) -> tuple[dict, bytes]:
        """GetObject and its body (its first `limit` bytes at most). s3fs retries the request but not the body
        that follows it, so a body that breaks off (a reset, a truncated response, a read timeout) is fetched
        again here, with s3fs's backoff."""
        from s3fs.core import S3_RETRYABLE_ERRORS

        for attempt in range(BODY_ATTEMPTS):
            resp = self._get_object(key, **kw)
            try:
                return resp, self._read_body(resp, limit)
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

    def get_at_most(self, key: str, limit: int) -> bytes:
        """One GET whose body is read no further than `limit` bytes (as read_object's)."""
        try:
            return self._get_with_body(key, limit)[1]
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None

    def capabilities(self) -> Capabilities:
        """What this store honours of the conditional writes (probed once per endpoint and bucket)."""
        return capabilities(self)

    def put_new(self, key: str, data: bytes | bytearray | BinaryIO) -> None:
        """PutObject If-None-Match: * of bytes or of a seekable file positioned at its start (S3's largest
        single PutObject; larger bytes go as put_new_stream)."""
        if not hasattr(data, "read") and len(data) > S3_MAX_PART:
            self.put_new_stream(key, [data], len(data))
            return
        self.capabilities().require(self.url)
        try:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
        except FileExistsError:
            raise ObjectExists(f"{self.url}/{key}: exists") from None
        except OSError as exc:
            code, status = _client_error(exc)
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise ObjectExists(f"{self.url}/{key}: exists ({code or status})") from None
            raise
        finally:
            self.fs.invalidate_cache(self._path(key))

    # -- large objects ---------------------------------------------------------------------------
    def put_new_stream(self, key: str, chunks: Iterable[Buffer], size: int, *, xxh3: str | None = None) -> None:
        """Up to `transfer.multipart_threshold` bytes: gathered (once, in one buffer) and created as put_new
        does, PutObject If-None-Match: *. Larger: a multipart upload that only its conditional completion
        makes visible (_multipart), or, on a store whose completion is not create-only, spooled (_spooled)."""
        where = f"{self.url}/{key}"
        if size <= self.transfer.multipart_threshold:
            checked = _Checked(where, chunks, size, xxh3, hashed=True)
            buf = bytearray(size)
            at = 0
            for view in checked:
                buf[at:at + len(view)] = view
                at += len(view)
            checked.finish()
            self.put_new(key, buf)
            return
        if not self.capabilities().create_only_completion:
            self._spooled(key, _Checked(where, chunks, size, xxh3, hashed=True), size)
            return
        self._multipart(key, _Checked(where, chunks, size, xxh3, hashed=False), size)

    def _spooled(self, key: str, checked: _Checked, size: int) -> None:
        """For a store that completes a multipart upload over an existing object whatever its If-None-Match
        says (Ceph RGW 16): a completion cannot create without replacing another writer's object, so the
        stream goes to an unlinked local file and then one create-only PutObject (which such a store does
        honour) creates the key from it. Memory holds a chunk; disk holds the object until the PUT ends.
        Above S3's largest PutObject there is no create-only way: StoreCapabilityError."""
        if size > S3_MAX_PART:
            raise StoreCapabilityError(
                f"{self.url}/{key}: {size} bytes, and the store at {self.capabilities().store} completes multipart "
                f"uploads over existing objects (CompleteMultipartUpload If-None-Match: * answered "
                f"{self.capabilities().complete_exists}): an object larger than one PutObject ({S3_MAX_PART} bytes) "
                f"cannot be created there without risking another writer's. Write smaller snapshot shards, or use "
                f"a store whose completion is create-only (AWS S3; docs/STORES.md)")
        if self._etag(key) is not None:  # the PUT's condition decides; this spares spooling in vain
            raise ObjectExists(f"{self.url}/{key}: exists")
        with tempfile.TemporaryFile(prefix="deltarelay-spool-", buffering=0) as f:
            for view in checked:
                write_all(f, view)
            checked.finish()
            f.seek(0)
            self.put_new(key, f)

    def _multipart(self, key: str, checked: _Checked, size: int) -> None:
        """CreateMultipartUpload; parts filled from the stream and uploaded on `threads` threads; each part's
        stored size and ETag checked (ListParts); CompleteMultipartUpload If-None-Match: *, so the object
        appears whole or not at all and never replaces another (412/409: ObjectExists). Any failure, the
        stream's own included, aborts the upload: nothing visible, no parts left behind."""
        where = f"{self.url}/{key}"
        if self._etag(key) is not None:  # the completion's condition decides; this spares uploading in vain
            raise ObjectExists(f"{where}: exists")
        part = self.transfer.part_size_for(size)
        uid = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self._key(key))["UploadId"]
        etags: dict[int, str] = {}
        try:
            digest = self._upload_parts(key, uid, checked, size, part, etags)
            checked.finish(digest)
            self._check_parts(key, uid, size, part, etags)
            self._complete(key, uid, etags)
        except BaseException:
            self._abort(key, uid)
            raise
        finally:
            self.fs.invalidate_cache(self._path(key))

    def _upload_parts(self, key: str, uid: str, checked: _Checked, size: int, part: int,
                      etags: dict[int, str]) -> str | None:
        """Copy the stream into part buffers (the bytes hashed are the bytes sent) and upload each on the
        pool; at most `threads` parts in flight plus the one being filled. Returns the stream's xxh3 when
        one was declared."""
        threads = self.transfer.threads
        digest = xxhash.xxh3_128() if checked.xxh3 is not None else None
        spare: list[bytearray] = []
        inflight: set[cf.Future[bytearray]] = set()
        number, fill = 0, 0
        buf: bytearray | None = None
        pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="s3-part")
        try:
            for view in checked:
                while view:
                    if buf is None:
                        while len(inflight) >= threads:
                            done, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
                            for fut in done:
                                inflight.discard(fut)
                                spare.append(fut.result())  # a part that failed for good raises here
                        length = min(part, size - number * part)
                        buf = spare.pop() if spare and len(spare[-1]) == length else bytearray(length)
                        if length < part:
                            spare.clear()  # the last part: no full buffer is needed again
                        fill = 0
                    n = min(len(view), len(buf) - fill)
                    buf[fill:fill + n] = view[:n]
                    fill, view = fill + n, view[n:]
                    if fill == len(buf):
                        number += 1
                        if digest is not None:
                            digest.update(buf)
                        inflight.add(pool.submit(self._upload_part, key, uid, number, buf, etags))
                        buf = None
            for fut in cf.as_completed(inflight):
                fut.result()
        finally:
            # on a failure no further part starts; those in flight end before the caller aborts the upload
            # (S3 keeps a part that lands after the abort)
            pool.shutdown(wait=True, cancel_futures=True)
        return digest.hexdigest() if digest is not None else None

    def _upload_part(self, key: str, uid: str, number: int, body: bytearray, etags: dict[int, str]) -> bytearray:
        """UploadPart, sent again on a transient failure or a body the store says arrived damaged (the part
        is in memory, so resending is safe). Returns the buffer for reuse."""
        for attempt in range(1, PART_ATTEMPTS + 1):
            try:
                with _PartBody(body) as reader:
                    resp = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self._key(key), UploadId=uid,
                                           PartNumber=number, Body=reader, ContentLength=len(body))
            except Exception as exc:
                if attempt == PART_ATTEMPTS or not (transient(exc) or _client_error(exc)[0] in _RESENDABLE):
                    raise
                log.info("%s/%s: part %d failed (%s); sending it again", self.url, key, number, exc)
                PART_BACKOFF.sleep(attempt)
                continue
            etags[number] = resp["ETag"]
            return body
        raise AssertionError("unreachable")

    def _check_parts(self, key: str, uid: str, size: int, part: int, etags: dict[int, str]) -> None:
        """ListParts against what was sent: a part stored with another size or ETag (a body torn on the way
        by a path without checksums) must never become part of an object, which no one could then repair."""
        stored: dict[int, tuple[int, str]] = {}
        marker: dict[str, int] = {}
        while True:
            resp = self.fs.call_s3("list_parts", Bucket=self.bucket, Key=self._key(key), UploadId=uid, **marker)
            for p in resp.get("Parts", []):
                stored[int(p["PartNumber"])] = (int(p["Size"]), p["ETag"].strip('"'))
            if not resp.get("IsTruncated"):
                break
            marker = {"PartNumberMarker": int(resp["NextPartNumberMarker"])}
        for number in range(1, len(etags) + 1):
            sent = (min(part, size - (number - 1) * part), etags[number].strip('"'))
            if stored.get(number) != sent:
                raise OSError(errno.EIO, f"{self.url}/{key}: multipart part {number} is stored as {stored.get(number)} "
                                         f"(size, ETag), sent {sent}: torn on the way; nothing was created")

    def _complete(self, key: str, uid: str, etags: dict[int, str]) -> None:
        parts: list[dict[str, Any]] = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        try:
            self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self._key(key), UploadId=uid,
                            MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except OSError as exc:
            code, status = _client_error(exc)
            if isinstance(exc, FileExistsError) or status in (409, 412) or code in (
                    "PreconditionFailed", "ConditionalRequestConflict"):
                expected = _multipart_etag([etags[n] for n in sorted(etags)])
                found = self._etag(key)
                if expected is not None and found == expected:
                    # a completion retried after the first one landed unanswered: the object is this upload
                    log.info("%s/%s: the multipart completion had landed before its retry", self.url, key)
                    return
                if found is None:  # refused, yet nothing there (409: a concurrent request): nothing was created
                    raise OSError(errno.EAGAIN, f"{self.url}/{key}: multipart completion refused ({code or status}) "
                                                f"and no object exists: nothing was created") from None
                raise ObjectExists(f"{self.url}/{key}: exists ({code or status} on completion)") from None
            raise

    def _abort(self, key: str, uid: str) -> None:
        try:
            self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self._key(key), UploadId=uid)
        except FileNotFoundError:
            pass  # NoSuchUpload: already gone
        except Exception as exc:  # noqa: BLE001 - the original failure is what the caller must see
            log.warning("%s/%s: could not abort multipart upload %s (%s); its parts are invisible but billed until "
                        "a lifecycle rule (AbortIncompleteMultipartUpload) removes them", self.url, key, uid, exc)

    def _etag(self, key: str) -> str | None:
        """The object's ETag, None if there is none (HeadObject)."""
        try:
            return self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._key(key))["ETag"]
        except FileNotFoundError:
            return None

    def _ranged(self, key: str, start: int, end: int, etag: str, total: int) -> dict:
        """GetObject of bytes [start, end) of the object's version `etag` (If-Match), its range checked."""
        try:
            resp = self._get_object(key, Range=f"bytes={start}-{end - 1}", IfMatch=etag)
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: removed while read", key) from None
        except OSError as exc:
            code, status = _client_error(exc)
            if status == 412 or code == "PreconditionFailed":
                raise ObjectChanged(f"{self.url}/{key}: replaced while read (its ETag is no longer {etag})") from None
            raise
        got = resp.get("ContentRange") or ""
        if got != f"bytes {start}-{end - 1}/{total}" or int(resp.get("ContentLength", -1)) != end - start:
            resp["Body"].close()
            raise ObjectChanged(f"{self.url}/{key}: asked for bytes {start}-{end - 1}/{total}, the store answered "
                                f"{got or 'no range'} ({resp.get('ContentLength')} bytes)")
        return resp

    def _piece(self, body: Any, n: int) -> bytes:
        """Up to `n` bytes of a response body (fewer only where it ended)."""
        import fsspec.asyn

        async def read() -> bytes:
            pieces, got = [], 0
            while got < n:
                data = await body.read(n - got)
                if not data:
                    break
                pieces.append(data)
                got += len(data)
            return b"".join(pieces)

        return fsspec.asyn.sync(self.fs.loop, read)

    def _span(self, key: str, start: int, end: int, etag: str, total: int,
              resp: dict | None = None) -> Generator[tuple[int, bytes], None, None]:
        """(offset, bytes) pieces of [start, end) of the version `etag`, at most chunk_size each, starting
        with the body of `resp` if given (already checked to cover the span). A body that breaks off (a reset,
        a read timeout, a truncated response) is asked for again from where it stopped, If-Match the same
        ETag; after BODY_ATTEMPTS breaks, an error: never a short span, never bytes of two versions."""
        from botocore.exceptions import IncompleteReadError
        from s3fs.core import S3_RETRYABLE_ERRORS

        pos, breaks = start, 0
        try:
            while pos < end:
                if resp is None:
                    resp = self._ranged(key, pos, end, etag, total)
                try:
                    while pos < end:
                        want = min(self.transfer.chunk_size, end - pos)
                        data = self._piece(resp["Body"], want)
                        if data:
                            yield pos, data
                            pos += len(data)
                        if len(data) < want:
                            raise _BodyEnded(f"the body ended at byte {pos}, the range at {end}")
                except (*S3_RETRYABLE_ERRORS, IncompleteReadError, _BodyEnded) as exc:
                    breaks += 1
                    if breaks >= BODY_ATTEMPTS:
                        raise OSError(errno.EIO, f"{self.url}/{key}: bytes {pos}-{end - 1} of {total}: the body broke "
                                                 f"off {breaks} times (last: {exc})") from exc
                    log.info("%s/%s: the response body broke off at byte %d (%s); fetching the rest again",
                             self.url, key, pos, exc)
                    BODY_BACKOFF.sleep(breaks)
                finally:
                    resp["Body"].close()
                    resp = None
        finally:
            if resp is not None:
                resp["Body"].close()

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        """One GetObject streamed in chunk_size pieces; a body that breaks off continues with ranged GETs
        If-Match its ETag (_span)."""
        try:
            resp = self._get_object(key)
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None
        total = int(resp["ContentLength"])
        for _, data in self._span(key, 0, total, resp["ETag"], total, resp):
            yield data

    def _first_range(self, key: str, span: int) -> tuple[dict, int, int]:
        """The first range's response, the object's size and where that response's body ends. The size
        comes from its Content-Range (an empty object, which has no range, from a plain GET; a store that
        ignores Range sends the whole body, and its Content-Length is the size)."""
        try:
            try:
                resp = self._get_object(key, Range=f"bytes=0-{span - 1}")
            except OSError as exc:
                code, status = _client_error(exc)
                if isinstance(exc, FileNotFoundError) or not (status == 416 or code == "InvalidRange"):
                    raise
                resp = self._get_object(key)  # 416: no byte 0, so the object is empty
                if int(resp["ContentLength"]) != 0:
                    resp["Body"].close()
                    raise ObjectChanged(f"{self.url}/{key}: refused bytes 0-{span - 1} as out of range, yet has "
                                        f"{resp['ContentLength']} bytes") from None
                return resp, 0, 0
        except FileNotFoundError:
            raise ObjectMissing(f"{self.url}/{key}: no such object", key) from None
        got = resp.get("ContentRange")
        if not got:
            total = int(resp["ContentLength"])
            return resp, total, total
        m = _CONTENT_RANGE.fullmatch(got)
        total = int(m.group(3)) if m else -1
        if m is None or int(m.group(1)) != 0 or int(m.group(2)) != min(span, total) - 1 or \
                int(resp.get("ContentLength", -1)) != min(span, total):
            resp["Body"].close()
            raise OSError(errno.EIO, f"{self.url}/{key}: asked for bytes 0-{span - 1}, the store answered {got!r} "
                                     f"({resp.get('ContentLength')} bytes)")
        return resp, total, min(span, total)

    def download(self, key: str, fd: int, size: int | None = None) -> int:
        """Ranges of `transfer.part_size`, `threads` at a time, each written with pwrite at its offset as
        it arrives (at most chunk_size per thread in memory). The first range's answer gives the object's
        size and ETag: another size than `size` is refused before anything is written, and every later
        range is asked If-Match that ETag, so an object replaced meanwhile is an error (ObjectChanged)."""
        t = self.transfer
        resp, total, first_end = self._first_range(key, t.part_size)
        if size is not None and total != size:
            resp["Body"].close()
            raise ValueError(f"{self.url}/{key}: {total} bytes, expected {size}")
        etag = resp["ETag"]
        stop = threading.Event()

        def fetch(start: int, end: int, first: dict | None) -> None:
            pieces = self._span(key, start, end, etag, total, first)
            try:
                for pos, data in pieces:
                    if stop.is_set():
                        return
                    _pwrite_all(fd, data, pos)
            finally:
                pieces.close()

        rest = [(a, min(a + t.part_size, total)) for a in range(first_end, total, t.part_size)]
        if not rest:
            fetch(0, first_end, resp)
            return total
        with cf.ThreadPoolExecutor(min(t.threads, 1 + len(rest)), thread_name_prefix="s3-range") as pool:
            futures = [pool.submit(fetch, 0, first_end, resp)] + [pool.submit(fetch, a, b, None) for a, b in rest]
            try:
                for fut in cf.as_completed(futures):
                    fut.result()
            except BaseException:
                stop.set()
                for fut in futures:
                    fut.cancel()
                if futures[0].cancelled():
                    resp["Body"].close()
                raise
        return total

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
    def read_object(self, key: str, if_none_match: None = None) -> ManifestRead | None: ...

    @overload
    def read_object(self, key: str, if_none_match: str | None) -> ManifestRead | None | Unchanged: ...

    def read_object(self, key: str, if_none_match: str | None = None) -> ManifestRead | None | Unchanged:
        kw = {"IfNoneMatch": if_none_match} if if_none_match else {}
        try:
            resp, body = self._get_with_body(key, MAX_MUTABLE_BYTES + 1, **kw)
        except FileNotFoundError:
            return None
        except OSError as exc:
            code, status = _client_error(exc)
            if status == 304 or code in ("304", "NotModified"):
                return NOT_MODIFIED
            raise
        return ManifestRead(body, resp["ETag"])

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        """PutObject If-Match the ETag, in the form the store takes (If-None-Match: * for none). A refusal is
        another writer's doing only if the object changed: one that still has `expected_etag` means the
        store refused a valid condition, StoreCapabilityError (retrying could never help)."""
        caps = self.capabilities()
        caps.require(self.url)
        cond = {"IfMatch": caps.if_match(expected_etag)} if expected_etag else {"IfNoneMatch": "*"}
        try:
            resp = self.fs.call_s3("put_object", Bucket=self.bucket, Key=self._key(key), Body=data,
                                   ContentType="application/json", **cond)
        except (OSError, FileExistsError) as exc:
            code, status = _client_error(exc)
            if isinstance(exc, FileExistsError) or status in (409, 412) or code in (
                    "PreconditionFailed", "ConditionalRequestConflict"):
                cond_text = f"If-Match {cond['IfMatch']}" if expected_etag else "If-None-Match *"
                found = self._etag(key)
                if expected_etag and found is not None and found.strip('"') == expected_etag.strip('"'):
                    raise StoreCapabilityError(
                        f"{self.url}/{key}: the store at {caps.store} refused a conditional write ({code or status} on "
                        f"{cond_text}) although the object still has that ETag: a store capability problem, not "
                        f"another writer (probed: {caps.if_match_form} If-Match; docs/STORES.md)") from None
                if expected_etag and found is None:
                    raise ConflictError(f"{self.url}/{key}: removed by another writer ({code or status} on "
                                        f"{cond_text})") from None
                raise ConflictError(f"{self.url}/{key}: changed by another writer "
                                    f"({code or status} on {cond_text})") from None
            if isinstance(exc, FileNotFoundError) and expected_etag:  # If-Match on a deleted object
                raise ConflictError(f"{self.url}/{key}: removed by another writer") from None
            raise
        self.fs.invalidate_cache(self._path(key))
        return resp["ETag"]


_SCHEME_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(:|//)")
_NAMELESS_OK = ("file", "local", "memory")  # schemes whose URL may have no bucket or host after "://"


def check_url(url: str) -> str:
    """`url` as open_store reads it (a plain path made a file:// URL), or ValueError naming it and why.

    A typo must not become a local path that a watcher then waits on forever, so a path without
    "://" whose first component looks like a scheme ('s3//bucket/run', 's3:/bucket', 'gs:bucket') is
    refused: write './s3//x' for such a local directory. A scheme must be one fsspec knows, and a
    scheme other than file, local or memory needs a bucket or host ('s3://' and 's3:///run' are refused)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"store URL {url!r}: empty")
    if "://" not in url:
        if _SCHEME_LIKE.match(url):
            meant = re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*)(:/*|//)", r"\1://", url)
            raise ValueError(f"store URL {url!r}: looks like a mistyped URL (did you mean {meant!r}?); "
                             f"a local directory of that name is written './{url}'")
        return "file://" + os.path.abspath(url)
    for part in url.split("::"):  # fsspec chains such as 'simplecache::s3://bucket/run'
        scheme, sep, rest = part.partition("://")
        try:
            fsspec.get_filesystem_class(scheme)
        except ValueError:
            raise ValueError(f"store URL {url!r}: unknown scheme {scheme!r} "
                             f"(s3://bucket/prefix, file:///path, memory://name, or another fsspec protocol)") from None
        except ImportError as exc:
            raise ValueError(f"store URL {url!r}: scheme {scheme!r} needs a package not installed ({exc})") from None
        if sep and scheme not in _NAMELESS_OK and not rest.split("/")[0]:
            raise ValueError(f"store URL {url!r}: no bucket or host after {scheme}://")
    return url


def open_store(url: str, storage_options: dict | None = None, *, transfer: Transfer | None = None) -> Store:
    """The Store for a run prefix such as 's3://bucket/run', 'file:///path/run' or 'memory://run'.

    `storage_options` go to fsspec, except `"transfer"`: the fields of a Transfer (how large objects
    move), used unless `transfer` is given. Malformed URLs are refused (check_url)."""
    url = check_url(url)
    options = dict(storage_options or {})
    if "transfer" in options:
        asked = Transfer.from_options(options.pop("transfer"))
        transfer = transfer or asked
    transfer = transfer or DEFAULT_TRANSFER
    fs, root = fsspec.core.url_to_fs(url, **options)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    url = url.rstrip("/")
    if "s3" in protocols or "s3a" in protocols:
        return S3Store(url, fs, root, transfer=transfer)
    if "file" in protocols or "local" in protocols:
        return LocalStore(url, root, transfer=transfer)
    return FsspecStore(url, fs, root, transfer=transfer)


__all__ = ["Store", "open_store", "check_url", "Transfer", "transient", "unsure_write", "UNSURE_ATTEMPTS",
           "ConflictError",
           "ObjectMissing", "ObjectExists", "ObjectChanged", "ManifestRead", "NOT_MODIFIED", "NotModified",
           "MANIFEST_KEY", "content_tag", "StoreCapabilityError"]
