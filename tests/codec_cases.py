"""Builders of test checkpoints and payload forgeries shared by the codec, checkpoint and CLI tests.

Everything works on bit patterns: tensors are compared as bytes, so NaN payloads, -0.0 and
subnormals count, and a forged payload is built the way an attacker would (valid container,
recomputed checksum) so that only the codec's own checks stand between it and wrong output.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np
import torch
import xxhash
import zstandard

FORMAT_VERSIONS = (1, 2, 3, 4)

# Container prefix (codec/container.py): magic 8s, version H, flags H, index length I, checksum 16s.
PREFIX = struct.Struct("<8sHHI16s")
CHECKSUM_SLICE = slice(16, 32)

# BF16 bit patterns worth naming.
BF16_SPECIAL = {
    "+0": 0x0000, "-0": 0x8000,
    "+inf": 0x7F80, "-inf": 0xFF80,
    "qnan": 0x7FC0, "qnan-payload": 0x7FC5, "snan": 0x7F81, "snan-max": 0x7FBF, "nan-all-ones": 0x7FFF,
    "-qnan": 0xFFC0, "-snan": 0xFF81, "-nan-payload": 0xFFAA,
    "min-subnormal": 0x0001, "max-subnormal": 0x007F, "-min-subnormal": 0x8001, "-max-subnormal": 0x807F,
    "min-normal": 0x0080, "-min-normal": 0x8080, "max-normal": 0x7F7F, "-max-normal": 0xFF7F,
    "one": 0x3F80, "-one": 0xBF80, "one+ulp": 0x3F81, "two": 0x4000, "half": 0x3F00,
    "small": 0x3A83, "-small": 0xBA83,
}

# Every dtype a checkpoint can hold, other than BF16.
OTHER_DTYPES = (
    torch.float32, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
)


# --- tensors from bits -------------------------------------------------------------------------

def bf16_from_bits(bits: np.ndarray | list[int], shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A BF16 tensor holding exactly these 16-bit patterns."""
    arr = np.ascontiguousarray(np.asarray(bits, dtype=np.uint16))
    t = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return t.reshape(shape if shape is not None else arr.shape)


def bits_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes (a copy), whatever its dtype."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().copy() if flat.numel() else np.zeros(0, np.uint8)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    """Random bit patterns of `dtype` (any pattern, NaNs included), bool restricted to 0/1."""
    n = int(np.prod(shape, dtype=np.int64))
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:
        raw = rng.integers(0, 2, size=n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def random_bf16_weights(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.02) -> torch.Tensor:
    """BF16 weights that look like a trained layer's: normal values of mixed magnitude."""
    return torch.from_numpy(rng.normal(0.0, scale, size=shape).astype(np.float32)).to(torch.bfloat16)


def change_elements(t: torch.Tensor, fraction: float, rng: np.random.Generator) -> torch.Tensor:
    """A copy of `t` with `fraction` of its elements (at least one if any) set to different random bits."""
    out = t.clone()
    n = t.numel()
    if n == 0 or fraction <= 0:
        return out
    k = max(1, int(round(n * fraction)))
    idx = rng.choice(n, size=k, replace=False)
    flat = out.reshape(-1)
    if t.dtype is torch.bool:
        flat[torch.from_numpy(idx)] = ~flat[torch.from_numpy(idx)]
        return out
    size = t.element_size()
    as_int = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    flips = torch.from_numpy(rng.integers(1, 256, size=k, dtype=np.uint8).astype(np.int64))
    lanes = torch.from_numpy(rng.integers(0, size, size=k).astype(np.int64))
    ids = torch.from_numpy(idx)
    with torch.no_grad():
        as_int[ids] = as_int[ids] ^ (flips << (8 * lanes)).to(as_int.dtype)
    return out


def rl_step(t: torch.Tensor, fraction: float, rng: np.random.Generator) -> torch.Tensor:
    """A BF16 RL-style update: `fraction` of elements move, mostly by a few mantissa ULPs,
    a few across an exponent boundary (value *2 or /2), a very few flip sign."""
    bits = bits_of(t).view(np.uint16).copy()
    n = bits.size
    k = max(1, int(round(n * fraction))) if n else 0
    idx = rng.choice(n, size=k, replace=False)
    kind = rng.random(k)
    new = bits[idx].copy()
    mant = kind < 0.97
    step = rng.choice(np.array([-2, -1, 1, 2], np.int32), size=int(mant.sum()))
    m = (new[mant] & 0x7F).astype(np.int32)
    m = np.clip(m + step, 0, 0x7F)
    m = np.where(m == (new[mant] & 0x7F), m ^ 1, m)  # always change
    new[mant] = (new[mant] & 0xFF80) | m.astype(np.uint16)
    expo = (kind >= 0.97) & (kind < 0.995)
    e = (new[expo] >> 7) & 0xFF
    e = np.where(e >= 0xFE, e - 1, e + 1)  # stay finite
    new[expo] = (new[expo] & 0x807F) | (e.astype(np.uint16) << 7)
    sign = kind >= 0.995
    new[sign] ^= 0x8000
    bits[idx] = new
    return bf16_from_bits(bits, tuple(t.shape))


