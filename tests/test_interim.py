"""encode(..., compiled=False): a fresh host's first deltas, coded while its kernels compile.

The payload must be one every decoder reads (records byte for byte those of the compiled coders
of the same methods), rebuild the target bit for bit, and run no compiled kernel at all: checked
in a fresh process whose kernel cache is empty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec import container, interim, tensors, wire
from codec.methods import same, sparse, xor_planes
from codec_cases import FORMAT_VERSIONS, assert_bit_exact, clone_all, edge_pair, model_pair

ROOT = Path(__file__).resolve().parents[1]


def test_uvarints_match_the_compiled_writer():
    rng = np.random.default_rng(1)
    edges = np.array([0, 1, 127, 128, 16383, 16384, (1 << 56) - 1, 1 << 56, (1 << 63) - 1], np.int64)
    for values in (np.zeros(0, np.int64), edges, rng.integers(0, 1 << 62, 2000) >> rng.integers(0, 62, 2000)):
        assert interim.uvarints(values) == wire.uvarints(values)


def test_changed_positions_across_chunks(monkeypatch):
    monkeypatch.setattr(interim, "CHUNK", 64)  # many chunks, a ragged last one
    rng = np.random.default_rng(2)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        b = rng.integers(0, 255, 1000).astype(dtype)
        t = b.copy()
        t[rng.choice(1000, 37, replace=False)] ^= 1
        assert np.array_equal(interim.changed_positions(b, t), np.flatnonzero(b != t))
    assert interim.changed_positions(b[:0], t[:0]).size == 0


@pytest.mark.parametrize("effort", ["fast", "default", "max"])
def test_sparse_records_are_the_compiled_coders_bytes(effort):
    base, target = edge_pair(seed=3)
    seen = 0
    for name, b in base.items():
        if b.dtype != torch.bfloat16 or not b.numel():
            continue
        be, te = tensors.element_view(b), tensors.element_view(target[name])
        index = interim.changed_positions(be, te)
        if not index.size:
            continue
        seen += 1
        got = interim.sparse_record(be, te, index, effort)
        want = sparse.encode(be, te, effort, index)
        assert got[0] == want[0], name
        assert [(s.codec, s.raw_len, bytes(s.stored)) for s in got[1]] == \
               [(s.codec, s.raw_len, bytes(s.stored)) for s in want[1]], name
    assert seen >= 2


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("workers", [1, 2])
def test_payload_round_trips_bit_exactly(version, workers):
    """Every dtype and edge case (NaN, -0.0, empty, dense): decode and apply_ rebuild the target, the
    index says the same as the compiled parse, and the methods are the kernel-free ones."""
    base, target = edge_pair(seed=4)
    payload = codec.encode(base, target, format_version=version, workers=workers, compiled=False)
    assert_bit_exact(codec.decode(base, payload), target)
    live = clone_all(base)
    codec.apply_(live, payload)
    assert_bit_exact(live, target)
    assert codec.digests(payload, compiled=False) == codec.digests(payload)
    parsed = container.unpack(payload)
    assert parsed.version == version
    assert {e.method for e in parsed.entries} <= {same.ID, sparse.ID, xor_planes.ID}
    assert any(e.method == sparse.ID for e in parsed.entries)
    assert container.pack(parsed, compiled=False) == container.pack(parsed)  # the same index bytes either way


def test_sparse_payload_is_larger_but_bounded():
    """The price of not waiting: RL-like changes cost a few bytes each instead of about one."""
    base, target = model_pair(n_tensors=4, shape=(256, 256), fraction=0.01, seed=5)
    fast = len(codec.encode(base, target))
    interim_size = len(codec.encode(base, target, compiled=False))
    changes = sum(int((tensors.element_view(base[k]) != tensors.element_view(target[k])).sum()) for k in base)
    assert fast < interim_size < 8 * changes + 4096


_CHILD = r"""
import json, sys
import torch
import codec
from codec import _warmup
base, target = _warmup.checkpoint()
before = _warmup.kernel_signatures()
payload = codec.encode(base, target, compiled=False, workers=2)
found = codec.digests(payload, compiled=False)
after = _warmup.kernel_signatures()
print(json.dumps({"new": sorted(k for k in after if after[k] != before.get(k, ())), "tensors": len(found),
                  "size": len(payload)}))
"""


def test_no_kernel_runs_in_a_fresh_process(tmp_path):
    """An empty kernel cache (a fresh host) and no warm-up: encoding and reading back the digests give no
    kernel a signature, so nothing compiled, loaded or waited for numba's compiler lock. (Importing the
    codec compiles its digest self-check, `hashing`: before `before`.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["new"] == [] and got["tensors"] > 5 and got["size"] > 0
