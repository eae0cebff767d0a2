"""Compressed snapshot objects (codec.encode_snapshot / decode_snapshot, docs/FORMAT.md "Snapshot objects").

The properties: every dtype round-trips bit for bit from any source (bytes, a path, a file, a
pipe); a damaged, truncated or forged object raises codec.SnapshotError naming the object (and the
tensor where there is one), never anything else and never wrong tensors; encode and decode stream.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
import threading
import tracemalloc

import numpy as np
import pytest
import torch
import xxhash

import codec
from codec import hashing, snapshot, snapshot_rans, wire
from codec import tensors as ct
from codec_cases import BF16_SPECIAL, OTHER_DTYPES, assert_bit_exact, bf16_from_bits, random_bf16_weights, random_tensor


class Pipe(io.RawIOBase):
    """A non-seekable reader that returns short reads, as a socket or pipe does."""

    def __init__(self, data: bytes, step: int = 1000) -> None:
        self._data, self._pos, self._step = data, 0, step

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self._step if n < 0 else min(n, self._step)
        out = self._data[self._pos:self._pos + n]
        self._pos += len(out)
        return out


def every_dtype(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for dt in OTHER_DTYPES + (torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64):
        for shape in ((), (0,), (1,), (7,), (3, 5), (2, 0, 3)):
            empty = 0 in shape  # random_tensor views bytes, which torch refuses for no elements
            out[f"{dt}-{shape}"] = torch.empty(shape, dtype=dt) if empty else random_tensor(dt, shape, rng)
    out["bf16-specials"] = bf16_from_bits(list(BF16_SPECIAL.values()))
    out["bf16-scalar"] = bf16_from_bits([0x3F80], ())
    out["bf16-empty"] = torch.empty((0, 4), dtype=torch.bfloat16)
    out["bf16-odd"] = random_bf16_weights((13,), rng)
    out["bf16-weights"] = random_bf16_weights((96, 130), rng)
    out["bf16-zeros"] = torch.zeros(5000, dtype=torch.bfloat16)  # one exponent: residual plane zstd-coded
    out["bf16-noise"] = bf16_from_bits(rng.integers(0, 1 << 16, 4099, dtype=np.uint16))  # stored raw
    out["bf16-strided"] = random_bf16_weights((40, 60), rng).t()  # not contiguous
    out["f32-strided"] = torch.randn(30, 20, generator=torch.Generator().manual_seed(1))[:, ::3]
    out[""] = torch.ones(2, dtype=torch.float16)  # the empty name is a name
    return out


def encoded(tensors: dict[str, torch.Tensor]) -> bytes:
    return b"".join(codec.encode_snapshot(tensors.items()))


@pytest.fixture(scope="module")
def small() -> tuple[dict[str, torch.Tensor], bytes]:
    rng = np.random.default_rng(3)
    tensors = {"w": random_bf16_weights((9, 11), rng), "b": random_tensor(torch.float32, (5,), rng),
               "i": random_tensor(torch.int64, (3,), rng)}
    return tensors, encoded(tensors)


def test_every_dtype_round_trips_from_every_source(tmp_path):
    tensors = every_dtype(np.random.default_rng(0))
    blob = encoded(tensors)
    path = tmp_path / "snap.drsn"
    path.write_bytes(blob)
    for src in (blob, memoryview(blob), bytearray(blob), path, str(path), io.BytesIO(blob), Pipe(blob, 777)):
        got = dict(codec.decode_snapshot(src, where="snap"))
        assert list(got) == list(tensors)
        assert_bit_exact(got, {k: v.contiguous() for k, v in tensors.items()})


@pytest.mark.parametrize("missing", ["NATIVE", "KERNEL_DIGESTS"])
def test_decoding_without_kernel_digests_verifies_the_same(monkeypatch, missing):
    """Where the xxhash wheel exports no C API (hashing.NATIVE None), no kernel feeds a digest:
    the reader hashes each tensor from Python instead; where kernels may feed one but not finish
    it (hashing.KERNEL_DIGESTS False), Python finishes it. Every block kind, zstd blocks and a
    zstd-coded residual plane decode the same, and damage is still caught."""
    tensors = every_dtype(np.random.default_rng(5))
    tensors["bf16-pairs"] = random_bf16_weights((3 * 1024 + 5,), np.random.default_rng(6))
    blobs = [b"".join(codec.encode_snapshot(tensors.items(), version=v, bf16_block_elems=1024,
                                            **({"pairs": "always"} if v == 3 else {}))) for v in (1, 2, 3)]
    monkeypatch.setattr(hashing, missing, None if missing == "NATIVE" else False)
    for blob in blobs:
        assert_bit_exact(dict(codec.decode_snapshot(blob)), {k: v.contiguous() for k, v in tensors.items()})
        bad = bytearray(blob)
        bad[len(blob) // 2] ^= 0x01
        with pytest.raises(codec.SnapshotError):
            dict(codec.decode_snapshot(bytes(bad)))


def test_large_records_are_mapped_from_files_and_read_otherwise(tmp_path, monkeypatch):
    """With `map_files`, a file's records of MAP_AT_LEAST bytes or more are mapped (one populated
    read-only mapping each), smaller ones read; without it (the default: a file another process
    truncates under a mapping would kill the reader), a file not where the reader expects it
    (the object embedded after other bytes), a pipe, a wrapper whose fileno is not its bytes
    (gzip) and a platform without MAP_POPULATE, everything is read. Every way decodes the same."""
    rng = np.random.default_rng(14)
    tensors = {"big": random_bf16_weights((snapshot.BF16_BLOCK_ELEMS + 7,), rng),
               "small": random_tensor(torch.float32, (9,), rng)}
    blob = encoded(tensors)
    path = tmp_path / "s.drsn"
    path.write_bytes(blob)
    maps = []
    real = snapshot._Source._map

    def counting(self, total):
        out = real(self, total)
        maps.append(out is not None)
        return out

    monkeypatch.setattr(snapshot._Source, "_map", counting)
    assert_bit_exact(dict(codec.decode_snapshot(path)), tensors)
    assert maps == []  # not asked to map
    assert_bit_exact(dict(codec.decode_snapshot(path, map_files=True)), tensors)
    assert maps == [True]  # the big record mapped; the small one under MAP_AT_LEAST read
    with open(path, "rb") as f:
        assert_bit_exact(dict(codec.decode_snapshot(f, only={"big"}, map_files=True)), {"big": tensors["big"]})
    with open(path, "rb", buffering=0) as f:
        assert_bit_exact(dict(codec.decode_snapshot(f, map_files=True)), tensors)
    assert maps == [True, True, True]
    embedded = tmp_path / "embedded"
    embedded.write_bytes(b"x" * 5 + blob)
    with open(embedded, "rb") as f:
        f.read(5)
        assert_bit_exact(dict(codec.decode_snapshot(f, map_files=True)), tensors)
    gz = tmp_path / "s.drsn.gz"
    with gzip.open(gz, "wb") as g:
        g.write(blob)
    with gzip.open(gz, "rb") as g:
        assert_bit_exact(dict(codec.decode_snapshot(g, map_files=True)), tensors)
    r, w = os.pipe()
    with os.fdopen(w, "wb") as wf:
        writer = threading.Thread(target=lambda: (wf.write(blob), wf.close()))
        writer.start()
        with os.fdopen(r, "rb") as rf:
            assert_bit_exact(dict(codec.decode_snapshot(rf, map_files=True)), tensors)
        writer.join()
    monkeypatch.setattr(snapshot, "_MAP_FLAGS", None)
    assert_bit_exact(dict(codec.decode_snapshot(path, map_files=True)), tensors)
    assert maps[3:] == [False] * 4


def test_large_bf16_tensor_spans_blocks_and_compresses():
    rng = np.random.default_rng(1)
    t = random_bf16_weights((snapshot.BF16_BLOCK_ELEMS * 2 + 3,), rng)
    blob = encoded({"big": t})
    assert len(blob) < 0.72 * t.numel() * 2  # the exponent costs ~2.5 of its 8 bits
    (entry,) = codec.read_snapshot_index(blob)
    assert (entry.name, entry.dtype, entry.shape) == ("big", "BF16", tuple(t.shape))
    assert_bit_exact(dict(codec.decode_snapshot(blob)), {"big": t})


def test_index_and_write_snapshot(tmp_path):
    tensors = every_dtype(np.random.default_rng(2))
    path = tmp_path / "s"
    with open(path, "wb") as f:
        size, tag = codec.write_snapshot(tensors.items(), f)
    data = path.read_bytes()
    assert size == len(data) and tag == xxhash.xxh3_128_hexdigest(data)
    entries = codec.read_snapshot_index(path)
    assert [e.name for e in entries] == list(tensors)
    for e in entries:
        t = tensors[e.name]
        assert e.shape == tuple(t.shape)
        assert e.digest == hashing.digest_elements(e.dtype, e.shape, ct.element_view(t))
        assert data[e.offset] == snapshot.TAG_RECORD
    with pytest.raises(codec.SnapshotError, match="seekable"):
        codec.read_snapshot_index(Pipe(data))


def test_digest_is_the_codec_tensor_digest():
    """The digest a record carries is the delta format's tensor digest: a record's verification
    and a delta's speak of the same thing."""
    rng = np.random.default_rng(4)
    t = random_bf16_weights((17, 3), rng)
    (entry,) = codec.read_snapshot_index(encoded({"t": t}))
    assert entry.digest == hashing.digest_elements("BF16", (17, 3), ct.element_view(t))


