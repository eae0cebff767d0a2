"""Bytes moved to and from a store, split by what they are (deltas, records, snapshots, manifests).

Why: the point of regional snapshots is that full snapshots stop crossing region boundaries, and
only a count by kind, taken where the bytes really move, shows it. `CountingStore` wraps any Store
and tallies every byte it reads or writes under the kind of its key; the relay keeps one per
region link, the benchmarks and the demo report the split per region.

Kinds follow the run layout (docs/PROTOCOL.md §2, §8): `deltas/`, `records/`, `snapshots/` (the
origin's full snapshots), `regional/snapshots/<step>/` (a region's own snapshots) and `manifests`
for every mutable object (manifest.json, regional/snapshots.json) and anything else.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import overload

from relay.store import Buffer, ManifestRead, Store, Unchanged

KINDS = ("deltas", "records", "snapshots", "regional_snapshots", "manifests")
_PREFIXES = (("deltas/", "deltas"), ("records/", "records"), ("snapshots/", "snapshots"),
             ("regional/snapshots/", "regional_snapshots"))


def kind_of(key: str) -> str:
    """The traffic kind of a key relative to a run prefix (one of KINDS)."""
    for prefix, kind in _PREFIXES:
        if key.startswith(prefix):
            return kind
    return "manifests"


class Traffic:
    """Thread-safe byte and object counts per kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = dict.fromkeys(KINDS, 0)
        self._objects = dict.fromkeys(KINDS, 0)

    def add(self, key: str, n: int, objects: int = 1) -> None:
        kind = kind_of(key)
        with self._lock:
            self._bytes[kind] += n
            self._objects[kind] += objects

    def bytes(self) -> dict[str, int]:
        """Bytes per kind (every kind present, zeros included)."""
        with self._lock:
            return dict(self._bytes)

    def objects(self) -> dict[str, int]:
        with self._lock:
            return dict(self._objects)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._bytes.values())


class CountingStore(Store):
    """A Store that counts what goes through it: `read` (bytes read, by kind) and `written`.

    Only payload bytes are counted (object bodies, manifest bodies), not request overhead; a
    conditional read answered "not modified" counts nothing."""

    def __init__(self, inner: Store, read: Traffic | None = None, written: Traffic | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.transfer = inner.transfer
        self.read = read if read is not None else Traffic()
        self.written = written if written is not None else Traffic()

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self.read.add(key, len(data))
        return data

    def get_at_most(self, key: str, limit: int) -> bytes:
        data = self.inner.get_at_most(key, limit)
        self.read.add(key, len(data))
        return data

    def put_new(self, key: str, data: bytes) -> None:
        self.inner.put_new(key, data)
        self.written.add(key, len(data))

    def put_new_stream(self, key: str, chunks: Iterable[Buffer], size: int, *, xxh3: str | None = None) -> None:
        self.inner.put_new_stream(key, chunks, size, xxh3=xxh3)
        self.written.add(key, size)

    def delete(self, keys: list[str]) -> None:
        self.inner.delete(keys)

    def list(self, prefix: str) -> dict[str, int]:
        return self.inner.list(prefix)

    @overload
    def read_object(self, key: str, if_none_match: None = None) -> ManifestRead | None: ...

    @overload
    def read_object(self, key: str, if_none_match: str | None) -> ManifestRead | None | Unchanged: ...

    def read_object(self, key: str, if_none_match: str | None = None) -> ManifestRead | None | Unchanged:
        got = self.inner.read_object(key, if_none_match)
        if isinstance(got, ManifestRead):
            self.read.add(key, len(got.data))
        return got

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        tag = self.inner.commit_object(key, data, expected_etag)
        self.written.add(key, len(data))
        return tag

    def iter_chunks(self, key: str) -> Iterator[bytes]:
        first = True
        for chunk in self.inner.iter_chunks(key):
            self.read.add(key, len(chunk), objects=1 if first else 0)
            first = False
            yield chunk

    def download(self, key: str, fd: int, size: int | None = None) -> int:
        n = self.inner.download(key, fd, size)
        self.read.add(key, n)
        return n

    # put_immutable_stream is Store's: through the counted put_new_stream and, when the object is there
    # already, the counted read-back (a create that did not happen moved no bytes into the store)


def split(counts: dict[str, int]) -> dict[str, int]:
    """Per-kind bytes with the two sums reports quote: `chain` (deltas + records) and `total`."""
    out = {k: int(counts.get(k, 0)) for k in KINDS}
    out["chain"] = out["deltas"] + out["records"]
    out["total"] = sum(out[k] for k in KINDS)
    return out


__all__ = ["KINDS", "kind_of", "Traffic", "CountingStore", "split"]
