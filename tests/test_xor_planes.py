"""xor-planes' compiled coders (codec/methods/xor_planes.py) against the numpy reference.

Every element size (1, 2, 4 and 8 bytes), sizes around the kernels' group of 8 and their digest
chunk (`patching.CHUNK`), changes only in a tensor's tail, every element changed, none changed;
the three decoders (a patch, a fresh target, in place) and both encoders agree with numpy, and
forged change counts are refused with the live tensor left exactly as it was.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import codec
from codec import tensors
from codec.container import Entry
from codec.errors import DeltaError
from codec.hashing import digest_elements, running
from codec.methods import xor_planes
from codec.patching import CHUNK

SIZES = (1, 7, 8, 9, 63, CHUNK - 1, CHUNK, CHUNK + 9, 2 * CHUNK + 13)
UINTS = (np.uint8, np.uint16, np.uint32, np.uint64)


def _pair(dtype: type, n: int, where: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    base = rng.integers(0, int(info.max), n, dtype=dtype, endpoint=True)
    if where == "sparse":
        mask = rng.random(n) < 0.01
        mask[[0, -1]] = True  # the first element and the last (in the tail where n % 8)
    elif where == "tail":
        mask = np.zeros(n, bool)
        mask[n // 8 * 8:] = True
        mask[-1] = True
    elif where == "all":
        mask = np.ones(n, bool)
    else:
        mask = np.zeros(n, bool)
    flip = rng.integers(1, int(info.max), n, dtype=dtype, endpoint=True)  # never 0: a masked element changes
    return base, np.where(mask, base ^ flip, base).astype(dtype)


def _entry(base: np.ndarray, target: np.ndarray, compiled: bool = True) -> Entry:
    params, streams = xor_planes.encode(base, target, "fast", compiled=compiled)
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[base.itemsize]
    dt = tensors.dtype_of(torch.from_numpy(base.view(signed)), "t")
    return Entry(name="t", dtype=dt, shape=(base.size,), method=xor_planes.ID,
                 changes=int(np.count_nonzero(base != target)), base_digest=b"", target_digest=b"",
                 params=params, streams=streams)


@pytest.mark.parametrize("dtype", UINTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("where", ["sparse", "tail", "all", "none"])
def test_every_decoder_gives_the_target(dtype, n, where):
    base, target = _pair(dtype, n, where, seed=n)
    entry = _entry(base, target)
    changed = np.flatnonzero(base != target)
    # the compiled and numpy encoders write the same record (codec.interim's path is the numpy one)
    ref = _entry(base, target, compiled=False)
    assert [(s.codec, s.raw_len, bytes(s.stored)) for s in entry.streams] == \
        [(s.codec, s.raw_len, bytes(s.stored)) for s in ref.streams]

    patch = xor_planes.decode(entry, base, {})
    assert np.array_equal(patch.index, changed) and np.array_equal(patch.values, target[changed])

    digest = running("t", (n,))
    count, built = xor_planes.decode_target(entry, base, {}, digest)
    assert count == changed.size and built.dtype == base.dtype and np.array_equal(built, target)
    if digest is not None:  # fed chunk by chunk as the target was written
        assert digest.digest() == digest_elements("t", (n,), target)

    live = base.copy()
    digest = running("t", (n,))
    undo = xor_planes.decode_in_place(entry, live, {}, digest)
    assert np.array_equal(live, target)
    assert np.array_equal(undo.index, changed) and np.array_equal(undo.values, base[changed])
    if digest is not None:
        assert digest.digest() == digest_elements("t", (n,), target)


@pytest.mark.parametrize("dtype", UINTS)
@pytest.mark.parametrize("delta", [-1, +1, 10 ** 9])
def test_a_forged_change_count_is_refused_and_the_tensor_kept(dtype, delta):
    """Too few declared (the in-place pass runs out of room: it restores what it wrote), too many
    (a short count; apply_ reverts it), or more than the tensor holds (refused before allocating)."""
    base, target = _pair(dtype, 3 * CHUNK + 5, "sparse", seed=3)
    entry = _entry(base, target)
    forged = dataclasses.replace(entry, changes=max(entry.changes + delta, 0))
    with pytest.raises(DeltaError, match="changes"):
        xor_planes.decode(forged, base, {})
    # a fresh target allocates nothing by the count: the true count goes back to codec.api, which
    # compares it with the index (the round trip below)
    assert xor_planes.decode_target(forged, base, {})[0] == entry.changes
    live = base.copy()
    if delta < 0 or delta == 10 ** 9:
        with pytest.raises(DeltaError):
            xor_planes.decode_in_place(forged, live, {})
        assert np.array_equal(live, base)
    else:
        assert xor_planes.decode_in_place(forged, live, {}).count == entry.changes


def test_a_short_plane_is_refused_before_anything_is_written():
    base, target = _pair(np.uint32, 1000, "sparse", seed=4)
    entry = _entry(base, target)
    short = dataclasses.replace(entry, streams=[dataclasses.replace(entry.streams[0], raw_len=999), *entry.streams[1:]])
    live = base.copy()
    with pytest.raises(DeltaError, match="plane 0"):
        xor_planes.decode_in_place(short, live, {})
    assert np.array_equal(live, base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128, torch.float16, torch.int8,
                                   torch.bool])
def test_codec_round_trips_and_forged_counts_keep_the_live_tensors(dtype):
    """Through codec.encode / decode / apply_: dtypes whose records are xor-planes, with tensors whose
    sizes are not multiples of 8; a payload whose count is forged leaves apply_'s tensors as they were."""
    g = torch.Generator().manual_seed(0)
    base, target = {}, {}
    for name, shape in (("a", (CHUNK + 3,)), ("b", (37, 5)), ("c", (1,))):
        b = (torch.rand(shape, generator=g) < 0.5) if dtype == torch.bool else \
            torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        t = b.clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
        flat[idx] = ~flat[idx] if dtype == torch.bool else flat[idx] + 1
        base[name], target[name] = b, t
    # v4 codes F16 with the conditional method: its xor-planes records are v3's
    payload = codec.encode(base, target, format_version=3 if dtype == torch.float16 else codec.FORMAT_VERSION)
    parsed = codec.container.unpack(payload)
    assert {e.method for e in parsed.entries} == {xor_planes.ID}
    assert tensors.same_bits(codec.decode(base, payload), target)
    held = {k: v.clone() for k, v in base.items()}
    codec.apply_(held, payload)
    assert tensors.same_bits(held, target)

    edited = [dataclasses.replace(e, changes=e.changes - 1) if e.name == "a" else e for e in parsed.entries]
    forged = codec.container.pack(codec.container.Payload(parsed.version, edited, dict(parsed.shared)))
    held = {k: v.clone() for k, v in base.items()}
    with pytest.raises(DeltaError, match="'a'"):
        codec.apply_(held, forged)
    assert tensors.same_bits(held, base)
