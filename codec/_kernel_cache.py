"""Numba's on-disk kernel cache, keyed by the source of every kernel module together.

Numba invalidates a cached kernel when the kernel's own file changes, not when a kernel it calls
in another module does: after an edit to `methods/exponent_classes.py` alone,
`conditional._decode` would keep running the old `positions()` from its cache. So while the
codec's modules are imported, numba caches into a directory named by a digest of all kernel
sources (a change anywhere means fresh compiles), and the setting is restored afterwards so the
caller's own numba caching is untouched. A NUMBA_CACHE_DIR set by the user wins.

Every edit or upgrade leaves a directory behind (~3 MB each), so each import marks its directory
as used and removes all but the KEEP most recently used ones.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numba
import xxhash

HERE = Path(__file__).resolve().parent
KERNEL_SOURCES = ("rans.py", "wire.py", "hashing.py", "patching.py", "methods/conditional.py", "methods/xor_planes.py",
                  "methods/exponent_classes.py", "snapshot_rans.py")
KEEP = 4  # cache directories kept: this version's and the three used most recently before it
_DIGEST_NAME = re.compile(r"[0-9a-f]{16}")


def cache_dir() -> Path:
    h = xxhash.xxh3_64()
    for rel in KERNEL_SOURCES:
        h.update((HERE / rel).read_bytes())
    return _writable_base() / h.hexdigest()


def _writable_base() -> Path:
    """Where digest directories go: next to the code (one cache for every process and user of an
    install), else (installed read-only, or its cache made by another user) a per-user cache,
    else a per-user temporary one. Never an unwritable one: numba would then fall back to its
    own locations, which a kernel edit elsewhere does not invalidate."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltarelay" / "kernels"
    for base in (HERE / "__pycache__" / "kernels", user):
        with contextlib.suppress(OSError):
            base.mkdir(parents=True, exist_ok=True)
        if base.is_dir() and os.access(base, os.W_OK | os.X_OK):
            return base
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"deltarelay-kernels-{uid}"


def prune(current: Path, keep: int = KEEP) -> list[Path]:
    """Marks `current` as just used and removes its sibling cache directories beyond the `keep`
    most recently used (only names of our digest form). Returns what it removed. Best effort: a
    directory another process still loads from costs that process a recompile, nothing more."""
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
        siblings = [p for p in current.parent.iterdir()
                    if p != current and p.is_dir() and _DIGEST_NAME.fullmatch(p.name)]
        siblings.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:  # a read-only or vanished cache: nothing to tidy
        return []
    stale = siblings[max(keep - 1, 0):]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


_USED: Path | None = None  # where the codec's kernels cache, once its modules are imported


def used_dir() -> Path:
    """The directory the codec's kernels cache into (the user's NUMBA_CACHE_DIR if set)."""
    if _USED is not None:
        return _USED
    user = os.environ.get("NUMBA_CACHE_DIR")
    return Path(user) if user else cache_dir()


@contextlib.contextmanager
def keyed_by_sources() -> Iterator[None]:
    global _USED
    if os.environ.get("NUMBA_CACHE_DIR"):
        _USED = Path(os.environ["NUMBA_CACHE_DIR"])
        yield
        return
    config: Any = numba.config  # its settings are module globals set at run time from the environment
    previous = config.CACHE_DIR
    current = cache_dir()
    prune(current)
    config.CACHE_DIR = str(current)
    _USED = current
    try:
        yield
    finally:
        config.CACHE_DIR = previous
