"""codec.warm_up compiles every kernel the real paths use, so a fresh host's first call compiles nothing."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import codec
from codec import _kernel_cache, _warmup

# In a fresh process with an empty kernel cache: warm every path, then run real calls of other
# shapes, sizes, dtypes, worker counts and buffer types; print what each compiled afterwards.
_FRESH = """
import json, sys
import torch
import codec
from codec import _warmup

handle = codec.warm_up()
assert handle.wait(600), "warm-up timed out"
assert not handle.failed, handle.failed
warm = _warmup.kernel_signatures()
stats_warm = _warmup._compile_stats()
g = torch.Generator().manual_seed(7)

def pair(dtype, shape, frac):
    if dtype.is_floating_point:
        b = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    elif dtype == torch.bool:
        b = torch.rand(shape, generator=g) > 0.5
    else:
        b = torch.randint(0, 100, shape, generator=g).to(dtype)
    t = b.clone()
    flat = t.view(-1).view(torch.uint8) if dtype == torch.bool else t.view(-1).view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    idx = torch.randperm(flat.numel(), generator=g)[: int(flat.numel() * frac)]
    flat[idx] = flat[idx] ^ 1
    return b, t

spec = [("bf16.a", torch.bfloat16, (1024, 1024), 0.01), ("bf16.b", torch.bfloat16, (4096, 333), 0.002),
        ("bf16.c", torch.bfloat16, (7,), 0.5), ("bf16.d", torch.bfloat16, (2048, 64), 0.4),
        ("f32", torch.float32, (65536,), 0.01), ("f16", torch.float16, (300, 100), 0.01),
        ("f8", torch.float8_e4m3fn, (4096,), 0.02), ("i64", torch.int64, (), 1.0), ("u8", torch.uint8, (999,), 0.1),
        ("same", torch.bfloat16, (64, 3), 0.0)]
base, target = {}, {}
for name, dtype, shape, frac in spec:
    base[name], target[name] = pair(dtype, shape, frac)
report = {}
for label, call in [
    ("encode", lambda: codec.encode(base, target)),
    ("encode workers=2", lambda: codec.encode(base, target, workers=2)),
    ("decode", lambda: codec.decode(base, payload)),
    ("decode workers=2 bytearray", lambda: codec.decode(base, bytearray(payload), workers=2)),
    ("apply_ bytes", lambda: codec.apply_({k: v.clone() for k, v in base.items()}, payload)),
    ("apply_ memoryview",
     lambda: codec.apply_({k: v.clone() for k, v in base.items()}, memoryview(bytearray(payload)))),
]:
    before = _warmup.kernel_signatures()
    out = call()
    if label == "encode":
        payload = out
    after = _warmup.kernel_signatures()
    report[label] = {k: [str(s) for s in v[len(before.get(k, ())):]] for k, v in after.items()
                     if len(v) != len(before.get(k, ()))}
methods = sorted({t["method"] for t in codec.describe(payload)["tensors"]})
print(json.dumps({"compiled_later": report, "warm_kernels": sum(len(v) for v in warm.values()),
                  "misses_after_warm_up": _warmup._compile_stats()[1] - stats_warm[1], "methods": methods}))
"""


def test_after_warm_up_no_real_call_compiles_anything(tmp_path):
    """Evidence without timing: every kernel signature a real encode, decode or apply_ uses is
    already held after warm_up, and numba records no cache miss (= compilation) afterwards."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "kernels")}
    run = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(result)
    assert result["warm_kernels"] > 30  # the warm-up did compile the codec's kernels
    assert {"conditional", "same", "xor-planes"} <= set(result["methods"])
    assert result["compiled_later"] == {label: {} for label in result["compiled_later"]}
    assert result["misses_after_warm_up"] == 0


def test_embedded_payload_still_decodes_and_uses_the_current_methods():
    """PAYLOAD is what lets a watcher warm up without compiling the encoder: it must decode
    against the tiny checkpoint, and exercise what a fresh encode of it would (else regenerate
    it with `_warmup.encoded()`)."""
    base, target = _warmup.checkpoint()
    payload = base64.b64decode(_warmup.PAYLOAD)
    decoded = codec.decode(base, payload)
    assert all(torch.equal(decoded[k].view(-1).view(torch.uint8), target[k].view(-1).view(torch.uint8))
               for k in target)
    fresh = codec.describe(codec.encode(base, target))
    embedded = codec.describe(payload)
    assert embedded["format_version"] == codec.FORMAT_VERSION
    assert [(t["name"], t["method"]) for t in embedded["tensors"]] == [(t["name"], t["method"])
                                                                         for t in fresh["tensors"]]
    dtypes = {t["dtype"] for t in embedded["tensors"]}
    assert {"BF16", "F32", "F16", "F8_E4M3", "F8_E5M2", "I32", "I64", "U8", "BOOL"} <= dtypes


