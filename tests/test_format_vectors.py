"""The committed codec test vectors (docs/vectors/codec/) are the format's contract.

For every vector: decoding the payload against the base gives the target bit for bit; the
payload uses the methods index.json says it exercises; re-encoding reproduces the payload byte
for byte (with the compressor libraries the vectors were made with); and a flipped byte is
refused, never turned into wrong output.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from safetensors.torch import load_file

import codec
from codec import container
from codec.methods import conditional
from codec.wire import Reader

VECTORS = Path(__file__).resolve().parents[1] / "docs" / "vectors" / "codec"
INDEX = json.loads((VECTORS / "index.json").read_text())
NAMES = [v["name"] for v in INDEX["vectors"]]
BY_NAME = {v["name"]: v for v in INDEX["vectors"]}


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _load(name: str) -> tuple[dict, dict, bytes]:
    d = VECTORS / name
    return (load_file(str(d / "base.safetensors")), load_file(str(d / "target.safetensors")),
            (d / "payload.drd").read_bytes())


def _same_as(out: dict, target: dict) -> bool:
    return list(out) == list(target) and all(
        out[k].dtype == target[k].dtype and tuple(out[k].shape) == tuple(target[k].shape)
        and _bytes(out[k]) == _bytes(target[k]) for k in target)


SNAPSHOTS = {v["name"]: v for v in INDEX["snapshot_vectors"]}


def test_index_lists_the_vectors_on_disk_and_their_hashes():
    on_disk = sorted(p.name for p in VECTORS.iterdir() if p.is_dir())
    assert sorted(NAMES + list(SNAPSHOTS)) == on_disk
    readme = (VECTORS / "README.md").read_text()
    for v in INDEX["vectors"] + INDEX["snapshot_vectors"]:
        assert f"`{v['name']}`" in readme, f"README.md does not list {v['name']}"
        for f, digest in v["sha256"].items():
            assert hashlib.sha256((VECTORS / v["name"] / f).read_bytes()).hexdigest() == digest, (v["name"], f)


def test_vectors_cover_every_method_version_and_compressor():
    versions = {v["format_version"] for v in INDEX["vectors"]}
    methods = {t["method"] for v in INDEX["vectors"] for t in v["tensors"].values()}
    codecs = {c for v in INDEX["vectors"] for t in v["tensors"].values() for c in t["stream_codecs"]}
    tensors = [t for v in INDEX["vectors"] for t in v["tensors"].values()]
    assert versions == {1, 2, 3, 4}
    assert methods == {"same", "xor-planes", "sparse-split", "conditional"}
    assert codecs == {0, 1, 2, 3}
    assert {t.get("position_mode") for t in tensors} >= {0, 1}
    assert {t.get("rans_states") for t in tensors} >= {2, 4}
    assert any(t.get("classes", 0) >= 3 for t in tensors)
    assert any(t["shape"] == [] for t in tensors) and any(0 in t["shape"] for t in tensors)
    assert any(t["method"] == "conditional" and int(np.prod(t["shape"])) % 64 for t in tensors)


@pytest.mark.parametrize("name", NAMES)
def test_vector_decodes_to_its_target_bit_for_bit(name):
    base, target, payload = _load(name)
    out = codec.decode(base, payload)
    assert _same_as(out, target)
    # the in-place path agrees
    live = {k: v.clone() for k, v in base.items()}
    codec.apply_(live, payload)
    assert all(_bytes(live[k]) == _bytes(target[k]) for k in target)


@pytest.mark.parametrize("name", NAMES)
def test_vector_uses_the_methods_the_index_names(name):
    v = BY_NAME[name]
    _, _, payload = _load(name)
    described = codec.describe(payload)
    assert described["format_version"] == v["format_version"]
    assert {t["name"]: t["method"] for t in described["tensors"]} == {k: t["method"] for k, t in v["tensors"].items()}
    parsed = container.unpack(payload)
    assert sorted(parsed.shared) == v["shared_kinds"]
    four_from = conditional._four_from(parsed.shared)
    for e in parsed.entries:
        t = v["tensors"][e.name]
        assert [e.dtype.name, list(e.shape), e.changes, [s.codec for s in e.streams]] == \
            [t["dtype"], t["shape"], t["changes"], t["stream_codecs"]]
        if e.method == conditional.ID:
            assert (4 if e.changes >= four_from else 2) == t["rans_states"]
            votes = conditional.SHARED_VOTE_TABLES in parsed.shared  # then the first byte's top bit: STILL
            assert e.params[0] & (0x7F if votes else 0xFF) == t["classes"]
            assert (bool(e.params[0] & conditional.STILL) if votes else None) == t.get("still")
            # a conditional stream is the words, then S final states of two words each
            assert len(e.streams[0].stored) % 4 == 0 and len(e.streams[0].stored) >= 8 * t["rans_states"]


def _compressors_as_recorded() -> bool:
    import brotli
    import lz4

    rec = INDEX["libraries"]
    now = {"zstd": ".".join(map(str, zstandard.ZSTD_VERSION)), "lz4": lz4.library_version_string(),
           "brotli": brotli.version if hasattr(brotli, "version") else brotli.__version__}
    return all(rec[k] == now[k] for k in now)


@pytest.mark.parametrize("name", NAMES)
def test_reencoding_reproduces_the_payload(name):
    """Encoding is deterministic: the recorded call gives the committed bytes. Compressed streams
    and the zstd index depend on the compressor libraries' versions, so only with those."""
    if not _compressors_as_recorded():
        pytest.skip(f"compressor libraries differ from the vectors' {INDEX['libraries']}")
    v = BY_NAME[name]
    base, target, payload = _load(name)
    assert codec.encode(base, target, format_version=v["format_version"], effort=v["effort"]) == payload


