"""codec.memory: decoded tensors in huge pages where they are large, each with its own storage."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import safetensors.torch
import torch

import codec
from codec import memory, tensors


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.bool, torch.int64])
def test_a_large_tensor_is_a_plain_writable_tensor_of_its_own(dtype):
    shape = (1024, memory.HUGE_MIN_BYTES // 1024 // dtype.itemsize + 3)
    a, b = memory.new_tensor(shape, dtype), memory.new_tensor(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous() and a.device.type == "cpu"
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    ea, eb = tensors.element_view(a), tensors.element_view(b)
    ea[...] = 1
    eb[...] = 0
    assert int(ea.sum()) == ea.size and int(eb.sum()) == 0  # written, and independent
    if memory.HUGE_PAGES:
        assert a.untyped_storage().nbytes() == a.numel() * dtype.itemsize  # exactly its bytes


def test_large_outputs_save_as_separate_tensors(tmp_path):
    """safetensors refuses tensors that share a storage: each output must have its own."""
    shape = (memory.HUGE_MIN_BYTES // 2,)
    out = {"a": memory.new_tensor(shape, torch.bfloat16), "b": memory.new_tensor(shape, torch.bfloat16)}
    out["a"].fill_(1.5)
    out["b"].fill_(-2.0)
    safetensors.torch.save_file(out, tmp_path / "x.safetensors")
    back = safetensors.torch.load_file(tmp_path / "x.safetensors")
    assert torch.equal(back["a"], out["a"]) and torch.equal(back["b"], out["b"])


@pytest.mark.skipif(not memory.HUGE_PAGES, reason="this host has no transparent huge pages")
def test_a_freed_tensor_gives_its_memory_back():
    """Each tensor's mapping is unmapped with it: resident memory falls by what it held."""
    held = [memory.new_tensor((memory.HUGE_MIN_BYTES,), torch.uint8) for _ in range(16)]
    for t in held:
        t.fill_(7)
    touched = _rss()
    del held, t
    gc.collect()
    assert touched - _rss() >= 12 * memory.HUGE_MIN_BYTES  # of 16 (other allocations may come and go)


def test_small_tensors_and_hosts_without_huge_pages_get_torch_empty(monkeypatch):
    small = memory.new_tensor((16, 16), torch.bfloat16)
    assert small.shape == (16, 16) and small.dtype == torch.bfloat16
    calls = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(memory, "HUGE_PAGES", False)
    big = memory.new_tensor((memory.HUGE_MIN_BYTES,), torch.uint8)
    assert calls and big.numel() == memory.HUGE_MIN_BYTES


def test_decode_into_huge_pages_is_bit_exact_and_saveable(tmp_path):
    """A real decode of a checkpoint with tensors above and below the threshold: bit-exact, each
    output its own storage, and the CLI's way of writing them works."""
    rng = np.random.default_rng(5)
    base = {"emb": torch.from_numpy(rng.standard_normal((2048, 1024), dtype=np.float32)).to(torch.bfloat16),
            "w": torch.from_numpy(rng.standard_normal((64, 64), dtype=np.float32)).to(torch.bfloat16)}
    target = {}
    for k, v in base.items():
        e = tensors.element_view(v).copy()
        at = rng.random(e.shape) < 0.03
        e[at] += 1
        target[k] = torch.from_numpy(e.view(np.int16)).view(torch.bfloat16).reshape(v.shape)
    out = codec.decode(base, codec.encode(base, target))
    for k in target:
        assert np.array_equal(tensors.element_view(out[k]), tensors.element_view(target[k]))
    assert out["emb"].untyped_storage().data_ptr() != out["w"].untyped_storage().data_ptr()
    safetensors.torch.save_file(out, tmp_path / "t.safetensors")


def test_new_elements_is_a_flat_writable_array_of_its_own():
    n = memory.HUGE_MIN_BYTES // 4 + 5
    a, b = memory.new_elements(n, np.float32), memory.new_elements(n, np.float32)
    assert a.shape == (n,) and a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous
    a[...] = 1.0
    b[...] = 2.0
    assert float(a.sum()) == n and float(b.sum()) == 2.0 * n


def test_targets_built_outside_the_batched_kernel_use_codec_memory(monkeypatch):
    """FP32 tensors (a patch applied to a copy of the base) and unchanged ones (a copy) are built in
    `memory.new_elements` too, like the batched BF16 outputs: bit-exact, each its own storage."""
    rng = np.random.default_rng(6)
    big = (1024, memory.HUGE_MIN_BYTES // 1024 // 4 + 1)
    base = {"fp32": torch.from_numpy(rng.standard_normal(big, dtype=np.float32)),
            "still": torch.from_numpy(rng.standard_normal(big, dtype=np.float32))}
    target = {"fp32": base["fp32"].clone(), "still": base["still"].clone()}
    e = tensors.element_view(target["fp32"])
    e[rng.random(e.shape) < 0.02] += 1
    payload = codec.encode(base, target)
    sizes = []
    real = memory.new_elements
    monkeypatch.setattr(memory, "new_elements", lambda n, dtype: sizes.append(n) or real(n, dtype))
    out = codec.decode(base, payload)
    assert sorted(sizes) == [base["fp32"].numel(), base["still"].numel()]
    for k in target:
        assert np.array_equal(tensors.element_view(out[k]), tensors.element_view(target[k]))
        assert out[k].untyped_storage().data_ptr() != base[k].untyped_storage().data_ptr()
    assert out["fp32"].untyped_storage().data_ptr() != out["still"].untyped_storage().data_ptr()