@pytest.mark.parametrize("seekable", [True, False])
def test_only_selects(seekable):
    tensors = every_dtype(np.random.default_rng(5))
    blob = encoded(tensors)
    want = {"bf16-weights", "torch.int32-(3, 5)", ""}
    src = io.BytesIO(blob) if seekable else Pipe(blob)
    got = dict(codec.decode_snapshot(src, only=want))
    assert set(got) == want
    assert_bit_exact(got, {k: tensors[k] for k in want})
    with pytest.raises(codec.SnapshotError, match="no tensor 'nope'"):
        dict(codec.decode_snapshot(io.BytesIO(blob) if seekable else Pipe(blob), only={"nope"}))


def test_encoder_streams_one_tensor_at_a_time():
    pulled = []

    def named():
        for i in range(4):
            pulled.append(i)
            yield f"t{i}", torch.full((1000,), float(i), dtype=torch.bfloat16)

    chunks = codec.encode_snapshot(named())
    next(chunks)  # the prefix
    assert pulled == []
    next(chunks)  # the first record's head
    assert pulled == [0]
    rest = list(chunks)
    assert pulled == [0, 1, 2, 3]
    assert max(map(len, rest)) < 4000


def test_decoder_streams_one_tensor_at_a_time():
    tensors = {f"t{i}": torch.zeros(1 << 18, dtype=torch.float32) + i for i in range(6)}  # 1 MiB each
    blob = encoded(tensors)
    tracemalloc.start()
    try:
        for _name, t in codec.decode_snapshot(Pipe(blob, 1 << 16)):
            del t
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * (1 << 20), peak  # one tensor and its blocks, not six


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="twice"):
        list(codec.encode_snapshot([("a", torch.zeros(1)), ("a", torch.zeros(1))]))


