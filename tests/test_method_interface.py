"""The per-tensor methods behind one interface (codec/methods/base.py, `Method`): codec/api.py
dispatches through it alone, every registered method implements it, and a new one slots in."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import codec
from codec import container, methods
from codec.methods import xor_planes
from codec.methods.base import Job, Method
from codec_cases import FORMAT_VERSIONS, assert_bit_exact, clone_all, edge_pair, model_pair, random_tensor

API = Path(codec.__file__).parent / "api.py"
METHOD_MODULES = ("conditional", "exponent_classes", "same", "sparse", "xor_planes")


def test_api_knows_no_method_by_name():
    """No `conditional.` or `exponent_classes.` (or any other method module) in codec/api.py."""
    source = API.read_text()
    assert "conditional." not in source and "exponent_classes." not in source
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names}
            assert not (names & set(METHOD_MODULES)), f"api.py imports {names & set(METHOD_MODULES)}"
            assert not any(node.module and node.module.endswith(f"methods.{m}") for m in METHOD_MODULES), node.module
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert node.value.id not in METHOD_MODULES, f"api.py uses {node.value.id}.{node.attr}"


def _overrides(method: Method, name: str) -> bool:
    return getattr(type(method), name) is not getattr(Method, name)


@pytest.mark.parametrize("method", list(methods.REGISTRY.values()), ids=lambda m: m.name)
def test_registered_method_implements_the_interface(method):
    assert isinstance(method, Method)
    assert not inspect.isabstract(type(method))
    assert methods.REGISTRY[method.id] is method
    assert 0 <= method.id < 256 and isinstance(method.name, str) and method.name
    assert method.versions and set(method.versions) <= set(container.SUPPORTED_VERSIONS)
    assert isinstance(method.preference, int)
    for block in method.shared_kinds:
        assert 0 <= block.kind < 256 and set(block.versions) <= set(method.versions)
    if method.analyses:
        assert _overrides(method, "analyse") and _overrides(method, "fit")
    if method.builds_target:
        assert _overrides(method, "decode_target")
    if method.decodes_in_place:
        assert _overrides(method, "decode_in_place")
    if _overrides(method, "batch_encodable"):
        assert method.analyses and _overrides(method, "analyse_batch") and _overrides(method, "encode_batch")
    if _overrides(method, "batch_decodable"):
        assert _overrides(method, "decode_batch")


def test_registry_is_consistent():
    ms = list(methods.REGISTRY.values())
    kinds = [b.kind for m in ms for b in m.shared_kinds]
    assert len(kinds) == len(set(kinds)), "two methods own the same shared block kind"
    assert len({m.name for m in ms}) == len(ms)
    for version in FORMAT_VERSIONS:
        inv = methods.in_version(version)
        assert [m for m in inv if m.identity], f"v{version} has no method for unchanged tensors"
        assert [m.preference for m in inv] == sorted(m.preference for m in inv)
        for dt in codec.tensors.DTYPES:  # every dtype has a method to code its changes
            coders = [m for m in inv if m.applicable(dt) and not m.identity]
            assert coders, (version, dt.name)
            for m in coders[1:]:  # a batching method codes its batches' tensors first (encode_batch)
                assert not _overrides(m, "batch_encodable"), (version, dt.name, m.name)


def _forge_method(payload: bytes, name: str, method_id: int) -> bytes:
    parsed = container.unpack(payload)
    parsed.entries = [dataclasses.replace(e, method=method_id) if e.name == name else e for e in parsed.entries]
    return container.pack(parsed)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_unknown_method_is_refused_naming_the_tensor(version):
    base, target = edge_pair(seed=2)
    payload = codec.encode(base, target, format_version=version)
    parsed = container.unpack(payload)
    unknown = next(i for i in range(256) if i not in methods.REGISTRY)
    # a record of every method the payload holds (batched conditional ones included), and an unchanged one
    picks = {e.method: e.name for e in parsed.entries if e.numel}
    for name in picks.values():
        forged = _forge_method(payload, name, unknown)
        for run in (lambda f=forged: codec.decode(base, f), lambda f=forged: codec.apply_(clone_all(base), f),
                    lambda f=forged: codec.describe(f)):
            with pytest.raises(codec.DeltaError) as err:
                run()
            assert err.value.tensor == name and f"unknown method {unknown}" in str(err.value)


class _XorClone(Method):
    """A toy method under a new id: xor-planes' records, preferred over every other method."""

    id, name, versions, preference = 200, "xor-clone", (1, 2, 3, 4), -1
    calls = 0

    def applicable(self, dtype):
        return dtype.itemsize >= 4

    def encode(self, job: Job, model):
        type(self).calls += 1
        return xor_planes.encode(job.base, job.target, job.effort)

    def decode(self, entry, base, shared):
        return xor_planes.decode(entry, base, shared)

    def stream_names(self, entry):
        return ["p"] * len(entry.streams)


@pytest.mark.parametrize("version", FORMAT_VERSIONS)
def test_a_new_method_slots_in(version):
    rng = np.random.default_rng(5)
    base, target = model_pair(seed=5)
    base["ints"] = random_tensor(torch.int32, (300,), rng)
    target["ints"] = base["ints"].clone()
    target["ints"][::7] += 3
    saved = dict(methods.REGISTRY)
    methods.register(_XorClone())
    try:
        payload = codec.encode(base, target, format_version=version)
        entries = {e.name: e for e in container.unpack(payload).entries}
        assert entries["ints"].method == 200 and _XorClone.calls
        assert entries["layers.0.weight"].method != 200  # BF16: 2-byte elements, not its dtype
        assert_bit_exact(codec.decode(base, payload), target)
        live = clone_all(base)
        codec.apply_(live, payload)
        assert_bit_exact(live, target)
        assert codec.describe(payload)["tensors"][-1]["method"] == "xor-clone"
    finally:
        methods.REGISTRY.clear()
        methods.REGISTRY.update(saved)
    with pytest.raises(codec.DeltaError) as err:
        codec.decode(base, payload)
    assert err.value.tensor == "ints"


def test_a_record_outside_its_methods_versions_is_refused_by_every_path():
    """A v1 payload holding `conditional` records (a v2 method; forged, checksum recomputed) is
    refused naming the tensor by decode as by apply_: the batched decoder asks the method's
    versions too, instead of decoding such records together."""
    base, target = model_pair(seed=9)
    parsed = container.unpack(codec.encode(base, target, format_version=2))
    name = next(e.name for e in parsed.entries if e.method == methods.conditional.ID)
    forged = container.pack(dataclasses.replace(parsed, version=1))
    for run in (lambda: codec.decode(base, forged), lambda: codec.apply_(clone_all(base), forged)):
        with pytest.raises(codec.DeltaError) as err:
            run()
        assert err.value.tensor == name and "needs format version 2" in str(err.value)
