"""Hostile payloads: corrupt, truncated, forged (checksum recomputed) or made for another base.

The property everywhere: decode raises codec.DeltaError (naming the tensor where there is one)
or returns exactly the target; it never raises anything else and never returns wrong tensors.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import codec
from codec import compressors, container
from codec_cases import (
    FORMAT_VERSIONS,
    PREFIX,
    assert_bit_exact,
    bf16_from_bits,
    clone_all,
    edge_pair,
    fix_checksum,
    join_payload,
    random_bf16_weights,
    random_tensor,
    rl_step,
    split_payload,
)


def small_pair() -> tuple[dict, dict]:
    """A few tensors, one per kind of record (sparse BF16, dense BF16, integer, unchanged, 0-d)."""
    rng = np.random.default_rng(21)
    base = {
        "sparse": random_bf16_weights((40, 50), rng),
        "dense": random_bf16_weights((6, 7), rng),
        "ints": random_tensor(torch.int32, (23,), rng),
        "same": random_bf16_weights((9,), rng),
        "scalar": bf16_from_bits([0x7FC1], ()),
    }
    target = clone_all(base)
    target["sparse"] = rl_step(base["sparse"], 0.02, rng)
    target["dense"] = rl_step(base["dense"], 1.0, rng)
    target["ints"][::3] += 1
    target["scalar"] = bf16_from_bits([0xFF80], ())
    return base, target


_BASE, _TARGET = small_pair()
_PAYLOADS = {v: codec.encode(_BASE, _TARGET, format_version=v) for v in FORMAT_VERSIONS}


@pytest.fixture(params=FORMAT_VERSIONS, ids=lambda v: f"v{v}")
def case(request):
    """(base, target, payload): fresh copies, so a test may damage them."""
    return clone_all(_BASE), clone_all(_TARGET), _PAYLOADS[request.param]


def refused_or_exact(base, payload, target) -> codec.DeltaError | None:
    """Decode a suspect payload: DeltaError (returned) or exactly the target; anything else fails."""
    try:
        out = codec.decode(base, payload)
    except codec.DeltaError as exc:
        assert str(exc), "a refusal must say why"
        return exc
    assert_bit_exact(out, target)
    return None


def refused(base, payload, tensor: str | None = None) -> codec.DeltaError:
    with pytest.raises(codec.DeltaError) as err:
        codec.decode(base, payload)
    if tensor is not None:
        assert tensor in str(err.value), str(err.value)
    return err.value


# --- corruption and truncation ------------------------------------------------------------------

def test_every_single_bit_flip_is_refused(case):
    base, _, payload = case
    data = bytearray(payload)
    for i in range(len(data)):
        for bit in range(8):
            data[i] ^= 1 << bit
            refused(base, bytes(data))
            with pytest.raises(codec.DeltaError):
                codec.describe(bytes(data))
            data[i] ^= 1 << bit


def test_every_truncation_is_refused(case):
    base, _, payload = case
    for n in range(len(payload)):
        refused(base, payload[:n])
        with pytest.raises(codec.DeltaError):
            codec.describe(payload[:n])


@pytest.mark.parametrize("tail", [b"\x00", b"garbage", bytes(1000)])
def test_trailing_bytes_are_refused(case, tail):
    base, _, payload = case
    refused(base, payload + tail)
    refused(base, fix_checksum(payload + tail))


@pytest.mark.parametrize("junk", [b"", b"DRDELTA", b"DRDELTA\x00" + bytes(24), bytes(64), b"PK\x03\x04" * 40])
def test_not_a_payload(case, junk):
    base, _, _ = case
    refused(base, junk)


# --- wrong base ---------------------------------------------------------------------------------

@pytest.mark.parametrize("victim", ["sparse", "dense", "ints", "same", "scalar"])
def test_base_with_one_tensor_changed_is_named(case, victim):
    base, _, payload = case
    other = clone_all(base)
    other[victim].reshape(-1).view(torch.uint8)[0] ^= 0x01
    err = refused(other, payload, victim)
    assert err.tensor == victim


def test_target_is_not_a_base(case):
    _, target, payload = case
    refused(target, payload)


def test_base_missing_a_tensor(case):
    base, _, payload = case
    del base["ints"]
    refused(base, payload, "ints")


def test_base_with_an_extra_tensor(case):
    base, _, payload = case
    base = dict(base, intruder=torch.zeros(2))
    refused(base, payload, "intruder")


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_base_with_other_shape_or_dtype(case, change):
    base, _, payload = case
    base = dict(base)
    base["sparse"] = base["sparse"].reshape(50, 40) if change == "shape" else base["sparse"].view(torch.float16)
    refused(base, payload, "sparse")


def test_another_checkpoint_entirely(case):
    _, _, payload = case
    rng = np.random.default_rng(0)
    refused({"model.embed": random_bf16_weights((10, 10), rng)}, payload)
    other_base, _ = edge_pair()
    refused(other_base, payload)


# --- forged payloads: valid container, checksum recomputed ----------------------------------------

def _forge(payload: bytes, tensor: str, edit) -> bytes:
    parsed = container.unpack(payload)
    entries = []
    for e in parsed.entries:
        if e.name == tensor:
            e = dataclasses.replace(e, streams=[dataclasses.replace(s) for s in e.streams])
            e = edit(e) or e
        entries.append(e)
    return container.pack(container.Payload(parsed.version, entries, dict(parsed.shared)))


def _flip(b: bytes) -> bytes:
    return bytes([b[0] ^ 0x01]) + b[1:]


def _other_dtype(e):
    alike = [d for d in container.tensors.DTYPES if d.itemsize == e.dtype.itemsize and d != e.dtype]
    return dataclasses.replace(e, dtype=alike[0])


FORGERIES = {
    "target-digest": lambda e: dataclasses.replace(e, target_digest=_flip(e.target_digest)),
    "both-digests": lambda e: dataclasses.replace(e, base_digest=_flip(e.base_digest),
                                                  target_digest=_flip(e.target_digest)),
    "shape-grown": lambda e: dataclasses.replace(e, shape=(e.shape[0] * 2 + 1, *e.shape[1:]) if e.shape else (2,)),
    "shape-huge": lambda e: dataclasses.replace(e, shape=(1 << 40, 1 << 7)),
    "shape-rank": lambda e: dataclasses.replace(e, shape=(*e.shape, 1)),
    "dtype": _other_dtype,
    "method-unknown": lambda e: dataclasses.replace(e, method=200),
    "method-same": lambda e: dataclasses.replace(e, method=0) if e.method else dataclasses.replace(e, method=1),
    "method-rotate": lambda e: dataclasses.replace(e, method=1 + e.method % 2),
    "changes-plus": lambda e: dataclasses.replace(e, changes=e.changes + 1),
    "changes-minus": lambda e: dataclasses.replace(e, changes=max(e.changes - 1, 0) if e.changes else 1),
    "streams-reversed": lambda e: dataclasses.replace(e, streams=e.streams[::-1]) if len(e.streams) > 1 else
    dataclasses.replace(e, target_digest=_flip(e.target_digest)),
    "stream-dropped": lambda e: dataclasses.replace(e, streams=e.streams[:-1]) if e.streams else
    dataclasses.replace(e, streams=[container.Stream(0, 1, b"\x01")]),
    "stream-added": lambda e: dataclasses.replace(e, streams=[*e.streams, container.Stream(0, 1, b"\x01")]),
    "raw-len-huge": lambda e: dataclasses.replace(e, streams=[dataclasses.replace(s, raw_len=1 << 60)
                                                              for s in e.streams])
    if e.streams else dataclasses.replace(e, streams=[container.Stream(1, 1 << 60, b"\x28\xb5\x2f\xfd")]),
    "raw-len-plus": lambda e: dataclasses.replace(e, streams=[dataclasses.replace(s, raw_len=s.raw_len + 1)
                                                              for s in e.streams])
    if e.streams else dataclasses.replace(e, params=b"\x00"),
    "codec-swap": lambda e: dataclasses.replace(e, streams=[dataclasses.replace(s, codec=(s.codec + 1) % 4)
                                                            for s in e.streams])
    if e.streams else dataclasses.replace(e, params=b"\x00"),
    "codec-unknown": lambda e: dataclasses.replace(e, streams=[dataclasses.replace(s, codec=99) for s in e.streams])
    if e.streams else dataclasses.replace(e, streams=[container.Stream(99, 0, b"")]),
    "params-junk": lambda e: dataclasses.replace(e, params=e.params + b"\x00"),
    "params-empty": lambda e: (dataclasses.replace(e, params=b"") if e.params
                               else dataclasses.replace(e, params=b"\x07\x01")),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
@pytest.mark.parametrize("victim", ["sparse", "dense", "ints", "same", "scalar"])
def test_forged_index_field_is_refused_naming_the_tensor(case, forgery, victim):
    base, _, payload = case
    forged = _forge(payload, victim, FORGERIES[forgery])
    err = refused(base, forged, victim)
    assert err.tensor == victim or err.tensor is None and victim in str(err)


@pytest.mark.parametrize("victim", ["sparse", "dense", "ints", "same", "scalar"])
def test_forged_base_digest_alone_is_refused_or_exact(case, victim):
    """A decoder may check the base digest only on failure (the target digest proves success):
    then a payload whose base digest alone was altered still yields exactly the target."""
    base, target, payload = case
    forged = _forge(payload, victim, lambda e: dataclasses.replace(e, base_digest=_flip(e.base_digest)))
    err = refused_or_exact(base, forged, target)
    assert err is None or victim in str(err)


@pytest.mark.parametrize("victim", ["sparse", "dense", "ints", "scalar"])
def test_forged_stream_bytes_are_refused_or_exact(case, victim):
    """Every byte of every stream of a tensor, tampered and re-checksummed: the tensor digest catches it."""
    base, target, payload = case
    parsed = container.unpack(payload)
    entry = next(e for e in parsed.entries if e.name == victim)
    refusals = 0
    for k, s in enumerate(entry.streams):
        for i in range(len(s.stored)):
            for xor in (0x01, 0x80):
                def edit(e, k=k, i=i, xor=xor):
                    raw = bytearray(e.streams[k].stored)
                    raw[i] ^= xor
                    e.streams[k].stored = bytes(raw)
                err = refused_or_exact(base, _forge(payload, victim, edit), target)
                if err is not None:
                    refusals += 1
                    assert victim in str(err)
    assert refusals > 0


def test_swapped_records_are_refused(case):
    """Two same-shaped records exchange names: each now claims the other's base."""
    base, target, payload = case
    base = dict(base, twin=base["dense"].clone().reshape(-1).flip(0).reshape(6, 7).contiguous())
    target = dict(target, twin=rl_step(base["twin"], 0.5, np.random.default_rng(1)))
    payload = codec.encode(base, target)
    parsed = container.unpack(payload)
    for e in parsed.entries:
        e.name = {"dense": "twin", "twin": "dense"}.get(e.name, e.name)
    refused(base, container.pack(parsed))


