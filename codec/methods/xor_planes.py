"""Method 1, `xor-planes`: any dtype. XOR with the base, split into byte planes, each compressed.

The generic lossless path for fp32 norms, fp16, fp8 and integer tensors, and the fallback for
dense BF16 changes. Splitting planes puts the near-constant high bytes (sign/exponent) together,
where a general-purpose compressor finds them.
"""

from __future__ import annotations

import numpy as np

from ..container import Entry, Stream
from ..errors import DeltaError
from .base import Patch, check_index, expect_streams, pack_stream, read_stream

ID = 1
NAME = "xor-planes"
MIN_VERSION = 1


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