# --- hostile objects --------------------------------------------------------------------------

def refused(data: bytes, match: str | None = None) -> codec.SnapshotError:
    """Both the walk and the seeking reader refuse `data`, naming the object; nothing else escapes."""
    for src in (Pipe(data), data):
        with pytest.raises(codec.SnapshotError) as err:
            list(codec.decode_snapshot(src, where="obj-under-test"))
        assert str(err.value).startswith("obj-under-test: "), str(err.value)
        if match is not None:
            assert match in str(err.value), str(err.value)
    return err.value


def test_every_single_bit_flip_is_refused(small):
    """Every flip is refused, but these: the prefix's version turned into another version this reader
    knows, in an object whose blocks all exist in both (here stored and zstd blocks only). That
    object decodes to the same verified tensors (FORMAT.md: one content, several encodings). No
    single flip of version 4 (0b100) gives a known version; one of version 3 gave 1 or 2."""
    tensors, blob = small
    data = bytearray(blob)
    same = []
    for i in range(len(data)):
        for bit in range(8):
            data[i] ^= 1 << bit
            try:
                got = dict(codec.decode_snapshot(bytes(data)))
            except codec.SnapshotError:
                pass
            else:
                assert i == 4 and int.from_bytes(data[4:6], "little") in codec.snapshot.VERSIONS, (i, bit)
                assert_bit_exact(got, tensors)
                same.append(int.from_bytes(data[4:6], "little"))
            data[i] ^= 1 << bit
    v = codec.snapshot.VERSION
    assert sorted(same) == [k for k in codec.snapshot.VERSIONS if bin(k ^ v).count("1") == 1]


def test_every_truncation_and_extension_is_refused(small):
    _, blob = small
    for n in range(len(blob)):
        with pytest.raises(codec.SnapshotError):
            list(codec.decode_snapshot(blob[:n]))
        with pytest.raises(codec.SnapshotError):
            list(codec.decode_snapshot(Pipe(blob[:n])))
    refused(blob + b"\0", "after the trailer")


def test_selective_reads_of_damaged_objects(small):
    _, blob = small
    with pytest.raises(codec.SnapshotError, match="trailer"):
        list(codec.decode_snapshot(blob[:-1], only={"w"}))
    entries = codec.read_snapshot_index(blob)
    w = next(e for e in entries if e.name == "w")
    data = bytearray(blob)
    data[w.offset + w.length - 1] ^= 0x40  # the last byte of w's last block
    with pytest.raises(codec.SnapshotError, match="'w'"):
        list(codec.decode_snapshot(bytes(data), only={"w"}))
    assert set(dict(codec.decode_snapshot(bytes(data), only={"b", "i"}))) == {"b", "i"}


def test_not_a_snapshot():
    refused(b"", "truncated prefix")
    refused(b"DRDELTA\0" + bytes(40), "not a snapshot object")
    refused(struct.pack("<4sHH", b"DRSN", 5, 0) + bytes(40), "version 5")
    refused(struct.pack("<4sHH", b"DRSN", 0, 0) + bytes(40), "version 0")
    refused(struct.pack("<4sHH", b"DRSN", 1, 1) + bytes(40), "reserved")


def forged_head(name: str, dtype_code: int, shape: tuple[int, ...], block_elems: int, sizes: list[int],
                digest: bytes = bytes(16)) -> bytes:
    """A record head with a valid checksum: only the decoder's own limits stand in the way."""
    w = wire.Writer()
    w.blob(name.encode())
    w.u8(dtype_code)
    w.uvarint(len(shape))
    for d in shape:
        w.uvarint(d)
    w.uvarint(block_elems)
    w.uvarint(len(sizes))
    for s in sizes:
        w.uvarint(s)
    w.raw(digest)
    fields = w.getvalue()
    head = fields + xxhash.xxh3_64_digest(fields)
    return struct.pack("<BI", snapshot.TAG_RECORD, len(head)) + head


PREFIX = struct.pack("<4sHH", b"DRSN", 1, 0)
PREFIX_V2 = struct.pack("<4sHH", b"DRSN", 2, 0)
PREFIX_V3 = struct.pack("<4sHH", b"DRSN", 3, 0)


