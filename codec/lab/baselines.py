"""Faithful reimplementations of the published checkpoint-delta formats, for the benchmark.

Each baseline turns (base, target) mappings of tensors into bytes and back, losslessly, the way
the system it is named after does (from its published design), so `deltarelay bench` can
compare sizes and speeds on the same data in one run:

- `trl-sparse`: Hugging Face TRL delta sync, a safetensors file of int32 flat indices + BF16 values.
- `trl-gap16`: TRL's later variant, uint16 index gaps (0xFFFF escapes a longer gap) + BF16 values.
- `pulse`: PULSESync, sorted COO (row deltas uint8 widening to uint16/int32, column deltas
  within a row uint16 else int32), raw BF16 values, the whole blob through zstd level 1, with an
  xxh3-128 hash of the whole target model.
- `arcv3`: Fireworks ARCv3, XOR vs previous with unchanged elements omitted through a change
  bitmask, mantissa-only changes sending the 7 mantissa XOR bits, sign/exponent changes packed
  separately, per tensor zstd / lz4 / brotli race and the smallest wins, Adler32 per tensor.
- `zstd1-full`: zstd level 1 of the full target checkpoint (a safetensors file), no delta.

Only BF16 tensors take each format's sparse path. Tensors of other dtypes that changed travel
the same way in every delta baseline (zstd-1 of their XOR with the base), so they never decide
a comparison. Unchanged tensors are not sent. These are measuring instruments, not hardened
decoders: they verify what their originals verify (hashes, checksums) and nothing more.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import safetensors.torch
import torch
import xxhash
import zstandard

from codec import check_structure, compressors, tensors
from codec.wire import Reader, Writer

OTHER_SUFFIX = ".xor_zstd"
_ZSTD1 = zstandard.ZstdCompressor(level=1)
GAP_ESCAPE = 0xFFFF
HIGH_BITS = np.uint16(0xFF80)  # BF16 sign + exponent: ARCv3 packs changes there separately


@dataclass(frozen=True)
class Baseline:
    """One anchor format: `encode(base, target) -> bytes`, `decode(base, payload) -> dict`."""

    key: str
    label: str
    encode: Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], bytes]
    decode: Callable[[Mapping[str, torch.Tensor], bytes], dict[str, torch.Tensor]]
    is_delta: bool = True


# ---------------------------------------------------------------------------------------------
# Shared plumbing: which tensors changed, how non-BF16 tensors travel, how the target is rebuilt.

@dataclass
class _Changed:
    name: str
    base: np.ndarray  # element view (uint16 for BF16)
    target: np.ndarray
    index: np.ndarray  # int64 flat positions of changed elements
    bf16: bool


def _changes(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> Iterator[_Changed]:
    """Tensors of `target` that differ from `base`, in target order."""
    check_structure(base, target)
    for name, t_tensor in target.items():
        dt = tensors.dtype_of(t_tensor, name)
        b = tensors.element_view(base[name])
        t = tensors.element_view(t_tensor)
        index = np.flatnonzero(b != t)
        if index.size:
            yield _Changed(name, b, t, index, dt is tensors.BF16)


def _other_pack(c: _Changed) -> bytes:
    """A non-BF16 tensor's change, the same way for every baseline: zstd-1 of its XOR with the base."""
    return _ZSTD1.compress(np.bitwise_xor(c.base, c.target).tobytes())


def _other_unpack(base_tensor: torch.Tensor, blob: bytes, name: str) -> torch.Tensor:
    elems = tensors.element_view(base_tensor)
    raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=max(elems.nbytes, 1))
    if len(raw) != elems.nbytes:
        raise ValueError(f"tensor {name!r}: XOR blob holds {len(raw)} bytes, base has {elems.nbytes}")
    return _rebuild(base_tensor, np.bitwise_xor(elems, np.frombuffer(raw, elems.dtype)))


def _rebuild(base_tensor: torch.Tensor, elems: np.ndarray) -> torch.Tensor:
    """A tensor shaped like `base_tensor` that takes ownership of `elems` (a fresh array)."""
    if elems.size == 0:
        return base_tensor.detach().clone()
    raw = torch.from_numpy(np.ascontiguousarray(elems).view(np.uint8))
    return raw.view(base_tensor.dtype).reshape(base_tensor.shape)


