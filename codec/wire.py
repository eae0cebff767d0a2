"""Bounded readers and writers for the payload index (LEB128 varints, fixed-width ints).

Every read checks the remaining length, so a truncated or forged index fails with DeltaError
instead of IndexError or a huge allocation.
"""

from __future__ import annotations

import struct

import numba as nb
import numpy as np

from .errors import DeltaError


_BYTES = [bytes((i,)) for i in range(256)]


class Writer:
    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def uvarint(self, value: int) -> None:
        if 0 <= value < 0x80:  # most index values: one byte, no loop
            self._parts.append(_BYTES[value])
            return
        if value < 0:
            raise ValueError("uvarint takes a non-negative integer")
        out = bytearray()
        while True:
            byte = value & 0x7F
            value >>= 7
            if value:
                out.append(byte | 0x80)
            else:
                out.append(byte)
                break
        self._parts.append(bytes(out))

    def u8(self, value: int) -> None:
        self._parts.append(struct.pack("<B", value))

    def raw(self, data: bytes) -> None:
        self._parts.append(bytes(data))

    def blob(self, data: bytes) -> None:
        self.uvarint(len(data))
        self.raw(data)

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


@nb.njit(inline="always", cache=True)
def put_uvarint(out, n, v):
    """Write non-negative v as a LEB128 varint at out[n] (room for 10 bytes); the next free index."""
    while v >= 0x80:
        out[n] = (v & 0x7F) | 0x80
        n += 1
        v >>= 7
    out[n] = v
    return n + 1


@nb.njit(cache=True)
def _encode_uvarints(values):
    out = np.empty(10 * values.size, np.uint8)
    n = 0
    for v in values:
        n = put_uvarint(out, n, v)
    return out[:n]


@nb.njit(cache=True)
def _decode_uvarints(buf):
    """All LEB128 varints of buf; count -1 if one is truncated or longer than 63 bits."""
    out = np.empty(buf.size, np.int64)
    n = 0
    v = np.int64(0)  # int64 as numba infers it for 0 too; written out for the type checker
    shift = 0
    for b in buf:
        v |= np.int64(b & 0x7F) << shift
        if b & 0x80:
            shift += 7
            if shift > 56:
                return out, -1
        else:
            out[n] = v
            n += 1
            v = np.int64(0)
            shift = 0
    if shift:
        return out, -1
    return out, n


def uvarints(values: np.ndarray) -> bytes:
    """Many non-negative integers as consecutive LEB128 varints, in one compiled pass."""
    values = np.asarray(values, np.int64)
    if values.size and values.min() < 0:
        raise ValueError("uvarints take non-negative integers")
    return _encode_uvarints(values).tobytes()


def read_uvarints(data: bytes | memoryview, what: str) -> list[int]:
    """Every varint of `data` (which must hold whole varints only), as Python ints."""
    out, n = _decode_uvarints(np.frombuffer(data, np.uint8))
    if n < 0:
        raise DeltaError(f"malformed varint in {what}")
    return out[:n].tolist()


class Reader:
    def __init__(self, data: bytes | memoryview, what: str = "index") -> None:
        self._data = memoryview(data)
        self._pos = 0
        self.what = what

    @property
    def remaining(self) -> int:
        return len(self._data) - self._pos

    def _need(self, n: int) -> None:
        if n < 0 or self._pos + n > len(self._data):
            raise DeltaError(f"truncated {self.what}: needs {n} bytes at offset {self._pos}, has {self.remaining}")

    def uvarint(self, limit: int = (1 << 63) - 1) -> int:
        pos = self._pos
        if pos < len(self._data) and self._data[pos] < 0x80:  # one byte: the common case
            value = self._data[pos]
            if value > limit:
                raise DeltaError(f"value {value} in {self.what} exceeds its limit {limit}")
            self._pos = pos + 1
            return value
        value = 0
        shift = 0
        while True:
            self._need(1)
            byte = self._data[self._pos]
            self._pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 63:
                raise DeltaError(f"malformed varint in {self.what}")
        if value > limit:
            raise DeltaError(f"value {value} in {self.what} exceeds its limit {limit}")
        return value

    def u8(self) -> int:
        self._need(1)
        value = self._data[self._pos]
        self._pos += 1
        return value

    def raw(self, n: int) -> bytes:
        self._need(n)
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += n
        return out

    def blob(self, limit: int) -> bytes:
        return self.raw(self.uvarint(limit))

    def expect_end(self) -> None:
        if self.remaining:
            raise DeltaError(f"{self.remaining} trailing bytes after the {self.what}")