def test_duplicate_and_missing_records(case):
    base, _, payload = case
    parsed = container.unpack(payload)
    dup = container.Payload(parsed.version, parsed.entries + parsed.entries[:1], parsed.shared)
    refused(base, container.pack(dup), parsed.entries[0].name)
    dropped = container.Payload(parsed.version, [e for e in parsed.entries if e.name != "ints"], parsed.shared)
    refused(base, container.pack(dropped), "ints")


def test_relabelled_version_is_refused_or_exact(case):
    base, target, payload = case
    for version in range(0, 5):
        data = bytearray(payload)
        data[8:10] = version.to_bytes(2, "little")
        refused_or_exact(base, bytes(data), target)


def test_every_raw_index_byte_tampered(case):
    """Each byte of the decompressed index, flipped and re-framed: refused or exact, never anything else."""
    base, target, payload = case
    version, index, body = split_payload(payload)
    assert join_payload(version, index, body) != b""
    for i in range(len(index)):
        for xor in (0x01, 0x40, 0xFF):
            raw = bytearray(index)
            raw[i] ^= xor
            refused_or_exact(base, join_payload(version, bytes(raw), body), target)
    for n in range(len(index)):  # truncated index, re-framed
        refused(base, join_payload(version, index[:n], body))


def test_every_body_byte_tampered_with_checksum_fixed(case):
    base, target, payload = case
    data = bytearray(payload)
    _, index, body = split_payload(payload)
    start = len(payload) - len(body)
    for i in range(start, len(data)):
        data[i] ^= 0xFF
        refused_or_exact(base, fix_checksum(bytes(data)), target)
        data[i] ^= 0xFF


