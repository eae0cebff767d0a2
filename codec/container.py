"""The payload container: fixed prefix, checksummed zstd-compressed index, concatenated streams.

Layout and every field are specified in docs/FORMAT.md. This module knows nothing about how a
tensor's streams are produced; methods (codec/methods/) do.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numba as nb
import numpy as np
import xxhash
import zstandard

from . import tensors
from .errors import DeltaError
from .hashing import DIGEST_SIZE
from .wire import Reader, Writer, put_uvarint

MAGIC = b"DRDELTA\x00"
PREFIX = struct.Struct("<8sHHI16s")  # magic, version, flags, index length, checksum
PREFIX_SIZE = PREFIX.size  # 32
SUPPORTED_VERSIONS = (1, 2, 3, 4)
CURRENT_VERSION = 4

MAX_INDEX_BYTES = 256 << 20
# The decompressed index may exceed its zstd frame by at most this ratio (beyond INDEX_FLOOR_BYTES,
# always allowed): every entry carries 32 bytes of digests that do not compress, so real indexes
# come out at 1.5-5x; a frame that claims more is a decompression bomb, refused before it allocates.
MAX_INDEX_RATIO = 64
INDEX_FLOOR_BYTES = 1 << 20
MIN_ENTRY_BYTES = 39  # name length, dtype, ndim, method, changes, two digests, params length, stream count
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


def index_limit(frame_len: int) -> int:
    """The most bytes a zstd frame of `frame_len` bytes may decompress to as an index (docs/FORMAT.md)."""
    return min(MAX_INDEX_BYTES, max(INDEX_FLOOR_BYTES, MAX_INDEX_RATIO * frame_len))


def pack(payload: Payload, *, compiled: bool = True) -> bytes:
    """The payload's bytes; with compiled=False the index is written field by field in Python (the
    same bytes, for callers that must not wait for a kernel to compile: codec/interim.py)."""
    if payload.version not in SUPPORTED_VERSIONS:
        raise ValueError(f"cannot write format version {payload.version}")
    raw = _index_bytes(payload) if compiled else _index_bytes_reference(payload)
    # level 3: within 1.2% of level 9's size on a model's index (its digests do not compress), 4x faster
    index = zstandard.ZstdCompressor(level=3).compress(raw)
    if len(raw) > index_limit(len(index)):  # never write what a decoder refuses
        raise ValueError(f"index of {len(raw)} bytes ({len(index)} compressed) exceeds the decoder's limit "
                         f"of {index_limit(len(index))} (MAX_INDEX_BYTES, MAX_INDEX_RATIO)")
    body = b"".join(bytes(s.stored) for e in payload.entries for s in e.streams)
    rest = index + body
    head = PREFIX.pack(MAGIC, payload.version, 0, len(index), bytes(16))[:16]
    return head + checksum(head, rest) + rest


def _index_bytes(payload: Payload) -> bytes:
    """The raw index (docs/FORMAT.md), written in one compiled pass from per-entry columns
    (a Python call per field costs more than the rest of a small payload's encode)."""
    entries = payload.entries
    names = [e.name.encode("utf-8") for e in entries]
    blobs = b"".join(b"".join((nm, e.base_digest, e.target_digest, e.params)) for nm, e in zip(names, entries))
    if any(len(e.base_digest) != DIGEST_SIZE or len(e.target_digest) != DIGEST_SIZE for e in entries):
        raise ValueError("digests must be 16 bytes")
    cols = np.array([(len(nm), e.dtype.code, len(e.shape), e.method, e.changes, len(e.params), len(e.streams))
                     for nm, e in zip(names, entries)], np.int64).reshape(-1, 7)
    dims = np.array([d for e in entries for d in e.shape], np.int64)
    streams = np.array([(s.codec, s.raw_len, len(s.stored)) for e in entries for s in e.streams],
                       np.int64).reshape(-1, 3)
    kinds = sorted(payload.shared)
    shared = b"".join(payload.shared[k] for k in kinds)
    shared_cols = np.array([(k, len(payload.shared[k])) for k in kinds], np.int64).reshape(-1, 2)
    if (cols.size and cols.min() < 0) or (dims.size and dims.min() < 0) or (streams.size and streams.min() < 0):
        raise ValueError("index fields must be non-negative")
    if (cols.size and max(cols[:, 1].max(), cols[:, 3].max()) > 255) or (streams.size and streams[:, 0].max() > 255) \
            or any(not 0 <= k <= 255 for k in kinds):
        raise ValueError("dtype, method, stream codec and shared kind codes are bytes")
    return _write_index(np.frombuffer(blobs, np.uint8), cols, dims, streams, np.frombuffer(shared, np.uint8),
                        shared_cols).tobytes()


@nb.njit(cache=True, nogil=True)
def _write_index(blobs, cols, dims, streams, shared, shared_cols):
    out = np.empty(blobs.size + shared.size + 10 * (1 + cols.size + 2 * cols.shape[0] + dims.size + streams.size
                                                    + 2 * shared_cols.size), np.uint8)
    n = put_uvarint(out, 0, cols.shape[0])
    b = 0
    d = 0
    s = 0
    for i in range(cols.shape[0]):
        name_len, code, ndim, method, changes, params_len, nstreams = cols[i]
        n = put_uvarint(out, n, name_len)
        for j in range(name_len):  # loops, not slice assignments (codec/_warmup.py says why)
            out[n + j] = blobs[b + j]
        n += name_len
        b += name_len
        out[n] = code
        n = put_uvarint(out, n + 1, ndim)
        for _ in range(ndim):
            n = put_uvarint(out, n, dims[d])
            d += 1
        out[n] = method
        n = put_uvarint(out, n + 1, changes)
        for j in range(2 * DIGEST_SIZE):
            out[n + j] = blobs[b + j]
        n += 2 * DIGEST_SIZE
        b += 2 * DIGEST_SIZE
        n = put_uvarint(out, n, params_len)
        for j in range(params_len):
            out[n + j] = blobs[b + j]
        n += params_len
        b += params_len
        n = put_uvarint(out, n, nstreams)
        for _ in range(nstreams):
            out[n] = streams[s, 0]
            n = put_uvarint(out, n + 1, streams[s, 1])
            n = put_uvarint(out, n, streams[s, 2])
            s += 1
    n = put_uvarint(out, n, shared_cols.shape[0])
    b = 0
    for k in range(shared_cols.shape[0]):
        out[n] = shared_cols[k, 0]
        n = put_uvarint(out, n + 1, shared_cols[k, 1])
        for j in range(shared_cols[k, 1]):
            out[n + j] = shared[b + j]
        n += shared_cols[k, 1]
        b += shared_cols[k, 1]
    return out[:n]


def _index_bytes_reference(payload: Payload) -> bytes:
    """The index written field by field (the specification `_index_bytes` is tested against)."""
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
    return w.getvalue()


def checksum(head: bytes | memoryview, rest: bytes | memoryview) -> bytes:
    """xxh3-128 over the prefix's first 16 bytes (magic, version, flags, index length) and
    everything after the prefix: no byte of a payload escapes it."""
    h = xxhash.xxh3_128()
    h.update(head)
    h.update(rest)
    return h.digest()


def unpack(data: bytes | bytearray | memoryview, *, compiled: bool = True, max_entries: int | None = None) -> Payload:
    """Parse and validate a payload's structure; no tensor is decoded here. With compiled=False the
    index is parsed in Python only (the same result; no kernel runs, none waits to compile).
    `max_entries`: refuse an index listing more tensors, before any entry is parsed (a decoder that
    needs every tensor named passes a bound from its base's count: an index of 2**20 minimal entries, 860 KB, took
    4.3 s and ~830 MiB to parse before its names were found not to be the base's).

    Every refusal is a DeltaError, running out of memory included (a payload this machine cannot
    parse is one it cannot use)."""
    try:
        return _unpack(data, compiled, max_entries)
    except MemoryError:
        raise DeltaError("the payload's index needs more memory than is available") from None


def _unpack(data: bytes | bytearray | memoryview, compiled: bool = True, max_entries: int | None = None) -> Payload:
    # read-only whatever the caller's buffer (bytes, bytearray, mmap): the kernels' arrays over
    # the streams then have one type, so no kernel compiles a second time for a writable buffer
    view = memoryview(data).toreadonly()
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
    limit = index_limit(index_len)
    claimed = -1  # the frame's declared content size; -1 while unknown
    try:
        frame = bytes(rest[:index_len])
        # decompress() allocates the size a frame header declares, ignoring max_output_size; without a
        # declared size it allocates max_output_size and fails beyond it
        claimed = zstandard.frame_content_size(frame)
        if claimed > limit:
            raise DeltaError(f"index declares {claimed} bytes from a {index_len}-byte frame, more than the "
                             f"{limit} a decoder accepts (MAX_INDEX_BYTES, MAX_INDEX_RATIO)")
        raw_index = zstandard.ZstdDecompressor().decompress(frame, max_output_size=limit)
    except zstandard.ZstdError as exc:
        beyond = f", or inflates past the {limit} bytes a decoder accepts from it" if claimed < 0 else ""
        raise DeltaError(f"index is corrupt ({exc}){beyond}") from None
    if max_entries is not None:
        try:
            listed = Reader(raw_index, "index").uvarint()
        except DeltaError:  # malformed: the parse below names it
            listed = 0
        if listed > max_entries:
            raise DeltaError(f"the index lists {listed} tensors, more than the {max_entries} this decoder accepts")
    fast = _entries_fast(raw_index, rest, index_len) if compiled else None
    if fast is not None:
        return Payload(version, *fast)
    return Payload(version, *_entries_checked(raw_index, rest, index_len))


def _entries_fast(raw_index: bytes, rest: memoryview, index_len: int) -> tuple[list[Entry], dict[int, bytes]] | None:
    """(entries, shared) of a well-formed index, parsed in one compiled pass; None at the first
    doubt, and `_entries_checked` then parses it again and names the fault."""
    raw = np.frombuffer(raw_index, np.uint8)
    status, cols, dims, streams, shared_cols = _scan_index(raw, len(rest) - index_len, _DTYPE_ELEMENTS)
    if status:
        return None
    entries = []
    names = set()
    d = s = 0
    for name_off, name_len, code, ndim, method, changes, digest_off, params_off, params_len, nstreams in cols.tolist():
        try:
            name = raw_index[name_off:name_off + name_len].decode("utf-8")
        except UnicodeDecodeError:
            return None
        if name in names:
            return None
        names.add(name)
        shape = tuple(dims[d:d + ndim].tolist())
        d += ndim
        parts = []
        for codec, raw_len, stored_off, stored_len in streams[s:s + nstreams].tolist():
            at = index_len + stored_off
            parts.append(Stream(codec, raw_len, rest[at:at + stored_len]))
        s += nstreams
        entries.append(Entry(name, tensors.BY_CODE[code], shape, method, changes,
                             raw_index[digest_off:digest_off + DIGEST_SIZE],
                             raw_index[digest_off + DIGEST_SIZE:digest_off + 2 * DIGEST_SIZE],
                             raw_index[params_off:params_off + params_len], parts))
    shared = {kind: raw_index[off:off + length] for kind, off, length in shared_cols.tolist()}
    return entries, shared


# per dtype code: elements per item (C128: two u64 halves; `changes` counts elements), 0 for no dtype
_DTYPE_ELEMENTS = np.array([tensors.elements_per_item(tensors.BY_CODE[code]) if code in tensors.BY_CODE else 0
                            for code in range(256)], np.int64)


@nb.njit(inline="always", cache=True)  # inlined: called with ten literal limits, it compiled ten times
def _uvarint(raw, pos, limit):
    """(value, next position, ok) of the varint at raw[pos], ok only if it is complete, at most
    63 bits and <= limit (the Reader's checks)."""
    value = np.int64(0)  # int64 as numba infers it for 0 too; written out for the type checker
    shift = 0
    while pos < raw.size:
        byte = np.int64(raw[pos])
        pos += 1
        if shift == 63 and byte > 0:  # 2**63 or more: beyond every limit
            return 0, pos, False
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos, value <= limit
        shift += 7
        if shift > 63:
            return 0, pos, False
    return 0, pos, False


@nb.njit(cache=True, nogil=True)
def _scan_index(raw, body_len, dtype_elements):
    """The index's fields as columns: (status, per entry (name offset, name length, dtype code,
    ndim, method, changes, digests offset, params offset, params length, streams), dims, per
    stream (codec, raw_len, body offset, stored length), per shared block (kind, offset, length)).
    Status 1 at any fault (left to `_entries_checked` to name), else 0.

    Allocations follow what the index can hold, not what it claims: an entry takes at least
    MIN_ENTRY_BYTES, and each dim (one byte) and stream (three) comes out of what is left, so an
    impossible entry count is refused before anything is allocated; dims and streams grow by
    doubling as they are read, so a bad index is refused having allocated about what it held."""
    empty = np.zeros((0, 10), np.int64)
    n, pos, ok = _uvarint(raw, 0, MAX_TENSORS)
    spare = raw.size - pos - 1 - n * MIN_ENTRY_BYTES  # the shared count takes a byte
    if not ok or spare < 0:
        return 1, empty, np.zeros(0, np.int64), np.zeros((0, 4), np.int64), np.zeros((0, 3), np.int64)
    max_dims = min(n * MAX_NDIM, spare)
    max_streams = min(n * MAX_STREAMS, spare // 3)
    cols = np.empty((n, 10), np.int64)
    dims = np.empty(min(max_dims, 2 * n + 16), np.int64)
    streams = np.empty((min(max_streams, 4 * n + 16), 4), np.int64)
    shared = np.empty((255, 3), np.int64)
    nd = ns = 0
    body = 0
    for i in range(n):
        name_len, pos, ok = _uvarint(raw, pos, MAX_NAME_BYTES)
        if not ok or pos + name_len + 1 > raw.size:
            return 1, cols, dims, streams, shared
        cols[i, 0] = pos
        cols[i, 1] = name_len
        pos += name_len
        code = raw[pos]
        pos += 1
        if dtype_elements[code] == 0:
            return 1, cols, dims, streams, shared
        cols[i, 2] = code
        ndim, pos, ok = _uvarint(raw, pos, MAX_NDIM)
        if not ok:
            return 1, cols, dims, streams, shared
        cols[i, 3] = ndim
        numel = 1  # saturating at MAX_NUMEL + 1; a zero dim makes it 0 whatever came before
        zero = False
        for _ in range(ndim):
            dim, pos, ok = _uvarint(raw, pos, MAX_NUMEL)
            if not ok:
                return 1, cols, dims, streams, shared
            if nd == dims.size:
                if nd >= max_dims:
                    return 1, cols, dims, streams, shared
                grown = np.empty(min(2 * nd + 16, max_dims), np.int64)
                for j in range(nd):  # a loop, not a slice assignment (codec/_warmup.py says why)
                    grown[j] = dims[j]
                dims = grown
            dims[nd] = dim
            nd += 1
            if dim == 0:
                zero = True
            elif numel > MAX_NUMEL // dim:
                numel = MAX_NUMEL + 1
            else:
                numel *= dim
        if zero:
            numel = 0
        if numel > MAX_NUMEL or pos >= raw.size:
            return 1, cols, dims, streams, shared
        cols[i, 4] = raw[pos]
        pos += 1
        changes, pos, ok = _uvarint(raw, pos, numel * dtype_elements[code])
        if not ok or pos + 2 * DIGEST_SIZE > raw.size:
            return 1, cols, dims, streams, shared
        cols[i, 5] = changes
        cols[i, 6] = pos
        pos += 2 * DIGEST_SIZE
        params_len, pos, ok = _uvarint(raw, pos, MAX_PARAMS)
        if not ok or pos + params_len > raw.size:
            return 1, cols, dims, streams, shared
        cols[i, 7] = pos
        cols[i, 8] = params_len
        pos += params_len
        nstreams, pos, ok = _uvarint(raw, pos, MAX_STREAMS)
        if not ok:
            return 1, cols, dims, streams, shared
        cols[i, 9] = nstreams
        for _ in range(nstreams):
            if pos >= raw.size:
                return 1, cols, dims, streams, shared
            if ns == streams.shape[0]:
                if ns >= max_streams:
                    return 1, cols, dims, streams, shared
                more = np.empty((min(2 * ns + 16, max_streams), 4), np.int64)
                for j in range(ns):
                    for c in range(4):
                        more[j, c] = streams[j, c]
                streams = more
            streams[ns, 0] = raw[pos]
            raw_len, pos, ok = _uvarint(raw, pos + 1, (1 << 63) - 1)
            if not ok:
                return 1, cols, dims, streams, shared
            stored_len, pos, ok = _uvarint(raw, pos, (1 << 63) - 1)
            if not ok or stored_len > body_len - body:
                return 1, cols, dims, streams, shared
            streams[ns, 1] = raw_len
            streams[ns, 2] = body
            streams[ns, 3] = stored_len
            body += stored_len
            ns += 1
    nshared, pos, ok = _uvarint(raw, pos, 255)
    if not ok or nshared > shared.shape[0]:
        return 1, cols, dims, streams, shared
    for k in range(nshared):
        if pos >= raw.size:
            return 1, cols, dims, streams, shared
        shared[k, 0] = raw[pos]
        length, pos, ok = _uvarint(raw, pos + 1, MAX_SHARED)
        if not ok or pos + length > raw.size:
            return 1, cols, dims, streams, shared
        shared[k, 1] = pos
        shared[k, 2] = length
        pos += length
    if pos != raw.size or body != body_len:
        return 1, cols, dims, streams, shared
    return 0, cols, dims[:nd], streams[:ns], shared[:nshared]


def _entries_checked(raw_index: bytes, rest: memoryview, index_len: int) -> tuple[list[Entry], dict[int, bytes]]:
    """(entries, shared) parsed field by field, every fault a DeltaError naming its tensor."""
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
            numel = spanned = 1  # spanned: the non-zero dims' product, bounded as the compiled parser does
            for d in shape:
                numel *= d
                spanned *= max(d, 1)
            if spanned > MAX_NUMEL:
                raise DeltaError(f"shape {shape} is too large", tensor=name)
            method = r.u8()
            changes = r.uvarint(numel * tensors.elements_per_item(tensors.BY_CODE[code]))  # C128: two per item
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
            entries.append(Entry(name, tensors.BY_CODE[code], shape, method, changes, base_digest, target_digest,
                                 params, streams))
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
    return entries, shared