def test_warm_up_is_idempotent_thread_safe_and_extensible(monkeypatch):
    calls = []
    monkeypatch.setitem(_warmup._STEPS, "test-path", [])
    monkeypatch.delitem(_warmup._FUTURES, "test-path", raising=False)
    gate = threading.Event()
    _warmup.register("test-path", lambda: (gate.wait(30), calls.append(threading.current_thread().name)))
    handles = []
    threads = [threading.Thread(target=lambda: handles.append(codec.warm_up(["test-path"]))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not handles[0].wait(timeout=0.05) and not handles[0].done()  # in the background
    gate.set()
    assert all(h.wait(30) for h in handles)
    assert calls == ["deltarelay-codec-warmup"]  # ran once, in its own thread
    assert handles[0].seconds is not None and not handles[0].failed
    assert codec.warm_up(["test-path"]).wait(0) and calls == ["deltarelay-codec-warmup"]
    with pytest.raises(ValueError, match="unknown warm-up path"):
        codec.warm_up(["no-such-path"])


def test_a_failing_step_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(_warmup._STEPS, "broken", [lambda: 1 / 0])
    monkeypatch.delitem(_warmup._FUTURES, "broken", raising=False)
    handle = codec.warm_up(["broken"], background=False)
    assert handle.wait(0) and isinstance(handle.failed["broken"], ZeroDivisionError)


def test_unwritable_install_caches_per_user(tmp_path, monkeypatch):
    """A read-only install (or a cache another user made) must not leave numba to pick its own
    location, which a kernel edit in another module does not invalidate."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    tree = tmp_path / "codec"
    for rel in _kernel_cache.KERNEL_SOURCES:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes((_kernel_cache.HERE / rel).read_bytes())
    (tree / "__pycache__").write_text("")  # nothing can be made under it
    monkeypatch.setattr(_kernel_cache, "HERE", tree)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    got = _kernel_cache.cache_dir()
    assert got.parent == tmp_path / "user-cache" / "deltarelay" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # no per-user cache either: a temporary one
    assert "deltarelay-kernels-" in str(_kernel_cache.cache_dir().parent)


_FRESH_SNAPSHOT = """
import io, json
import torch
import codec
from codec import _warmup

handle = codec.warm_up(("snapshot_encode", "snapshot_decode"))
assert handle.wait(600) and not handle.failed, handle.failed
g = torch.Generator().manual_seed(3)
named = {"w": (torch.randn(700, 900, generator=g) * 0.02).to(torch.bfloat16), "z": torch.zeros(5000).bfloat16(),
         "n": torch.randint(0, 1 << 15, (3001,), generator=g, dtype=torch.int16).view(torch.bfloat16),
         "f": torch.randn(77, generator=g), "i": torch.arange(9)}
before = _warmup.kernel_signatures()
blob = b"".join(codec.encode_snapshot(named.items()))
old = b"".join(codec.encode_snapshot(named.items(), version=1))  # a version-1 object, as buckets keep
mid = b"".join(codec.encode_snapshot(named.items(), version=2))
for src in (blob, bytearray(blob), io.BytesIO(blob), old, bytearray(old), io.BytesIO(old), mid, io.BytesIO(mid)):
    list(codec.decode_snapshot(src))
list(codec.decode_snapshot(io.BytesIO(blob), only={"w"}))
after = _warmup.kernel_signatures()
print(json.dumps({"later": {k: [str(s) for s in v[len(before.get(k, ())):]] for k, v in after.items()
                            if len(v) != len(before.get(k, ()))},
                  "warm": sorted(k.rsplit(".", 1)[1] for k, v in before.items() if "snapshot_rans" in k and v)}))
"""


def test_snapshot_warm_up_paths_leave_nothing_to_compile(tmp_path):
    """The snapshot paths (what a writer or reader of compressed snapshots warms up) hold every
    kernel signature real snapshot encodes and decodes use, from every kind of source."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "kernels")}
    run = subprocess.run([sys.executable, "-c", _FRESH_SNAPSHOT], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["warm"] == ["_bf16_block", "block_head", "decode_block", "decode_groups", "decode_pair_groups",
                              "decode_record", "encode_block", "encode_groups", "encode_pair_groups", "histograms",
                              "index_entries", "pair_block_head", "pair_codes", "pair_histogram", "pair_slot_table",
                              "record_head", "slot_table"]
    assert result["later"] == {}
