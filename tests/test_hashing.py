"""Digests fed by compiled kernels (hashing.Running, hash_update) against the xxhash binding."""

from __future__ import annotations

import numba as nb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import hashing

pytestmark = pytest.mark.skipif(hashing.NATIVE is None, reason="this xxhash build does not export its C API")


@nb.njit(cache=False)
def _feed(function, state, arr, cuts):
    """arr fed as arr[cuts[i]:cuts[i + 1]] for each i, from compiled code."""
    for i in range(cuts.size - 1):
        hashing.hash_update(function, state, arr, cuts[i], cuts[i + 1])


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 5000), dtype=st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]),
       cuts=st.lists(st.integers(0, 5000), max_size=6), seed=st.integers(0, 2**32 - 1))
def test_kernel_fed_digest_is_the_whole_tensor_digest(size, dtype, cuts, seed):
    """However a kernel splits a tensor (empty parts included), the digest is the one of the
    whole tensor, as the Python binding computes it: any dtype width, any length."""
    data = np.random.default_rng(seed).integers(0, np.iinfo(dtype).max, size, dtype=dtype, endpoint=True)
    bounds = np.array(sorted({0, size, *(c for c in cuts if c <= size)}), np.int64)
    running = hashing.running("X", (size,))
    _feed(np.uintp(running.function), np.uintp(running.state), data, bounds)
    assert running.digest() == hashing.digest_elements("X", (size,), data)


def test_header_names_dtype_and_shape():
    """The same bytes under another dtype or shape give another digest, as with digest_elements."""
    data = np.arange(600, dtype=np.uint16)
    digests = set()
    for dtype_name, shape in (("BF16", (600,)), ("F16", (600,)), ("BF16", (20, 30))):
        running = hashing.running(dtype_name, shape)
        _feed(np.uintp(running.function), np.uintp(running.state), data, np.array([0, 600], np.int64))
        assert running.digest() == hashing.digest_elements(dtype_name, shape, data)
        digests.add(running.digest())
    assert len(digests) == 3


def test_no_running_digests_without_the_c_api(monkeypatch):
    """Where kernels cannot hash, running() says so (callers then hash from Python)."""
    monkeypatch.setattr(hashing, "NATIVE", None)
    assert hashing.running("BF16", (4,)) is None


@nb.njit(cache=False)
def _digest_each(functions, state, headers, hoff, arr, cuts):
    """Digest of each arr[cuts[i]:cuts[i + 1]] with header i, one state reset per digest, all
    inside compiled code (as the batched scan makes them)."""
    out = np.zeros((cuts.size - 1, 2), np.uint64)
    for i in range(cuts.size - 1):
        hashing.hash_reset(functions[0], state)
        hashing.hash_update(functions[1], state, headers, hoff[i], hoff[i + 1])
        hashing.hash_update(functions[1], state, arr, cuts[i], cuts[i + 1])
        out[i, 0], out[i, 1] = hashing.hash_digest(functions[2], state)
    return out


@pytest.mark.skipif(not hashing.KERNEL_DIGESTS, reason="kernels cannot finish digests on this platform")
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 3000), max_size=5), seed=st.integers(0, 2**32 - 1))
def test_kernel_made_digests_are_the_binding_digests(cuts, seed):
    """Digests reset, fed and finished inside a kernel (`hash_reset`, `hash_digest`, one reused
    state) are the binding's, tensor after tensor, empty ones included."""
    data = np.random.default_rng(seed).integers(0, 1 << 16, 3000, dtype=np.uint16)
    bounds = np.array(sorted({0, *cuts}), np.int64)
    shapes = [(int(bounds[i + 1] - bounds[i]),) for i in range(bounds.size - 1)]
    headers = [hashing.header_bytes("BF16", shape) for shape in shapes]
    hoff = np.zeros(len(headers) + 1, np.int64)
    np.cumsum([len(h) for h in headers], out=hoff[1:])
    scratch = hashing.Scratch(hashing.NATIVE)
    halves = _digest_each(hashing.NATIVE.functions(), scratch.states[0], np.frombuffer(b"".join(headers), np.uint8),
                          hoff, data, bounds)
    blob = hashing.digest_bytes(halves)
    for i, shape in enumerate(shapes):
        want = hashing.digest_elements("BF16", shape, data[bounds[i]: bounds[i + 1]])
        assert blob[16 * i: 16 * (i + 1)] == want
