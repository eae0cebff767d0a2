"""Round trips: decode(base, encode(base, target)) is the target, bit for bit, for every BF16 bit
pattern and every dtype a checkpoint can hold; mismatched checkpoints are refused at encode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec_cases import (
    BF16_SPECIAL,
    FORMAT_VERSIONS,
    OTHER_DTYPES,
    assert_bit_exact,
    bf16_from_bits,
    change_elements,
    clone_all,
    edge_pair,
    random_bf16_weights,
    random_tensor,
    rl_step,
    snapshot,
)


def roundtrip(base, target, **kw) -> bytes:
    """Encode, decode, check bit-exactness and that the base was not touched; return the payload."""
    before = snapshot(base)
    payload = codec.encode(base, target, **kw)
    assert isinstance(payload, bytes)
    assert_bit_exact(codec.decode(base, payload), target)
    assert snapshot(base) == before
    return payload


ALL_BITS = np.arange(1 << 16, dtype=np.uint16)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_special_bf16_every_transition(version):
    """Every named special pattern (zeros, NaN payloads, infinities, subnormals, extremes) to every other."""
    specials = np.array(list(BF16_SPECIAL.values()), np.uint16)
    base = {"w": bf16_from_bits(np.repeat(specials, specials.size))}
    target = {"w": bf16_from_bits(np.tile(specials, specials.size))}
    roundtrip(base, target, format_version=version)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("transform",
                         ["permutation", "sign-flip", "exponent-change", "mantissa-only", "to-nan", "to-zero"])
def test_all_65536_bf16_patterns(version, transform):
    """The base holds every BF16 pattern once; the target moves each of them in one way."""
    rng = np.random.default_rng(7)
    bits = ALL_BITS.copy()
    if transform == "permutation":
        new = rng.permutation(bits)
    elif transform == "sign-flip":
        new = bits ^ np.uint16(0x8000)
    elif transform == "exponent-change":
        new = bits ^ np.uint16(0x0080)  # lowest exponent bit: normal <-> subnormal, finite <-> inf/NaN
    elif transform == "mantissa-only":
        new = bits ^ rng.integers(1, 0x80, size=bits.size, dtype=np.uint16)
    elif transform == "to-nan":
        new = (np.uint16(0x7F80) | rng.integers(1, 0x80, size=bits.size, dtype=np.uint16)
               | (rng.integers(0, 2, size=bits.size, dtype=np.uint16) << np.uint16(15)))
    else:
        new = np.where(rng.random(bits.size) < 0.5, np.uint16(0), np.uint16(0x8000)).astype(np.uint16)
    base = {"all": bf16_from_bits(bits, (256, 256))}
    target = {"all": bf16_from_bits(new, (256, 256))}
    roundtrip(base, target, format_version=version)
    # and back again: the reverse delta starts from the transformed patterns
    roundtrip(target, base, format_version=version)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.2, 1.0])
def test_bf16_change_fractions(version, fraction):
    rng = np.random.default_rng(int(fraction * 1000))
    base = {"a": random_bf16_weights((128, 160), rng), "b": random_bf16_weights((5000,), rng)}
    target = {k: (rl_step(v, fraction, rng) if fraction else v.clone()) for k, v in base.items()}
    payload = roundtrip(base, target, format_version=version)
    info = codec.describe(payload)
    changed = {r["name"]: r["changed"] for r in info["tensors"]}
    for k in base:
        want = int((base[k].view(torch.int16) != target[k].view(torch.int16)).sum())
        assert changed[k] == want
    if fraction == 0.0:
        assert info["changed"] == 0 and info["body_bytes"] == 0


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_sparse_bf16_delta_is_small(version):
    """Omitting unchanged elements: 1% mantissa-level changes cost far less than the raw tensor."""
    rng = np.random.default_rng(3)
    base = {"w": random_bf16_weights((256, 256), rng)}
    target = {"w": rl_step(base["w"], 0.01, rng)}
    payload = roundtrip(base, target, format_version=version)
    raw_bytes = base["w"].numel() * 2
    changed = int((base["w"].view(torch.int16) != target["w"].view(torch.int16)).sum())
    assert len(payload) < 0.05 * raw_bytes
    assert codec.describe(payload)["body_bytes"] < 6 * changed  # below TRL's int32 index + bf16 value


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fraction", [0.0, 0.05, 1.0])
def test_other_dtypes(version, dtype, fraction):
    rng = np.random.default_rng(11)
    base = {
        "m": random_tensor(dtype, (31, 17), rng),
        "scalar": random_tensor(dtype, (), rng),
        "empty": torch.empty((4, 0, 2), dtype=dtype),
    }
    target = {k: change_elements(v, fraction, rng) for k, v in base.items()}
    roundtrip(base, target, format_version=version)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_zero_dim_and_empty_bf16(version):
    base = {"s": bf16_from_bits([0x8000], ()), "e": torch.empty(0, dtype=torch.bfloat16),
            "e2": torch.empty((2, 0, 3), dtype=torch.bfloat16), "same_s": bf16_from_bits([0x7FC3], ())}
    target = {"s": bf16_from_bits([0x0000], ()), "e": torch.empty(0, dtype=torch.bfloat16),
              "e2": torch.empty((2, 0, 3), dtype=torch.bfloat16), "same_s": bf16_from_bits([0x7FC3], ())}
    roundtrip(base, target, format_version=version)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
@pytest.mark.parametrize("effort", ["fast", "default", "max"])
def test_edge_checkpoint_every_effort(version, effort):
    base, target = edge_pair(seed=version)
    roundtrip(base, target, format_version=version, effort=effort)


def test_unknown_effort_is_refused():
    base, target = edge_pair()
    with pytest.raises(ValueError):
        codec.encode(base, target, effort="ludicrous")


def test_large_tensor():
    """A few million elements with 1% changes, plus a 100% dense neighbour."""
    rng = np.random.default_rng(5)
    base = {"big": random_bf16_weights((2048, 2048), rng), "dense": random_bf16_weights((512, 512), rng)}
    target = {"big": rl_step(base["big"], 0.01, rng), "dense": rl_step(base["dense"], 1.0, rng)}
    payload = roundtrip(base, target)
    assert len(payload) < 0.05 * base["big"].numel() * 2 + base["dense"].numel() * 2


def test_empty_checkpoint():
    payload = codec.encode({}, {})
    assert codec.decode({}, payload) == {}
    assert codec.describe(payload)["tensors"] == []


@pytest.mark.parametrize("version", [0, 5, 255])
def test_unsupported_format_version_is_refused_at_encode(version):
    base, target = edge_pair()
    with pytest.raises(ValueError):
        codec.encode(base, target, format_version=version)


def test_payload_accepts_bytes_like():
    base, target = edge_pair()
    payload = codec.encode(base, target)
    for form in (bytearray(payload), memoryview(payload)):
        assert_bit_exact(codec.decode(base, form), target)
        assert codec.describe(form)["total_bytes"] == len(payload)


def test_non_contiguous_and_grad_inputs():
    """Transposed views and parameters that require grad encode by value; the output is contiguous."""
    rng = np.random.default_rng(9)
    w = random_bf16_weights((48, 32), rng)
    base = {"t": w.t(), "p": torch.nn.Parameter(random_bf16_weights((10,), rng))}
    target = {"t": rl_step(w, 0.1, rng).t(), "p": rl_step(base["p"].detach(), 0.5, rng)}
    out = codec.decode(base, codec.encode(base, target))
    assert_bit_exact(out, {k: v.detach().contiguous() for k, v in target.items()})
    assert all(v.is_contiguous() for v in out.values())


def test_decoded_tensors_do_not_alias_base():
    base, target = edge_pair()
    out = codec.decode(base, codec.encode(base, target))
    before = snapshot(base)
    for v in out.values():
        if v.numel() and v.dtype is not torch.bool:
            v.reshape(-1).view(torch.uint8).fill_(0xAB)
    assert snapshot(base) == before


def test_payload_is_deterministic():
    base, target = edge_pair()
    assert codec.encode(base, target) == codec.encode(clone_all(base), clone_all(target))


# --- mismatched checkpoints -------------------------------------------------------------------

def _mismatch(base, target, name):
    with pytest.raises(codec.CheckpointMismatchError) as err:
        codec.encode(base, target)
    assert name in str(err.value)


def test_added_tensor_is_named():
    base, target = edge_pair()
    target["brand.new"] = torch.zeros(3, dtype=torch.bfloat16)
    _mismatch(base, target, "brand.new")


def test_removed_tensor_is_named():
    base, target = edge_pair()
    del target["bf16.sparse"]
    _mismatch(base, target, "bf16.sparse")


def test_shape_change_is_named():
    base, target = edge_pair()
    target["bf16.dense"] = target["bf16.dense"].reshape(40, 32).contiguous()
    _mismatch(base, target, "bf16.dense")


def test_dtype_change_is_named():
    base, target = edge_pair()
    target["bf16.sparse"] = target["bf16.sparse"].to(torch.float16)
    _mismatch(base, target, "bf16.sparse")


def test_mismatch_error_is_a_value_error_but_not_a_delta_error():
    assert issubclass(codec.CheckpointMismatchError, ValueError)
    assert not issubclass(codec.CheckpointMismatchError, codec.DeltaError)
    assert issubclass(codec.DeltaError, ValueError)


@pytest.mark.parametrize("unsigned_views", [True, False], ids=["torch-unsigned", "signed-then-numpy"])
def test_element_views_and_tensors_from_elements_round_trip_every_dtype(unsigned_views, monkeypatch):
    """element_view gives the raw bits of any dtype's tensor (contiguous, strided, 0-d, empty,
    requiring grad), through torch's unsigned dtypes where this torch converts them and through
    signed views otherwise; tensor_from_elements rebuilds the same tensor from them."""
    from codec import tensors
    if not unsigned_views:
        monkeypatch.setattr(tensors, "_UNSIGNED_TORCH", {})
    rng = np.random.default_rng(0)
    for dt in tensors.DTYPES:
        for shape in [(3, 5), (), (0, 4), (7,)]:
            raw = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * dt.itemsize, dtype=np.uint8)
            t = (torch.from_numpy(raw.copy()).view(dt.torch).reshape(shape) if raw.size
                 else torch.empty(shape, dtype=dt.torch))
            if dt.torch.is_floating_point and t.numel():
                t.requires_grad_(True)
            elems = tensors.element_view(t)
            assert elems.tobytes() == raw.tobytes()
            back = tensors.tensor_from_elements(elems, dt, tuple(shape))
            assert back.dtype == dt.torch and tuple(back.shape) == tuple(shape)
            assert tensors.element_view(back).tobytes() == raw.tobytes()
        raw6 = rng.integers(0, 256, 8 * 6 * dt.itemsize, dtype=np.uint8)
        strided = torch.from_numpy(raw6).view(dt.torch).reshape(8, 6)
        assert tensors.element_view(strided.t()).tobytes() == tensors.element_view(strided.t().contiguous()).tobytes()


F16_SPECIAL = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE55, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF,
               0x3C00, 0xBC00, 0x3C01, 0x03FF]


def f16_from_bits(bits: np.ndarray, shape=None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(bits, np.uint16).view(np.int16).copy()).view(torch.float16)
    return t.reshape(shape if shape is not None else (-1,))


def method_of(payload: bytes) -> dict[str, str]:
    return {r["name"]: r["method"] for r in codec.describe(payload)["tensors"]}


def test_f16_is_coded_by_the_conditional_method_in_v4_and_round_trips_every_pattern():
    """F16 records take method 3 in v4 (older versions keep xor-planes, as their encodes did): every F16 bit
    pattern moved in each way, every special pattern to every other, through decode and apply_ (in place, and
    the batched decoder of many small records)."""
    rng = np.random.default_rng(16)
    bits = ALL_BITS.copy()
    sp = np.array(F16_SPECIAL, np.uint16)
    cases = {
        "all.permuted": (bits, rng.permutation(bits)),
        "all.sign": (bits, bits ^ np.uint16(0x8000)),
        "all.mantissa": (bits, bits ^ rng.integers(1, 0x400, size=bits.size, dtype=np.uint16)),
        "specials": (np.repeat(sp, sp.size), np.tile(sp, sp.size)),
    }
    base = {k: f16_from_bits(b, (-1, 64)) for k, (b, _) in cases.items()}
    target = {k: f16_from_bits(t, (-1, 64)) for k, (_, t) in cases.items()}
    for i in range(40):  # many small records: the batched decoder
        w = torch.from_numpy(rng.normal(0, 0.02, (8, 24)).astype(np.float32)).to(torch.float16)
        base[f"small.{i}"] = w
        t = w.clone()
        t.view(-1)[rng.choice(w.numel(), 5, replace=False)] *= 1.001
        target[f"small.{i}"] = t
    for version in FORMAT_VERSIONS:
        payload = roundtrip(base, target, format_version=version)
        held = clone_all(base)
        codec.apply_(held, payload)
        assert_bit_exact(held, target)
        methods = method_of(payload)
        if version >= 4:  # the race keeps xor-planes where it is smaller (random permutations)
            assert all(methods[k] == "conditional" for k in methods if k.startswith("small.")), methods
        else:
            assert set(methods.values()) == {"xor-planes"}, (version, methods)
        assert roundtrip(target, base, format_version=version)


def test_f16_training_step_costs_what_bf16_does():
    """On a training-like F16 step the conditional method codes far below xor-planes (v3's only F16 coder): 1% of a
    weight matrix's elements moved by a relative 1e-3."""
    rng = np.random.default_rng(17)
    w = torch.from_numpy(rng.normal(0, 0.02, (512, 384)).astype(np.float32)).to(torch.float16)
    t = w.clone()
    at = torch.from_numpy(rng.choice(w.numel(), w.numel() // 100, replace=False))
    t.view(-1)[at] = (t.view(-1)[at].float() * (1 + 1e-3 * torch.from_numpy(rng.normal(size=at.numel())))).half()
    v4 = roundtrip({"w": w}, {"w": t}, format_version=4)
    v3 = roundtrip({"w": w}, {"w": t}, format_version=3)
    assert method_of(v4) == {"w": "conditional"} and method_of(v3) == {"w": "xor-planes"}
    assert len(v4) < 0.75 * len(v3), (len(v4), len(v3))