# ---------------------------------------------------------------- flipped bytes

def _regions(payload: bytes) -> dict[str, tuple[range, int]]:
    """Byte ranges of a payload, each with its stream codec (-1 outside the body): its prefix, the
    compressed index, each stream."""
    index_len = int.from_bytes(payload[12:16], "little")
    out = {"prefix": (range(0, 32), -1), "index": (range(32, 32 + index_len), -1)}
    at = 32 + index_len
    for e in container.unpack(payload).entries:
        for i, s in enumerate(e.streams):
            if len(s.stored):
                out[f"{e.name}/stream{i}"] = (range(at, at + len(s.stored)), s.codec)
            at += len(s.stored)
    assert at == len(payload)
    return out


def _sample(r: range, k: int, seed: int) -> list[int]:
    if len(r) <= k:
        return list(r)
    return sorted(np.random.default_rng(seed).choice(np.array(r), size=k, replace=False).tolist())


def _reseal(head16: bytes, rest: bytes) -> bytes:
    """A payload with its checksum recomputed: what a forger sends."""
    h = xxhash.xxh3_128()
    h.update(head16)
    h.update(rest)
    return head16 + h.digest() + rest


def _outcome(base: dict, target: dict, payload: bytes) -> str:
    try:
        out = codec.decode(base, payload)
    except codec.DeltaError:
        return "refused"
    assert _same_as(out, target), "a modified payload decoded to wrong output"
    return "accepted"


@pytest.mark.parametrize("name", NAMES)
def test_flipped_byte_is_refused(name):
    """Any flipped byte of the index or of a stream (or of the prefix) is caught by the checksum."""
    base, target, payload = _load(name)
    seed = zlib.crc32(name.encode())
    for r, _ in _regions(payload).values():
        for pos in _sample(r, 24, seed):
            for mask in (0x01, 0x80):
                bad = bytearray(payload)
                bad[pos] ^= mask
                with pytest.raises(codec.DeltaError):
                    codec.decode(base, bytes(bad))


@pytest.mark.parametrize("name", NAMES)
def test_forged_stream_byte_is_refused(name):
    """With the checksum recomputed (a forger's payload), a flipped stream byte is still refused,
    by the stream's own checks or by the target digest: never wrong output. A raw stream (every
    rANS stream among them) has no two forms of one content, so a flip there is always refused;
    a compressed one may have (an lz4, zstd or brotli stream is malleable), and a flip that
    decompresses to the same bytes is then harmless: the output is the exact target."""
    base, target, payload = _load(name)
    seed = zlib.crc32(name.encode()) + 1
    for region, (r, stream_codec) in _regions(payload).items():
        if stream_codec < 0:
            continue
        for pos in _sample(r, 16, seed):
            bad = bytearray(payload)
            bad[pos] ^= 0x01 if pos % 2 else 0x40
            outcome = _outcome(base, target, _reseal(bytes(bad[:16]), bytes(bad[32:])))
            if stream_codec == 0:
                assert outcome == "refused", (region, pos)