def test_edge_checkpoint_forgeries(case):
    """Target-digest forgery on every record of the edge-case checkpoint, both versions."""
    base, target = edge_pair()
    for version in FORMAT_VERSIONS:
        payload = codec.encode(base, target, format_version=version)
        for name in target:
            err = refused(base, _forge(payload, name, FORGERIES["target-digest"]), name)
            assert err.tensor == name


def _zstd_frame_declaring(raw: bytes, declared: int) -> bytes:
    """A valid zstd frame holding `raw` in one raw block whose header claims `declared` bytes."""
    header = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + declared.to_bytes(8, "little")  # 8-byte content size
    return header + ((len(raw) << 3) | 1).to_bytes(3, "little") + raw  # last block, raw, len(raw)


def test_index_frame_declaring_a_huge_size_is_refused(case):
    """zstd's one-shot decompress allocates what the frame header claims: that claim is checked first."""
    base, target, payload = case
    version, index, body = split_payload(payload)

    def framed(frame: bytes) -> bytes:
        rest = frame + body
        return fix_checksum(PREFIX.pack(b"DRDELTA\x00", version, 0, len(frame), bytes(16)) + rest)

    assert_bit_exact(codec.decode(base, framed(_zstd_frame_declaring(index, len(index)))), target)
    for declared in (1 << 30, 1 << 60):
        with pytest.raises(codec.DeltaError, match="index"):
            codec.decode(base, framed(_zstd_frame_declaring(index, declared)))


