"""The payload container: fixed prefix, checksummed zstd-compressed index, concatenated streams.

Layout and every field are specified in docs/FORMAT.md. This module knows nothing about how a
tensor's streams are produced; methods (codec/methods/) do.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import xxhash
import zstandard

from . import tensors
from .errors import DeltaError
from .hashing import DIGEST_SIZE
from .wire import Reader, Writer

MAGIC = b"DRDELTA\x00"
PREFIX = struct.Struct("<8sHHI16s")  # magic, version, flags, index length, checksum
PREFIX_SIZE = PREFIX.size  # 32
SUPPORTED_VERSIONS = (1, 2, 3)
CURRENT_VERSION = 3

MAX_INDEX_BYTES = 256 << 20
MAX_TENSORS = 1 << 20
MAX_NAME_BYTES = 1 << 16
MAX_NDIM = 32
MAX_NUMEL = 1 << 48
MAX_STREAMS = 64
MAX_PARAMS = 1 << 20
MAX_SHARED = 1 << 24


@dataclass
class Stream:
    codec: int
    raw_len: int
    stored: bytes | memoryview


@dataclass
class Entry:
    """One tensor's record in the index."""

    name: str
    dtype: tensors.DType
    shape: tuple[int, ...]
    method: int
    changes: int  # changed elements; decoders check their patch against it
    base_digest: bytes
    target_digest: bytes
    params: bytes = b""
    streams: list[Stream] = field(default_factory=list)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Payload:
    version: int
    entries: list[Entry]
    shared: dict[int, bytes]  # method-wide parameters (e.g. v2 value tables), keyed by kind

    @property
    def body_size(self) -> int:
        return sum(len(s.stored) for e in self.entries for s in e.streams)


def pack(payload: Payload) -> bytes:
    if payload.version not in SUPPORTED_VERSIONS:
        raise ValueError(f"cannot write format version {payload.version}")
    w = Writer()
    w.uvarint(len(payload.entries))
    for e in payload.entries:
        w.blob(e.name.encode("utf-8"))
        w.u8(e.dtype.code)
        w.uvarint(len(e.shape))
        for d in e.shape:
            w.uvarint(d)
        w.u8(e.method)
        w.uvarint(e.changes)
        w.raw(e.base_digest)
        w.raw(e.target_digest)
        w.blob(e.params)
        w.uvarint(len(e.streams))
        for s in e.streams:
            w.u8(s.codec)
            w.uvarint(s.raw_len)
            w.uvarint(len(s.stored))
    w.uvarint(len(payload.shared))
    for kind in sorted(payload.shared):
        w.u8(kind)
        w.blob(payload.shared[kind])
    index = zstandard.ZstdCompressor(level=9).compress(w.getvalue())
    body = b"".join(bytes(s.stored) for e in payload.entries for s in e.streams)
    rest = index + body
    head = PREFIX.pack(MAGIC, payload.version, 0, len(index), bytes(16))[:16]
    return head + checksum(head, rest) + rest


def checksum(head: bytes | memoryview, rest: bytes | memoryview) -> bytes:
    """xxh3-128 over the prefix's first 16 bytes (magic, version, flags, index length) and
    everything after the prefix: no byte of a payload escapes it."""
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(rest)
    return h.digest()


def unpack(data: bytes | bytearray | memoryview) -> Payload:
    """Parse and validate a payload's structure; no tensor is decoded here."""
    view = memoryview(data)
    if len(view) < PREFIX_SIZE:
        raise DeltaError(f"truncated payload: {len(view)} bytes, the prefix alone is {PREFIX_SIZE}")
    magic, version, flags, index_len, declared = PREFIX.unpack(view[:PREFIX_SIZE])
    if magic != MAGIC:
        raise DeltaError("not a deltarelay payload (bad magic)")
    if version not in SUPPORTED_VERSIONS:
        raise DeltaError(f"format version {version} is not supported (this decoder reads {SUPPORTED_VERSIONS})")
    if flags != 0:
        raise DeltaError(f"unknown flags {flags:#x} in the prefix")
    rest = view[PREFIX_SIZE:]
    if checksum(view[:16], rest) != declared:
        raise DeltaError("payload checksum mismatch: the payload is corrupt or truncated")
    if index_len > len(rest):
        raise DeltaError(f"index length {index_len} exceeds the payload")
    try:
        frame = bytes(rest[:index_len])
        # decompress() allocates the size a frame header declares, ignoring max_output_size
        if zstandard.frame_content_size(frame) > MAX_INDEX_BYTES:
            raise DeltaError(f"index declares more than {MAX_INDEX_BYTES} bytes")
        raw_index = zstandard.ZstdDecompressor().decompress(frame, max_output_size=MAX_INDEX_BYTES)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"index is corrupt ({exc})") from None
    r = Reader(raw_index, "index")
    entries: list[Entry] = []
    body_pos = index_len
    n = r.uvarint(MAX_TENSORS)
    names = set()
    for _ in range(n):
        try:
            name = r.blob(MAX_NAME_BYTES).decode("utf-8")
        except UnicodeDecodeError:
            raise DeltaError("tensor name is not valid UTF-8") from None
        if name in names:
            raise DeltaError("tensor appears twice in the index", tensor=name)
        names.add(name)
        try:  # index-level refusals inside a record name its tensor
            code = r.u8()
            if code not in tensors.BY_CODE:
                raise DeltaError(f"unknown dtype code {code}", tensor=name)
            ndim = r.uvarint(MAX_NDIM)
            shape = tuple(r.uvarint(MAX_NUMEL) for _ in range(ndim))
            numel = 1
            for d in shape:
                numel *= d
            if numel > MAX_NUMEL:
                raise DeltaError(f"shape {shape} is too large", tensor=name)
            method = r.u8()
            changes = r.uvarint(numel)
            base_digest = r.raw(DIGEST_SIZE)
            target_digest = r.raw(DIGEST_SIZE)
            params = r.blob(MAX_PARAMS)
            streams = []
            for _ in range(r.uvarint(MAX_STREAMS)):
                codec = r.u8()
                raw_len = r.uvarint()
                stored_len = r.uvarint()
                if body_pos + stored_len > len(rest):
                    raise DeltaError("stream runs past the end of the payload", tensor=name)
                streams.append(Stream(codec, raw_len, rest[body_pos : body_pos + stored_len]))
                body_pos += stored_len
            entries.append(Entry(name, tensors.BY_CODE[code], shape, method, changes, base_digest, target_digest, params, streams))
        except DeltaError as exc:
            if exc.tensor is not None:
                raise
            raise DeltaError(exc.reason, tensor=name) from None
    shared = {}
    for _ in range(r.uvarint(255)):
        kind = r.u8()
        shared[kind] = r.blob(MAX_SHARED)
    r.expect_end()
    if body_pos != len(rest):
        raise DeltaError(f"{len(rest) - body_pos} bytes after the last stream")
    return Payload(version, entries, shared)
