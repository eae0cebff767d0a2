"""Crash-safe local file writes: the one implementation every component uses.

A file that others read (a checkpoint, a delta written by the CLI, a key, the relay's status file)
is written to a temporary sibling, flushed to disk, and only then renamed (or linked) into place, so
a reader or a crash sees the old content or the new one, never a torn file. Temporary names start
with '.' and end in '.tmp', which listings ignore. An object of a file:// store follows the same
scheme from its opened directory, so that no link under the store's root is followed
(relay.store.LocalStore._write).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or link inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def temporary_sibling(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """A temporary path next to `path` (same directory, so a rename is atomic), removed unless the caller
    moved it away; created empty with `mode` (default: 0600 from mkstemp)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    if mode is not None:
        os.chmod(tmp, mode)
    try:
        yield Path(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """Write to the yielded temporary path; on success it replaces `path` atomically (fsynced first, and
    the directory after, when `durable`); on failure `path` is untouched and the temporary removed."""
    p = Path(path)
    with temporary_sibling(p) as tmp:
        yield tmp
        if durable:
            _fsync_file(tmp)
        os.replace(tmp, p)
    if durable:
        fsync_dir(p.parent)


def write_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data`: whole or not at all, also across a crash (see atomic_path)."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def write_all(f: BinaryIO, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of `data` to the unbuffered file `f` (a raw write may take only part of it)."""
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        if not n:
            raise OSError(f"{getattr(f, 'name', f)}: the write took no bytes")
        view = view[n:]


def create_exclusive(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Create `path` with `data` and `mode`, only if it does not exist (FileExistsError otherwise, the existing
    file untouched): written and fsynced under a temporary name, then link(2)ed into place, so the name
    never shows a partial file and two writers never both win."""
    create_exclusive_with(path, lambda f: write_all(f, data), mode)


def create_exclusive_with(path: str | os.PathLike, write: Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """create_exclusive for content too large to hold: `write(f)` writes it into the temporary file (an
    unbuffered binary file). Whatever `write` raises aborts the creation: the temporary is removed and
    `path` never appears."""
    p = Path(path)
    with temporary_sibling(p, mode) as tmp:
        with open(tmp, "r+b", buffering=0) as f:
            write(f)
            os.fsync(f.fileno())
        os.link(tmp, p)
    fsync_dir(p.parent)


__all__ = ["atomic_path", "write_atomic", "create_exclusive", "create_exclusive_with", "write_all", "temporary_sibling",
           "fsync_dir"]
