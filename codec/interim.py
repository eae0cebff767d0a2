"""The encoder's path that runs no compiled kernel: a fresh host's first deltas, while its kernels compile.

On a host whose kernel cache is empty, numba compiles the encoder's kernels on their first call:
~20-40 s on a loaded 2-core machine, which a publisher's first delta used to wait for (its warm-up,
`codec.warm_up`, starts at construction, but a large snapshot's upload and the compile share the
cores). `encode(..., compiled=False)` writes a valid payload of the same format from numpy, torch,
xxhash and the compressors alone: changed BF16 tensors as `sparse-split` records (method 2, the
ARCv3-style coder: ~3-4 bytes per change instead of the conditional method's ~1), other changed
tensors as `xor-planes`, unchanged ones as `same`. Every record is byte for byte what the
compiled coders of those methods write for the same pair (tests/test_interim.py), so decoders see
nothing new; the payload is only larger. A publisher uses it while its "encode" warm-up runs,
then the compiled path (relay/publisher.py).

Nothing here may call a numba dispatcher, not even a compiled one: a call that needs a
compilation waits on numba's global compiler lock, i.e. on whatever the warm-up thread is
compiling at the time. tests/test_interim.py checks, in a fresh process with an empty kernel
cache, that no kernel gets a signature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from . import container, tensors
from .container import Entry, Payload, Stream
from .hashing import digest_elements
from .methods import same, sparse, xor_planes
from .methods.base import pack_stream
from .wire import Writer

CHUNK = 1 << 22  # elements compared at a time (8 MiB of BF16): bounded temporaries
DENSE = 4  # a BF16 tensor with more than 1 in DENSE elements changed is coded as xor-planes


def changed_positions(base: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Positions where two flat element arrays differ (int64, increasing), CHUNK elements at a time:
    a comparison's mask is never the size of the tensor. (Comparing 8-byte words first measured
    2.4x slower: numpy's nonzero of a bool mask is its fastest.)"""
    out = [o + np.flatnonzero(base[o:o + CHUNK] != target[o:o + CHUNK]) for o in range(0, base.size, CHUNK)]
    return np.concatenate(out).astype(np.int64, copy=False) if out else np.zeros(0, np.int64)


def uvarints(values: np.ndarray) -> bytes:
    """Non-negative integers as consecutive LEB128 varints (what `wire.uvarints` writes), vectorised:
    byte k of every value that has one, k = 0, 1, ... (few: RL's position gaps are mostly 1-2 bytes)."""
    v = np.asarray(values, np.uint64)
    if not v.size:
        return b""
    length = np.ones(v.size, np.int64)
    for k in range(1, 10):  # bytes: 1 + how many of 2**7, 2**14, ..., 2**63 it reaches
        length += v >= np.uint64(1 << (7 * k))
    ends = np.cumsum(length)
    out = np.empty(int(ends[-1]), np.uint8)
    at = ends - length  # where each value's byte k goes
    sel = np.arange(v.size)
    for k in range(int(length.max())):
        if k:
            keep = length[sel] > k
            sel, at = sel[keep], at[keep]
        more = length[sel] > k + 1
        out[at + k] = ((v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8) | (more.astype(np.uint8) << 7)
    return out.tobytes()


def sparse_record(base: np.ndarray, target: np.ndarray, index: np.ndarray, effort: str) -> tuple[bytes, list[Stream]]:
    """`sparse.encode`'s record (params, streams) from numpy alone: position gaps, a kind bit per change
    (sign or exponent moved), the mantissa-only changes' 7 bits, the others' full XOR (high bytes, then
    low bytes)."""
    x = base[index] ^ target[index]
    full = (x & sparse.HIGH_BITS) != 0
    gaps = np.diff(index, prepend=-1) - 1
    low = (x[~full] & 0x7F).astype(np.uint8)
    hi = (x[full] >> 8).astype(np.uint8)
    lo = (x[full] & 0xFF).astype(np.uint8)
    pos = pack_stream(uvarints(gaps), effort)
    mode = sparse.POS_GAPS
    if effort == "max" or (effort == "default" and index.size * sparse.BITMASK_DENSITY > base.size):
        mask = np.zeros(base.size, bool)
        mask[index] = True
        pos_mask = pack_stream(np.packbits(mask, bitorder="little").tobytes(), effort)
        if len(pos_mask.stored) < len(pos.stored):
            mode, pos = sparse.POS_BITMASK, pos_mask
    w = Writer()
    w.u8(mode)
    w.uvarint(int(index.size))
    streams = [pos, pack_stream(np.packbits(full, bitorder="little").tobytes(), effort),
               pack_stream(low.tobytes(), effort), pack_stream(hi.tobytes() + lo.tobytes(), effort)]
    return w.getvalue(), streams


def _entry(name: str, base: torch.Tensor, target: torch.Tensor, version: int, effort: str) -> Entry:
    dt = tensors.dtype_of(target, name)
    shape = tuple(target.shape)
    b, t = tensors.element_view(base), tensors.element_view(target)
    base_digest = digest_elements(dt.name, shape, b)
    index = changed_positions(b, t)
    if not index.size:
        return Entry(name, dt, shape, same.ID, 0, base_digest, base_digest)
    target_digest = digest_elements(dt.name, shape, t)
    if dt is tensors.BF16 and sparse.METHOD.exists_in(version) and index.size * DENSE <= b.size:
        method, (params, streams) = sparse.ID, sparse_record(b, t, index, effort)
    else:
        method, (params, streams) = xor_planes.ID, xor_planes.encode(b, t, effort, compiled=False)
    return Entry(name, dt, shape, method, int(index.size), base_digest, target_digest, params, streams)


def encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], version: int, effort: str,
           map_: Callable[[Callable[[str], Entry], list[str]], list[Any]] | None = None) -> bytes:
    """The payload turning `base` into `target` (same names, dtypes and shapes: checked by the caller),
    each tensor's record made by `map_` (the caller's threads: numpy's comparisons and the compressors
    release the GIL), else one after another."""
    def one(name: str) -> Entry:
        return _entry(name, base[name], target[name], version, effort)

    names = list(target)
    entries = map_(one, names) if map_ is not None else [one(n) for n in names]
    return container.pack(Payload(version, entries, {}), compiled=False)