def _patched(base_tensor: torch.Tensor, index: np.ndarray, values: np.ndarray) -> torch.Tensor:
    elems = tensors.element_view(base_tensor).copy()
    elems[index] = values
    return _rebuild(base_tensor, elems)


def _finish(base: Mapping[str, torch.Tensor], changed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full target in base order: unchanged tensors copied from the base (a receiver's new copy)."""
    return {k: changed[k] if k in changed else v.detach().clone() for k, v in base.items()}


def _base_elems(base: Mapping[str, torch.Tensor], name: str) -> np.ndarray:
    if name not in base:
        raise ValueError(f"payload names tensor {name!r}, which the base does not hold")
    return tensors.element_view(base[name])


def _as_bf16(elems: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(elems, np.uint16).view(np.int16)).view(torch.bfloat16)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


# ---------------------------------------------------------------------------------------------
# TRL sparse: safetensors with `{name}.indices` (int32) and `{name}.values` (BF16).

def trl_sparse_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    out: dict[str, torch.Tensor] = {}
    for c in _changes(base, target):
        if not c.bf16:
            out[c.name + OTHER_SUFFIX] = torch.frombuffer(bytearray(_other_pack(c)), dtype=torch.uint8)
            continue
        if c.base.size > np.iinfo(np.int32).max:
            raise ValueError(f"tensor {c.name!r}: {c.base.size} elements overflow TRL's int32 indices")
        out[c.name + ".indices"] = torch.from_numpy(c.index.astype(np.int32))
        out[c.name + ".values"] = _as_bf16(c.target[c.index])
    return safetensors.torch.save(out)


def _split_keys(loaded: Mapping[str, torch.Tensor], suffixes: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in loaded.items():
        for suffix in suffixes:
            if key.endswith(suffix):
                groups.setdefault(key[: -len(suffix)], {})[suffix] = value
                break
        else:
            raise ValueError(f"unexpected entry {key!r} in the sparse safetensors payload")
    return groups


def trl_sparse_decode(base: Mapping[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    groups = _split_keys(safetensors.torch.load(bytes(payload)), (".indices", ".values", OTHER_SUFFIX))
    for name, parts in groups.items():
        _base_elems(base, name)
        if OTHER_SUFFIX in parts:
            out[name] = _other_unpack(base[name], parts[OTHER_SUFFIX].numpy().tobytes(), name)
        else:
            out[name] = _patched(base[name], parts[".indices"].numpy().astype(np.int64), _bits(parts[".values"]))
    return _finish(base, out)


# ---------------------------------------------------------------------------------------------
# TRL gap-coded: `{name}.gaps` (uint16, 0xFFFF = skip 65535 positions) and `{name}.values` (BF16).

def gaps_encode(index: np.ndarray) -> np.ndarray:
    """uint16 tokens: each change is its gap (positions skipped since the last change) after
    gap // 65535 escape tokens, so any gap fits while typical ones cost two bytes."""
    gap = np.diff(index, prepend=-1) - 1
    escapes = gap // GAP_ESCAPE
    tokens = np.full(index.size + int(escapes.sum()), GAP_ESCAPE, np.uint16)
    tokens[np.cumsum(escapes + 1) - 1] = (gap % GAP_ESCAPE).astype(np.uint16)
    return tokens


def gaps_decode(tokens: np.ndarray) -> np.ndarray:
    real = np.flatnonzero(tokens != GAP_ESCAPE)
    if tokens.size and (real.size == 0 or real[-1] != tokens.size - 1):
        raise ValueError("gap stream ends with an escape token")
    escapes = np.diff(real, prepend=-1) - 1
    gap = tokens[real].astype(np.int64) + GAP_ESCAPE * escapes
    return np.cumsum(gap + 1) - 1


def trl_gap16_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    out: dict[str, torch.Tensor] = {}
    for c in _changes(base, target):
        if not c.bf16:
            out[c.name + OTHER_SUFFIX] = torch.frombuffer(bytearray(_other_pack(c)), dtype=torch.uint8)
            continue
        out[c.name + ".gaps"] = torch.from_numpy(gaps_encode(c.index).view(np.int16)).view(torch.uint16)
        out[c.name + ".values"] = _as_bf16(c.target[c.index])
    return safetensors.torch.save(out)


def trl_gap16_decode(base: Mapping[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    groups = _split_keys(safetensors.torch.load(bytes(payload)), (".gaps", ".values", OTHER_SUFFIX))
    for name, parts in groups.items():
        elems = _base_elems(base, name)
        if OTHER_SUFFIX in parts:
            out[name] = _other_unpack(base[name], parts[OTHER_SUFFIX].numpy().tobytes(), name)
            continue
        index = gaps_decode(parts[".gaps"].view(torch.int16).numpy().view(np.uint16))
        if index.size and index[-1] >= elems.size:
            raise ValueError(f"tensor {name!r}: gap-coded position {index[-1]} outside {elems.size} elements")
        out[name] = _patched(base[name], index, _bits(parts[".values"]))
    return _finish(base, out)


# ---------------------------------------------------------------------------------------------
# PULSESync: sorted COO with narrow delta-coded indices, raw BF16 values, zstd-1 over the blob.

PULSE_MAGIC = b"PLS1"
_IDX_DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.int32)}
KIND_BF16, KIND_OTHER = 0, 1


def _narrowest(values: np.ndarray, allowed: tuple[int, ...]) -> int:
    top = int(values.max()) if values.size else 0
    for width in allowed:
        if width == 4 or top <= np.iinfo(_IDX_DTYPES[width]).max:
            return width
    raise AssertionError("unreachable")


def coo_deltas(index: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Row deltas, and column deltas that restart (absolute column) whenever the row changes.

    As PULSESync, a tensor is viewed as rows of prod(shape[1:]) columns; a 1-D tensor is one
    column, every element its own row.
    """
    cols_per_row = int(np.prod(shape[1:])) if len(shape) >= 2 else 1
    cols_per_row = max(cols_per_row, 1)
    rows, cols = np.divmod(index, cols_per_row)
    row_delta = np.diff(rows, prepend=0)
    col_delta = np.diff(cols, prepend=0)
    new_row = np.ones(index.size, bool)
    new_row[1:] = row_delta[1:] != 0
    col_delta[new_row] = cols[new_row]
    return row_delta, col_delta


def coo_index(row_delta: np.ndarray, col_delta: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    cols_per_row = max(int(np.prod(shape[1:])) if len(shape) >= 2 else 1, 1)
    row_delta = row_delta.astype(np.int64)
    col_delta = col_delta.astype(np.int64)
    rows = np.cumsum(row_delta)
    new_row = np.ones(row_delta.size, bool)
    new_row[1:] = row_delta[1:] != 0
    running = np.cumsum(col_delta)
    segment = np.cumsum(new_row) - 1
    cols = running - (running - col_delta)[new_row][segment]  # cumulative sum restarted at each row
    return rows * cols_per_row + cols


def pulse_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    head = Writer()
    data: list[bytes] = []
    entries = list(_changes(base, target))
    head.uvarint(len(entries))
    for c in entries:
        head.blob(c.name.encode())
        if not c.bf16:
            blob = _other_pack(c)
            head.u8(KIND_OTHER)
            head.uvarint(len(blob))
            data.append(blob)
            continue
        row_delta, col_delta = coo_deltas(c.index, tuple(base[c.name].shape))
        rw, cw = _narrowest(row_delta, (1, 2, 4)), _narrowest(col_delta, (2, 4))
        head.u8(KIND_BF16)
        head.uvarint(int(c.index.size))
        head.u8(rw)
        head.u8(cw)
        data += [row_delta.astype(_IDX_DTYPES[rw]).tobytes(), col_delta.astype(_IDX_DTYPES[cw]).tobytes(),
                 c.target[c.index].tobytes()]
    head.raw(_model_hash(target))
    header = head.getvalue()
    blob = PULSE_MAGIC + len(header).to_bytes(4, "little") + header + b"".join(data)
    return _ZSTD1.compress(blob)


def _model_hash(tensors_: Mapping[str, torch.Tensor]) -> bytes:
    """xxh3-128 over every tensor's name and bytes, in name order: PULSESync's whole-model hash."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors_):
        h.update(name.encode())
        h.update(np.ascontiguousarray(tensors.element_view(tensors_[name])).data.cast("B"))  # .data: its memoryview
    return h.digest()


def pulse_decode(base: Mapping[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    base_bytes = sum(tensors.element_view(v).nbytes for v in base.values())
    blob = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=16 * base_bytes + (1 << 20))
    if blob[:4] != PULSE_MAGIC:
        raise ValueError("not a PULSESync-style payload (bad magic)")
    hlen = int.from_bytes(blob[4:8], "little")
    r = Reader(blob[8 : 8 + hlen], "PULSESync header")
    pos = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for _ in range(r.uvarint(len(base))):
        name = r.blob(1 << 16).decode()
        elems = _base_elems(base, name)
        if r.u8() == KIND_OTHER:
            n = r.uvarint(len(blob))
            out[name] = _other_unpack(base[name], blob[pos : pos + n], name)
            pos += n
            continue
        count, rw, cw = r.uvarint(elems.size), r.u8(), r.u8()
        rows = np.frombuffer(blob, _IDX_DTYPES[rw], count, pos)
        pos += rw * count
        cols = np.frombuffer(blob, _IDX_DTYPES[cw], count, pos)
        pos += cw * count
        values = np.frombuffer(blob, np.uint16, count, pos)
        pos += 2 * count
        index = coo_index(rows, cols, tuple(base[name].shape))
        if index.size and (index.min() < 0 or index.max() >= elems.size):
            raise ValueError(f"tensor {name!r}: COO position outside the tensor")
        out[name] = _patched(base[name], index, values)
    out = _finish(base, out)
    if r.raw(16) != _model_hash(out):
        raise ValueError("PULSESync whole-model hash does not match the reconstruction")
    return out


# ---------------------------------------------------------------------------------------------
# ARCv3: change bitmask, kind bits, 7-bit mantissa XORs, sign/exponent XORs; per tensor codec race.

ARC_MAGIC = b"ARC3"
# Levels a per-step production encoder can afford (brotli-9 is already slow on the masks).
# ARC_RACE_MAX adds zstd-19 and brotli-11 (an order of magnitude slower again), which reaches the
# published ARCv3 ratio; `arcv3-max` runs it when asked.
ARC_RACE = ((compressors.ZSTD, 3), (compressors.LZ4, 0), (compressors.BROTLI, 9))
ARC_RACE_MAX = compressors.EFFORT["max"]


def _arc_streams(c: _Changed) -> list[bytes]:
    mask = np.zeros(c.base.size, bool)
    mask[c.index] = True
    x = c.base[c.index] ^ c.target[c.index]
    high = (x & HIGH_BITS) != 0  # sign or exponent moved
    mant = (x[~high] & 0x7F).astype(np.uint8)  # the 7 mantissa XOR bits, one per byte
    full = x[high]
    return [np.packbits(mask, bitorder="little").tobytes(), np.packbits(high, bitorder="little").tobytes(),
            mant.tobytes(), (full >> 8).astype(np.uint8).tobytes() + (full & 0xFF).astype(np.uint8).tobytes()]


def arcv3_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor],
                 race: tuple[tuple[int, int], ...] = ARC_RACE) -> bytes:
    head = Writer()
    data: list[bytes] = []
    entries = list(_changes(base, target))
    head.uvarint(len(entries))
    for c in entries:
        head.blob(c.name.encode())
        head.raw(zlib.adler32(c.target.tobytes()).to_bytes(4, "little"))
        if not c.bf16:
            blob = _other_pack(c)
            head.u8(KIND_OTHER)
            head.uvarint(len(blob))
            data.append(blob)
            continue
        raw = _arc_streams(c)
        best: tuple[int, list[bytes]] | None = None
        for codec, level in race:  # one codec per tensor: the one whose streams add up smallest
            packed = [compressors.compress(codec, s, level) for s in raw]
            if best is None or sum(map(len, packed)) < sum(map(len, best[1])):
                best = (codec, packed)
        if best is None:
            raise ValueError("arcv3_encode: the race names no codec")
        codec, packed = best
        head.u8(KIND_BF16)
        head.uvarint(int(c.index.size))
        head.u8(codec)
        for s, p in zip(raw, packed):
            head.uvarint(len(s))
            head.uvarint(len(p))
        data += packed
    header = head.getvalue()
    return ARC_MAGIC + len(header).to_bytes(4, "little") + header + b"".join(data)


def arcv3_decode(base: Mapping[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    payload = bytes(payload)
    if payload[:4] != ARC_MAGIC:
        raise ValueError("not an ARCv3-style payload (bad magic)")
    hlen = int.from_bytes(payload[4:8], "little")
    r = Reader(payload[8 : 8 + hlen], "ARCv3 header")
    pos = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for _ in range(r.uvarint(len(base))):
        name = r.blob(1 << 16).decode()
        elems = _base_elems(base, name)
        adler = int.from_bytes(r.raw(4), "little")
        if r.u8() == KIND_OTHER:
            n = r.uvarint(len(payload))
            rebuilt = _other_unpack(base[name], payload[pos : pos + n], name)
            pos += n
        else:
            count, codec = r.uvarint(elems.size), r.u8()
            streams = []
            for i in range(4):
                raw_len, stored_len = r.uvarint(2 * elems.size + 8), r.uvarint(len(payload))
                streams.append(compressors.decompress(codec, payload[pos : pos + stored_len], raw_len,
                                                      f"ARCv3 stream {i} of {name!r}"))
                pos += stored_len
            mask = np.unpackbits(np.frombuffer(streams[0], np.uint8), count=elems.size, bitorder="little")
            index = np.flatnonzero(mask)
            high = np.unpackbits(np.frombuffer(streams[1], np.uint8), count=count, bitorder="little").astype(bool)
            nfull = int(high.sum())
            hl = np.frombuffer(streams[3], np.uint8)
            x = np.empty(count, np.uint16)
            x[~high] = np.frombuffer(streams[2], np.uint8)
            x[high] = (hl[:nfull].astype(np.uint16) << 8) | hl[nfull:]
            rebuilt = _patched(base[name], index, elems[index] ^ x)
        if zlib.adler32(tensors.element_view(rebuilt).tobytes()) != adler:
            raise ValueError(f"tensor {name!r}: Adler32 of the reconstruction does not match")
        out[name] = rebuilt
    return _finish(base, out)


# ---------------------------------------------------------------------------------------------
# zstd-1 of the full target checkpoint: what shipping the whole file costs.

def zstd1_full_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    check_structure(base, target)
    return _ZSTD1.compress(safetensors.torch.save({k: v.contiguous() for k, v in target.items()}))


def zstd1_full_decode(base: Mapping[str, torch.Tensor], payload: bytes) -> dict[str, torch.Tensor]:
    limit = sum(tensors.element_view(v).nbytes for v in base.values()) + (64 << 20)
    loaded = safetensors.torch.load(zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=limit))
    return {k: loaded[k] for k in base}


def arcv3_max_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> bytes:
    return arcv3_encode(base, target, ARC_RACE_MAX)


BASELINES: dict[str, Baseline] = {
    b.key: b
    for b in (
        Baseline("trl-sparse", "TRL sparse (int32 idx + bf16)", trl_sparse_encode, trl_sparse_decode),
        Baseline("trl-gap16", "TRL gap-coded (uint16 gaps + bf16)", trl_gap16_encode, trl_gap16_decode),
        Baseline("pulse", "PULSESync-style (COO + zstd-1)", pulse_encode, pulse_decode),
        Baseline("arcv3", "ARCv3-style (mask/mantissa/exp + race)", arcv3_encode, arcv3_decode),
        Baseline("zstd1-full", "zstd-1 full checkpoint", zstd1_full_encode, zstd1_full_decode, is_delta=False),
    )
}
# Slow references the bench runs only when asked (--slow): minutes per pair on a large model.
SLOW_BASELINES: dict[str, Baseline] = {
    "arcv3-max": Baseline("arcv3-max", "ARCv3-style, max race (+zstd-19, brotli-11)", arcv3_max_encode, arcv3_decode),
}