def _raw_index(payload: bytes) -> tuple[bytes, bytes]:
    index_len = int.from_bytes(payload[12:16], "little")
    return zstandard.ZstdDecompressor().decompress(payload[32:32 + index_len]), payload[32 + index_len:]


def _with_index(payload: bytes, raw_index: bytes, body: bytes) -> bytes:
    frame = zstandard.ZstdCompressor(level=3).compress(raw_index)
    head = payload[:12] + len(frame).to_bytes(4, "little")
    return _reseal(head, frame + body)


def _index_fields(raw: bytes) -> list[tuple[int, int, str]]:
    """(start, end, field) of every field of a raw index (docs/FORMAT.md, Index)."""
    r = Reader(raw)
    out = []

    def field(name: str, read) -> None:
        at = r._pos
        read()
        out.append((at, r._pos, name))

    n = r.uvarint()
    out.append((0, r._pos, "n_tensors"))
    for _ in range(n):
        field("name", lambda: r.blob(1 << 16))
        field("dtype", r.u8)
        field("shape", lambda: [r.uvarint() for _ in range(r.uvarint())])
        field("method", r.u8)
        field("changes", r.uvarint)
        field("base_digest", lambda: r.raw(16))
        field("target_digest", lambda: r.raw(16))
        field("params", lambda: r.blob(1 << 20))
        at = r._pos
        for _ in range(r.uvarint()):
            r.u8(), r.uvarint(), r.uvarint()
        out.append((at, r._pos, "streams"))
    field("n_shared", r.uvarint)
    while r.remaining:
        at = r._pos
        kind = r.u8()
        r.blob(1 << 24)
        out.append((at, r._pos, f"shared{kind}"))
    return out


# Fields where a flip can leave the output unchanged, so a decoder may accept it (ours does, and
# the output is then the exact target): the base digest (checked only for `same` records and to
# explain a failure: the target digest proves every success), a conditional record's params (the
# mask level of a class without changes is never used) and the shared blocks (value- or
# vote-table rows of keys or contexts no record uses; an interleave rule that puts every record on the same states; an
# interleave block whose kind becomes unknown, and is ignored). Every other field is refused.
MAY_BE_HARMLESS = {"base_digest", "params", "shared1", "shared2", "shared3"}


@pytest.mark.parametrize("name", NAMES)
def test_forged_index_byte_is_refused_or_harmless(name):
    """With the index rewritten and the checksum recomputed, a flipped index byte is refused, or
    decodes to the exact target where it touches nothing the output depends on: never wrong
    output. Names, dtypes, shapes, methods, change counts, target digests and stream fields are
    always refused."""
    base, target, payload = _load(name)
    raw, body = _raw_index(payload)
    assert _with_index(payload, raw, body) == payload  # the index is re-packed exactly as the encoder did
    fields = _index_fields(raw)
    assert fields[-1][1] == len(raw)
    for pos in _sample(range(len(raw)), 160, zlib.crc32(name.encode()) + 2):
        bad = bytearray(raw)
        bad[pos] ^= 0x01
        outcome = _outcome(base, target, _with_index(payload, bytes(bad), body))
        what = next(f for a, b, f in fields if a <= pos < b)
        if what not in MAY_BE_HARMLESS:
            assert outcome == "refused", (what, pos)


def test_v2_payload_with_an_interleave_rule_is_refused():
    base, target, payload = _load("v2-conditional")
    raw, body = _raw_index(payload)
    # n_shared is the byte before the value-tables block: 1 -> 2, and a kind-2 block appended
    tables = container.unpack(payload).shared[conditional.SHARED_VALUE_TABLES]
    at = raw.rfind(bytes([conditional.SHARED_VALUE_TABLES]) + _uvarint(len(tables)) + tables)
    assert raw[at - 1] == 1 and at + 1 + len(_uvarint(len(tables))) + len(tables) == len(raw)
    forged = raw[:at - 1] + bytes([2]) + raw[at:] + bytes([2, 2, 0x80, 0x20])
    with pytest.raises(codec.DeltaError, match="interleave"):
        codec.decode(base, _with_index(payload, forged, body))


