#!/usr/bin/env python3
"""Write the codec's test vectors: docs/vectors/codec/<name>/{base,target}.safetensors, payload.drd.

Each vector is a (base, target) checkpoint pair and the payload our encoder makes for it:

    payload = codec.encode(load_file(base), load_file(target), format_version=V, effort=E)
    codec.decode(load_file(base), payload) == load_file(target)   # bit for bit

The committed files are the contract (tests/test_format_vectors.py checks them, and a second
decoder can check itself against them); this script only says how they were made. Everything
is seeded, so a rerun with the same library versions writes the same bytes. It refuses to
overwrite existing vectors unless given --overwrite.

    python scripts/make_codec_vectors.py [--out docs/vectors/codec] [--overwrite]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import codec  # noqa: E402
from codec import container  # noqa: E402
from codec.methods import conditional  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "vectors" / "codec"

# BF16 bit patterns every decoder must carry exactly (NaN payloads, both zeros, infinities, subnormals)
SPECIALS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC5, 0x7F81, 0xFFAA, 0x0001, 0x807F,
            0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x3F81]


# ---------------------------------------------------------------- tensor builders

def bf16(bits, shape) -> torch.Tensor:
    arr = np.ascontiguousarray(np.asarray(bits, np.uint16)).view(np.int16).copy()
    return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16).copy()


def weights(rng: np.random.Generator, shape, spread: float = 1.0) -> torch.Tensor:
    """BF16 weights of mixed magnitude: log-normal scales over a few binades, random signs."""
    n = int(np.prod(shape))
    mag = np.exp(rng.normal(np.log(0.02), spread, n)) * rng.choice([-1.0, 1.0], n)
    return torch.from_numpy(mag.astype(np.float32)).to(torch.bfloat16).reshape(shape)


def rl_step(t: torch.Tensor, fraction: float, rng: np.random.Generator, small_first: bool = True) -> torch.Tensor:
    """`fraction` of the elements move by a few ULPs (small weights likelier, as AdamW makes them),
    a few cross an exponent boundary, a very few flip sign."""
    b = bits16(t)
    n = b.size
    k = max(1, int(round(n * fraction)))
    expo = ((b >> 7) & 0xFF).astype(np.float64)
    p = np.exp2(-(expo - expo.min()) / 2) if small_first else np.ones(n)
    idx = rng.choice(n, size=k, replace=False, p=p / p.sum())
    new = b[idx].astype(np.int64)
    kind = rng.random(k)
    mant = kind < 0.97
    step = rng.choice(np.array([-3, -2, -1, 1, 1, 2, 3]), size=int(mant.sum()))
    m = np.clip((new[mant] & 0x7F) + step, 0, 0x7F)
    m = np.where(m == (new[mant] & 0x7F), m ^ 1, m)
    new[mant] = (new[mant] & 0xFF80) | m
    ex = (kind >= 0.97) & (kind < 0.995)
    e = (new[ex] >> 7) & 0xFF
    e = np.where(e >= 0xFE, e - 1, e + 1)
    new[ex] = (new[ex] & 0x807F) | (e << 7)
    new[kind >= 0.995] ^= 0x8000
    out = b.copy()
    out[idx] = new.astype(np.uint16)
    return bf16(out, tuple(t.shape))


def random_bits(dtype: torch.dtype, shape, rng: np.random.Generator) -> torch.Tensor:
    n = int(np.prod(shape, dtype=np.int64))
    size = torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:
        raw = rng.integers(0, 2, size=n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, size=n * size, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def flip_bytes(t: torch.Tensor, fraction: float, rng: np.random.Generator) -> torch.Tensor:
    """A copy with `fraction` of its elements given one different random byte (bool: negated)."""
    out = t.clone()
    n = t.numel()
    k = max(1, int(round(n * fraction)))
    idx = torch.from_numpy(rng.choice(n, size=k, replace=False))
    flat = out.reshape(-1)
    if t.dtype is torch.bool:
        flat[idx] = ~flat[idx]
        return out
    raw = flat.view(torch.uint8).reshape(n, -1)
    lane = torch.from_numpy(rng.integers(0, raw.shape[1], size=k))
    flips = torch.from_numpy(rng.integers(1, 256, size=k).astype(np.uint8))
    raw[idx, lane] ^= flips
    return out


# ---------------------------------------------------------------- the vectors

def v1_methods(rng):
    """v1: every v1 method: same, sparse-split with gap positions, sparse-split with a bitmask,
    xor-planes on F32."""
    base = {
        "a.same": weights(rng, (16, 8)),
        "b.sparse_gaps": weights(rng, (64, 32)),
        "c.sparse_mask": weights(rng, (32, 32)),
        "d.f32": torch.from_numpy(rng.normal(1.0, 0.1, 64).astype(np.float32)),
    }
    target = {
        "a.same": base["a.same"].clone(),
        "b.sparse_gaps": rl_step(base["b.sparse_gaps"], 0.01, rng),
        "c.sparse_mask": rl_step(base["c.sparse_mask"], 0.20, rng, small_first=False),
        "d.f32": base["d.f32"] + torch.from_numpy(rng.choice([0.0, 1e-3], 64).astype(np.float32)),
    }
    return base, target


def v2_conditional(rng):
    """v2: conditional records with several exponent classes (two rANS states), one whose size is
    not a multiple of 64 (padded blocks), changes to and from NaN payloads, -0.0 and infinities."""
    sp = np.array(SPECIALS, np.uint16)
    w = weights(rng, (96, 64), spread=1.5)
    tail = weights(rng, (100,), spread=1.0)
    grid_b = np.repeat(sp, sp.size)
    grid_t = np.tile(sp, sp.size)
    keep = grid_b != grid_t
    specials_b = bits16(weights(rng, (2048,)))
    specials_t = specials_b.copy()
    at = rng.choice(2048, size=int(keep.sum()), replace=False)
    at.sort()
    specials_b[at] = grid_b[keep]
    specials_t[at] = grid_t[keep]
    base = {"layer.w": w, "layer.tail": tail, "layer.specials": bf16(specials_b, (2048,)),
            "layer.same": weights(rng, (8, 8))}
    target = {"layer.w": rl_step(w, 0.03, rng), "layer.tail": rl_step(tail, 0.05, rng),
              "layer.specials": bf16(specials_t, (2048,)), "layer.same": base["layer.same"].clone()}
    return base, target


def v3_interleave(rng):
    """v3: one conditional record with >= 4096 changes (four interleaved rANS states, the
    payload's interleave rule) next to one with few (two states)."""
    big = weights(rng, (144, 128), spread=1.2)
    small = weights(rng, (32, 64))
    return {"big": big, "small": small}, {"big": rl_step(big, 0.24, rng), "small": rl_step(small, 0.02, rng)}


def v3_dtypes(rng):
    """v3: xor-planes on every item size and on non-float dtypes; an unchanged non-BF16 tensor."""
    dtypes = [("f16", torch.float16), ("f32", torch.float32), ("f64", torch.float64), ("i8", torch.int8),
              ("i32", torch.int32), ("i64", torch.int64), ("u8", torch.uint8), ("bool", torch.bool),
              ("f8e4m3", torch.float8_e4m3fn), ("f8e5m2", torch.float8_e5m2), ("f8e8m0", torch.float8_e8m0fnu),
              ("u16", torch.uint16), ("u32", torch.uint32), ("u64", torch.uint64), ("c64", torch.complex64)]
    base, target = {}, {}
    for name, dt in dtypes:
        base[name] = random_bits(dt, (24,), rng)
        target[name] = flip_bytes(base[name], 0.25, rng)
    base["i16.same"] = random_bits(torch.int16, (5, 3), rng)
    target["i16.same"] = base["i16.same"].clone()
    return base, target


def v3_edge(rng):
    """v3: 0-d and empty tensors (same, xor-planes), a one-element BF16 tensor that becomes a NaN
    payload, a conditional record of 65 elements whose one change lies in its padded last block."""
    base = {
        "scalar.bf16": bf16([0x3F80], ()),
        "scalar.f32": torch.tensor(1.5, dtype=torch.float32),
        "scalar.same": bf16([0x7FC5], ()),
        "empty.bf16": torch.empty((0, 8), dtype=torch.bfloat16),
        "empty.f32": torch.empty((3, 0), dtype=torch.float32),
        "one.bf16": bf16([0xBF80], (1,)),
        "tail65.bf16": weights(rng, (65,)),
    }
    target = {
        "scalar.bf16": bf16([0x3F81], ()),
        "scalar.f32": torch.tensor(-0.0, dtype=torch.float32),
        "scalar.same": bf16([0x7FC5], ()),
        "empty.bf16": torch.empty((0, 8), dtype=torch.bfloat16),
        "empty.f32": torch.empty((3, 0), dtype=torch.float32),
        "one.bf16": bf16([0xFFAA], (1,)),
        "tail65.bf16": bf16(np.concatenate([bits16(base["tail65.bf16"])[:64], [0x8000]]), (65,)),
    }
    return base, target


def v3_dense_max(rng):
    """v3 at effort "max": dense BF16 changes, where sparse-split and xor-planes race the
    conditional method (sparse-split with a bitmask wins one), and brotli races the other
    stream compressors (and wins on an F32 tensor's planes)."""
    a = weights(rng, (40, 40))
    b = weights(rng, (48, 32))
    ta = bf16(bits16(a) ^ (rng.random(a.numel()) < 0.6).astype(np.uint16) * rng.integers(1, 1 << 16, a.numel(),
                                                                                          dtype=np.uint16),
              tuple(a.shape))
    f = torch.from_numpy(np.linspace(-1.0, 1.0, 1024, dtype=np.float32))
    tf = f + torch.from_numpy(np.tile(np.array([0.0, 0.0, 0.0, 2.0 ** -20], np.float32), 256))
    return ({"dense.random": a, "dense.rl": b, "norm.f32": f},
            {"dense.random": ta, "dense.rl": rl_step(b, 0.5, rng, False), "norm.f32": tf})


def column_step(t: torch.Tensor, fraction: float, rng: np.random.Generator) -> torch.Tensor:
    """`fraction` of the elements move by 1 to 40 ULPs, mostly (97%) the way their column leans
    (a random direction per column, as an update's sign is shared along a weight's input axis),
    so column counters reach both signs and every strength, large steps carry raw bits, and a
    few steps cross zero."""
    b = bits16(t)
    cols = t.shape[-1] if t.dim() >= 2 else 1
    k = max(1, int(round(b.size * fraction)))
    idx = rng.choice(b.size, size=k, replace=False)
    lean = rng.choice(np.array([-1, 1]), size=cols)[idx % cols]
    sign = np.where(rng.random(k) < 0.97, lean, -lean)
    size = rng.choice(np.array([1, 1, 1, 1, 1, 1, 1, 2, 9, 40]), size=k)
    o = np.where(b & 0x8000, b ^ 0xFFFF, b ^ 0x8000).astype(np.int64)
    moved = np.clip(o[idx] + sign * size, 0, 0xFFFF)
    moved = np.where(moved == o[idx], moved ^ 1, moved)
    o[idx] = moved
    out = np.where(o < 0x8000, o ^ 0xFFFF, o ^ 0x8000).astype(np.uint16)
    return bf16(out, tuple(t.shape))


def v4_votes(rng):
    """v4: conditional values coded with column votes (the vote tables, kind 3): 2-D records with
    column-wise leaning steps, one with >= 4096 changes (four states), a 1-D record (one column),
    a 3-D one (columns = its last dim), transitions to and from special patterns, and a still
    record (its steps go either way whatever their column: its params' STILL bit)."""
    sp = np.array(SPECIALS, np.uint16)
    grid_b = np.repeat(sp, sp.size)
    grid_t = np.tile(sp, sp.size)
    keep = grid_b != grid_t
    specials_b = bits16(weights(rng, (32, 64)))
    specials_t = specials_b.copy()
    at = np.sort(rng.choice(specials_b.size, size=int(keep.sum()), replace=False))
    specials_b[at] = grid_b[keep]
    specials_t[at] = grid_t[keep]
    base = {"big": weights(rng, (192, 192), spread=0.3), "small": weights(rng, (48, 40), spread=0.3),
            "bias": weights(rng, (300,)), "cube": weights(rng, (4, 6, 24)),
            "specials": bf16(specials_b, (32, 64)), "noisy": weights(rng, (96, 64), spread=0.3)}
    target = {"big": column_step(base["big"], 0.25, rng), "small": column_step(base["small"], 0.03, rng),
              "bias": column_step(base["bias"], 0.1, rng), "cube": column_step(base["cube"], 0.2, rng),
              "specials": bf16(specials_t, (32, 64)), "noisy": rl_step(base["noisy"], 0.2, rng)}
    return base, target


# F16 bit patterns every decoder must carry exactly: NaN payloads, both zeros, infinities, subnormals, the largest
F16_SPECIALS = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE55, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF,
                0x3C00, 0xBC00, 0x3C01, 0x03FF]