def test_stream_frame_declaring_a_huge_size_allocates_nothing(case):
    base, target, payload = case
    parsed = container.unpack(payload)
    entry = next(e for e in parsed.entries if e.name == "ints")
    s = entry.streams[0]
    raw = compressors.decompress(s.codec, s.stored, s.raw_len, "plane 0")
    entry.streams[0] = container.Stream(compressors.ZSTD, s.raw_len, _zstd_frame_declaring(raw, len(raw)))
    assert_bit_exact(codec.decode(base, container.pack(parsed)), target)  # the forging helper is sound

    entry.streams[0] = container.Stream(compressors.ZSTD, s.raw_len, _zstd_frame_declaring(raw, 1 << 30))
    forged = container.pack(parsed)
    tracemalloc.start()
    try:
        with pytest.raises(codec.DeltaError, match="ints"):
            codec.decode(base, forged)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"a {len(forged)}-byte payload made decode allocate {peak} bytes"


def _with_index_frame(payload: bytes, frame: bytes) -> bytes:
    """`payload` with its index frame replaced by `frame` (any bytes), checksum fixed."""
    version, _, body = split_payload(payload)
    return fix_checksum(PREFIX.pack(b"DRDELTA\x00", version, 0, len(frame), bytes(16)) + frame + body)


@pytest.mark.parametrize("content_size", [True, False], ids=["declared", "undeclared"])
def test_tiny_payload_whose_index_inflates_is_refused_before_it_allocates(case, content_size):
    """A few-KiB payload whose index decompresses to 128 MiB (under MAX_INDEX_BYTES): before the ratio bound
    the decoder inflated all of it (and then reserved gigabytes of scan columns sized by it); now the frame's
    size bounds what it may decompress to, so it is refused at once, having allocated next to nothing."""
    import time

    base, _, payload = case
    _, index, _ = split_payload(payload)
    bomb = index + bytes(128 << 20)
    frame = zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(bomb)
    forged = _with_index_frame(payload, frame)
    assert len(forged) < 64 << 10
    started = time.perf_counter()
    tracemalloc.start()
    try:
        for parse in (lambda: codec.decode(base, forged), lambda: codec.apply_(clone_all(base), forged),
                      lambda: container.unpack(forged), lambda: codec.describe(forged)):
            with pytest.raises(codec.DeltaError, match="index"):
                parse()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"a {len(forged)}-byte payload made the decoder allocate {peak} bytes"
    assert time.perf_counter() - started < 2.0