def _uvarint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


# ---------------------------------------------------------------- what FORMAT.md says decoders do today

def _shared_tail(raw: bytes, payload: bytes) -> int:
    """Offset of the n_shared field in a raw index."""
    return [a for a, _, f in _index_fields(raw) if f == "n_shared"][0]


def _with_shared(name: str, blocks: list[tuple[int, bytes]]) -> tuple[dict, dict, bytes]:
    """Vector `name` with its shared blocks replaced by `blocks` (kind, data), in that order."""
    base, target, payload = _load(name)
    raw, body = _raw_index(payload)
    at = _shared_tail(raw, payload)
    tail = _uvarint(len(blocks)) + b"".join(bytes([k]) + _uvarint(len(d)) + d for k, d in blocks)
    return base, target, _with_index(payload, raw[:at] + tail, body)


def test_index_varints_accept_non_minimal_forms():
    base, target, payload = _load("v3-edge")
    raw, body = _raw_index(payload)
    assert raw[0] < 0x80
    longer = bytes([raw[0] | 0x80, 0x00]) + raw[1:]  # n_tensors in two bytes
    assert _same_as(codec.decode(base, _with_index(payload, longer, body)), target)
    ten = bytes([raw[0] | 0x80]) + b"\x80" * 8 + b"\x00" + raw[1:]  # ten bytes: the longest accepted
    assert _same_as(codec.decode(base, _with_index(payload, ten, body)), target)
    eleven = bytes([raw[0] | 0x80]) + b"\x80" * 9 + b"\x00" + raw[1:]
    with pytest.raises(codec.DeltaError):
        codec.decode(base, _with_index(payload, eleven, body))


def test_shared_blocks_unknown_kinds_ignored_duplicates_last_wins():
    base, target, payload = _load("v3-interleave")
    shared = container.unpack(payload).shared
    tables, rule = shared[conditional.SHARED_VALUE_TABLES], shared[conditional.SHARED_INTERLEAVE]
    ok = [(1, tables), (2, rule), (9, b"anything")]
    assert _same_as(codec.decode(*_with_shared("v3-interleave", ok)[::2]), target)
    # two rules: the last one counts (a rule of 0 puts the 2-state record on four states)
    zero = _uvarint(0)
    assert _same_as(codec.decode(*_with_shared("v3-interleave", [(1, tables), (2, zero), (2, rule)])[::2]), target)
    with pytest.raises(codec.DeltaError):
        codec.decode(*_with_shared("v3-interleave", [(1, tables), (2, rule), (2, zero)])[::2])
    # a malformed block no record reads is not refused
    b, t, p = _with_shared("v3-dtypes", [(1, b"\xff")])
    assert _same_as(codec.decode(b, p), t)
    # no value tables with a conditional record: refused
    with pytest.raises(codec.DeltaError, match="value tables"):
        codec.decode(*_with_shared("v3-interleave", [(2, rule)])[::2])


def test_vote_tables_rules():
    """Kind 3 (v4): it wins over a kind 1 block; without it (and without kind 1) a conditional
    record is refused; a v3 payload carrying it is refused when opened; a malformed one, or one
    missing a context a change falls under, is refused naming a tensor."""
    base, target, payload = _load("v4-votes")
    shared = container.unpack(payload).shared
    votes, rule = shared[conditional.SHARED_VOTE_TABLES], shared[conditional.SHARED_INTERLEAVE]
    assert conditional.SHARED_VALUE_TABLES not in shared
    v3_tables = container.unpack(_load("v3-interleave")[2]).shared[conditional.SHARED_VALUE_TABLES]
    assert _same_as(codec.decode(*_with_shared("v4-votes", [(1, v3_tables), (2, rule), (3, votes)])[::2]), target)
    with pytest.raises(codec.DeltaError, match="(value|vote) tables"):  # (a still record: its bit needs them)
        codec.decode(*_with_shared("v4-votes", [(2, rule)])[::2])
    b, _, p = _with_shared("v3-interleave", [(1, v3_tables), (2, shared[2] if 2 in shared else rule), (3, votes)])
    with pytest.raises(codec.DeltaError, match="v4 field"):
        codec.decode(b, p)
    with pytest.raises(codec.DeltaError) as err:
        codec.decode(*_with_shared("v4-votes", [(2, rule), (3, votes[:-1])])[::2])
    assert err.value.tensor in target
    model = conditional.ValueModel.unpack(votes, vote=True)
    one = conditional.ValueModel(model.freq[1:], model.keys[1:], vote=True)  # the first context dropped
    with pytest.raises(codec.DeltaError, match="no value table") as err:
        codec.decode(*_with_shared("v4-votes", [(2, rule), (3, one.pack())])[::2])
    assert err.value.tensor in target


