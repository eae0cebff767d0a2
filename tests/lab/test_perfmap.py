"""codec.lab.perfmap: perf's names for compiled kernels."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numba as nb
import numpy as np
import pytest

from codec.lab import perfmap


def test_readable_gives_the_dotted_path_of_a_numba_symbol():
    mangled = "_ZN5codec7methods16exponent_classes17positions_betweenB4v191B52c8tJTIeFIjxB2IKSgE"
    assert perfmap.readable(mangled) == "codec.methods.exponent_classes.positions_between"
    assert perfmap.readable("XXH3_update_avx512") == "XXH3_update_avx512"


needs_nm = pytest.mark.skipif(shutil.which("nm") is None or not sys.platform.startswith("linux"),
                              reason="reads ELF object code with nm")


@needs_nm
def test_the_map_names_a_kernel_compiled_here_at_its_entry_address(tmp_path):
    def summed(a):
        s = 0
        for x in a:
            s += x
        return s

    kernel = nb.njit(cache=False)(summed)
    assert kernel(np.arange(10)) == 45
    module = types.ModuleType("lab_kernels")
    module.summed = kernel
    path, count = perfmap.write_map([module], tmp_path / "perf.map")
    rows = [line.split(" ", 2) for line in path.read_text().splitlines()]
    assert count == len(rows) > 0
    cres = next(iter(kernel.overloads.values()))
    entry = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    # the kernel's own symbol, by its dotted path, starts exactly where numba loaded it
    named = {int(a, 16): int(s, 16) for a, s, n in rows if n.endswith(".summed")}
    assert named.get(entry, 0) > 0
    starts = sorted(int(a, 16) for a, _, _ in rows)
    assert starts == sorted(set(starts))  # one row per symbol


def test_an_uncompiled_kernel_is_left_out(tmp_path):
    kernel = nb.njit(cache=False)(lambda x: x + 1)  # never called: no overloads at all
    module = types.ModuleType("lab_kernels")
    module.k = kernel
    assert perfmap.write_map([module], tmp_path / "perf.map")[1] == 0


_CACHED = """
import numba as nb, numpy as np, sys
@nb.njit(cache=True)
def twice(a):
    return a * 2
twice(np.arange(3))
from codec.lab import perfmap
print(perfmap.write_map([sys.modules[__name__]], __import__("pathlib").Path(sys.argv[1]))[1])
"""


@needs_nm
def test_a_kernel_loaded_from_the_cache_is_left_out(tmp_path):
    """Only a kernel compiled in the process has object code: the second run loads it from
    numba's cache and can name nothing (which is why the profiler compiles afresh)."""
    (tmp_path / "cached_kernel.py").write_text(_CACHED)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, str(tmp_path / "cached_kernel.py"), str(tmp_path / "map")], env=env,
                           capture_output=True, text=True, check=True).stdout.split() for _ in range(2)]
    assert int(runs[0][-1]) > 0 and int(runs[1][-1]) == 0


def test_the_profiler_says_what_it_needs_without_perf(tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "profile_kernels.py"
    env = dict(os.environ, PATH=str(tmp_path))  # no perf on it
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and "needs `perf`" in run.stderr