@pytest.mark.parametrize("head, reason", [
    (forged_head("x", 99, (4,), 4, [9]), "unknown dtype code 99"),
    (forged_head("x", 7, (1 << 30, 1 << 30), 1 << 18, []), "over 2**48"),
    (forged_head("x", 7, (1 << 40,), 1 << 18, [1]), "blocks for"),
    (forged_head("x", 8, (4,), 1 << 21, [17]), "at most"),
    (forged_head("x", 7, (4,), 4, [10]), "exceeds its limit"),  # a block over 1 + its raw bytes
    (forged_head("x", 7, (4,), 0, []), "block of 0"),
])
def test_lying_heads_are_refused(head, reason):
    err = refused(PREFIX + head + bytes(64), reason)
    assert err.tensor == "x"


def _head_fields(head: bytes) -> memoryview:
    return memoryview(head)[5:-8]  # past the tag and length; before the checksum


def _damaged(data: bytes, rng: np.random.Generator) -> bytes:
    """`data` with a few random bytes appended, cut short, or one or two bytes changed (set at
    random, or their top bit flipped)."""
    b = bytearray(data)
    op = rng.integers(4)
    if op == 0 or not b:
        b += bytes(rng.integers(0, 256, rng.integers(1, 4), dtype=np.uint8))
    elif op == 1:
        del b[rng.integers(len(b)):]
    else:
        for _ in range(rng.integers(1, 3)):
            b[rng.integers(len(b))] = int(rng.integers(256)) if op == 2 else b[rng.integers(len(b))] ^ 0x80
    return bytes(b)


def test_kernel_head_parser_agrees_with_the_reference():
    """`snapshot_rans.record_head` (the fast path) accepts exactly the heads the Python reference
    parser accepts, with the same fields: every head of a real object, the forged ones above, and
    thousands of damaged ones (bytes changed, cut, extended, checksum made valid again)."""
    tensors = every_dtype(np.random.default_rng(9))
    tensors["multi"] = random_bf16_weights((3 * 1024 + 5,), np.random.default_rng(10))
    blob = b"".join(codec.encode_snapshot(tensors.items(), bf16_block_elems=1024))
    heads = []
    at = snapshot.PREFIX.size
    while blob[at] == snapshot.TAG_RECORD:
        (n,) = struct.unpack_from("<I", blob, at + 1)
        fields = blob[at + 5:at + 5 + n - 8]
        heads.append(fields)
        head = snapshot._parse_head(snapshot._Source(b"", "t"), memoryview(fields), 5 + n)
        at += 5 + n + int(head.sizes.sum())
    assert len(heads) == len(tensors)
    heads += [bytes(_head_fields(h)) for h in (
        forged_head("x", 99, (4,), 4, [9]), forged_head("x", 7, (1 << 30, 1 << 30), 1 << 18, []),
        forged_head("x", 7, (1 << 40,), 1 << 18, [1]), forged_head("x", 8, (4,), 1 << 21, [17]),
        forged_head("x", 7, (4,), 4, [10]), forged_head("x", 7, (4,), 0, []), forged_head("x", 7, (), 4, [3]),
        forged_head("x", 7, (0, 5), 4, []), forged_head("x", 7, (1 << 24, 1 << 24), 1 << 21, []))]
    heads.append(bytes(_head_fields(forged_head("xy", 7, (1,), 1, [3]))).replace(b"xy", b"\xff\xfe", 1))
    rng = np.random.default_rng(11)
    cases = list(heads)
    for fields in heads:
        cases += [_damaged(fields, rng) for _ in range(300)]
    tables = snapshot._Tables()
    accepted = 0
    for fields in cases:
        a = np.frombuffer(fields, np.uint8)
        fast = snapshot_rans.record_head(a, snapshot._ITEMSIZES, snapshot.MAX_BLOCK_BYTES, tables.head_ints(a.size))
        try:
            ref = snapshot._parse_head(snapshot._Source(b"", "t"), memoryview(fields), 5 + len(fields) + 8)
        except codec.SnapshotError:
            ref = None
        if ref is None:
            if fast:  # the kernel may pass a name that is not UTF-8: the reader then asks the reference
                at, n = tables.head_ints(a.size)[:2]
                with pytest.raises(UnicodeDecodeError):
                    fields[at:at + n].decode("utf-8", "strict")
            continue
        assert fast, fields
        accepted += 1
        src = snapshot._Source(struct.pack("<I", len(fields) + 8) + fields + xxhash.xxh3_64_digest(fields), "t")
        got = snapshot._record_head(src, tables)
        assert (got.name, got.dt, got.shape, got.block_elems, got.sizes.tolist(), got.digest, got.length) == \
            (ref.name, ref.dt, ref.shape, ref.block_elems, ref.sizes.tolist(), ref.digest, ref.length)
    assert accepted > len(heads)  # some damage leaves a valid head: those must agree field by field


def _outcome(parse, *args):
    try:
        return parse(*args)
    except codec.SnapshotError as exc:
        return str(exc)


