"""Method 2, `sparse-split` (codec v1): BF16 changes as positions + mantissa bits + full XORs.

Unchanged elements are omitted. Positions travel as LEB128 gaps or a bitmask, whichever
compresses smaller; a kind bit per change says whether only the 7 mantissa bits moved (sent as
one byte) or the sign/exponent too (sent as the full 16-bit XOR, high plane then low plane).
Every stream races the general-purpose compressors. This is the ARCv3 recipe with a choice
of position coding, so it is never larger than ARCv3 on the same compressors.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from .. import tensors
from ..container import Entry, Stream
from ..errors import DeltaError
from ..wire import Reader, Writer, uvarints
from . import exponent_classes as ec
from .base import Job, Method, Patch, check_index, expect_streams, pack_stream, read_stream

ID = 2
NAME = "sparse-split"
VERSIONS = (1, 2, 3, 4)

POS_GAPS, POS_BITMASK = 0, 1
HIGH_BITS = np.uint16(0xFF80)  # BF16 sign + exponent
MAX_VARINT_BYTES = 7  # gaps < 2**49
BITMASK_DENSITY = 16  # race the bitmask when more than 1 in 16 elements changed


@nb.njit(cache=True, nogil=True)
def _gap_positions(buf, count, n):
    """The positions coded as `count` LEB128 gaps in buf (position = previous + gap + 1, from -1),
    in one pass into one array of `count`: (positions, status), status 0, or 1 (not exactly
    `count` varints), 2 (a varint longer than MAX_VARINT_BYTES), 3 (a position outside the
    tensor of n elements). Memory is 8 bytes per change whatever the bytes hold: the numpy form
    built several 8-byte arrays per *byte*, and a few-KB zstd stream of 7-byte varints took
    ~200 bytes of memory per element of the tensor."""
    out = np.empty(count, np.int64)
    k = 0
    pos = np.int64(-1)
    gap = np.int64(0)
    shift = 0
    for j in range(buf.size):
        b = buf[j]
        gap |= np.int64(b & 0x7F) << shift
        if b & 0x80:
            shift += 7
            if shift >= 7 * MAX_VARINT_BYTES:
                return out, 2
            continue
        if k == count:
            return out, 1
        pos += gap + 1
        if pos >= n:
            return out, 3
        out[k] = pos
        k += 1
        gap = np.int64(0)
        shift = 0
    if shift or k != count:
        return out, 1
    return out, 0


_GAP_ERRORS = {1: "positions: expected {count} varints", 2: "positions: varint too long",
               3: "position gap outside the tensor"}


@nb.njit(cache=True, nogil=True)
def _split(base, target, index):
    """One pass over the changes: (position gaps, kind of each change, mantissa bytes of the
    mantissa-only changes, high and low bytes of the others' XORs)."""
    n = index.size
    gaps = np.empty(n, np.int64)
    full = np.empty(n, np.bool_)
    low = np.empty(n, np.uint8)
    hi = np.empty(n, np.uint8)
    lo = np.empty(n, np.uint8)
    nl = 0
    nf = 0
    prev = -1
    for j in range(n):
        i = index[j]
        x = base[i] ^ target[i]
        gaps[j] = i - prev - 1
        prev = i
        if x & HIGH_BITS:
            full[j] = True
            hi[nf] = x >> 8
            lo[nf] = x & 0xFF
            nf += 1
        else:
            full[j] = False
            low[nl] = x & 0x7F
            nl += 1
    return gaps, full, low[:nl], hi[:nf], lo[:nf]


def encode(base: np.ndarray, target: np.ndarray, effort: str,
           index: np.ndarray | None = None) -> tuple[bytes, list[Stream]]:
    if index is None:
        index = ec.differences(base, target)
    gaps, full, low, hi, lo = _split(base.reshape(-1), target.reshape(-1), np.asarray(index, np.int64))
    pos_gaps = pack_stream(uvarints(gaps), effort)
    mode, pos = POS_GAPS, pos_gaps
    # a bitmask costs numel/8 bytes before compression: only worth racing when changes are dense
    if effort == "max" or (effort == "default" and index.size * BITMASK_DENSITY > base.size):
        mask = np.zeros(base.size, bool)
        mask[index] = True
        pos_mask = pack_stream(np.packbits(mask, bitorder="little").tobytes(), effort)
        if len(pos_mask.stored) < len(pos_gaps.stored):
            mode, pos = POS_BITMASK, pos_mask
    w = Writer()
    w.u8(mode)
    w.uvarint(int(index.size))
    streams = [
        pos,
        pack_stream(np.packbits(full, bitorder="little").tobytes(), effort),
        pack_stream(low.tobytes(), effort),
        pack_stream(hi.tobytes() + lo.tobytes(), effort),
    ]
    return w.getvalue(), streams


def decode(entry: Entry, base: np.ndarray, shared: dict) -> Patch:
    if base.dtype != np.uint16:
        raise DeltaError("`sparse-split` applies to 2-byte elements only", tensor=entry.name)
    expect_streams(entry, 4)
    r = Reader(entry.params, f"params of {entry.name!r}")
    mode = r.u8()
    count = r.uvarint(base.size)
    r.expect_end()
    n = base.size
    if mode == POS_GAPS:
        raw = read_stream(entry, 0, "positions", at_most=MAX_VARINT_BYTES * count)
        index, status = _gap_positions(np.frombuffer(raw, np.uint8), count, n)
        if status:
            raise DeltaError(_GAP_ERRORS[status].format(count=count), tensor=entry.name)
    elif mode == POS_BITMASK:
        raw = read_stream(entry, 0, "position mask", exact=(n + 7) // 8)
        index = np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8), count=n, bitorder="little")).astype(np.int64)
        if index.size != count:
            raise DeltaError(f"position mask has {index.size} changes, params say {count}", tensor=entry.name)
    else:
        raise DeltaError(f"unknown position mode {mode}", tensor=entry.name)
    check_index(entry, index, n)
    kinds = np.unpackbits(np.frombuffer(read_stream(entry, 1, "kinds", exact=(count + 7) // 8), np.uint8),
                          count=count, bitorder="little").astype(bool)
    nfull = int(kinds.sum())
    low = np.frombuffer(read_stream(entry, 2, "mantissa", exact=count - nfull), np.uint8)
    if np.any(low & 0x80):
        raise DeltaError("mantissa stream has bits outside the mantissa", tensor=entry.name)
    hl = np.frombuffer(read_stream(entry, 3, "sign/exponent", exact=2 * nfull), np.uint8)
    x = np.empty(count, np.uint16)
    x[~kinds] = low
    x[kinds] = (hl[:nfull].astype(np.uint16) << 8) | hl[nfull:]
    if np.any(x == 0) or np.any((x[kinds] & HIGH_BITS) == 0):
        raise DeltaError("a recorded change does not change the element", tensor=entry.name)
    return Patch(index, base[index] ^ x)


def stream_names(entry: Entry) -> list[str]:
    return ["positions", "kinds", "mantissa", "sign/exponent"]


class SparseSplit(Method):
    """BF16 only: the v1 coder of sparse changes; in v2 and v3 raced where changes are dense or
    effort is "max" (the conditional method codes the rest)."""

    id, name, versions = ID, NAME, VERSIONS
    preference = 20

    def applicable(self, dtype: tensors.DType) -> bool:
        return dtype is tensors.BF16

    def encode(self, job: Job, model: object) -> tuple[bytes, list[Stream]]:
        return encode(job.base, job.target, job.effort, job.index)

    def decode(self, entry: Entry, base: np.ndarray, shared: dict) -> Patch:
        return decode(entry, base, shared)

    def stream_names(self, entry: Entry) -> list[str]:
        return stream_names(entry)


METHOD = SparseSplit()
