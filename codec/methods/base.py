"""What every per-tensor method shares: the patch it decodes to and bounded stream access."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import compressors
from ..container import Entry, Stream
from ..errors import DeltaError


@dataclass
class Patch:
    """The changes one tensor's record describes, in flat element positions.

    Sparse on purpose: apply_ keeps an undo log of exactly these positions.
    """

    index: np.ndarray  # int64, strictly increasing, < numel
    values: np.ndarray  # new elements, same dtype as the element view

    @property
    def count(self) -> int:
        return int(self.index.size)


def empty_patch(dtype: np.dtype) -> Patch:
    return Patch(np.zeros(0, np.int64), np.zeros(0, dtype))


def pack_stream(raw: bytes, effort: str) -> Stream:
    codec, stored = compressors.compress_best(raw, effort)
    return Stream(codec, len(raw), stored)


def read_stream(entry: Entry, i: int, what: str, *, exact: int | None = None, at_most: int | None = None) -> bytes:
    """Decompress stream `i` of `entry` after checking its declared length against the base."""
    if i >= len(entry.streams):
        raise DeltaError(f"missing {what} stream", tensor=entry.name)
    s = entry.streams[i]
    if exact is not None and s.raw_len != exact:
        raise DeltaError(f"{what} stream declares {s.raw_len} bytes, expected {exact}", tensor=entry.name)
    if at_most is not None and s.raw_len > at_most:
        raise DeltaError(f"{what} stream declares {s.raw_len} bytes, at most {at_most} possible", tensor=entry.name)
    try:
        return compressors.decompress(s.codec, s.stored, s.raw_len, what)
    except DeltaError as exc:
        raise DeltaError(exc.reason, tensor=entry.name) from None


def expect_streams(entry: Entry, n: int) -> None:
    if len(entry.streams) != n:
        raise DeltaError(f"method expects {n} streams, index has {len(entry.streams)}", tensor=entry.name)


def check_index(entry: Entry, index: np.ndarray, numel: int) -> None:
    """Positions must be strictly increasing and inside the tensor."""
    if index.size and (index[0] < 0 or index[-1] >= numel or (index.size > 1 and np.any(np.diff(index) <= 0))):
        raise DeltaError("change positions are out of order or outside the tensor", tensor=entry.name)
