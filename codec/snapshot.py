"""Compressed snapshot objects (`DRSN`, docs/FORMAT.md "Snapshot objects"): a whole checkpoint
entropy-coded without a base.

Snapshots are most of the bytes that cross regions, and a BF16 exponent carries ~2.6 of its 8
bits: BF16 tensors (and, from version 4, F16 ones) have their exponents rANS-coded (`snapshot_rans`),
every other dtype goes through zstd or is stored, so every dtype round-trips bit for bit.

The object streams both ways: tensor records back to back (each a checksummed head, then its
blocks of at most 4 MiB), then an index and a fixed trailer. An encoder holds one tensor's output
at a time; a decoder walks records front to back (a pipe will do) and holds one tensor, or, on
a seekable source, reads the trailer's index and seeks straight to the tensors it wants. Every
tensor carries the codec's xxh3-128 tensor digest (`hashing`), checked before it is yielded.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, BinaryIO

import numpy as np
import torch
import xxhash

from . import compressors, hashing, rans, snapshot_rans, tensors, wire
from .errors import DeltaError
from .snapshot_rans import (KIND_BF16, KIND_BF16_GROUPS, KIND_BF16_PAIRS, KIND_RAW, KIND_ZSTD, RESIDUAL_RAW,
                            RESIDUAL_ZSTD)

MAGIC = b"DRSN"
VERSION = 4  # what the encoder writes; v2 adds block kind 3 (BF16 exponents, 8 states), v3 kind 4 (pairs), v4 F16
VERSIONS = (1, 2, 3, 4)  # what the decoder reads
PREFIX = struct.Struct("<4sHH")  # magic, version, flags
TRAILER = struct.Struct("<QII8s8s")  # index offset, index length, reserved, index checksum, magic
TAIL_MAGIC = b"DRSNTAIL"
TAG_RECORD, TAG_INDEX = 1, 2
BF16_KINDS = {1: (KIND_BF16,), 2: (KIND_BF16, KIND_BF16_GROUPS),
              3: (KIND_BF16, KIND_BF16_GROUPS, KIND_BF16_PAIRS),
              4: (KIND_BF16, KIND_BF16_GROUPS, KIND_BF16_PAIRS)}  # the BF16 block kinds of each version
F16_FROM = 4  # from this version the BF16 kinds code F16 records too (their 16-bit patterns, as BF16's)


def exponent_coded(dt: tensors.DType, version: int) -> bool:
    """Whether records of `dt` take the BF16 block kinds (2-4) in a `version` object: BF16 always, F16 from
    F16_FROM (its top byte after the sign, 5 exponent and 3 mantissa bits, is coded as BF16's exponent)."""
    return dt is tensors.BF16 or (dt is tensors.F16 and version >= F16_FROM)

BF16_BLOCK_ELEMS = 1 << 18  # 512 KiB of output: per-block tables follow local statistics
OTHER_BLOCK_BYTES = 1 << 20
MIN_ZSTD_BLOCK_BYTES = 1 << 10  # a zstd-coded block (kind 1, or a zstd residual plane) but a record's last covers this
MAX_BLOCK_BYTES = 1 << 22  # block_elems * itemsize
MAX_HEAD = 1 << 24
MAX_INDEX = 1 << 28
MAX_TENSORS = 1 << 20
MAX_NAME, MAX_NDIM, MAX_NUMEL = snapshot_rans.MAX_NAME, snapshot_rans.MAX_NDIM, snapshot_rans.MAX_NUMEL  # one source
ZSTD_LEVEL = 3
PAIR_SLACK = 1.01  # kind 4 is taken while its estimated size is within 1% of kind 3's
PAIR_MIN_ELEMS = 1 << 15  # and only in blocks this large: below, its table never pays (and costs a 2**16 scan)
RESIDUAL_TRY_BITS = 7.5  # the residual plane is tried through zstd-1 below this order-0 entropy
READ_CHUNK = 8 << 20
MAP_AT_LEAST = 1 << 16  # a record's blocks of this many bytes or more are mapped from a file, not read
_MAP_FLAGS = (mmap.MAP_SHARED | mmap.MAP_POPULATE) if hasattr(mmap, "MAP_POPULATE") else None


class SnapshotError(DeltaError):
    """A snapshot object that cannot be trusted: truncated, corrupt, forged or over a limit."""

    def __init__(self, obj: str, reason: str, *, tensor: str | None = None) -> None:
        self.obj = obj
        DeltaError.__init__(self, reason, tensor=tensor)
        self.args = (f"{obj}: " + (f"tensor {tensor!r}: " if tensor is not None else "") + reason,)

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class SnapshotEntry:
    """One tensor as the index lists it: where its record lies and the digest it must decode to."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: bytes
    offset: int
    length: int


# ---------------------------------------------------------------- encoding


def _varint_bytes(values: np.ndarray) -> int:
    """How many bytes `values` take as LEB128 varints."""
    v = np.maximum(np.asarray(values, np.int64), 1)
    return int((np.floor(np.log2(v)) // 7 + 1).sum())


def _coded_bits(counts: np.ndarray, freq: np.ndarray, scale: int) -> float:
    """The rANS stream's size in bits, near enough: each coded symbol costs scale - log2(freq)."""
    used = counts > 0
    return float((counts[used] * (scale - np.log2(freq[used]))).sum())


def _bf16_block(blk: np.ndarray, version: int = VERSION, pairs: str = "auto") -> bytes:
    """One BF16 block: in version 3 kind 4, unless the block has more distinct exponent pairs than
    MAX_PAIR_SYMBOLS, or (`pairs` "auto") it is under PAIR_MIN_ELEMS or kind 4's exponent stream
    and table would come out over PAIR_SLACK times kind 3's estimate (small blocks, where the
    pair table outweighs the exponents: kind 4 decodes ~2x faster, worth a percent); then kind
    3, as in version 2; kind 2 in version 1; kind 0 wherever coding does not pay. `pairs`
    "always" (tests and vectors) takes kind 4 wherever it can."""
    n = blk.size
    residual = np.empty(n, np.uint8)
    head = wire.Writer()
    stream = None
    if version >= 3 and (pairs == "always" or n >= PAIR_MIN_ELEMS):
        codes = np.empty((n + 1) // 2, np.uint16)
        hr = snapshot_rans.pair_codes(blk, codes, residual)
        index = np.empty(1 << 16, np.int64)
        present, counts = snapshot_rans.pair_histogram(codes, index)
        if present.size <= snapshot_rans.MAX_PAIR_SYMBOLS:
            if present.size == 1:  # normalize's spare symbol: a second code, never coded
                spare = 1 if present[0] == 0 else 0
                present = np.sort(np.array([present[0], spare], np.int64))
                counts = np.where(present == spare, 0, counts[0])
                index[present] = np.arange(2)
            pf = rans.normalize(counts, snapshot_rans.SCALE_PAIRS, floor_all=False)
            table = np.empty(2 * present.size, np.int64)
            table[0::2] = np.diff(present, prepend=-1) - 1  # gaps between increasing codes
            table[1::2] = pf
            take = pairs == "always"
            if not take:
                he = np.bincount(present & 0xFF, counts, 256) + np.bincount(present >> 8, counts, 256)
                he = he.astype(np.int64)
                he[0] -= n & 1  # an odd block's half pair
                f3 = rans.normalize(he, snapshot_rans.SCALE, floor_all=False)
                table3 = np.count_nonzero(f3) + _varint_bytes(f3[f3 > 0])  # (symbol, freq) bytes
                bits3 = _coded_bits(he, f3, snapshot_rans.SCALE) + 8 * table3
                bits4 = _coded_bits(counts, pf, snapshot_rans.SCALE_PAIRS) + 8 * _varint_bytes(table)
                take = bool(bits4 <= PAIR_SLACK * bits3)
            if take:
                cum = np.zeros(present.size, np.int64)
                np.cumsum(pf[:-1], out=cum[1:])
                rcp, rsh = rans.reciprocals(pf)
                words, nw, xs = snapshot_rans.encode_pair_groups(codes, index, pf, cum, rcp, rsh)
                if nw < 0:
                    raise AssertionError("rANS word buffer overflow")  # unreachable with normalised tables
                stream = rans.words_to_bytes(words, nw, tuple(int(x) for x in xs))
                head.u8(KIND_BF16_PAIRS)
                head.uvarint(int(present.size))
                head.raw(wire.uvarints(table))
    if stream is None:
        he, hr = snapshot_rans.histograms(blk)
        freq = rans.normalize(he, snapshot_rans.SCALE, floor_all=False)
        cum = np.zeros(256, np.int64)
        np.cumsum(freq[:-1], out=cum[1:])
        rcp, rsh = rans.reciprocals(freq)
        if version >= 2:
            kind = KIND_BF16_GROUPS
            words, nw, xs = snapshot_rans.encode_groups(blk, freq, cum, rcp, rsh, residual)
            states = tuple(int(x) for x in xs)
        else:
            kind = KIND_BF16
            words, nw, *xs = snapshot_rans.encode_block(blk, freq, cum, rcp, rsh, residual)
            states = tuple(int(x) for x in xs)
        if nw < 0:
            raise AssertionError("rANS word buffer overflow")  # unreachable with normalised tables
        stream = rans.words_to_bytes(words, nw, states)
        head.u8(kind)
        syms = np.flatnonzero(freq)
        head.uvarint(int(syms.size))
        for s in syms.tolist():
            head.u8(s)
            head.uvarint(int(freq[s]))
    res_codec, res = RESIDUAL_RAW, residual.tobytes()
    p = hr[hr > 0] / n
    if 2 * n >= MIN_ZSTD_BLOCK_BYTES and float(-(p * np.log2(p)).sum()) < RESIDUAL_TRY_BITS:
        packed = compressors.compress(compressors.ZSTD, res, 1)
        if len(packed) < len(res):
            res_codec, res = RESIDUAL_ZSTD, packed
    head.uvarint(len(stream) // 4)
    head.u8(res_codec)
    out = b"".join((head.getvalue(), stream, res))
    if len(out) >= 1 + 2 * n:
        return bytes((KIND_RAW,)) + blk.tobytes()
    return out


def _other_block(raw: bytes) -> bytes:
    packed = compressors.compress(compressors.ZSTD, raw, ZSTD_LEVEL)
    if len(packed) < len(raw):
        return bytes((KIND_ZSTD,)) + packed
    return bytes((KIND_RAW,)) + bytes(raw)


def _encode_tensor(name: str, t: torch.Tensor, bf16_block: int, version: int, pairs: str
                   ) -> tuple[bytes, list[bytes], SnapshotEntry]:
    """(record head with its tag and length, blocks, index entry without offset)."""
    dt = tensors.dtype_of(t, name)
    shape = tuple(int(d) for d in t.shape)
    elems = np.ascontiguousarray(tensors.element_view(t))
    digest = hashing.digest_elements(dt.name, shape, elems)
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    blocks: list[bytes] = []
    if exponent_coded(dt, version):
        block_elems = bf16_block
        for start in range(0, numel, block_elems):
            blocks.append(_bf16_block(elems[start:start + block_elems], version, pairs))
    else:
        block_elems = max(1, OTHER_BLOCK_BYTES // dt.itemsize)
        raw = elems.view(np.uint8)
        step = block_elems * dt.itemsize
        for start in range(0, numel * dt.itemsize, step):
            blocks.append(_other_block(raw[start:start + step].tobytes()))
    w = wire.Writer()
    _tensor_fields(w, name, dt.code, shape)
    w.uvarint(block_elems)
    w.uvarint(len(blocks))
    for b in blocks:
        w.uvarint(len(b))
    w.raw(digest)
    fields = w.getvalue()
    head = fields + xxhash.xxh3_64_digest(fields)
    head = struct.pack("<BI", TAG_RECORD, len(head)) + head
    entry = SnapshotEntry(name, dt.name, shape, digest, 0, len(head) + sum(map(len, blocks)))
    return head, blocks, entry


def _tensor_fields(w: wire.Writer, name: str, code: int, shape: Iterable[int]) -> None:
    """name, dtype code, rank and dims: how a record head and the index each begin a tensor (FORMAT.md)."""
    w.blob(name.encode())
    w.u8(code)
    dims = tuple(shape)
    w.uvarint(len(dims))
    for d in dims:
        w.uvarint(d)


def _index_body(entries: list[SnapshotEntry]) -> bytes:
    w = wire.Writer()
    w.uvarint(len(entries))
    for e in entries:
        _tensor_fields(w, e.name, tensors.BY_NAME[e.dtype].code, e.shape)
        w.uvarint(e.offset)
        w.uvarint(e.length)
        w.raw(e.digest)
    return w.getvalue()


def encode_snapshot(named: Iterable[tuple[str, torch.Tensor]], *, bf16_block_elems: int = BF16_BLOCK_ELEMS,
                    version: int = VERSION, pairs: str = "auto") -> Iterator[bytes]:
    """The snapshot object of `named` (name, tensor) pairs, as chunks in order: memory holds one
    tensor's output at a time. Names must be unique (ValueError otherwise, before the index).
    `bf16_block_elems` (1 to 2**21) is for tests and vectors: decoders take any block size.
    `version` 1, 2 or 3 writes an older format (BF16 blocks of kind 2, or 3; F16 through zstd), for
    readers that predate v2, v3 or v4. `pairs` "always" (tests and vectors) writes kind 4 wherever a block allows it,
    rather than where it pays (`_bf16_block`)."""
    if not 1 <= bf16_block_elems <= MAX_BLOCK_BYTES // 2:
        raise ValueError(f"bf16_block_elems {bf16_block_elems} is not in 1..{MAX_BLOCK_BYTES // 2}")
    if version not in VERSIONS:
        raise ValueError(f"snapshot format version {version} is not one of {VERSIONS}")
    if pairs not in ("auto", "always"):
        raise ValueError(f"pairs must be 'auto' or 'always', not {pairs!r}")
    if pairs == "always" and version < 3:
        raise ValueError(f"pairs='always' asks for block kind 4, which version {version} does not have")
    yield PREFIX.pack(MAGIC, version, 0)
    offset = PREFIX.size
    entries: list[SnapshotEntry] = []
    seen: set[str] = set()
    for name, t in named:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        if len(name.encode()) > MAX_NAME:
            raise ValueError(f"tensor {name[:64]!r}...: name over {MAX_NAME} bytes")
        tensors.check_shape_limits(name, tuple(t.shape), MAX_NDIM, MAX_NUMEL)  # else written, and unreadable
        seen.add(name)
        head, blocks, entry = _encode_tensor(name, t, bf16_block_elems, version, pairs)
        entries.append(SnapshotEntry(entry.name, entry.dtype, entry.shape, entry.digest, offset, entry.length))
        offset += entry.length
        yield head
        yield from blocks
    body = _index_body(entries)
    yield struct.pack("<BI", TAG_INDEX, len(body)) + body
    yield TRAILER.pack(offset, len(body), 0, xxhash.xxh3_64_digest(body), TAIL_MAGIC)


def write_snapshot(named: Iterable[tuple[str, torch.Tensor]], f: IO[bytes]) -> tuple[int, str]:
    """Writes the snapshot object into the binary file `f`; returns (size, xxh3-128 hex of its
    bytes): what `Store.put_new_stream` wants up front, so a spool file can then be streamed."""
    h = xxhash.xxh3_128()
    size = 0
    for chunk in encode_snapshot(named):
        f.write(chunk)
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


# ---------------------------------------------------------------- reading


class _Source:
    """Exact reads from bytes, a path or a binary file object, each refused if short."""

    def __init__(self, src: object, where: str, map_files: bool = False, max_bytes: int | None = None) -> None:
        self.where = where
        self.map_files = map_files  # see _map
        self.budget = max_bytes  # tensor bytes the records may still declare (decode_snapshot's max_bytes)
        self._own: BinaryIO | None = None
        self._mv: memoryview | None = None
        self._f: IO[bytes] | None = None
        self.pos = 0
        self.version = 0  # the object's, once its prefix is read
        self._buf = np.empty(0, np.uint8)  # a file source's record bytes, reused record after record
        if isinstance(src, (bytes, bytearray, memoryview)):
            self._mv = memoryview(src).cast("B")
        elif isinstance(src, (str, os.PathLike)):
            self._own = open(src, "rb")
            self._f = self._own
        elif hasattr(src, "read"):
            self._f = src  # type: ignore[assignment]
        else:
            raise TypeError(f"{where}: a snapshot source is bytes, a path or a binary file, not {type(src).__name__}")

    def close(self) -> None:
        if self._own is not None:
            self._own.close()

    def error(self, reason: str, tensor: str | None = None) -> SnapshotError:
        return SnapshotError(self.where, reason, tensor=tensor)

    def read(self, n: int, what: str, tensor: str | None = None) -> memoryview:
        if self._mv is not None:
            if self.pos + n > len(self._mv):
                raise self.error(f"truncated {what}: needs {n} bytes at offset {self.pos}, "
                                 f"{len(self._mv) - self.pos} left", tensor)
            out = self._mv[self.pos:self.pos + n]
            self.pos += n
            return out
        assert self._f is not None
        parts = []
        left = n
        while left:  # in chunks, so a length the object cannot back allocates no more than it holds
            got = self._f.read(min(left, READ_CHUNK))
            if not got:
                raise self.error(f"truncated {what}: needs {n} bytes at offset {self.pos}, "
                                 f"{n - left} left", tensor)
            parts.append(got)
            left -= len(got)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.pos += n
        return memoryview(data)

    def read_blocks(self, sizes: np.ndarray, total: int, tensor: str) -> np.ndarray:
        """A record's blocks, back to back, as one read-only uint8 array. From memory, a view; from
        a file, with `map_files`, a mapping of a large record (`_map`), else one buffer reused
        from record to record (valid until the next call): a new bytes
        object per block cost fresh pages each time. A buffer grows only as far as the file can
        back it (its size, or the bytes that arrived), so a length the file cannot back allocates
        no more than it holds. `total`: the sum of `sizes`."""
        if self._mv is not None:
            if self.pos + total > len(self._mv):
                raise self._truncated(sizes, len(self._mv) - self.pos, tensor)
            out = np.frombuffer(self._mv, np.uint8, total, self.pos)
            self.pos += total
        elif self.map_files and total >= MAP_AT_LEAST and (mapped := self._map(total)) is not None:
            out = mapped
        else:
            readinto = getattr(self._f, "readinto", None)
            if readinto is not None and self._readinto(readinto, sizes, total, tensor):
                out = self._buf[:total]
                self.pos += total
            else:  # block by block (read moves pos)
                out = np.frombuffer(b"".join([self.read(size, f"block {i}", tensor)
                                              for i, size in enumerate(sizes)]), np.uint8)
        if out.flags.writeable:  # one array type for the kernel, whatever the source
            out = out.view()
            out.flags.writeable = False
        return out

    def _map(self, total: int) -> np.ndarray | None:
        """The next `total` bytes of a regular file, mapped read-only and populated in one call
        (MAP_POPULATE), or None where that cannot be done (no such flag, no file descriptor, not
        a regular file, bytes past its end, a file not where this source thinks: the caller
        reads; only an io.FileIO, or a buffered reader over one, maps). Measured on
        all-MiniLM-L6-v2's spool file, from the page cache: read() into a
        buffer ran at 1.4 GB/s, a mapping read through at 6.9; but pages faulted in one by one
        while the kernel decodes cost as much as read() did, so the mapping is populated at once
        (decoding the file: 61 -> 45 ms, from memory 40). Valid while the array lives. Only with
        `map_files`: a file that another process truncates while it is mapped kills this one
        (SIGBUS), where a read would have raised, so only callers that own the file (the relay's
        spool files) ask for it."""
        f = self._f
        raw = f.raw if isinstance(f, (io.BufferedReader, io.BufferedRandom)) else f
        if f is None or _MAP_FLAGS is None or not isinstance(raw, io.FileIO):  # gzip's fileno is not its bytes
            return None
        try:
            fd = raw.fileno()
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or self.pos + total > st.st_size or f.tell() != self.pos:
                return None
            base = self.pos - self.pos % mmap.ALLOCATIONGRANULARITY
            m = mmap.mmap(fd, self.pos + total - base, flags=_MAP_FLAGS, prot=mmap.PROT_READ, offset=base)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return None
        out = np.frombuffer(m, np.uint8, total, self.pos - base)  # holds the mapping until dropped
        self.seek(self.pos + total)
        return out

    def _truncated(self, sizes: np.ndarray, got: int, tensor: str) -> SnapshotError:
        ends = np.cumsum(sizes)
        i = int(np.searchsorted(ends, got, side="right"))
        start = int(ends[i]) - sizes[i]
        return self.error(f"truncated block {i}: needs {sizes[i]} bytes at offset {self.pos + start}, "
                          f"{got - start} left", tensor)

    def _readinto(self, readinto: Callable[[memoryview], int | None], sizes: np.ndarray, total: int,
                  tensor: str) -> bool:
        """Reads `total` bytes into self._buf; False if the reader's readinto does not work."""
        if self._buf.size < total and self.seekable() and self.size() - self.pos >= total:
            self._buf = np.empty(total, np.uint8)  # the file holds them: no growing (and copying) as they come
        got = 0
        while got < total:
            if got == self._buf.size:
                bigger = np.empty(min(total, max(2 * self._buf.size, READ_CHUNK)), np.uint8)
                bigger[:got] = self._buf[:got]
                self._buf = bigger
            try:
                n = readinto(self._buf.data[got:min(total, self._buf.size)])
            except (NotImplementedError, io.UnsupportedOperation):  # a reader without readinto
                if got:
                    raise
                return False
            if not n:
                raise self._truncated(sizes, got, tensor)
            got += n
        return True

    def skip(self, n: int, what: str, tensor: str | None = None) -> None:
        if self.seekable():
            self.seek(self.pos + n)
            if self.pos > self.size():
                raise self.error(f"truncated {what}", tensor)
            return
        while n:
            step = min(n, READ_CHUNK)
            self.read(step, what, tensor)
            n -= step

    def seekable(self) -> bool:
        if self._mv is not None:
            return True
        assert self._f is not None
        try:
            return bool(self._f.seekable())
        except (AttributeError, OSError):
            return False

    def size(self) -> int:
        if self._mv is not None:
            return len(self._mv)
        assert self._f is not None
        here = self._f.tell()
        end = self._f.seek(0, io.SEEK_END)
        self._f.seek(here)
        return end

    def seek(self, offset: int) -> None:
        self.pos = offset
        if self._f is not None:
            self._f.seek(offset)

    def at_end(self) -> bool:
        if self._mv is not None:
            return self.pos == len(self._mv)
        assert self._f is not None
        return not self._f.read(1)


def _prefix(src: _Source) -> int:
    """Checks the prefix; the object's format version."""
    magic, version, flags = PREFIX.unpack(src.read(PREFIX.size, "prefix"))
    if magic != MAGIC:
        raise src.error(f"not a snapshot object (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version not in VERSIONS:
        known = ", ".join(map(str, VERSIONS))
        raise src.error(f"snapshot format version {version} is not supported (this reader knows {known})")
    if flags:
        raise src.error(f"flags {flags:#x} are reserved and must be 0")
    src.version = int(version)
    return src.version


def _shape(r: wire.Reader) -> tuple[int, ...]:
    ndim = r.uvarint(MAX_NDIM)
    shape = tuple(r.uvarint(MAX_NUMEL) for _ in range(ndim))
    spanned = 1  # the product of the non-zero dims: bounded too, or an empty tensor's strides overflow int64
    for d in shape:
        spanned *= max(d, 1)
        if spanned > MAX_NUMEL:
            raise DeltaError(f"shape {list(shape)} spans over 2**48 elements")
    return shape


def _dtype(code: int) -> tensors.DType:
    dt = tensors.BY_CODE.get(code)
    if dt is None:
        raise DeltaError(f"unknown dtype code {code}")
    return dt


def _name(r: wire.Reader) -> str:
    raw = r.blob(MAX_NAME)
    try:
        return raw.decode("utf-8", "strict")
    except UnicodeDecodeError:
        raise DeltaError("tensor name is not valid UTF-8") from None


@dataclass
class _Head:
    name: str
    dt: tensors.DType
    shape: tuple[int, ...]
    block_elems: int
    sizes: np.ndarray  # int64, each block's bytes
    digest: bytes
    length: int  # of the tag, length field and head
    numel: int
    blocks_bytes: int  # the sum of sizes


_NO_ROWS, _NO_DIMS = np.zeros((0, snapshot_rans.INDEX_ROW), np.int64), np.zeros(0, np.int64)  # index_entries counting
_ITEMSIZES = np.zeros(256, np.int64)  # record_head's dtype table: item size by wire code (0: unknown)
for _dt in tensors.DTYPES:
    _ITEMSIZES[_dt.code] = _dt.itemsize


def _record_head(src: _Source, tables: _Tables) -> _Head:
    """A record's head (after its tag byte): parsed, checksummed and its block layout checked.
    A kernel parses it (`snapshot_rans.record_head`: ~25 us of Python a record, most of what
    Python spent on a small tensor); what the kernel refuses, `_parse_head` refuses in words."""
    (head_len,) = struct.unpack("<I", src.read(4, "record head length"))
    if head_len > MAX_HEAD or head_len < 8:
        raise src.error(f"record head of {head_len} bytes (must be 8 to {MAX_HEAD})")
    raw = src.read(head_len, "record head")
    fields, check = raw[:-8], raw[-8:]
    if xxhash.xxh3_64_digest(fields) != bytes(check):
        raise src.error(f"record head at offset {src.pos - head_len - 5} fails its checksum")
    a = np.frombuffer(fields, np.uint8)
    ints = tables.head_ints(a.size)
    R = snapshot_rans
    if R.record_head(a, _ITEMSIZES, MAX_BLOCK_BYTES, ints):
        at, n, code, ndim, block_elems, n_blocks, digest_at, total = ints[:8].tolist()
        try:
            name = bytes(fields[at:at + n]).decode("utf-8", "strict")
        except UnicodeDecodeError:
            pass  # _parse_head words it
        else:
            shape = tuple(ints[R.HEAD_SHAPE:R.HEAD_SHAPE + ndim].tolist())
            sizes = ints[R.HEAD_SIZES:R.HEAD_SIZES + n_blocks].copy()
            return _Head(name, tensors.BY_CODE[code], shape, block_elems, sizes, bytes(fields[digest_at:]),
                         5 + head_len, math.prod(shape), total)
    _parse_head(src, fields, 5 + head_len)
    raise src.error("record head refused by the kernel parser but not by the reference (a reader bug)")


def _parse_head(src: _Source, fields: memoryview, length: int) -> _Head:
    """The reference parser of a record head's fields (`length`: the record's tag, length field
    and head): what `snapshot_rans.record_head` must agree with, and, where it refuses, the
    words for why."""
    r = wire.Reader(fields, "record head")
    try:
        name = _name(r)
    except DeltaError as exc:
        raise src.error(exc.reason) from None
    try:
        dt = _dtype(r.u8())
        shape = _shape(r)
        block_elems = r.uvarint(MAX_BLOCK_BYTES)
        if block_elems < 1 or block_elems * dt.itemsize > MAX_BLOCK_BYTES:
            raise DeltaError(f"block of {block_elems} elements of {dt.name} (at most {MAX_BLOCK_BYTES} bytes)")
        head = _Head(name, dt, shape, block_elems, np.zeros(0, np.int64), b"", length, math.prod(shape), 0)
        n_blocks = r.uvarint(r.remaining)
        expected = -(-head.numel // block_elems)
        if n_blocks != expected:
            raise DeltaError(f"{n_blocks} blocks for {head.numel} elements in blocks of {block_elems} "
                             f"(must be {expected})")
        sizes = []
        for i in range(n_blocks):
            elems = min(block_elems, head.numel - i * block_elems)
            sizes.append(r.uvarint(1 + elems * dt.itemsize))
        head.sizes = np.array(sizes, np.int64)
        head.blocks_bytes = sum(sizes)
        head.digest = r.raw(hashing.DIGEST_SIZE)
        r.expect_end()
    except DeltaError as exc:
        raise src.error(exc.reason, name) from None
    return head


_HEAD_ERRORS = {
    snapshot_rans.E_TRUNCATED: lambda v: "truncated BF16 block header",
    snapshot_rans.E_VARINT: lambda v: "malformed varint in BF16 block",
    snapshot_rans.E_LIMIT: lambda v: f"value {v} in BF16 block exceeds its limit",
    snapshot_rans.E_N_SYM: lambda v: f"exponent table of {v} symbols (needs 2 to 256)",
    snapshot_rans.E_ORDER: lambda v: "exponent table symbols are not strictly increasing",
    snapshot_rans.E_FREQ_0: lambda v: f"exponent {v} listed with frequency 0",
    snapshot_rans.E_SUM: lambda v: f"exponent frequencies sum to {v}, not {1 << snapshot_rans.SCALE}",
    snapshot_rans.E_WORDS: lambda v: f"rANS stream of {v} words does not fit the block",
}
_PAIR_HEAD_ERRORS = {  # kind 4's words where its table differs; the rest as above
    snapshot_rans.E_N_SYM: lambda v: f"exponent-pair table of {v} symbols (needs 2 to {snapshot_rans.PAIR_SLOTS})",
    snapshot_rans.E_CODE: lambda v: f"exponent-pair code {v} is past 0xFFFF (codes must increase)",
    snapshot_rans.E_FREQ_0: lambda v: f"exponent pair {v:#06x} listed with frequency 0",
    snapshot_rans.E_SUM: lambda v: f"exponent-pair frequencies sum to {v}, not {snapshot_rans.PAIR_SLOTS}",
}


class _Tables:
    """The scratch tables the BF16 kernels fill, made once per object read (not per record):
    kinds 2 and 3's frequencies and slots, kind 4's codes, frequencies and slots."""

    def __init__(self) -> None:
        self.freq = np.zeros(256, np.int64)
        self.table = np.empty(1 << snapshot_rans.SCALE, np.uint32)
        slots = snapshot_rans.PAIR_SLOTS
        self.codes = np.empty(slots, np.int64)
        self.pfreq = np.empty(slots, np.int64)
        self.ptable = np.empty(slots, np.uint64)
        # one XXH3 state for the object's digests, which the kernel resets per tensor (and, where
        # hashing.KERNEL_DIGESTS, finishes and checks): no state made and freed from Python per tensor
        native = self._native = hashing.NATIVE
        self._scratch = hashing.Scratch(native) if native is not None else None
        self.functions = native.functions() if native is not None else np.zeros(0, np.uintp)
        self.state = self._scratch.states[0] if self._scratch is not None else np.uintp(0)
        self.finish = hashing.KERNEL_DIGESTS and native is not None
        self._ints = np.empty(0, np.int64)

    def head_ints(self, n: int) -> np.ndarray:
        """record_head's output for a head of `n` field bytes (grown as heads need)."""
        if self._ints.size < snapshot_rans.HEAD_SIZES + n:
            self._ints = np.empty(snapshot_rans.HEAD_SIZES + max(n, 1024), np.int64)
        return self._ints

    def feed(self, part: np.ndarray) -> None:
        """Feeds the digest in progress what Python decompressed (the kernel feeds the rest)."""
        assert self._native is not None
        self._native.feed(int(self.state), part)

    def digest(self) -> bytes:
        """The digest in progress, finished from Python (where kernels cannot finish one)."""
        assert self._native is not None
        return self._native.digest_bytes(int(self.state))


_NO_RESIDUAL = np.frombuffer(b"", np.uint8)  # read-only, as a decompressed residual plane is
_NO_BYTES = np.empty(0, np.uint8)
_DIGEST_MISMATCH = "decoded bytes do not match the tensor's digest (corrupt or forged record)"
_NO_ELEMS = np.empty(0, np.uint16)  # `out` for a dtype no BF16 kind is defined for
_KIND_MASKS = {v: sum(1 << k for k in kinds) for v, kinds in BF16_KINDS.items()}


def _fault(src: _Source, head: _Head, buf: np.ndarray, block: int, code: int, value: int, at: int) -> str:
    """decode_record's FAULT in words."""
    R = snapshot_rans
    if code == R.F_EMPTY:
        return f"block {block} is empty"
    start = block * head.block_elems
    n = min(start + head.block_elems, head.numel) - start
    kind = int(buf[at])
    if code == R.F_STORED:
        return f"block {block}: {value} stored bytes for {n * head.dt.itemsize}"
    if code == R.F_KIND:
        defined = (f"in a version {src.version} object" if kind in (KIND_BF16_GROUPS, KIND_BF16_PAIRS)
                   and exponent_coded(head.dt, src.version) else f"for {head.dt.name}"
                   + (f" in a version {src.version} object" if head.dt is tensors.F16 else ""))
        return f"block {block}: kind {kind} is not defined {defined}"
    if code == R.F_RESIDUAL_SIZE:
        reason = f"residual plane of {value} bytes for {n} elements"
    elif code == R.F_RESIDUAL_CODEC:
        reason = f"unknown residual codec {value}"
    elif code == R.F_BAD_STATES:
        reason = "rANS final states out of range"
    elif code == R.F_CORRUPT:
        reason = "rANS stream does not decode to its block (corrupt)"
    else:
        words = (_PAIR_HEAD_ERRORS if kind == KIND_BF16_PAIRS else {}).get(code) or _HEAD_ERRORS[code]
        reason = words(value)
    return f"block {block}: {reason}"


def _decode_record(src: _Source, head: _Head, tables: _Tables) -> torch.Tensor:
    """Reads a record's blocks (all of them before any allocation: the output is justified by bytes
    actually present) and returns its verified tensor. One kernel call decodes the blocks
    (`snapshot_rans.decode_record`); Python steps in only for zstd, and to word a fault."""
    dt = head.dt
    if src.budget is not None:  # before any read or allocation: zstd blocks are no bound on what a record declares
        need = head.numel * dt.itemsize
        if need > src.budget:
            raise src.error(f"record declares {need} bytes of tensor, past the {src.budget} the reader still "
                            "expects of this snapshot", head.name)
        src.budget -= need
    buf = src.read_blocks(head.sizes, head.blocks_bytes, head.name)
    try:
        out = np.empty(head.numel * tensors.elements_per_item(dt), tensors.element_dtype(dt))
    except MemoryError:
        raise src.error(f"no memory for {head.numel} elements", head.name) from None
    raw = out.view(np.uint8)
    isz = dt.itemsize
    bf16 = exponent_coded(dt, src.version)  # the BF16 block kinds are defined for this record
    native = tables.functions.size != 0
    header = np.frombuffer(hashing.header_bytes(dt.name, head.shape), np.uint8) if native else _NO_BYTES
    expected = np.frombuffer(head.digest, np.uint8) if tables.finish else _NO_BYTES
    sizes = head.sizes
    R = snapshot_rans
    first, first_at, residual = 0, 0, _NO_RESIDUAL
    last = len(sizes) - 1
    while True:
        outcome, block, code, value, at = R.decode_record(
            buf, sizes, first, first_at, residual, head.block_elems, isz, _KIND_MASKS[src.version] if bf16 else 0,
            raw, out if bf16 else _NO_ELEMS, tables.freq, tables.table, tables.codes, tables.pfreq, tables.ptable,
            tables.functions, tables.state, header, expected)
        if outcome == R.DONE:
            break
        if outcome == R.FAULT:
            if code == R.F_DIGEST:
                raise src.error(_DIGEST_MISMATCH, head.name)
            raise src.error(_fault(src, head, buf, block, code, value, at), head.name)
        start = block * head.block_elems
        stop = min(start + head.block_elems, head.numel)
        end = at + int(sizes[block])
        if block != last and (stop - start) * isz < MIN_ZSTD_BLOCK_BYTES:
            # each zstd-coded block costs a round trip to Python: tiny ones would make a small file cost
            # minutes (FORMAT.md: such blocks are not valid)
            raise src.error(f"block {block}: zstd-coded, but covers {(stop - start) * isz} bytes of tensor, under "
                            f"the {MIN_ZSTD_BLOCK_BYTES} a zstd-coded block other than a record's last must cover",
                            head.name)
        try:
            if outcome == R.NEED_ZSTD:
                part = raw[start * isz:stop * isz]
                part[:] = np.frombuffer(compressors.decompress(compressors.ZSTD, buf[at + 1:end].data, part.size,
                                                               f"block {block}"), np.uint8)
                if native:  # in order: the kernel fed the blocks before it
                    tables.feed(part)
                first, first_at, residual = block + 1, end, _NO_RESIDUAL
            elif first == block and residual.size:  # NEED_RESIDUAL for the plane it was given
                raise DeltaError(f"block {block}: residual plane refused")
            else:
                first, first_at = block, at
                residual = np.frombuffer(compressors.decompress(compressors.ZSTD, buf[value:end].data, stop - start,
                                                                f"block {block}: residual plane"), np.uint8)
        except DeltaError as exc:
            raise src.error(exc.reason, head.name) from None
    if not tables.finish:  # the kernel fed the digest, or (no C API) nothing did
        digest = tables.digest() if native else hashing.digest_elements(dt.name, head.shape, out)
        if digest != head.digest:
            raise src.error(_DIGEST_MISMATCH, head.name)
    return tensors.tensor_from_elements(out, dt, head.shape, copy=False)


def _read_index(src: _Source) -> list[SnapshotEntry]:
    """The index via the trailer (seekable sources): checksummed and every entry inside the file."""
    size = src.size()
    if size < PREFIX.size + TRAILER.size + 5:
        raise src.error(f"{size} bytes is too short for a snapshot object")
    src.seek(0)
    _prefix(src)
    src.seek(size - TRAILER.size)
    offset, length, reserved, check, magic = TRAILER.unpack(src.read(TRAILER.size, "trailer"))
    if magic != TAIL_MAGIC:
        raise src.error("trailer magic missing (truncated or not a snapshot object)")
    if reserved:
        raise src.error("trailer reserved field is not 0")
    if length > MAX_INDEX or offset + 5 + length != size - TRAILER.size:
        raise src.error(f"index of {length} bytes at offset {offset} does not end at the trailer")
    src.seek(offset)
    tag, body_len = struct.unpack("<BI", src.read(5, "index tag"))
    if tag != TAG_INDEX or body_len != length:
        raise src.error("trailer does not point at the index")
    body = src.read(length, "index")
    if xxhash.xxh3_64_digest(body) != check:
        raise src.error("index fails its checksum")
    return _parse_index(src, body, offset)


def _parse_index(src: _Source, body: memoryview, index_offset: int) -> list[SnapshotEntry]:
    """The index's entries. A kernel parses and checks the body (`snapshot_rans.index_entries`:
    Python's parse cost ~10 us an entry, a tenth of a small tensor's decode); names are decoded
    and checked for repeats here; anything refused is refused again, in words, by `_parse_index_words`."""
    body = memoryview(bytes(body))  # a copy: both passes must see the bytes the checksum saw
    a = np.frombuffer(body, np.uint8)
    R = snapshot_rans
    ok, n, n_dims = R.index_entries(a, _ITEMSIZES, MAX_TENSORS, PREFIX.size, index_offset, _NO_ROWS, _NO_DIMS)
    if ok:
        rows = np.empty((n, R.INDEX_ROW), np.int64)
        dims = np.empty(n_dims, np.int64)
        if R.index_entries(a, _ITEMSIZES, MAX_TENSORS, PREFIX.size, index_offset, rows, dims) != (True, n, n_dims):
            raise src.error("index parsed differently twice (a reader bug)")
        entries: list[SnapshotEntry] = []
        names: set[str] = set()
        d = 0
        by_code = tensors.BY_CODE
        flat = dims.tolist()
        try:
            for at, k, code, ndim, offset, length, digest_at in rows.tolist():
                name = bytes(body[at:at + k]).decode("utf-8", "strict")
                if name in names:
                    break
                names.add(name)
                entries.append(SnapshotEntry(name, by_code[code].name, tuple(flat[d:d + ndim]),
                                             bytes(body[digest_at:digest_at + hashing.DIGEST_SIZE]), offset, length))
                d += ndim
            else:
                return entries
        except UnicodeDecodeError:
            pass
    _parse_index_words(src, body, index_offset)
    raise src.error("index refused by the kernel parser but not by the reference (a reader bug)")


def _parse_index_words(src: _Source, body: memoryview, index_offset: int) -> list[SnapshotEntry]:
    """The reference parser of the index: what `snapshot_rans.index_entries` must agree with,
    and, where the fast path refuses, the words for why."""
    r = wire.Reader(body, "index")
    entries: list[SnapshotEntry] = []
    names: set[str] = set()
    at = PREFIX.size
    try:
        n = r.uvarint(min(MAX_TENSORS, len(body)))
        for _ in range(n):
            name = _name(r)
            if name in names:
                raise DeltaError(f"tensor {name!r} listed twice")
            names.add(name)
            dt = _dtype(r.u8())
            shape = _shape(r)
            offset = r.uvarint()
            length = r.uvarint()
            if offset != at or length < 5:
                raise DeltaError(f"tensor {name!r}: record at {offset} (+{length}) does not follow the previous one")
            at += length
            entries.append(SnapshotEntry(name, dt.name, shape, r.raw(hashing.DIGEST_SIZE), offset, length))
        r.expect_end()
        if at != index_offset:
            raise DeltaError(f"records end at {at}, the index starts at {index_offset}")
    except DeltaError as exc:
        raise src.error(exc.reason) from None
    return entries


def read_snapshot_index(src: object, *, where: str = "snapshot") -> list[SnapshotEntry]:
    """The tensors a snapshot object holds (names, dtypes, shapes, digests, record spans), read from
    its trailer and index alone: a few KiB however large the object. `src` is bytes, a path or a
    seekable binary file."""
    s = _Source(src, where)
    try:
        if not s.seekable():
            raise s.error("reading the index needs a seekable source")
        return _read_index(s)
    finally:
        s.close()


def _matches(head: _Head, e: SnapshotEntry) -> bool:
    return (head.name, head.dt.name, head.shape, head.digest, head.length + head.blocks_bytes) == \
        (e.name, e.dtype, e.shape, e.digest, e.length)


def decode_snapshot(src: object, only: set[str] | None = None, *, where: str = "snapshot",
                    map_files: bool = False, max_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of the snapshot object in `src` (bytes, a path or a binary
    file; a pipe will do), in the object's order, each yielded only once its digest verifies;
    with `only`, just those names (a seekable source seeks past the rest). Raises SnapshotError,
    naming `where`, on anything truncated, corrupt or over a limit, also after the last tensor if
    the index disagrees with the records: a caller has the whole snapshot only once the iterator
    is exhausted. Memory: one tensor and its compressed bytes. `map_files`: a regular file's large
    records are mapped rather than read (faster where read() is slow; only for a file no other
    process truncates, see `_Source._map`). `max_bytes`: the most tensor bytes the records decoded
    may declare in all; a record that would go past it is refused before it is read or allocated.
    A reader passes what the step's record says the snapshot holds: a record's stored blocks bound
    its allocation, but a few KB of zstd frames can declare, and fill, gigabytes before its digest
    is checked."""
    s = _Source(src, where, map_files, max_bytes)
    try:
        if only is not None and s.seekable():
            entries = _read_index(s)
            tables = _Tables()
            known = {e.name for e in entries}
            missing = sorted(set(only) - known)
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise s.error(f"holds no tensor {missing[0]!r}{more}")
            for e in entries:
                if e.name not in only:
                    continue
                s.seek(e.offset)
                if s.read(1, "record tag", e.name)[0] != TAG_RECORD:
                    raise s.error("index points at no record", e.name)
                head = _record_head(s, tables)
                if not _matches(head, e):
                    raise s.error("record head disagrees with the index", e.name)
                yield head.name, _decode_record(s, head, tables)
            return
        yield from _walk(s, only)
    finally:
        s.close()


def _walk(s: _Source, only: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Front to back, records then index and trailer, which must agree with what was read."""
    _prefix(s)
    tables = _Tables()
    seen: list[tuple[_Head, int]] = []
    names: set[str] = set()
    while True:
        at = s.pos
        tag = s.read(1, "section tag")[0]
        if tag == TAG_INDEX:
            break
        if tag != TAG_RECORD:
            raise s.error(f"unknown section tag {tag} at offset {at}")
        head = _record_head(s, tables)
        if head.name in names:
            raise s.error("tensor appears twice", head.name)
        names.add(head.name)
        seen.append((head, at))
        if only is None or head.name in only:
            yield head.name, _decode_record(s, head, tables)
        else:
            for i, size in enumerate(head.sizes.tolist()):
                s.skip(size, f"block {i}", head.name)
    index_at = s.pos - 1
    (length,) = struct.unpack("<I", s.read(4, "index length"))
    if length > MAX_INDEX:
        raise s.error(f"index of {length} bytes (at most {MAX_INDEX})")
    body = s.read(length, "index")
    offset, tlen, reserved, check, magic = TRAILER.unpack(s.read(TRAILER.size, "trailer"))
    if magic != TAIL_MAGIC or reserved or offset != index_at or tlen != length:
        raise s.error("trailer disagrees with the index")
    if xxhash.xxh3_64_digest(body) != check:
        raise s.error("index fails its checksum")
    if not s.at_end():
        raise s.error("bytes after the trailer")
    entries = _parse_index(s, body, index_at)
    if len(entries) != len(seen) or any(
            e.offset != at or not _matches(h, e) for e, (h, at) in zip(entries, seen)):
        raise s.error("index disagrees with the records")
    if only is not None:
        missing = sorted(set(only) - names)
        if missing:
            raise s.error(f"holds no tensor {missing[0]!r}")
