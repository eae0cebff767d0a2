"""Watcher(engine=...): each persisted step is staged then committed; an engine that fails stays on its
step, the watcher reports it and retries; only the tensors whose record entries changed are named.

The engine here is a plain in-memory one that loads what it is told from the version directory the
watcher names (the contract relay.engines.vllm's worker extension relies on); the real vLLM engine
is driven in tests/test_engine_vllm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from relay.engines import Engine, EngineError, Update, changed_names
from relay.engines.vllm import layer_of, widen_to_layers
from relay.manifest import TensorInfo
from relay.publisher import Publisher
from relay.watcher import Watcher

from conftest import Trainer, same_bits


class MemoryEngine:
    """Holds a step's tensors, loaded from Update.files at stage time (only the changed ones)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.step: int | None = None
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self.fail_commit = False
        self.loaded: list[set[str]] = []
        self.aborts = 0

    def stage(self, update: Update) -> None:
        names = None if update.changed is None else set(update.changed)
        got = {}
        for p in sorted(Path(update.files).glob("*.safetensors")):
            with safe_open(str(p), framework="pt") as f:
                got.update({k: f.get_tensor(k) for k in f.keys() if names is None or k in names})
        self.staged = (update.step, got)

    def commit(self, step: int) -> float:
        if self.staged is None or self.staged[0] != step:
            raise EngineError(f"step {step} not staged")
        if self.fail_commit:
            raise EngineError("apply failed")
        self.weights.update(self.staged[1])
        self.loaded.append(set(self.staged[1]))
        self.step, self.staged = step, None
        return 0.001

    def abort(self) -> None:
        self.staged = None
        self.aborts += 1

    def state(self) -> dict:
        return {"kind": "memory", "step": self.step, "weight_version": str(self.step), "status": "serving",
                "last_pause_s": 0.001}


def test_engine_takes_each_step_and_only_what_changed(tmp_path):
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=4)
    engine = MemoryEngine()
    assert isinstance(engine, Engine)
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine) as w:
        states = [t.state()]
        pub.publish(states[0], 0)
        assert w.sync() == 0 and w.engine_step == 0 and engine.step == 0
        assert engine.loaded[-1] == set(states[0])  # the first step moves whole
        for k in (1, 2):
            frozen = dict(t.step())
            frozen["0.weight"] = states[-1]["0.weight"]  # one tensor keeps its bits: it must not move
            changed = {n for n in frozen if not torch.equal(frozen[n], states[-1][n])}
            assert changed and "0.weight" not in changed
            states.append(frozen)
            pub.publish(frozen, k)
            assert w.sync() == k and engine.step == k
            assert engine.loaded[-1] == changed
        assert same_bits(engine.weights, states[-1])


def test_failed_commit_keeps_the_engine_step_and_is_retried(tmp_path):
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=5)
    engine = MemoryEngine()
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine) as w:
        pub.publish(s0 := t.state(), 0)
        w.sync()
        pub.publish(s1 := t.step(), 1)
        engine.fail_commit = True
        with pytest.raises(EngineError, match="apply failed"):
            w.sync()
        assert w.step == 1 and w.engine_step == 0 and engine.step == 0 and engine.aborts == 1
        assert same_bits(engine.weights, s0)
        engine.fail_commit = False
        assert w.sync() == 1 and w.engine_step == 1  # the same manifest: the engine is retried anyway
        assert same_bits(engine.weights, s1)


def test_engine_needs_complete_steps_in_dest(tmp_path):
    with pytest.raises(ValueError, match="persist"):
        Watcher((tmp_path / "s").as_uri(), tmp_path / "d", engine=MemoryEngine(), persist="journal")
    with pytest.raises(ValueError, match="persist"):
        Watcher((tmp_path / "s").as_uri(), tmp_path / "d2", engine=MemoryEngine(), tensors=["a"])


def test_changed_names_from_records():
    a, b = TensorInfo("BF16", (2,), "00" * 16), TensorInfo("BF16", (2,), "11" * 16)
    assert changed_names(None, {"x": a}) is None
    assert changed_names({"x": a, "y": a}, {"x": a, "y": b}) == {"y"}
    assert changed_names({"x": a}, {"x": a, "z": b}) == {"z"}  # a new tensor moves
    assert changed_names({"x": a, "gone": a}, {"x": a}) is None  # a removed one: reload whole


def test_changed_tensors_widen_to_vllm_layers():
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    pre = "model.layers.0."
    names = [pre + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                               "mlp.down_proj.weight", "input_layernorm.weight")]
    assert layer_of(pre + "self_attn.k_proj.weight", packed) == pre + "self_attn.qkv_proj"
    assert layer_of(pre + "mlp.down_proj.weight", packed) == pre + "mlp.down_proj"
    got = widen_to_layers([pre + "self_attn.k_proj.weight", pre + "mlp.up_proj.weight"], names, packed)
    assert sorted(got) == sorted(pre + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                   "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                                                   "mlp.up_proj.weight"))
