"""Anchor baselines round-trip bit for bit and are the size their formats say; the entropy bound is exact."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import safetensors.torch
import torch
import zstandard

from codec import CheckpointMismatchError, tensors
from codec.lab.baselines import (BASELINES, GAP_ESCAPE, SLOW_BASELINES, coo_deltas, coo_index, gaps_decode, gaps_encode,
                             pulse_decode, pulse_encode, arcv3_decode, arcv3_encode)
from codec.lab.bound import conditional_entropy_bound, ordered
from codec.wire import Reader

ALL = dict(BASELINES, **SLOW_BASELINES)


def bf16(bits) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16)


EDGE = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x807F, 0x3F80, 0xBF80, 0x0080, 0x7F7F]


def checkpoints() -> tuple[dict, dict]:
    """Every BF16 bit-pattern transition the anchors care about, plus shapes and dtypes that stress the formats."""
    rng = np.random.default_rng(0)
    base, target = {}, {}
    e = np.array(EDGE, np.uint16)
    # every edge pattern to every other: +-0, +-Inf, NaN payloads, subnormals, sign flips, exponent moves
    base["edges"] = bf16(np.repeat(e, e.size).reshape(e.size, e.size))
    target["edges"] = bf16(np.tile(e, e.size).reshape(e.size, e.size))
    # realistic: ~1% mantissa nudges on small weights, a few exponent changes
    w = rng.normal(0, 0.02, (300, 257)).astype(np.float32)
    b = torch.from_numpy(w).to(torch.bfloat16)
    tb = bits(b).copy()
    idx = rng.choice(tb.size, 800, replace=False)
    tb[idx] = tb[idx] + rng.choice(np.array([1, 0xFFFF], np.uint16), idx.size)  # one ULP either way
    tb[idx[:20]] ^= 0x0080  # exponent change
    base["w"], target["w"] = b, bf16(tb).reshape(300, 257)
    # far-apart changes: gaps > 65535 (TRL escape), row deltas > 255 / 65535 (PULSE widening)
    tall = np.zeros((70000, 1), np.uint16) + 0x3C00
    tall_t = tall.copy()
    tall_t[[0, 300, 70000 - 1], 0] = 0x3C01
    base["tall"], target["tall"] = bf16(tall), bf16(tall_t)
    wide = np.zeros((2, 140000), np.uint16) + 0x3C00
    wide_t = wide.copy()
    wide_t[0, [5, 70000, 139999]] = 0x3C02  # column deltas > 65535 (PULSE int32 columns)
    wide_t[1, 139998] = 0xBC00
    base["wide"], target["wide"] = bf16(wide), bf16(wide_t)
    base["vec"] = bf16(np.arange(0x3F00, 0x3F00 + 600))
    target["vec"] = bf16(np.arange(0x3F00, 0x3F00 + 600) ^ (np.arange(600) % 7 == 0))
    base["cube"] = bf16(np.full(24, 0x4000)).reshape(2, 3, 4)
    target["cube"] = bf16(np.full(24, 0x4000) ^ np.eye(24, dtype=np.uint16)[5] * 3).reshape(2, 3, 4)
    base["scalar"], target["scalar"] = bf16([0x8000]).reshape(()), bf16([0x0000]).reshape(())
    base["empty"], target["empty"] = bf16([]).reshape(0, 4), bf16([]).reshape(0, 4)
    base["same"] = bf16(rng.integers(0, 1 << 16, 64)).reshape(8, 8)
    target["same"] = base["same"].clone()
    # other dtypes travel as zstd-1 XOR
    f = torch.randn(33)
    base["f32"], target["f32"] = f, f + torch.where(torch.arange(33) % 5 == 0, 1e-3, 0.0)
    base["ids"], target["ids"] = torch.arange(10), torch.arange(10) * 3
    base["half"] = torch.tensor([1.0, -0.0, float("nan")], dtype=torch.float16)
    target["half"] = torch.tensor([1.5, 0.0, float("inf")], dtype=torch.float16)
    return base, target


def assert_identical(out: dict, target: dict) -> None:
    assert list(out) == list(target)
    for name, t in target.items():
        o = out[name]
        assert o.dtype == t.dtype and tuple(o.shape) == tuple(t.shape), name
        assert np.array_equal(tensors.element_view(o), tensors.element_view(t)), name


@pytest.mark.parametrize("key", list(ALL))
def test_round_trip_is_bit_exact(key):
    base, target = checkpoints()
    payload = ALL[key].encode(base, target)
    assert_identical(ALL[key].decode(base, payload), target)
    assert_identical(ALL[key].decode(base, ALL[key].encode(base, base)), base)  # no change at all


@pytest.mark.parametrize("key", list(ALL))
def test_structure_mismatch_is_refused(key):
    base, target = checkpoints()
    target["extra"] = torch.zeros(2)
    with pytest.raises(CheckpointMismatchError):
        ALL[key].encode(base, target)


def _bf16_changes(base, target):
    return {k: np.flatnonzero(bits(base[k]) != bits(v)) for k, v in target.items()
            if v.dtype == torch.bfloat16 and np.any(bits(base[k]) != bits(v))}


def _other_blob_bytes(base, target):
    total = 0
    for k, v in target.items():
        if v.dtype != torch.bfloat16:
            x = np.bitwise_xor(tensors.element_view(base[k]), tensors.element_view(v))
            if x.any():
                total += len(zstandard.ZstdCompressor(level=1).compress(x.tobytes()))
    return total


def _safetensors_sizes(payload: bytes) -> tuple[int, dict]:
    hlen = int.from_bytes(payload[:8], "little")
    loaded = safetensors.torch.load(payload)
    return 8 + hlen, {k: v.numel() * v.element_size() for k, v in loaded.items()}


def test_trl_sparse_costs_six_bytes_per_change():
    base, target = checkpoints()
    changes = _bf16_changes(base, target)
    payload = BASELINES["trl-sparse"].encode(base, target)
    head, sizes = _safetensors_sizes(payload)
    n = sum(i.size for i in changes.values())
    assert sum(v for k, v in sizes.items() if not k.endswith(".xor_zstd")) == 6 * n
    assert len(payload) == head + 6 * n + _other_blob_bytes(base, target)
    assert safetensors.torch.load(payload)["w.indices"].dtype == torch.int32


def test_trl_gap16_costs_four_bytes_per_change_plus_escapes():
    base, target = checkpoints()
    changes = _bf16_changes(base, target)
    escapes = sum(int(((np.diff(i, prepend=-1) - 1) // GAP_ESCAPE).sum()) for i in changes.values())
    assert escapes >= 3  # the tall / wide tensors force long gaps
    payload = BASELINES["trl-gap16"].encode(base, target)
    head, _ = _safetensors_sizes(payload)
    n = sum(i.size for i in changes.values())
    assert len(payload) == head + 4 * n + 2 * escapes + _other_blob_bytes(base, target)


def test_gap_tokens_escape_long_gaps():
    index = np.array([0, 65534, 65534 + 65536, 65534 + 65536 + 65537, 10**7, 10**7 + 1], np.int64)
    tokens = gaps_encode(index)
    assert tokens.dtype == np.uint16
    assert np.array_equal(gaps_decode(tokens), index)
    gaps = np.diff(index, prepend=-1) - 1
    assert tokens.size == index.size + int((gaps // GAP_ESCAPE).sum())
    assert np.array_equal(gaps_decode(gaps_encode(np.array([70000]))), [70000])
    with pytest.raises(ValueError, match="escape"):
        gaps_decode(np.array([3, GAP_ESCAPE], np.uint16))


def test_pulse_blob_layout_narrow_indices_and_zstd1():
    base, target = checkpoints()
    changes = _bf16_changes(base, target)
    payload = pulse_encode(base, target)
    blob = zstandard.ZstdDecompressor().decompress(payload)
    assert blob[:4] == b"PLS1"
    assert len(zstandard.ZstdCompressor(level=1).compress(blob)) == len(payload)  # the whole blob is zstd-1
    hlen = int.from_bytes(blob[4:8], "little")
    r = Reader(blob[8:8 + hlen])
    widths, data = {}, 0
    for _ in range(r.uvarint()):
        name = r.blob(1 << 16).decode()
        if r.u8() == 1:
            data += r.uvarint()
            continue
        count, rw, cw = r.uvarint(), r.u8(), r.u8()
        assert count == changes[name].size
        widths[name] = (rw, cw)
        data += (rw + cw + 2) * count
    assert r.remaining == 16  # xxh3-128 of the whole target model
    assert len(blob) == 8 + hlen + data
    assert widths["w"] == (1, 2)  # uint8 rows, uint16 columns when they fit
    assert widths["tall"] == (4, 2)  # 1 -> 300 -> 69999: row delta 69699 needs int32
    assert widths["wide"] == (1, 4)  # column delta 69995 > 65535: int32 columns
    assert widths["vec"] == (1, 2)  # 1-D: every element its own row, deltas of 7 fit uint8


def test_coo_deltas_round_trip():
    rng = np.random.default_rng(3)
    for shape in [(50, 40), (2000,), (3, 4, 5), (1, 100000), ()]:
        n = int(np.prod(shape)) if shape else 1
        index = np.sort(rng.choice(n, min(n, 37), replace=False)).astype(np.int64)
        rows, cols = coo_deltas(index, shape)
        assert (rows >= 0).all() and (cols >= 0).all()
        assert np.array_equal(coo_index(rows, cols, shape), index)


def test_arcv3_streams_are_mask_kinds_mantissa_and_sign_exponent():
    base, target = checkpoints()
    changes = _bf16_changes(base, target)
    payload = arcv3_encode(base, target)
    assert payload[:4] == b"ARC3"
    hlen = int.from_bytes(payload[4:8], "little")
    r = Reader(payload[8:8 + hlen])
    stored = 0
    for _ in range(r.uvarint()):
        name = r.blob(1 << 16).decode()
        adler = int.from_bytes(r.raw(4), "little")
        assert adler == zlib.adler32(tensors.element_view(target[name]).tobytes())
        if r.u8() == 1:
            stored += r.uvarint()
            continue
        count, codec = r.uvarint(), r.u8()
        x = bits(base[name])[changes[name]] ^ bits(target[name])[changes[name]]
        nfull = int(((x & 0xFF80) != 0).sum())
        raw = [r.uvarint() for _ in range(8)]
        assert count == changes[name].size and codec in (1, 2, 3)
        assert raw[0::2] == [math.ceil(base[name].numel() / 8), math.ceil(count / 8), count - nfull, 2 * nfull]
        stored += sum(raw[1::2])
    assert len(payload) == 8 + hlen + stored


def test_checksums_refuse_a_wrong_base():
    base, target = checkpoints()
    other = dict(base)
    other["same"] = bf16(bits(base["same"]) ^ 1).reshape(8, 8)  # a tensor the delta does not touch
    with pytest.raises(ValueError, match="whole-model hash"):
        pulse_decode(other, pulse_encode(base, target))
    other = dict(base)
    other["w"] = bf16(bits(base["w"]) ^ 2).reshape(300, 257)
    with pytest.raises(ValueError, match="Adler32"):
        arcv3_decode(other, arcv3_encode(base, target))


def test_zstd1_full_is_the_compressed_checkpoint_file():
    base, target = checkpoints()
    payload = BASELINES["zstd1-full"].encode(base, target)
    want = safetensors.torch.save({k: v.contiguous() for k, v in target.items()})
    assert zstandard.ZstdDecompressor().decompress(payload) == want


# --- the conditional entropy bound -------------------------------------------------------------

def test_ordered_is_monotone_in_float_order_and_steps_cross_zero():
    finite = np.array([b for b in range(1 << 16) if (b & 0x7F80) != 0x7F80 or (b & 0x7F) == 0], np.uint16)
    values = bf16(finite).float().numpy()
    order = np.lexsort((-(finite >> 15).astype(np.int64), values))  # -0 before +0
    assert np.all(np.diff(ordered(finite[order])) == 1)
    assert ordered(np.array([0x0000], np.uint16))[0] - ordered(np.array([0x8000], np.uint16))[0] == 1


def test_bound_on_a_hand_made_example():
    # 8 elements at exponent 127 (1.0, none change) and 8 at exponent 117 (half change):
    # mask bits = 8 * H(0) + 8 * H(1/2) = 8; steps +1, +1, -1, -1: 4 * H(1/2) = 4 bits.
    one = np.full(8, 0x3F80, np.uint16)
    small = np.full(8, 0x3AA0, np.uint16)
    small_t = small.copy()
    small_t[:4] += np.array([1, 1, 0xFFFF, 0xFFFF], np.uint16)
    base = {"a": bf16(one), "b": bf16(small).reshape(2, 4), "f": torch.zeros(3)}
    target = {"a": bf16(one), "b": bf16(small_t).reshape(2, 4), "f": torch.ones(3)}  # fp32 is outside the bound
    r = conditional_entropy_bound(base, target)
    assert r["elements"] == 16 and r["changed"] == 4
    assert r["mask_bits"] == pytest.approx(8.0)
    assert r["value_bits"] == pytest.approx(4.0)
    assert r["bytes"] == pytest.approx(1.5)
    assert r["bits_per_changed"] == pytest.approx(3.0)
    assert r["percent"] == pytest.approx(100 * 1.5 / 32)



def test_bound_gives_f16_exponents_contexts_of_their_own():
    # F16 1.0 is 0x3C00 (exponent 15); BF16 1.0 is 0x3F80 (exponent 127). Four of each, all four F16
    # elements change and no BF16 one: separate contexts make the mask free (both are certain), one
    # step up each (0 value bits). Pooled into one context it would cost 8 * H(1/2) = 8 bits.
    f16 = torch.tensor([1.0] * 4, dtype=torch.float16)
    f16_t = torch.from_numpy(np.full(4, 0x3C01, np.uint16).view(np.int16)).view(torch.float16)
    b16 = bf16(np.full(4, 0x3F80, np.uint16))
    r = conditional_entropy_bound({"h": f16, "b": b16}, {"h": f16_t, "b": b16.clone()})
    assert r["elements"] == 8 and r["changed"] == 4
    assert r["mask_bits"] == pytest.approx(0.0) and r["value_bits"] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="'h'"):
        conditional_entropy_bound({"h": f16.to(torch.bfloat16)}, {"h": f16_t})

def test_bound_counts_ulp_steps_across_sign_and_pools_exponents():
    # +0 -> -0 is one step down; -0 -> +0 one step up; a skewed change set at one exponent.
    base = bf16([0x0000, 0x8000, 0x3F80, 0x3F80, 0x3F80, 0x3F80])
    target = bf16([0x8000, 0x0000, 0x3F82, 0x3F82, 0x3F82, 0x3F80])
    r = conditional_entropy_bound({"x": base}, {"x": target})
    # exponent 0: 2 of 2 changed (0 bits); exponent 127: 3 of 4 changed.
    def h(p: float) -> float:
        return -p * math.log2(p) - (1 - p) * math.log2(1 - p)

    assert r["mask_bits"] == pytest.approx(4 * h(0.75))
    # steps: -1, +1, +2, +2, +2 -> counts {-1: 1, +1: 1, +2: 3}
    assert r["value_bits"] == pytest.approx(-(2 * (1 / 5) * math.log2(1 / 5) + (3 / 5) * math.log2(3 / 5)) * 5)
    assert conditional_entropy_bound({"x": base}, {"x": base})["total_bits"] == 0
