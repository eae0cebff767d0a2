"""The compiled-kernel cache is keyed by every kernel source, so a stale kernel never runs."""

from __future__ import annotations

import shutil

import numba

from codec import _kernel_cache
from codec.methods import conditional, exponent_classes


def test_kernels_cache_under_the_digest_of_all_kernel_sources():
    expected = _kernel_cache.cache_dir()
    for kernel in (conditional._decode, conditional._encode, exponent_classes.positions, exponent_classes._analyze):
        assert str(kernel._cache._cache_path).startswith(str(expected))
    assert numba.config.CACHE_DIR in ("", None) or "deltarelay" not in str(numba.config.CACHE_DIR)


def test_editing_any_kernel_module_moves_the_cache(tmp_path, monkeypatch):
    """conditional._decode calls exponent_classes.positions: numba alone would keep the caller's
    stale cache when only the callee's file changed."""
    tree = tmp_path / "codec"
    for rel in _kernel_cache.KERNEL_SOURCES:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_kernel_cache.HERE / rel, tree / rel)
    monkeypatch.setattr(_kernel_cache, "HERE", tree)
    before = _kernel_cache.cache_dir()
    with open(tree / "methods" / "exponent_classes.py", "a") as f:
        f.write("\n# an edit\n")
    after = _kernel_cache.cache_dir()
    assert before != after and before.parent == after.parent


def test_old_cache_directories_are_pruned_most_recently_used_kept(tmp_path):
    """Each edit or upgrade leaves a directory of compiled kernels behind; only the KEEP most
    recently used survive, and nothing that is not a digest-named directory is touched."""
    import os
    root = tmp_path / "kernels"
    dirs = [root / f"{i:016x}" for i in range(7)]
    for age, d in enumerate(dirs):  # dirs[0] used most recently, dirs[6] longest ago
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "k.nbi").write_bytes(b"x")
        os.utime(d, (1_000_000 - age, 1_000_000 - age))
    (root / "notes").mkdir()
    (root / "readme.txt").write_text("mine")
    current = root / "00000000000000ff"  # this version's, not yet created
    removed = _kernel_cache.prune(current, keep=4)
    assert sorted(removed) == sorted(dirs[3:])
    assert current.is_dir() and all(d.is_dir() for d in dirs[:3])
    assert not any(d.exists() for d in dirs[3:])
    assert (root / "notes").is_dir() and (root / "readme.txt").read_text() == "mine"
    # using an old directory again makes it the most recent: now dirs[2] is the oldest kept
    assert _kernel_cache.prune(dirs[2], keep=3) == [dirs[1]]
    assert _kernel_cache.prune(dirs[2], keep=3) == []


def test_pruning_a_cache_it_cannot_write_is_a_no_op(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _kernel_cache.prune(blocker / "0123456789abcdef") == []


_CACHED_KERNEL = """
import numpy as np
from codec import rans
from codec.methods import conditional as C

pairs = (np.uint32(0x3F80) << np.uint32(16)) | np.array([0x3F81, 0x3F82, 0x3F83], np.uint32)
cls, ranks = np.zeros(3, np.uint8), np.arange(3)
model = C.ValueModel(rans.normalize(np.ones(C.VALUE_TOKENS), C.VALUE_SCALE, floor_all=True)[None, :], np.array([0x7F]))
levels = np.zeros(8, np.int64)
mfreq, mcum, mslot = C.mask_tables()
mrcp, mrsh = C.mask_reciprocals()
counts = np.array([3, 0, 0, 0, 0, 0, 0, 0])
four, direct = {four}, {direct}
n = 4 if four else 2
if direct:  # only this state count's kernels, compiled (and cached) in this process
    enc, gaps, vals = (C._encode4, C._decode_gaps4, C._decode_values4) if four else (C._encode2, C._decode_gaps2,
                                                                                      C._decode_values2)
else:  # the dispatchers, linking both counts' kernels
    enc, gaps, vals = (lambda *a: C._encode(*a, four), lambda w, *a: C._decode_gaps(64, 64, w, *a[:4], four, *a[4:]),
                       lambda *a: C._decode_values(*a[:9], four, *a[9:]))
words, nw, *final = enc(pairs, C._value_symbols(pairs), cls, ranks, counts, levels, mcum, mfreq, mrcp, mrsh, model.cum,
                        model.freq, model.rcp, model.rsh, model.row_of_key)
w, xs = rans.bytes_to_words(rans.words_to_bytes(words, nw, tuple(int(x) for x in final[:n])), n)
xs = [np.int64(x) for x in xs + (rans.RANS_L,) * (4 - n)]
if direct:
    _, _, _, *state, status = gaps(64, 64, w, *xs, levels, counts, mcum, mfreq, mslot)
else:
    _, _, _, *state, status = gaps(w, *xs, levels, counts, mcum, mfreq, mslot)
out = np.full(3, 0x3F80, np.uint16)
*end, status = vals(out.copy(), ranks, 0, 3, w, *state, model.cum, model.freq, model.slots, model.row_of_key,
                    np.empty(0, np.uint16), out)
assert status == 0 and end == [rans.RANS_L] * 4 + [-1], (four, end, status)
assert out.tolist() == [0x3F81, 0x3F82, 0x3F83], out
"""


def test_kernels_per_state_count_never_swap_when_cached(tmp_path):
    """The two- and four-state kernels are one source compiled twice. Each compiled and cached
    by its own process (where it gets the same per-process serial), then linked together by a
    third: each must still run its own code. numba links cached code by symbol name, and one
    name per source swapped them once (a v2 stream decoded with four states)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "kernels")}
    for four, direct in ((True, True), (False, True), (False, False), (True, False)):
        run = subprocess.run([sys.executable, "-c", _CACHED_KERNEL.format(four=four, direct=direct)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (four, direct, run.stderr[-2000:])