def _spec_vote_walk(base: np.ndarray, target: np.ndarray, cols: int, still: bool = False) -> list[tuple[int, int]]:
    """FORMAT.md's column votes in plain Python: each change's (context, coded zigzag u'); a
    still record's counters stay 0."""
    def ordered(x: int) -> int:
        return x ^ 0xFFFF if x & 0x8000 else x ^ 0x8000

    counters = [0] * cols
    out = []
    for i in np.flatnonzero(base != target).tolist():
        b, t = int(base[i]), int(target[i])
        s = ordered(t) - ordered(b)
        u = 2 * s - 2 if s > 0 else -2 * s - 1
        v = counters[i % cols]
        out.append(((b >> 7 & 0xFF) * 5 + abs(v), u ^ (1 if v < 0 else 0)))
        if not still:
            counters[i % cols] = min(4, v + 1) if s > 0 else max(-4, v - 1)
    return out


def test_vote_symbols_are_the_walk_format_md_defines():
    """The encoder's vote symbols for every record of the v4 vector are FORMAT.md's column-vote
    walk: the context, and the token of the coded (possibly negated) step; a record the payload
    marks still codes the walk without votes (every context `key * 5`, nothing negated)."""
    base, target, payload = _load("v4-votes")
    still = {e.name: bool(e.params[0] & conditional.STILL) for e in container.unpack(payload).entries}
    assert set(still.values()) == {False, True}
    seen = set()
    for name in target:
        b = base[name].contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
        t = target[name].contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
        cols = conditional.vote_columns(tuple(target[name].shape))
        a = conditional.analyze(b, t, cols)
        sym = a.vote_symbols().astype(np.int64)
        want = _spec_vote_walk(b, t, cols)
        ctx = [c for c, _ in want]
        tok = conditional._tokens(np.array([u for _, u in want], np.int64))
        assert np.array_equal((sym >> 6) & conditional.CONTEXT_MASK, ctx), name
        assert np.array_equal(sym & 63, tok), name
        a.settle()  # the encoder's choice, as the payload records it
        assert a.still == still[name], name
        coded = a.coded_symbols(True).astype(np.int64)
        want = _spec_vote_walk(b, t, cols, still[name])
        assert np.array_equal((coded >> 6) & conditional.CONTEXT_MASK, [c for c, _ in want]), name
        assert np.array_equal(coded & 63, conditional._tokens(np.array([u for _, u in want], np.int64))), name
        assert not still[name] or not ((coded >> conditional.FLIP_BIT) & 1).any(), name
        seen |= {c % 5 for c in ctx} | {-1 for c in (sym >> conditional.FLIP_BIT) & 1 if c}
    assert seen == {-1, 0, 1, 2, 3, 4}  # every strength, and negated steps


_M = (4503599627370496, 4012251135041684, 3574509393065758, 3184525836262886, 2837089985411397, 2527559831251808)