def test_kernel_index_parser_agrees_with_the_reference():
    """`snapshot._parse_index` (its kernel, `snapshot_rans.index_entries`, then names) returns
    what the Python reference returns, or refuses with the reference's words, for a real index
    and thousands of damaged ones (including repeated and non-UTF-8 names)."""
    tensors = every_dtype(np.random.default_rng(12))
    tensors["a"] = torch.zeros(0, dtype=torch.bfloat16)
    tensors["é"] = torch.ones((2, 0, 3), dtype=torch.float32)
    blob = b"".join(codec.encode_snapshot(tensors.items()))
    offset, length = struct.unpack_from("<QI", blob, len(blob) - snapshot.TRAILER.size)
    body = blob[offset + 5:offset + 5 + length]
    rng = np.random.default_rng(13)
    cases = [body, body.replace(b"\x01a", b"\x01b", 1), body.replace("é".encode(), b"\xff\xfe", 1)]
    cases += [_damaged(body, rng) for _ in range(3000)]
    accepted = 0
    for case in cases:
        src = snapshot._Source(b"", "t")
        ref = _outcome(snapshot._parse_index_words, src, memoryview(case), offset)
        assert _outcome(snapshot._parse_index, src, memoryview(case), offset) == ref
        accepted += isinstance(ref, list)
    assert accepted > 1  # damage that leaves a valid index (a digest byte, say) must agree entry by entry


def test_head_claiming_a_huge_tensor_allocates_nothing_big():
    # 2**30 BF16 elements (2 GiB) in 2**12 blocks of 512 KiB: the head is valid, the bytes are absent
    n_blocks = 1 << 12
    head = forged_head("huge", 7, (n_blocks << 18,), 1 << 18, [1 << 19] * n_blocks)
    tracemalloc.start()
    try:
        refused(PREFIX + head + bytes(1000), "truncated block")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


def _forged_block_cases(kind: int, states: int) -> list[tuple[bytes, str]]:
    """Blocks of kind 2 or 3 (128 elements) that each break one rule of FORMAT.md, with the reason."""
    table = bytes([kind, 2, 0x70, 0x80, 0x10, 0x7F, 0x80, 0x10])  # 2 symbols, 2048 each
    at_l = struct.pack(f"<{2 * states}I", *([0x80000000, 0] * states))  # every state at exactly 2**31
    n = bytes([2 * states])  # n_words: just the states
    return [
        (bytes([kind, 1, 0x70, 0x80, 0x20]) + bytes(130), "2 to 256"),
        (bytes([kind, 2, 0x71, 0x80, 0x10, 0x70, 0x80, 0x10]) + bytes(130), "strictly increasing"),
        (bytes([kind, 2, 0x70, 0x80, 0x10, 0x71, 0x80, 0x08]) + bytes(130), "sum to"),
        (bytes([kind, 2, 0x70, 0x00, 0x71, 0x80, 0x20]) + bytes(130), "frequency 0"),
        (bytes([kind, 2, 0x70, 0x80, 0x20, 0x71, 0x80, 0x20]) + bytes(130), "exceeds its limit"),  # freq 4096
        (bytes([kind, 2, 0x70, 0x80, 0x10, 0x71]), "truncated"),
        (bytes([kind, 0x80]), "truncated"),
        (bytes([kind]) + bytes([0x80] * 11), "malformed varint"),
        (table + bytes([0xFF, 0x01, 0]) + bytes(128), "exceeds its limit"),  # 255 words
        (table + bytes([2 * states - 1, 0]) + bytes(128), "does not fit"),
        (table + n + bytes([0]) + bytes(8 * states) + bytes(128), "out of range"),
        (table + n + bytes([0]) + at_l[:-4] + struct.pack("<I", 0x80000000) + bytes(128), "out of range"),  # 2**63
        (table + n + bytes([0]) + at_l + bytes(127), "residual plane of 127"),
        (table + n + bytes([7]) + at_l + bytes(128), "unknown residual codec"),
        (table + n + bytes([0]) + at_l + bytes(128), "does not decode"),
        (table + bytes([2 * states + 1, 0]) + bytes(4) + at_l + bytes(128), "does not decode"),  # a word unread
    ]


def _pair_block(pairs: list[tuple[int, int]], tail: bytes) -> bytes:
    """A kind 4 block: its (code, freq) table as FORMAT.md lays it out (gaps), then `tail`."""
    w = wire.Writer()
    w.u8(snapshot.KIND_BF16_PAIRS)
    w.uvarint(len(pairs))
    prev = -1
    for code, freq in pairs:
        w.uvarint(code - prev - 1)
        w.uvarint(freq)
        prev = code
    return w.getvalue() + tail


def _forged_pair_block_cases() -> list[tuple[bytes, str]]:
    """Kind 4 blocks (128 elements) that each break one rule of FORMAT.md, with the reason."""
    half = [(0x7070, 4096), (0x7071, 4096)]
    at_l = struct.pack("<16I", *([0x80000000, 0] * 8))  # every state at exactly 2**31
    n = bytes([16])  # n_words: just the states
    over = wire.Writer()
    over.u8(snapshot.KIND_BF16_PAIRS)
    over.uvarint(8193)
    past = wire.Writer()  # codes 0xFFFF, then 0x10000
    for v in (snapshot.KIND_BF16_PAIRS, 2, 0xFFFF, 4096, 0, 4096):
        past.uvarint(v)
    return [
        (_pair_block([(0x7070, 8192)], bytes(130)), "2 to 8192"),
        (over.getvalue() + bytes(130), "value 8193 in BF16 block exceeds its limit"),
        (past.getvalue() + bytes(130), "code 65536 is past 0xFFFF"),
        (_pair_block([(0x7070, 4096), (0x7071, 2048)], bytes(130)), "sum to 6144, not 8192"),
        (_pair_block([(0x7070, 0), (0x7071, 8192)], bytes(130)), "pair 0x7070 listed with frequency 0"),
        (_pair_block([(0x7070, 8192), (0x7071, 8192)], bytes(130)), "exceeds its limit"),
        (_pair_block(half, b"")[:-1], "truncated"),
        (bytes([4]) + bytes([0x80] * 11), "malformed varint"),
        (_pair_block(half, bytes([0xFF, 0x01, 0]) + bytes(128)), "exceeds its limit"),  # 255 words
        (_pair_block(half, bytes([15, 0]) + bytes(128)), "does not fit"),
        (_pair_block(half, n + bytes([0]) + bytes(64) + bytes(128)), "out of range"),
        (_pair_block(half, n + bytes([0]) + at_l + bytes(127)), "residual plane of 127"),
        (_pair_block(half, n + bytes([7]) + at_l + bytes(128)), "unknown residual codec"),
        (_pair_block(half, n + bytes([0]) + at_l + bytes(128)), "does not decode"),
        (_pair_block(half, bytes([17, 0]) + bytes(4) + at_l + bytes(128)), "does not decode"),  # a word unread
    ]