# --- checkpoints -------------------------------------------------------------------------------

def edge_pair(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A hostile edge-case (base, target) pair: every BF16 special transition, every dtype,
    0-d and empty tensors, unchanged, sparse and dense tensors, in one checkpoint."""
    rng = np.random.default_rng(seed)
    specials = np.array(list(BF16_SPECIAL.values()), np.uint16)
    grid_b = np.repeat(specials, specials.size)  # every special -> every special
    grid_t = np.tile(specials, specials.size)
    base: dict[str, torch.Tensor] = {
        "bf16.specials": bf16_from_bits(grid_b, (specials.size, specials.size)),
        "bf16.sparse": random_bf16_weights((64, 96), rng),
        "bf16.dense": random_bf16_weights((32, 40), rng),
        "bf16.same": random_bf16_weights((17, 3), rng),
        "bf16.scalar": bf16_from_bits([0x7FC1], ()),
        "bf16.empty": torch.empty((0, 8), dtype=torch.bfloat16),
    }
    target = {
        "bf16.specials": bf16_from_bits(grid_t, (specials.size, specials.size)),
        "bf16.sparse": rl_step(base["bf16.sparse"], 0.01, rng),
        "bf16.dense": rl_step(base["bf16.dense"], 1.0, rng),
        "bf16.same": base["bf16.same"].clone(),
        "bf16.scalar": bf16_from_bits([0xFF81], ()),
        "bf16.empty": torch.empty((0, 8), dtype=torch.bfloat16),
    }
    for dt in OTHER_DTYPES:
        key = str(dt).removeprefix("torch.")
        base[f"{key}.vec"] = random_tensor(dt, (300,), rng)
        target[f"{key}.vec"] = change_elements(base[f"{key}.vec"], 0.05, rng)
        base[f"{key}.scalar"] = random_tensor(dt, (), rng)
        target[f"{key}.scalar"] = change_elements(base[f"{key}.scalar"], 1.0, rng)
        base[f"{key}.empty"] = torch.empty((3, 0), dtype=dt)
        target[f"{key}.empty"] = torch.empty((3, 0), dtype=dt)
    return base, target


def model_pair(n_tensors: int = 6, shape: tuple[int, ...] = (64, 64), fraction: float = 0.01,
               seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A BF16 checkpoint and its next RL step, plus an unchanged fp32 norm."""
    rng = np.random.default_rng(seed)
    base = {f"layers.{i}.weight": random_bf16_weights(shape, rng) for i in range(n_tensors)}
    base["norm.weight"] = torch.ones(shape[-1], dtype=torch.float32)
    target = {k: rl_step(v, fraction, rng) if v.dtype is torch.bfloat16 else v.clone() for k, v in base.items()}
    return base, target


def clone_all(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tensors.items()}


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """Dtype, shape and raw bytes of every tensor, to prove later that nothing moved."""
    return {k: (v.dtype, tuple(v.shape), bits_of(v).tobytes()) for k, v in tensors.items()}


def assert_bit_exact(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (NaN payloads and -0.0 included)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for name in want:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert tuple(g.shape) == tuple(w.shape), (name, tuple(g.shape), tuple(w.shape))
        gb, wb = bits_of(g), bits_of(w)
        if not np.array_equal(gb, wb):
            diff = np.flatnonzero(gb != wb)
            raise AssertionError(f"tensor {name!r}: {diff.size} bytes differ, first at byte {diff[0]}")


# --- payload forgery ---------------------------------------------------------------------------

def fix_checksum(data: bytes | bytearray) -> bytes:
    """Recompute the container checksum (xxh3-128 over bytes[:16] + bytes[32:]) after tampering."""
    out = bytearray(data)
    if len(out) >= PREFIX.size:
        out[CHECKSUM_SLICE] = xxhash.xxh3_128_digest(bytes(out[:16]) + bytes(out[PREFIX.size:]))
    return bytes(out)


def split_payload(payload: bytes) -> tuple[int, bytes, bytes]:
    """(version, decompressed index, body) of a well-formed payload."""
    _, version, _, index_len, _ = PREFIX.unpack(payload[: PREFIX.size])
    index = zstandard.ZstdDecompressor().decompress(payload[PREFIX.size : PREFIX.size + index_len])
    return version, index, payload[PREFIX.size + index_len :]


def join_payload(version: int, index: bytes, body: bytes) -> bytes:
    """A payload with this raw index and body, correctly framed and checksummed."""
    packed = zstandard.ZstdCompressor(level=3).compress(index)
    rest = packed + body
    return fix_checksum(PREFIX.pack(b"DRDELTA\x00", version, 0, len(packed), bytes(16)) + rest)