def _spec_mask_row(level: int) -> list[int]:
    """One gap table, built from FORMAT.md's steps 1-7 in plain Python floats (IEEE binary64)."""
    import math

    j = level + 1
    q = 1.0 - math.ldexp(_M[j % 6], -(52 + j // 6))
    sq = [q]
    for _ in range(48):
        sq.append(sq[-1] * sq[-1])
    bounds = [t if t < 8 else (4 + ((t - 8) & 3)) << (1 + ((t - 8) >> 2)) for t in range(188)] + [1 << 48]
    powers = []
    for b in bounds:
        x = 1.0
        for k in range(49):
            if b >> k & 1:
                x *= sq[k]
        powers.append(x)
    m = [powers[t] - powers[t + 1] for t in range(187)] + [powers[187]]
    mass = 0.0
    for v in m:
        mass += v
    freq = [1 + math.floor((v / mass) * 32580) for v in m]
    top = max(range(188), key=lambda t: (m[t], -t))
    freq[top] += (1 << 15) - sum(freq)
    return freq


def test_mask_tables_are_the_ones_format_md_defines():
    freq = conditional.mask_tables()[0]
    assert freq.shape == (256, 188)
    assert hashlib.sha256(freq.astype("<u2").tobytes()).hexdigest() == \
        "3870bc8433eb6e782783386142793256b6b3721eff32f1efc3d223732e407803"
    for level in range(256):
        assert _spec_mask_row(level) == freq[level].tolist(), level


# --- snapshot objects (docs/FORMAT.md "Snapshot objects") ------------------------------------------

def _snapshot(name: str) -> tuple[dict, bytes]:
    d = VECTORS / name
    return load_file(str(d / "tensors.safetensors")), (d / "snapshot.drsn").read_bytes()


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_snapshot_vector_decodes_bit_for_bit_and_reencodes(name):
    tensors, blob = _snapshot(name)
    assert _same_as(dict(codec.decode_snapshot(blob)), tensors)
    entries = codec.read_snapshot_index(blob)
    assert {e.name: [e.dtype, list(e.shape)] for e in entries} == \
        {k: [v["dtype"], v["shape"]] for k, v in SNAPSHOTS[name]["tensors"].items()}
    call = SNAPSHOTS[name]["call"]
    block = int(call.split("bf16_block_elems=", 1)[1].split(",", 1)[0])
    version = int(call.split("version=", 1)[1].split(",", 1)[0].rstrip(")"))
    pairs = SNAPSHOTS[name].get("pairs", "auto")
    assert (f'pairs="{pairs}"' in call) == (pairs != "auto")
    assert version == SNAPSHOTS[name]["snapshot_version"] == int.from_bytes(blob[4:6], "little")
    assert b"".join(codec.encode_snapshot(tensors.items(), bf16_block_elems=block, version=version,
                                          pairs=pairs)) == blob


def test_snapshot_vectors_cover_every_block_kind():
    kinds = {str(k) for v in SNAPSHOTS.values() for t in v["tensors"].values() for k in t["block_kinds"]}
    assert kinds == {"0", "1", "2", "2+zstd", "3", "3+zstd", "4", "4+zstd"}
    assert {v["snapshot_version"] for v in SNAPSHOTS.values()} == {1, 2, 3, 4}  # every version still decodes
    assert any(len(t["block_kinds"]) > 1 for v in SNAPSHOTS.values() for t in v["tensors"].values())


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_snapshot_vector_with_a_flipped_byte_is_refused_or_harmless(name):
    """Every flipped byte is refused, by a walk and by a seeking read of one tensor, except where
    the decoded tensors cannot change (the seeking read skips other records; a one-exponent
    block's spare symbol is never decoded; zstd reads a residual frame's header descriptor with
    those bits flipped as another valid header): then the output is still exact, never wrong."""
    tensors, blob = _snapshot(name)
    pick = max(tensors, key=lambda k: tensors[k].numel())
    data = bytearray(blob)
    harmless = 0
    for i in range(len(data)):
        data[i] ^= 0x5A
        for only in (None, {pick}):
            try:
                got = dict(codec.decode_snapshot(bytes(data), only=only))
            except codec.SnapshotError:
                continue
            assert _same_as(got, tensors if only is None else {pick: tensors[pick]}), (i, only)
            harmless += only is None
        data[i] ^= 0x5A
    # snapshot-bf16's, -v2's and -v3's three one-exponent (one-pair) blocks: spare symbol (spare
    # code's gap), frame descriptor; their F32 zstd block and -v3's zstd residual of "spread":
    # its frame descriptor. snapshot-f16 has six blocks with a zstd residual (three of them one-pair
    # blocks) and an F32 zstd block
    assert harmless <= (12 if name == "snapshot-f16" else 8), harmless
