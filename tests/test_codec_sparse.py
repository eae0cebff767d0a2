"""sparse-split's gap positions (codec/methods/sparse.py, `_gap_positions`): every malformed gap
stream is refused with its reason, and a hostile one cannot make the decoder use memory out of
proportion to the tensor (a few KB of zstd once took ~200 bytes per element of it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from codec.methods import sparse

ROOT = Path(__file__).resolve().parents[1]


def _varints(values, width=None) -> np.ndarray:
    out = bytearray()
    for v in values:
        n = 0
        while True:
            n += 1
            more = v >= 0x80 or (width is not None and n < width)
            out.append((v & 0x7F) | (0x80 if more else 0))
            v >>= 7
            if not more:
                break
    return np.frombuffer(bytes(out), np.uint8)


def test_gaps_give_positions():
    at, status = sparse._gap_positions(_varints([0, 0, 5, 300, 2 ** 40]), 5, 2 ** 41 + 400)
    assert status == 0 and at.tolist() == [0, 1, 7, 308, 308 + 2 ** 40 + 1]
    at, status = sparse._gap_positions(_varints([3, 1], width=7), 2, 10)  # non-minimal varints are valid
    assert status == 0 and at.tolist() == [3, 5]
    assert sparse._gap_positions(_varints([]), 0, 10)[1] == 0


@pytest.mark.parametrize("stream, count, n, status", [
    ([0, 0], 3, 10, 1),  # fewer varints than the params say
    ([0, 0, 0, 0], 3, 10, 1),  # more
    ("truncated", 1, 10, 1),  # the last one unfinished
    ("eight bytes", 1, 10, 2),  # longer than MAX_VARINT_BYTES
    ([9], 1, 10, 0),  # the last element
    ([10], 1, 10, 3),  # past it
    ([4, 4], 2, 10, 0),
    ([4, 5], 2, 10, 3),
])
def test_malformed_gaps_are_refused(stream, count, n, status):
    if stream == "truncated":
        buf = np.frombuffer(b"\x81", np.uint8)
    elif stream == "eight bytes":
        buf = np.frombuffer(b"\x80" * 7 + b"\x00", np.uint8)
    else:
        buf = _varints(stream)
    assert sparse._gap_positions(buf, count, n)[1] == status


_CHILD = r"""
import json, resource, sys
import numpy as np, torch
import codec
from codec import compressors, container
from codec.hashing import digest_elements
n = int(sys.argv[1])
base = torch.zeros(n, dtype=torch.bfloat16)
target = base.clone(); target.view(torch.int16)[:] = 1
elems = lambda t: t.view(torch.int16).numpy().view(np.uint16)
positions = b"\x80\x80\x80\x80\x80\x80\x00" * n  # every gap 0, as a 7-byte varint: valid, and the worst case
streams = [container.Stream(1, len(positions), compressors.compress(1, positions, 19)),
           container.Stream(1, (n + 7) // 8, compressors.compress(1, b"\x00" * ((n + 7) // 8), 19)),
           container.Stream(1, n, compressors.compress(1, b"\x01" * n, 19)), container.Stream(0, 0, b"")]
entry = container.Entry("w", codec.tensors.BF16, (n,), 2, n, digest_elements("BF16", (n,), elems(base)),
                        digest_elements("BF16", (n,), elems(target)), bytes([0]) + codec.wire.uvarints(np.array([n])),
                        streams)
payload = container.pack(container.Payload(1, [entry], {}))
small = {"w": torch.zeros(64, dtype=torch.bfloat16)}
codec.decode(small, codec.encode(small, {"w": torch.ones(64, dtype=torch.bfloat16)}, format_version=1))  # warm
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = codec.decode({"w": base}, payload)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"payload": len(payload), "grew": (after - before) * 1024, "exact": torch.equal(out["w"], target)}))
"""


def test_a_hostile_gap_stream_takes_memory_in_proportion_to_the_tensor(tmp_path):
    n = 1 << 22
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _CHILD, str(n)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["exact"] and got["payload"] < 20_000
    # the positions' 7 bytes, 8 for each position, a few more per change for kinds and values: was ~207
    assert got["grew"] < 48 * n, got["grew"] / n
