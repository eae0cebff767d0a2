"""Numba's on-disk kernel cache, keyed by the source of every kernel module together.

Numba invalidates a cached kernel when the kernel's own file changes, not when a kernel it calls
in another module does: after an edit to `methods/exponent_classes.py` alone,
`conditional._decode` would keep running the old `positions()` from its cache. So while the
codec's modules are imported, numba caches into a directory named by a digest of all kernel
sources (a change anywhere means fresh compiles), and the setting is restored afterwards so the
caller's own numba caching is untouched. A NUMBA_CACHE_DIR set by the user wins.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numba
import xxhash

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = ("rans.py", "wire.py", "hashing.py", "methods/conditional.py", "methods/exponent_classes.py")


def cache_dir() -> Path:
    h = xxhash.xxh3_64()
    for rel in KERNEL_SOURCES:
        h.update((HERE / rel).read_bytes())
    base = HERE / "__pycache__" / "kernels"
    if not os.access(HERE, os.W_OK):  # installed read-only: a per-user cache instead
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltarelay" / "kernels"
    return base / h.hexdigest()


@contextlib.contextmanager
def keyed_by_sources() -> Iterator[None]:
    if os.environ.get("NUMBA_CACHE_DIR"):
        yield
        return
    previous = numba.config.CACHE_DIR
    numba.config.CACHE_DIR = str(cache_dir())
    try:
        yield
    finally:
        numba.config.CACHE_DIR = previous
