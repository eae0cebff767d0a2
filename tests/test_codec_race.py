"""The encoder's race on dense tensors (codec/api.py, `_Plan.encode`): large ones race the later
methods on a sample first, and a method that is clearly larger there is not run on the whole
tensor. The race must pick what a full race picks wherever the sizes are not close."""

from __future__ import annotations

import pytest
import torch

import codec
from codec import api, container, methods, tensors


def _dense(kind: str, shape=(512, 512), fraction=0.5, seed=0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    base = (0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    if kind == "training":  # a small relative step on half the elements
        new = (base.float() * (1 + 0.02 * torch.randn(shape, generator=g))).to(torch.bfloat16)
    elif kind == "random-bits":  # noise the entropy coders cannot beat: the plain XOR planes win
        new = torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
    else:  # re-initialised weights
        new = (0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    mask = torch.rand(shape, generator=g) < fraction
    return {"w": base}, {"w": torch.where(mask, new, base)}


@pytest.fixture
def calls(monkeypatch):
    """Every (method, elements) a method's encode was called with."""
    seen: list[tuple[str, int]] = []
    for method in methods.REGISTRY.values():
        original = type(method).encode

        def spy(self, job, model, _original=original):
            seen.append((self.name, int(job.base.size)))
            return _original(self, job, model)
        monkeypatch.setattr(type(method), "encode", spy)
    return seen


def _method(payload: bytes) -> str:
    return methods.REGISTRY[container.unpack(payload).entries[0].method].name


def test_a_clearly_larger_method_runs_on_the_sample_only(calls):
    base, target = _dense("training")
    n = base["w"].numel()
    assert n >= api.SAMPLED_RACE
    payload = codec.encode(base, target)
    assert _method(payload) == "conditional"
    full = {name for name, size in calls if size == n}
    sampled = {name for name, size in calls if size < n}
    assert full == {"conditional"} and sampled == {"sparse-split", "xor-planes"}
    assert tensors.same_bits(codec.decode(base, payload), target)


@pytest.mark.parametrize("kind", ["training", "random-bits", "reinit"])
@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_the_sampled_race_picks_what_the_full_race_picks(kind, fraction, monkeypatch):
    base, target = _dense(kind, fraction=fraction, seed=1)
    sampled = codec.encode(base, target)
    monkeypatch.setattr(api, "SAMPLED_RACE", 1 << 62)  # every method on the whole tensor
    full = codec.encode(base, target)
    assert _method(sampled) == _method(full)
    assert len(sampled) == len(full)
    assert tensors.same_bits(codec.decode(base, sampled), target)


def test_noise_is_still_coded_by_the_method_that_wins_it():
    base, target = _dense("random-bits", fraction=1.0)
    assert _method(codec.encode(base, target)) == "xor-planes"


def test_effort_max_races_every_method_in_full(calls):
    base, target = _dense("training")
    n = base["w"].numel()
    codec.encode(base, target, effort="max")
    assert {name for name, size in calls if size == n} == {"conditional", "sparse-split", "xor-planes"}
    assert all(size == n for _, size in calls)


def test_small_and_sparse_tensors_do_not_sample(calls):
    small, small_target = _dense("training", shape=(64, 64))
    codec.encode(small, small_target)
    sparse, sparse_target = _dense("training", fraction=0.05)
    codec.encode(sparse, sparse_target)
    assert all(size in (64 * 64, 512 * 512) for _, size in calls)
