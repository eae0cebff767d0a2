"""Method 1, `xor-planes`: any dtype. XOR with the base, split into byte planes, each compressed.

The generic lossless path for fp32 norms, fp16, fp8 and integer tensors, and the fallback for
dense BF16 changes. Splitting planes puts the near-constant high bytes (sign/exponent) together,
where a general-purpose compressor finds them.
"""

from __future__ import annotations

import numpy as np

from .. import tensors
from ..container import Entry, Stream
from ..errors import DeltaError
from .base import Job, Method, Patch, check_index, expect_streams, pack_stream, read_stream

ID = 1
NAME = "xor-planes"
VERSIONS = (1, 2, 3, 4)


def encode(base: np.ndarray, target: np.ndarray, effort: str) -> tuple[bytes, list[Stream]]:
    x = np.bitwise_xor(base, target)
    planes = x.view(np.uint8).reshape(-1, x.itemsize).T
    return b"", [pack_stream(np.ascontiguousarray(p).tobytes(), effort) for p in planes]


def decode(entry: Entry, base: np.ndarray, shared: dict) -> Patch:
    size = base.itemsize
    expect_streams(entry, size)
    if entry.params:
        raise DeltaError("`xor-planes` takes no parameters", tensor=entry.name)
    x = np.empty((base.size, size), np.uint8)
    for k in range(size):
        x[:, k] = np.frombuffer(read_stream(entry, k, f"plane {k}", exact=base.size), np.uint8)
    xor = x.reshape(-1).view(base.dtype)
    index = np.flatnonzero(xor).astype(np.int64)
    check_index(entry, index, base.size)
    return Patch(index, base[index] ^ xor[index])


def stream_names(entry: Entry) -> list[str]:
    return [f"plane{k}" for k in range(len(entry.streams))]


class XorPlanes(Method):
    """Any dtype: the encoders' last resort, raced where changes are dense or effort is "max"."""

    id, name, versions = ID, NAME, VERSIONS
    preference = 30

    def applicable(self, dtype: tensors.DType) -> bool:
        return True

    def encode(self, job: Job, model: object) -> tuple[bytes, list[Stream]]:
        return encode(job.base, job.target, job.effort)

    def decode(self, entry: Entry, base: np.ndarray, shared: dict) -> Patch:
        return decode(entry, base, shared)

    def stream_names(self, entry: Entry) -> list[str]:
        return stream_names(entry)


METHOD = XorPlanes()
