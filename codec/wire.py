"""Bounded readers and writers for the payload index (LEB128 varints, fixed-width ints).

Every read checks the remaining length, so a truncated or forged index fails with DeltaError
instead of IndexError or a huge allocation.
"""

from __future__ import annotations

import struct

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
