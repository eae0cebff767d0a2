"""Names for numba's compiled kernels in `perf` profiles (`scripts/profile_kernels.py`).

perf shows JIT code as bare addresses. It reads a map, /tmp/perf-<pid>.map, one line per symbol:
start address, size (both hex) and name. numba's kernels are in memory, but their symbols are
only in each library's ELF object code, which numba keeps only for a kernel it compiled in this
process: one loaded from the on-disk cache has none. So a profile needs a fresh compile (an empty
NUMBA_CACHE_DIR). Every function of a kernel's object code is named, the inlined helpers' copies
included, by dotted path (`readable`). An address is the symbol's offset in the object plus where
the library's entry function was loaded: the object's text is loaded in one piece.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from numba.core.registry import CPUDispatcher


def _text_symbols(obj: bytes) -> dict[str, tuple[int, int]]:
    """{name: (offset, size)} of the functions in ELF object code (`nm -S`)."""
    with tempfile.NamedTemporaryFile(suffix=".o", delete=False) as f:
        f.write(obj)
    try:
        out = subprocess.run(["nm", "-S", "--defined-only", f.name], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(f.name)
    symbols = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in ("t", "T"):
            symbols[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
    return symbols


def readable(symbol: str) -> str:
    """A numba symbol's dotted path: `_ZN5codec7methods3abc4nameB4v12...` is `codec.methods.abc.name`
    (its length-prefixed parts up to the ABI tags); other symbols as they are."""
    if not symbol.startswith("_ZN"):
        return symbol
    parts, at = [], 3
    while at < len(symbol) and symbol[at].isdigit():
        end = at
        while end < len(symbol) and symbol[end].isdigit():
            end += 1
        n = int(symbol[at:end])
        parts.append(symbol[end:end + n])
        at = end + n
    return ".".join(parts) if parts else symbol


def kernel_symbols(dispatchers: Iterable[CPUDispatcher]) -> list[tuple[int, int, str]]:
    """(address, size, name) of every function of every compiled overload of these kernels whose
    object code this process holds (those compiled here); others are left out."""
    rows = []
    for d in dispatchers:
        for compiled in d.overloads.values():
            cres: Any = compiled  # numba's stubs omit CompileResult's fields
            lib = cres.library
            try:
                obj = lib._get_compiled_object()
            except (RuntimeError, AttributeError):  # loaded from the cache: no object code kept
                continue
            symbols = _text_symbols(obj)
            entry = cres.fndesc.llvm_func_name
            if entry not in symbols:
                continue
            origin = lib.get_pointer_to_function(entry) - symbols[entry][0]
            rows += [(origin + offset, size, readable(name))
                     for name, (offset, size) in symbols.items()]
    return sorted(rows)


def dispatchers_of(modules: Iterable[ModuleType]) -> list[CPUDispatcher]:
    """The numba kernels these modules define at top level."""
    return [v for m in modules for v in vars(m).values() if isinstance(v, CPUDispatcher)]


def write_map(modules: Iterable[ModuleType], path: Path | None = None) -> tuple[Path, int]:
    """Write the perf map of these modules' compiled kernels (default /tmp/perf-<pid>.map, where
    perf looks for this process's). Returns (path, symbols written)."""
    rows = kernel_symbols(dispatchers_of(modules))
    path = Path(f"/tmp/perf-{os.getpid()}.map") if path is None else path
    path.write_text("".join(f"{a:x} {s:x} {n}\n" for a, s, n in rows))
    return path, len(rows)
