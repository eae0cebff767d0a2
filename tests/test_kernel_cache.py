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