def _pair_stream_block(codes: np.ndarray, n: int) -> bytes:
    """A kind 4 block of `n` elements whose stream codes exactly `codes` (which may break a rule
    the stream itself cannot show), residual bytes all 0."""
    present, counts = np.unique(codes, return_counts=True)
    freq = snapshot.rans.normalize(counts, snapshot_rans.SCALE_PAIRS, floor_all=False)
    index = np.zeros(1 << 16, np.int64)
    index[present] = np.arange(present.size)
    cum = np.concatenate(([0], np.cumsum(freq)[:-1])).astype(np.int64)
    rcp, rsh = snapshot.rans.reciprocals(freq)
    words, nw, xs = snapshot_rans.encode_pair_groups(codes.astype(np.uint16), index, freq, cum, rcp, rsh)
    stream = snapshot.rans.words_to_bytes(words, nw, tuple(int(x) for x in xs))
    return _pair_block(list(zip(present.tolist(), freq.tolist())),
                       wire.uvarints(np.array([len(stream) // 4])) + bytes([0]) + stream + bytes(n))


def test_forged_pair_blocks_are_refused():
    rng = np.random.default_rng(16)
    t = random_bf16_weights((4096,), rng)  # enough for kind 4 to pay for its pair table

    def obj(block: bytes, prefix: bytes = PREFIX_V3, dtype: int = 7, n: int = 128) -> bytes:
        return prefix + forged_head("t", dtype, (n,), 1 << 18, [len(block)], bytes(16)) + block

    cases = [(obj(b), why) for b, why in _forged_pair_block_cases()]
    cases += [
        (obj(bytes([4]) + bytes(128), PREFIX_V2), "kind 4 is not defined in a version 2 object"),
        (obj(bytes([4]) + bytes(128), PREFIX), "kind 4 is not defined in a version 1 object"),
        (obj(bytes([4]) + bytes(256), dtype=ct.BY_NAME["F16"].code), "kind 4 is not defined for F16"),
        (obj(bytes([5]) + bytes(128)), "kind 5"),
    ]
    # an odd block's last pair must have 0 for its missing second exponent
    codes = rng.integers(0x7070, 0x7074, 64)
    codes[-1] = 0x7170  # second exponent 0x71: not 0
    cases.append((obj(_pair_stream_block(codes, 127), n=127), "does not decode"))
    codes[-1] = 0x0070
    odd_ok = _pair_stream_block(codes, 127)
    for data, reason in cases:
        err = refused(data, reason)
        assert err.tensor == "t"
        assert "block 0: " in str(err), str(err)
    # the same odd block with a 0 second exponent decodes (to other bits than the zero digest)
    refused(obj(odd_ok, n=127), "digest")
    good = snapshot._bf16_block(t.view(torch.int16).numpy().view(np.uint16), 3, "always")
    assert good[0] == snapshot.KIND_BF16_PAIRS
    (entry,) = codec.read_snapshot_index(encoded({"t": t}))
    real = PREFIX_V3 + forged_head("t", 7, (4096,), 1 << 18, [len(good)], entry.digest) + good
    name, got = next(codec.decode_snapshot(real))
    assert_bit_exact({name: got}, {"t": t})
    other = bytearray(real)
    other[-1] ^= 1  # a mantissa bit in the residual plane
    refused(bytes(other), "digest")


def test_forged_blocks_are_refused():
    rng = np.random.default_rng(6)
    t = random_bf16_weights((128,), rng)
    (entry,) = codec.read_snapshot_index(encoded({"t": t}))

    def obj(block: bytes, prefix: bytes = PREFIX) -> bytes:
        return prefix + forged_head("t", 7, (128,), 1 << 18, [len(block)], entry.digest) + block

    cases = [
        (obj(bytes([0]) + bytes(10)), "stored bytes"),
        (obj(bytes([1]) + b"junk" * 8), "zstd"),
        (obj(bytes([9]) + bytes(128)), "kind 9"),
        (obj(bytes([3]) + bytes(128)), "kind 3 is not defined in a version 1 object"),
        (obj(bytes([9]) + bytes(128), PREFIX_V2), "kind 9"),
    ]
    cases += [(obj(b, PREFIX), why) for b, why in _forged_block_cases(2, 4)]
    cases += [(obj(b, PREFIX_V2), why) for b, why in _forged_block_cases(2, 4)]  # v2 reads kind 2 too
    cases += [(obj(b, PREFIX_V2), why) for b, why in _forged_block_cases(3, 8)]
    for data, reason in cases:
        err = refused(data, reason)
        assert err.tensor == "t"
        assert "block 0: " in str(err), str(err)
    # blocks that decode, to other bits than the digest's
    for version, prefix in ((1, PREFIX), (2, PREFIX_V2)):
        good = snapshot._bf16_block(t.view(torch.int16).numpy().view(np.uint16), version)
        assert good[0] == {1: 2, 2: 3}[version]
        name, got = next(codec.decode_snapshot(obj(good, prefix)))  # an object without an index: its first tensor
        assert_bit_exact({name: got}, {"t": t})
        other = bytearray(good)
        other[-1] ^= 1  # a mantissa bit in the residual plane
        refused(obj(bytes(other), prefix), "digest")


@pytest.mark.parametrize("version", [2, 3])
def test_a_block_of_a_kind_is_refused_when_its_stream_is_cut_anywhere(version):
    """Every shortening of a multi-group kind-3 or kind-4 stream (words dropped from its front, the
    states kept) is refused: the fast loop's unchecked reads stop in time and the checked tail
    catches it."""
    rng = np.random.default_rng(8)
    t = random_bf16_weights((4099,), rng)
    block = snapshot._bf16_block(t.view(torch.int16).numpy().view(np.uint16), version, "always")
    assert block[0] == {2: snapshot.KIND_BF16_GROUPS, 3: snapshot.KIND_BF16_PAIRS}[version]
    r = wire.Reader(block[1:], "block")
    for _ in range(r.uvarint()):
        r.u8() if version == 2 else r.uvarint()  # a symbol, or a pair code's gap
        r.uvarint()
    head_len = len(block) - r.remaining
    n_words = r.uvarint()
    at = len(block) - r.remaining + 1
    words, rest = block[at:at + 4 * n_words], block[at + 4 * n_words:]
    prefix = PREFIX_V2 if version == 2 else PREFIX_V3
    for drop in range(1, n_words - 16 + 1, 7):
        w = wire.Writer()
        w.uvarint(n_words - drop)
        w.u8(block[at - 1])
        forged = block[:head_len] + w.getvalue() + words[4 * drop:] + rest
        data = prefix + forged_head("t", 7, (4099,), 1 << 18, [len(forged)], bytes(16)) + forged
        refused(data, "block 0")


def test_version_1_to_3_objects_still_decode():
    """Objects written as version 1 (kind-2 blocks) and 2 (kind 3) decode to the same tensors as
    version 3 (kind 4), which costs at most ~0.3% more bytes here (its pair tables); version 4
    differs from 3 in its F16 records only (BF16 kinds instead of zstd)."""
    tensors = every_dtype(np.random.default_rng(9))
    tensors["big"] = random_bf16_weights((snapshot.BF16_BLOCK_ELEMS + 77,), np.random.default_rng(10))
    v1, v2, v3 = (b"".join(codec.encode_snapshot(tensors.items(), version=v)) for v in (1, 2, 3))
    new = encoded(tensors)
    assert (v1[4:6], v2[4:6], v3[4:6], new[4:6]) == (b"\x01\x00", b"\x02\x00", b"\x03\x00", b"\x04\x00")
    assert abs(len(v1) - len(v2)) < 0.001 * len(v2)
    assert len(v2) < len(v3) < 1.003 * len(v2)
    no_f16 = {k: v for k, v in tensors.items() if v.dtype != torch.float16}
    assert encoded(no_f16)[6:] == b"".join(codec.encode_snapshot(no_f16.items(), version=3))[6:]
    for blob in (v1, v2, v3, new):
        assert_bit_exact(dict(codec.decode_snapshot(blob)), {k: v.contiguous() for k, v in tensors.items()})
    with pytest.raises(ValueError, match="version 5"):
        list(codec.encode_snapshot(tensors.items(), version=5))


@pytest.mark.parametrize("numel", [1, 2, 3, 31, 32, 33, 63, 64, 65, 4097])
@pytest.mark.parametrize("block_elems", [1, 2, 3, 17, 32, 1 << 18])
def test_pair_blocks_round_trip_every_length(numel, block_elems):
    """Kind 4 at every edge: odd blocks (a half pair), short last groups, one-pair blocks (a spare
    code), blocks starting at odd elements."""
    t = random_bf16_weights((numel,), np.random.default_rng(numel * 7 + block_elems))
    constant = torch.full((numel,), 0.5, dtype=torch.bfloat16)  # one pair code in every block
    for pairs in ("auto", "always"):
        for name, x in (("t", t), ("c", constant)):
            blob = b"".join(codec.encode_snapshot([(name, x)], bf16_block_elems=block_elems, pairs=pairs))
            assert_bit_exact(dict(codec.decode_snapshot(blob)), {name: x})


def test_the_encoder_takes_kind_4_where_it_pays_and_where_it_can():
    """A whole block of weights is kind 4; a small one (its pair table outweighs the exponents) is
    kind 3 unless `pairs="always"`; a block with more distinct exponent pairs than
    MAX_PAIR_SYMBOLS (random bit patterns) is kind 3 (or stored) even then."""
    rng = np.random.default_rng(12)

    def kind(t: torch.Tensor, pairs: str = "auto") -> int:
        return snapshot._bf16_block(t.view(torch.int16).numpy().view(np.uint16), 3, pairs)[0]

    whole, small = random_bf16_weights((1 << 18,), rng), random_bf16_weights((4096,), rng)
    assert kind(whole) == snapshot.KIND_BF16_PAIRS
    assert (kind(small), kind(small, "always")) == (snapshot.KIND_BF16_GROUPS, snapshot.KIND_BF16_PAIRS)
    bits = torch.from_numpy(rng.integers(0, 1 << 16, 1 << 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    assert kind(bits, "always") in (snapshot.KIND_BF16_GROUPS, snapshot.KIND_RAW)
    for pairs in ("auto", "always"):
        blob = b"".join(codec.encode_snapshot({"b": bits, "w": whole, "s": small}.items(), pairs=pairs))
        assert_bit_exact(dict(codec.decode_snapshot(blob)), {"b": bits, "w": whole, "s": small})
    with pytest.raises(ValueError, match="pairs"):
        list(codec.encode_snapshot({"w": small}.items(), pairs="never"))
    with pytest.raises(ValueError, match="version 2 does not have"):
        list(codec.encode_snapshot({"w": small}.items(), version=2, pairs="always"))


def test_index_that_lies_is_refused(small):
    tensors, blob = small
    # a self-consistent index (checksum recomputed) naming other tensors than the records hold
    (offset, length, _, _, magic) = snapshot.TRAILER.unpack(blob[-snapshot.TRAILER.size:])
    entries = codec.read_snapshot_index(blob)
    lied = [codec.SnapshotEntry("other" if e.name == "b" else e.name, e.dtype, e.shape, e.digest, e.offset, e.length)
            for e in entries]
    body = snapshot._index_body(lied)
    forged = (blob[:offset] + struct.pack("<BI", snapshot.TAG_INDEX, len(body)) + body
              + snapshot.TRAILER.pack(offset, len(body), 0, xxhash.xxh3_64_digest(body), magic))
    with pytest.raises(codec.SnapshotError, match="index disagrees"):
        list(codec.decode_snapshot(forged))
    with pytest.raises(codec.SnapshotError, match="disagrees with the index"):
        list(codec.decode_snapshot(forged, only={"other"}))


def test_max_bytes_bounds_what_the_records_declare_before_reading_them():
    """A record's stored blocks bound its allocation, but zstd frames do not: zeros of 8 MiB take a
    few KB. A reader that says how many tensor bytes it expects (`max_bytes`, the step record's) is
    refused the record that goes past them before its blocks are read: a truncated object says so,
    not that it is truncated."""
    tensors = {"small": torch.ones(100, dtype=torch.float32), "zeros": torch.zeros(1 << 22, dtype=torch.bfloat16)}
    blob = encoded(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert len(blob) < total // 100
    got = dict(codec.decode_snapshot(blob, max_bytes=total))
    assert_bit_exact(got, tensors)
    with pytest.raises(codec.SnapshotError, match="'zeros'.*past the") as exc:
        list(codec.decode_snapshot(blob, max_bytes=total - 1))
    assert str(total - 1 - 400) in str(exc.value)  # what was left after the first record
    head_end = blob.index(b"zeros") + 64  # inside the record's blocks: truncated before most of them
    with pytest.raises(codec.SnapshotError, match="past the"):
        list(codec.decode_snapshot(blob[:head_end], max_bytes=1 << 20))
    with pytest.raises(codec.SnapshotError, match="past the"):
        list(codec.decode_snapshot(io.BytesIO(blob), only={"zeros"}, max_bytes=1 << 20))


def _f16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits, np.uint16).view(np.int16).copy()).view(torch.float16)


def test_f16_records_take_the_bf16_kinds_from_version_4():
    """Version 4 codes F16 records with the BF16 block kinds (their 16-bit patterns, as BF16's): every F16
    pattern round-trips, weight-like F16 costs less than through zstd (version 3), and a version 3 reader refuses
    such a block by name (a v4 object relabelled v3)."""
    rng = np.random.default_rng(41)
    every = _f16(np.arange(1 << 16, dtype=np.uint16))
    weights = torch.from_numpy(rng.normal(0, 0.02, 300_000).astype(np.float32)).to(torch.float16)
    tensors = {"every": every, "weights": weights, "odd": weights[:1001].clone(), "zero-d": weights[0].clone(),
               "empty": torch.empty(0, 3, dtype=torch.float16)}
    v4 = encoded(tensors)
    v3 = b"".join(codec.encode_snapshot(tensors.items(), version=3))
    for blob in (v3, v4):
        assert_bit_exact(dict(codec.decode_snapshot(blob)), tensors)
    w4 = len(encoded({"weights": weights}))
    w3 = len(b"".join(codec.encode_snapshot({"weights": weights}.items(), version=3)))
    assert w4 < 0.95 * w3, (w4, w3)  # 8% smaller here; MiniLM cast to F16: 0.665 of its bytes, zstd 0.767
    relabelled = bytearray(v4)
    relabelled[4:6] = (3).to_bytes(2, "little")
    refused(bytes(relabelled), "is not defined for F16 in a version 3 object")
