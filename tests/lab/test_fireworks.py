"""codec.lab.fireworks: the real Fireworks ARCv2 / ARCv3 (fireworks-delta-compression) as bench anchors,
round-tripped bit-exactly through the package's own decoder on a tiny-model corpus."""

from __future__ import annotations

import importlib.util
import pickle
import zlib

import pytest
import safetensors
import safetensors.torch
from safetensors.torch import load_file

from codec import tensors
from codec.lab import baselines as style
from codec.lab import fireworks
from relay.lab.bench import identical
from relay.lab.corpus import make_corpus

needs_package = pytest.mark.skipif(fireworks.unavailable() is not None,
                                   reason=f"{fireworks.unavailable()}: the real anchors cannot run")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("fireworks") / "tiny"
    make_corpus(out, regime="fp32-lr1e-6", steps=1, warmup=1, tiny=True, seed=4)
    return load_file(str(out / "step_0000.safetensors")), load_file(str(out / "step_0001.safetensors"))


@needs_package
@pytest.mark.parametrize("key", sorted(fireworks.BASELINES))
def test_round_trip_is_bit_exact_through_the_packages_decoder(pair, key, tmp_path):
    base, target = pair
    b = fireworks.BASELINES[key]
    payload = b.encode(base, target)
    out = b.decode(base, payload)
    assert identical(out, target) and list(out) == list(base)
    assert not identical(base, target)  # the pair has changes to carry
    # the payload is the package's delta file: one uint8 tensor per model tensor, Adler-32 of each target
    # tensor in its metadata (what delta_compress_dicts_to_file writes)
    loaded = safetensors.torch.load(payload)
    assert set(loaded) == set(target) and all(str(v.dtype) == "torch.uint8" for v in loaded.values())
    (tmp_path / "delta.safetensors").write_bytes(payload)
    with safetensors.safe_open(str(tmp_path / "delta.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta == {k: str(zlib.adler32(tensors.element_view(v).tobytes())) for k, v in target.items()}


@needs_package
def test_the_packages_checksums_catch_a_wrong_base(pair):
    base, target = pair
    payload = fireworks.arc_v2_encode(base, target)
    with pytest.raises((ValueError, RuntimeError), match="(?i)checksum|decompress"):
        fireworks.arc_v2_decode(target, payload)  # applied to another base than it was made for


@needs_package
def test_every_candidate_keeps_the_smallest_of_all_of_arcv3s_candidates(pair):
    """arc_v3-all holds, per tensor, the smallest of ARCv3's candidates (flat / row indices x zstd / bz2,
    and its ARCv2 fallback), each rebuilt here from the package's own functions; the default race
    keeps the smallest of those that finished before its deadline, never smaller."""
    from fireworks_delta_compression.backends import arc2, arc3

    base, target = pair
    every = safetensors.torch.load(fireworks.arc_v3_all_encode(base, target))
    raced = safetensors.torch.load(fireworks.arc_v3_encode(base, target))
    for name, dst in target.items():
        src = base[name]
        sizes = []
        spec = arc3._float_encoding_spec(dst.dtype)
        if spec is not None:
            payload, changed = arc3._build_mantissa_payload(prev=src, curr=dst, spec=spec)
            for mode in ("flat", "row"):
                p = dict(payload)
                if changed.size:
                    p["indices"] = arc3._encode_indices(indices=changed, shape=tuple(dst.shape), mode=mode)
                raw = pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)
                sizes += [len(arc3._compress_pickled_payload(raw=raw, codec=c)) for c in ("zstd", "bz2")]
        diff, checksum = arc2.Arc2Backend(compress_fn=arc3.zstd.compress, decompress_fn=arc3.zstd.decompress).compress(
            src=src, dst=dst)
        sizes.append(len(safetensors.torch.save({"tensor": diff}, metadata={"tensor": checksum,
                                                                              "fallback_name": "arc_v2"})))
        assert every[name].numel() == min(sizes), name
        assert raced[name].numel() >= every[name].numel(), name


@needs_package
def test_select_puts_the_real_anchors_in_and_the_style_arcv3_out(monkeypatch):
    chosen, reference, not_run = fireworks.select()
    assert reference == "arc_v3" and not not_run
    assert set(chosen) == set(fireworks.BASELINES) | (set(style.BASELINES) - set(fireworks.SUPERSEDED))
    slow, _, _ = fireworks.select(slow=True)
    assert set(slow) == set(fireworks.BASELINES) | set(style.BASELINES) | set(style.SLOW_BASELINES)


def test_without_the_package_they_are_listed_as_not_run_with_the_reason(monkeypatch, pair):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == fireworks.PACKAGE else real_find_spec(name, *a))
    reason = fireworks.unavailable()
    assert reason is not None and "fireworks-delta-compression is not installed" in reason
    assert fireworks.INSTALL_HINT in reason
    chosen, reference, not_run = fireworks.select()
    assert reference == "arcv3" and set(chosen) == set(style.BASELINES)
    assert not_run == {k: reason for k in fireworks.BASELINES}
    with pytest.raises(RuntimeError, match="real Fireworks anchors need fireworks-delta-compression"):
        fireworks.arc_v3_encode(*pair)