def test_index_claims_are_bounded_by_what_the_index_can_hold():
    """An incompressible 32 MiB index (within every size and ratio limit) that claims one entry: the scan used to
    reserve dims, streams and shared columns sized by the whole index (about 1 GB), which under an address-space
    limit escaped as a MemoryError; now its columns are sized by the entry count and grow as they are read. Run in
    a child process under RLIMIT_AS, so a reservation that is too large fails instead of being overcommitted."""
    import subprocess
    import sys
    from pathlib import Path

    script = r"""
import os, resource, sys
sys.path.insert(0, "tests")
import numpy as np, zstandard
import codec
from codec import container
from codec_cases import PREFIX, fix_checksum, split_payload
from test_codec_hostile import _BASE, _PAYLOADS

payload = _PAYLOADS[3]
version, _, body = split_payload(payload)
codec.decode(_BASE, payload)  # compiled kernels loaded before the limit
raw = b"\x01" + np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8).tobytes()
frame = zstandard.ZstdCompressor(level=1).compress(raw)
forged = fix_checksum(PREFIX.pack(b"DRDELTA\x00", version, 0, len(frame), bytes(16)) + frame + body)
vm = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
for parse in (lambda: container.unpack(forged), lambda: codec.decode(_BASE, forged)):
    try:
        parse()
    except codec.DeltaError as exc:
        print("DeltaError", exc)
    except BaseException as exc:
        print("ESCAPED", type(exc).__name__, exc)
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("DeltaError") for line in lines), out.stdout + out.stderr[-2000:]


def test_pack_never_writes_an_index_the_decoder_would_refuse(case):
    """The ratio bound is a decoder limit, so the encoder checks it too: 64 near-identical 60 KiB names compress
    about 1000x, and pack refuses that index (ValueError) rather than publish a payload nobody can read."""
    _, _, payload = case
    parsed = container.unpack(payload)
    entry = parsed.entries[0]
    stem = "x" * (60 << 10)
    parsed.entries = [dataclasses.replace(entry, name=f"{stem}{i}", streams=[]) for i in range(64)]
    with pytest.raises(ValueError, match="limit"):
        container.pack(parsed)


# --- fuzzing ------------------------------------------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
mutation = st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255))


def _mutate(data: bytes, muts, cut, extra) -> bytes:
    out = bytearray(data)
    for pos, xor in muts:
        if out:
            out[pos % len(out)] ^= xor
    if cut is not None and out:
        del out[cut % len(out):]
    return bytes(out) + extra


def _check_fuzzed(payload: bytes) -> None:
    try:
        info = codec.describe(payload)
    except codec.DeltaError:
        pass
    else:
        assert isinstance(info, dict)
    refused_or_exact(_BASE, payload, _TARGET)
    live = clone_all(_BASE)  # and in place: refused with every bit restored, or exactly the target
    try:
        codec.apply_(live, payload)
    except codec.DeltaError:
        assert_bit_exact(live, _BASE)
    else:
        assert_bit_exact(live, _TARGET)


@FUZZ
@given(version=st.sampled_from(FORMAT_VERSIONS), muts=st.lists(mutation, max_size=4),
       cut=st.none() | st.integers(min_value=0), extra=st.binary(max_size=8), fix=st.booleans())
def test_fuzz_payload_bytes(version, muts, cut, extra, fix):
    data = _mutate(_PAYLOADS[version], muts, cut, extra)
    _check_fuzzed(fix_checksum(data) if fix else data)


@FUZZ
@given(version=st.sampled_from(FORMAT_VERSIONS), muts=st.lists(mutation, min_size=1, max_size=3),
       cut=st.none() | st.integers(min_value=0), extra=st.binary(max_size=4))
def test_fuzz_raw_index(version, muts, cut, extra):
    v, index, body = split_payload(_PAYLOADS[version])
    _check_fuzzed(join_payload(v, _mutate(index, muts, cut, extra), body))


@FUZZ
@given(version=st.sampled_from(FORMAT_VERSIONS), muts=st.lists(mutation, min_size=1, max_size=3))
def test_fuzz_body_with_checksum_fixed(version, muts):
    payload = _PAYLOADS[version]
    _, _, body = split_payload(payload)
    start = len(payload) - len(body)
    data = bytearray(payload)
    for pos, xor in muts:
        data[start + pos % len(body)] ^= xor
    _check_fuzzed(fix_checksum(bytes(data)))


# --- the index's compiled fast path -------------------------------------------------------------


def _parsed(raw_index: bytes, body: bytes):
    """(fast, checked) parse of an index over a body: fast is None where it declined; checked is
    the entries and shared blocks, or the DeltaError it raised."""
    rest = memoryview(b"\0" * 7 + body)  # the parsers index streams from index_len into `rest`
    fast = container._entries_fast(raw_index, rest, 7)
    try:
        checked = container._entries_checked(raw_index, rest, 7)
    except codec.DeltaError as exc:
        checked = exc
    return fast, checked


def _same(fast, checked) -> None:
    entries, shared = fast
    assert shared == checked[1]
    assert len(entries) == len(checked[0])
    for a, b in zip(entries, checked[0]):
        assert (dataclasses.astuple(dataclasses.replace(a, streams=[]))
                == dataclasses.astuple(dataclasses.replace(b, streams=[])))
        assert [(s.codec, s.raw_len, bytes(s.stored)) for s in a.streams] == \
               [(s.codec, s.raw_len, bytes(s.stored)) for s in b.streams]


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_index_fast_path_matches_the_checked_parser(version):
    """Well-formed indexes parse to the same payload both ways, and pack writes what the
    field-by-field writer writes."""
    for base, target in (small_pair(), edge_pair()):
        payload = codec.encode(base, target, format_version=version)
        _, index, body = split_payload(payload)
        fast, checked = _parsed(index, body)
        assert fast is not None
        _same(fast, checked)
        parsed = container.unpack(payload)
        assert container._index_bytes(parsed) == container._index_bytes_reference(parsed) == index


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_index_fast_path_never_accepts_what_the_checked_parser_refuses(data):
    """Mutated indexes (bytes flipped, inserted, deleted, truncated): the fast path either declines
    or returns exactly what the checked parser returns; it never accepts a fault."""
    base, target = small_pair()
    version = data.draw(st.sampled_from(FORMAT_VERSIONS))
    _, index, body = split_payload(codec.encode(base, target, format_version=version))
    raw = bytearray(index)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if kind == "flip" and raw:
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and raw:
            raw[at] = data.draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]))
        elif kind == "insert":
            raw[at:at] = bytes([data.draw(st.integers(0, 255))])
        elif kind == "delete" and raw:
            del raw[at]
        elif kind == "truncate":
            del raw[at:]
    fast, checked = _parsed(bytes(raw), body)
    if fast is not None:
        assert not isinstance(checked, Exception), checked
        _same(fast, checked)


def test_an_index_listing_more_tensors_than_the_base_is_refused_before_its_entries_are_parsed():
    """decode and apply_ need every tensor of the base named and no other, so an index listing more than the
    base holds is refused from its count alone: 2**16 minimal entries (a 55 KB payload) parse in ~0.3 s and
    ~50 MiB of Python objects otherwise. A partial replica's apply_(only=...) may be given more: not bounded."""
    import tracemalloc

    d = bytes(16)
    rng = np.random.default_rng(0)  # names that do not compress past the index ratio a packer allows
    many = [container.Entry(f"{i:x}-{rng.integers(1 << 62):x}", codec.tensors.BF16, (), 0, 0, d, d)
            for i in range(1 << 16)]
    payload = container.pack(container.Payload(4, many, {}))
    base = {"0": torch.zeros((), dtype=torch.bfloat16)}
    tracemalloc.start()
    try:
        with pytest.raises(codec.DeltaError, match="lists 65536 tensors, more than the 66"):
            codec.decode(base, payload)
        with pytest.raises(codec.DeltaError, match="lists 65536 tensors"):
            codec.apply_(dict(base), payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # the decompressed index (2.8 MB here), not its entries (~50 MB)
    with pytest.raises(codec.DeltaError) as partial:  # only=: parsed, then refused for what it names
        codec.apply_(dict(base), payload, only={"0"})
    assert "lists" not in str(partial.value)