def f16(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor's bit patterns as F16."""
    return t.contiguous().view(torch.int16).view(torch.float16)


def v4_f16(rng):
    """v4: conditional records on F16 (method 3 takes any 2-byte element; encoders code F16 with it from v4 on),
    with column votes (the vote tables, kind 3): column-leaning steps on a 2-D record with >= 4096 changes (four
    states), a sparse 1-D one, transitions to and from special F16 patterns (NaN payloads, infinities, both zeros,
    subnormals), and random bits with 90% of their elements changed."""
    sp = np.array(F16_SPECIALS, np.uint16)
    grid_b = np.repeat(sp, sp.size)
    grid_t = np.tile(sp, sp.size)
    keep = grid_b != grid_t
    w = lambda shape, spread=0.3: weights(rng, shape, spread).float().to(torch.float16)  # noqa: E731
    specials_b = bits16(w((32, 64)))
    specials_t = specials_b.copy()
    at = np.sort(rng.choice(specials_b.size, size=int(keep.sum()), replace=False))
    specials_b[at] = grid_b[keep]
    specials_t[at] = grid_t[keep]
    base = {"big": w((160, 128)), "bias": w((256,), 1.0), "specials": f16(bf16(specials_b, (32, 64))),
            "noise": random_bits(torch.float16, (64, 16), rng)}
    target = {"big": f16(column_step(base["big"], 0.5, rng)), "bias": f16(column_step(base["bias"], 0.02, rng)),
              "specials": f16(bf16(specials_t, (32, 64))), "noise": flip_bytes(base["noise"], 0.9, rng)}
    return base, target


# (name, builder, seed, format_version, effort)
VECTORS = [
    ("v1-methods", v1_methods, 101, 1, "default"),
    ("v2-conditional", v2_conditional, 202, 2, "default"),
    ("v3-interleave", v3_interleave, 303, 3, "default"),
    ("v3-dtypes", v3_dtypes, 404, 3, "default"),
    ("v3-edge", v3_edge, 505, 3, "default"),
    ("v3-dense-max", v3_dense_max, 606, 3, "max"),
    ("v4-votes", v4_votes, 707, 4, "default"),
    ("v4-f16", v4_f16, 808, 4, "default"),
]


# ---------------------------------------------------------------- snapshot objects (DRSN)

def snapshot_bf16(rng):
    """BF16 blocks of kind 2 (weights over several blocks of 1024 elements, the last one short;
    zeros: one exponent, so a spare symbol, and a zstd-coded residual plane) and kind 0 (random
    bits, which coding would not shrink); NaN payloads, zeros, infinities, subnormals; a scalar,
    an empty tensor."""
    return {
        "weights": weights(rng, (3, 1000)),
        "zeros": torch.zeros(3000, dtype=torch.bfloat16),
        "noise": random_bits(torch.bfloat16, (300,), rng),
        "specials": bf16(SPECIALS, (len(SPECIALS),)),
        "scalar": bf16([0x3F81], ()),
        "empty": torch.empty((0, 8), dtype=torch.bfloat16),
    }


def snapshot_dtypes(rng):
    """Every other dtype: zstd blocks (kind 1) where they are smaller, stored blocks (kind 0)
    where not; an empty name. (Blocks of other dtypes hold 2**20 bytes: a vector spanning two
    would weigh a megabyte, so multi-block records are in snapshot-bf16.)"""
    out = {}
    for name, dt in [("f16", torch.float16), ("f32", torch.float32), ("f64", torch.float64), ("i8", torch.int8),
                     ("i16", torch.int16), ("i32", torch.int32), ("i64", torch.int64), ("u8", torch.uint8),
                     ("bool", torch.bool), ("f8e4m3", torch.float8_e4m3fn), ("f8e5m2", torch.float8_e5m2),
                     ("f8e8m0", torch.float8_e8m0fnu), ("u16", torch.uint16), ("u32", torch.uint32),
                     ("u64", torch.uint64), ("c64", torch.complex64)]:
        out[name] = random_bits(dt, (24,), rng)
    out["f32.zeros"] = torch.zeros(4096, dtype=torch.float32)
    out["i64.range"] = torch.arange(1000, dtype=torch.int64)
    out[""] = torch.ones(3, dtype=torch.float16)
    return out


def snapshot_v2(rng):
    """Version 2: BF16 blocks of kind 3 (weights over three blocks of 1024 elements, the last one
    952 long, so its last group of 16 is short: 8 elements, one symbol per state; 1008 elements in
    one block: whole groups only; zeros: one exponent and a zstd-coded residual plane) and kind 0
    (random bits; 13 elements, shorter than one group, where coding does not pay); an F32 tensor
    (kind 1) beside them."""
    return {
        "weights": weights(rng, (3, 1000)),
        "groups": weights(rng, (63, 16)),
        "zeros": torch.zeros(3000, dtype=torch.bfloat16),
        "noise": random_bits(torch.bfloat16, (300,), rng),
        "short": weights(rng, (13,)),
        "specials": bf16(SPECIALS, (len(SPECIALS),)),
        "f32.zeros": torch.zeros(512, dtype=torch.float32),
    }


def snapshot_v3(rng):
    """Version 3: BF16 blocks of kind 4, exponent pairs, written with `pairs="always"` (ours takes
    kind 4 only where it pays, in blocks of ~2**16 elements and up: a vector that size would weigh
    too much): weights over three blocks of 1025 elements, odd, so each ends on a half pair, the
    last one 1017 long, so its last group of 16 pairs is short (13 pairs, the last a half);
    1024 elements in one block: whole groups only; zeros: one pair code, so a spare code, and a
    zstd-coded residual plane; random exponents over 12 values (a table of ~140 pairs, codes far
    apart: two-byte gaps); kind 0 for random bits and specials; an F32 tensor (kind 1) beside
    them."""
    spread = (rng.integers(0x70, 0x7C, 1025) << 7 | rng.integers(0, 0x80, 1025)).astype(np.uint16)
    return {
        "weights": weights(rng, (3067,)),
        "pairs": weights(rng, (64, 16)),
        "zeros": torch.zeros(3000, dtype=torch.bfloat16),
        "spread": torch.from_numpy(spread.view(np.int16)).view(torch.bfloat16),
        "noise": random_bits(torch.bfloat16, (300,), rng),
        "specials": bf16(SPECIALS, (len(SPECIALS),)),
        "f32.zeros": torch.zeros(512, dtype=torch.float32),
    }


def snapshot_f16(rng):
    """Version 4: F16 records in the BF16 block kinds (their 16-bit patterns coded as BF16's), written with
    `pairs="always"`: F16 weights over three blocks of 1025 elements (kind 4, each ending on a half pair),
    zeros (one pair code, a zstd-coded residual plane), special F16 patterns and random bits (kind 0); a BF16
    tensor and an F32 one beside them."""
    w = lambda n: weights(rng, (n,), 0.5).float().to(torch.float16)  # noqa: E731
    return {
        "weights": w(3067),
        "zeros": torch.zeros(3000, dtype=torch.float16),
        "specials": f16(bf16(F16_SPECIALS, (len(F16_SPECIALS),))),
        "noise": random_bits(torch.float16, (300,), rng),
        "bf16": weights(rng, (1025,)),
        "f32.zeros": torch.zeros(512, dtype=torch.float32),
    }


# (name, builder, seed, bf16_block_elems, snapshot format version, pairs)
SNAPSHOT_VECTORS = [
    ("snapshot-bf16", snapshot_bf16, 707, 1024, 1, "auto"),
    ("snapshot-dtypes", snapshot_dtypes, 808, 1 << 18, 1, "auto"),
    ("snapshot-v2", snapshot_v2, 909, 1024, 2, "auto"),
    ("snapshot-v3", snapshot_v3, 1010, 1025, 3, "always"),
    ("snapshot-f16", snapshot_f16, 1111, 1025, 4, "always"),
]


def make_snapshots(out: Path, overwrite: bool, only: list[str] | None = None,
                   kept: list[dict] | None = None) -> list[dict]:
    """docs/vectors/codec/snapshot-*/{tensors.safetensors, snapshot.drsn}; their index.json rows (`only`: those
    named, the rows `kept` standing for the others)."""
    chosen = [v for v in SNAPSHOT_VECTORS if only is None or v[0] in only]
    existing = [name for name, *_ in chosen if (out / name).exists()]
    if existing and not overwrite:
        raise SystemExit(f"{out}: vectors {', '.join(existing)} exist; pass --overwrite to replace them")
    rows = [r for r in kept or [] if only is not None and r["name"] not in only]
    for name, build, seed, block, version, pairs in chosen:
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        save_file(build(np.random.default_rng(seed)), str(d / "tensors.safetensors"))
        t = load_file(str(d / "tensors.safetensors"))
        kw = {"bf16_block_elems": block, "version": version} | ({"pairs": pairs} if pairs != "auto" else {})
        blob = b"".join(codec.encode_snapshot(t.items(), **kw))
        if blob != b"".join(codec.encode_snapshot(t.items(), **kw)):
            raise SystemExit(f"{name}: encoding is not deterministic")
        got = dict(codec.decode_snapshot(blob))
        if list(got) != list(t) or any(bits(got[k]) != bits(t[k]) for k in t):
            raise SystemExit(f"{name}: does not round-trip")
        (d / "snapshot.drsn").write_bytes(blob)
        kinds = snapshot_kinds(blob)
        rows.append({"name": name, "about": " ".join(build.__doc__.split()), "seed": seed,
                     "call": f'codec.encode_snapshot(load_file("tensors.safetensors").items(), '
                             f'bf16_block_elems={block}, version={version}'
                             + (f', pairs="{pairs}")' if pairs != "auto" else ")"),
                     "snapshot_version": version, "pairs": pairs, "bytes": len(blob),
                     "tensors": {e.name: {"dtype": e.dtype, "shape": list(e.shape), "block_kinds": kinds[e.name]}
                                 for e in codec.read_snapshot_index(blob)},
                     "sha256": {f: hashlib.sha256((d / f).read_bytes()).hexdigest()
                                for f in ("tensors.safetensors", "snapshot.drsn")}})
        print(f"{name}: {len(blob)} bytes, kinds " + ", ".join(f"{k or '(empty)'}={v}" for k, v in kinds.items()))
    order = [v[0] for v in SNAPSHOT_VECTORS]
    return sorted(rows, key=lambda r: order.index(r["name"]))


def snapshot_kinds(blob: bytes) -> dict[str, list]:
    """Per tensor, each block's kind (2, 3 and 4 with their residual codec as "2+zstd", "3+zstd",
    "4+zstd"), read from the object."""
    from codec import snapshot, wire

    out = {}
    for e in codec.read_snapshot_index(blob):
        r = wire.Reader(blob[e.offset + 5:e.offset + e.length], "record")
        r.blob(1 << 16)
        r.u8()
        for _ in range(r.uvarint()):
            r.uvarint()
        r.uvarint()
        sizes = [r.uvarint() for _ in range(r.uvarint())]
        head_len = int.from_bytes(blob[e.offset + 1:e.offset + 5], "little")
        at = e.offset + 5 + head_len
        kinds = []
        for size in sizes:
            block = blob[at:at + size]
            kind = block[0]
            if kind in (snapshot.KIND_BF16, snapshot.KIND_BF16_GROUPS, snapshot.KIND_BF16_PAIRS):
                br = wire.Reader(block[1:], "block")
                for _ in range(br.uvarint()):
                    br.u8() if kind != snapshot.KIND_BF16_PAIRS else br.uvarint()  # a symbol, or a code's gap
                    br.uvarint()
                br.uvarint()
                kind = f"{kind}+zstd" if br.u8() == snapshot.RESIDUAL_ZSTD else kind
            kinds.append(kind)
            at += size
        out[e.name] = kinds
    return out


def _library_versions() -> dict:
    import brotli
    import lz4
    import zstandard

    return {"zstandard": zstandard.__version__, "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
            "lz4": lz4.library_version_string(),
            "brotli": brotli.version if hasattr(brotli, "version") else brotli.__version__}


def _describe(payload: bytes) -> dict:
    """What the vector exercises, read back from the payload itself."""
    parsed = container.unpack(payload)
    four_from = conditional._four_from(parsed.shared)
    tensors = {}
    for e, row in zip(parsed.entries, codec.describe(payload)["tensors"]):
        info = {"dtype": e.dtype.name, "shape": list(e.shape), "method": row["method"], "changes": e.changes,
                "stream_codecs": [s.codec for s in e.streams]}
        if e.method == conditional.ID:
            info["rans_states"] = 4 if e.changes >= four_from else 2
            still = conditional.SHARED_VOTE_TABLES in parsed.shared and bool(e.params[0] & conditional.STILL)
            info["classes"] = int(e.params[0]) & ~conditional.STILL if still else int(e.params[0])
            if conditional.SHARED_VOTE_TABLES in parsed.shared:
                info["still"] = still
        if e.method == 2:
            info["position_mode"] = int(e.params[0])
        tensors[e.name] = info
    return {"format_version": parsed.version, "shared_kinds": sorted(parsed.shared), "tensors": tensors}


def make(out: Path, overwrite: bool, only: list[str] | None = None) -> dict:
    """Write the vectors (`only`: those named, the other rows of index.json kept as they are)."""
    chosen = [v for v in VECTORS if only is None or v[0] in only]
    if only is not None and len(chosen) != len(set(only)):
        raise SystemExit(f"unknown vector names in {only}; known: {[v[0] for v in VECTORS]}")
    existing = [name for name, *_ in chosen if (out / name).exists()]
    if existing and not overwrite:
        raise SystemExit(f"{out}: vectors {', '.join(existing)} exist; pass --overwrite to replace them")
    index = {"about": "deltarelay codec test vectors (docs/FORMAT.md); made by scripts/make_codec_vectors.py",
             "libraries": _library_versions(), "vectors": []}
    if only is not None:
        index = json.loads((out / "index.json").read_text())
        if index["libraries"] != _library_versions():
            raise SystemExit(f"the other vectors were made with {index['libraries']}, this is "
                             f"{_library_versions()}: write them all again (--overwrite)")
        index["vectors"] = [v for v in index["vectors"] if v["name"] not in only]
    for name, build, seed, version, effort in chosen:
        base, target = build(np.random.default_rng(seed))
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        save_file(base, str(d / "base.safetensors"))
        save_file(target, str(d / "target.safetensors"))
        # the call is made on the files as a reader loads them (their tensor order included)
        b, t = load_file(str(d / "base.safetensors")), load_file(str(d / "target.safetensors"))
        payload = codec.encode(b, t, format_version=version, effort=effort)
        again = codec.encode(b, t, format_version=version, effort=effort)
        if again != payload:
            raise SystemExit(f"{name}: encoding is not deterministic")
        out_t = codec.decode(b, payload)
        for k in t:
            if bits(out_t[k]) != bits(t[k]):
                raise SystemExit(f"{name}: {k} does not round-trip")
        (d / "payload.drd").write_bytes(payload)
        entry = {"name": name, "about": " ".join(build.__doc__.split()), "seed": seed,
                 "call": f'codec.encode(load_file("base.safetensors"), load_file("target.safetensors"), '
                         f'format_version={version}, effort="{effort}")',
                 "format_version": version, "effort": effort, "payload_bytes": len(payload),
                 "sha256": {f: hashlib.sha256((d / f).read_bytes()).hexdigest()
                            for f in ("base.safetensors", "target.safetensors", "payload.drd")}}
        entry.update(_describe(payload))
        index["vectors"].append(entry)
        order = [v[0] for v in VECTORS]
        index["vectors"].sort(key=lambda v: order.index(v["name"]))
        print(f"{name}: {len(payload)} bytes, " + ", ".join(f"{k}={v['method']}" for k, v in entry["tensors"].items()))
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def bits(t: torch.Tensor) -> bytes:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--overwrite", action="store_true", help="replace existing vectors")
    ap.add_argument("--snapshots-only", action="store_true",
                    help="write only the snapshot-object vectors (index.json's other rows are kept)")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="write only these payload vectors (index.json's other rows, snapshots included, are kept)")
    args = ap.parse_args()
    payload_only = None if args.only is None else [n for n in args.only if not n.startswith("snapshot-")]
    snapshot_only = None if args.only is None else [n for n in args.only if n.startswith("snapshot-")]
    if args.snapshots_only or payload_only == []:
        index = json.loads((args.out / "index.json").read_text())
    else:
        index = make(args.out, args.overwrite, payload_only)
    if snapshot_only is None or snapshot_only:
        index["snapshot_vectors"] = make_snapshots(args.out, args.overwrite, snapshot_only,
                                                   index.get("snapshot_vectors"))
    (args.out / "index.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
