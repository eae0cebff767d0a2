"""Watcher(engine=...): each persisted step is staged then committed; an engine that fails stays on its
step, the watcher reports it and retries; only the tensors whose record entries changed are named.

The engine here is a plain in-memory one that loads what it is told from the version directory the
watcher names (the contract relay.engines.vllm's worker extension relies on); the real vLLM engine
is driven in tests/test_engine_vllm.py.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import socket
import threading
import time

import pytest
import torch
from safetensors import safe_open

from relay import dest as dest_mod
from relay.engines import Engine, EngineError, Update, changed_names
from relay.engines.vllm import VLLMEngine, VLLMServer, layer_of, widen_to_layers
from relay.manifest import Manifest, Record, TensorInfo, mismatches
from relay.store import open_store
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
        self.previous: list[Path | None] = []  # Update.previous of each stage
        self.aborts = 0

    def stage(self, update: Update) -> None:
        names = None if update.changed is None else set(update.changed)
        got = {}
        for p in sorted(Path(update.files).glob("*.safetensors")):
            with safe_open(str(p), framework="pt") as f:
                got.update({k: f.get_tensor(k) for k in f.keys() if names is None or k in names})
        self.staged = (update.step, got)
        self.previous.append(update.previous)

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


def test_engine_that_restarts_gets_the_held_step_back_whole(tmp_path):
    """An engine that lost its step (restarted from its checkpoint: state() reports step None) is re-pushed the
    held step whole, by the next sync and, with no new step published, by the watcher's poll loop."""
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=6)
    engine = MemoryEngine()
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine, poll_interval=0.05) as w:
        pub.publish(s0 := t.state(), 0)
        w.sync()
        s1 = {**t.step(), "0.weight": s0["0.weight"]}  # one tensor keeps its bits
        pub.publish(s1, 1)
        assert w.sync() == 1 and "0.weight" not in engine.loaded[-1]  # premise: step 1 moved only what changed
        engine.step, engine.weights = None, {}  # a restart: the engine serves its checkpoint, no step known
        assert w.sync() == 1 and engine.step == 1 and engine.loaded[-1] == set(s1) and engine.previous[-1] is None
        assert same_bits(engine.weights, s1)
        engine.step, engine.weights = None, {}
        runner = threading.Thread(target=w.run, daemon=True)
        runner.start()
        try:
            deadline = time.monotonic() + 30
            while engine.step != 1:  # the manifest is unchanged: only the loop's engine check brings it back
                assert time.monotonic() < deadline, "the poll loop never re-pushed the step to the restarted engine"
                time.sleep(0.02)
        finally:
            w.stop()
            runner.join(timeout=30)
        assert same_bits(engine.weights, s1) and w.engine_step == 1


def test_dest_keeps_the_engines_step_until_it_takes_a_newer_one(tmp_path):
    """Update.previous is the version directory of the step the engine serves (a failed commit's rollback reads
    it): it outlives the persisting of newer steps while the engine has not taken them, and goes once it has."""
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=7)
    engine = MemoryEngine()
    dest = tmp_path / "dest"
    with Publisher(url, background=False, snapshot_every=100) as pub, Watcher(url, dest, engine=engine) as w:
        pub.publish(s0 := t.state(), 0)
        w.sync()
        assert engine.previous == [None]  # a first update has nothing to roll back to but the engine's own
        v0 = w._version
        engine.fail_commit = True
        for k in (1, 2):  # the engine refuses both: DEST moves on, step 0's version stays for the engine
            pub.publish(t.step(), k)
            with pytest.raises(EngineError):
                w.sync()
            assert engine.previous[-1] == v0 and v0 is not None and v0.is_dir()
            assert {p.name for p in (dest / ".versions").iterdir()} == {v0.name, w._version.name}
        held = {}
        for shard in v0.glob("*.safetensors"):
            with safe_open(str(shard), framework="pt") as f:
                held.update({k: f.get_tensor(k) for k in f.keys()})
        assert same_bits(held, s0)
        engine.fail_commit = False
        assert w.sync() == 2 and w.engine_step == 2 and engine.previous[-1] == v0
        assert not v0.exists() and [p.name for p in (dest / ".versions").iterdir()] == [w._version.name]


class ScriptedLLM:
    """What VLLMEngine calls on a `vllm.LLM`, answering collective_rpc from a script: the driver's own
    bookkeeping (rollback outcomes, unknown outcomes, a relabelled engine) without an engine."""

    def __init__(self) -> None:
        self.version = "default"
        self.calls: list[tuple[str, dict]] = []
        self.commit_result: object = None  # a dict to return, or an exception to raise
        self.llm_engine = self

    def set_weight_version(self, v: str) -> None:
        self.version = v

    def get_weight_version(self) -> str:
        return self.version

    def reset_prefix_cache(self) -> bool:
        return True

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        spec = json.loads(args[0]) if args else {}
        self.calls.append((method, spec))
        if method == "deltarelay_commit":
            if isinstance(self.commit_result, Exception):
                raise self.commit_result
            return [self.commit_result or {"step": spec["step"], "apply_s": 0.001}]
        return [{"step": spec.get("step"), "tensors": 1}]


def test_vllm_driver_knows_what_the_engine_serves_after_each_outcome(tmp_path):
    llm = ScriptedLLM()
    engine = VLLMEngine(llm)
    up = lambda k, changed=frozenset({"a"}): Update(k, "r", {}, tmp_path / str(k), changed,  # noqa: E731
                                                   tmp_path / str(k - 1))
    engine.stage(up(0, None))
    assert llm.calls[-1][1]["changed"] is None and llm.calls[-1][1]["previous"] is None
    engine.commit(0)
    assert engine.state()["step"] == 0 and llm.version == "0"
    engine.stage(up(1))
    assert llm.calls[-1][1] == {"step": 1, "files": str(tmp_path / "1"), "changed": ["a"],
                                "previous": str(tmp_path / "0")}
    llm.commit_result = {"step": 1, "error": "boom", "rolled_back_to": "previous"}
    with pytest.raises(EngineError, match="rolled back and serves step 0"):
        engine.commit(1)
    st = engine.state()
    assert st["step"] == 0 and st["status"] == "serving" and "boom" in st["last_error"] and llm.version == "0"
    llm.commit_result = RuntimeError("the rollback failed too")  # outcome unknown: the next update is whole
    engine.stage(up(1))
    with pytest.raises(EngineError, match="weights are unknown"):
        engine.commit(1)
    assert engine.state()["step"] is None and engine.state()["status"] == "unknown"
    engine.stage(up(2))
    assert llm.calls[-1][1]["changed"] is None and llm.calls[-1][1]["previous"] is None
    llm.commit_result = {"step": 2, "error": "boom", "rolled_back_to": "checkpoint"}
    with pytest.raises(EngineError, match="own checkpoint"):
        engine.commit(2)
    assert llm.version == "default" and engine.state()["step"] is None
    llm.commit_result = None
    engine.stage(up(2, None))
    engine.commit(2)
    assert engine.state()["step"] == 2
    llm.version = "default"  # the engine restarted (or someone relabelled it)
    st = engine.state()
    assert st["step"] is None and st["status"] == "lost" and st["weight_version"] == "default"


def test_vllm_server_down_or_hung_fails_fast_and_clearly(tmp_path):
    """A server that refuses connections, or accepts and never answers: every call fails within its timeout with
    an error naming the URL, the ledger reports "unreachable", and a watcher keeps its step and retries."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = VLLMServer(f"http://127.0.0.1:{port}")
    url = (tmp_path / "store").as_uri()
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=down) as w:
        pub.publish(Trainer(seed=8).state(), 0)
        for _ in range(2):  # retried at each sync, never wedged
            with pytest.raises(EngineError, match=f"127.0.0.1:{port}.*(refused|up there)"):
                w.sync()
            assert w.step == 0 and w.engine_step is None
        assert down.state()["status"] == "unreachable"
    with socket.socket() as hung:  # listens (connections complete in the backlog) but never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        server = VLLMServer(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout=1.0, control_timeout=0.5)
        t0 = time.monotonic()
        assert server.state()["status"] == "unreachable"
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="timed out"):
            server.stage(Update(0, "r", {}, tmp_path, None))
        assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="timeouts must be positive"):
        VLLMServer("http://127.0.0.1:1", control_timeout=0)


class OneCallAtATimeLLM(ScriptedLLM):
    """A ScriptedLLM whose client, like vLLM's (a ZMQ socket to the engine core in its own process), breaks
    when two threads call it at once: an overlapping call is recorded. collective_rpc takes `rpc_s`."""

    def __init__(self, rpc_s: float) -> None:
        super().__init__()
        self.rpc_s = rpc_s
        self.busy = threading.Lock()
        self.overlaps: list[str] = []

    def _enter(self, what: str) -> None:
        if not self.busy.acquire(blocking=False):
            self.overlaps.append(what)
            self.busy.acquire()

    def get_weight_version(self) -> str:
        self._enter("get_weight_version")
        try:
            return self.version
        finally:
            self.busy.release()

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self._enter(method)
        try:
            time.sleep(self.rpc_s)
            return super().collective_rpc(method, args)
        finally:
            self.busy.release()


def test_vllm_engine_never_calls_its_llm_from_two_threads_at_once(tmp_path):
    """The fleet heartbeat asks state() while the sync thread stages: VLLMEngine serialises its calls into the LLM
    (vLLM's engine client garbles interleaved sends and the engine core stops taking requests), and state() does
    not wait for a long stage: it reports the version last known, "updating"."""
    llm = OneCallAtATimeLLM(rpc_s=0.5)
    engine = VLLMEngine(llm)
    engine.stage(Update(0, "r", {}, tmp_path, None))
    engine.commit(0)
    stager = threading.Thread(target=engine.stage, args=(Update(1, "r", {}, tmp_path, frozenset({"a"})),))
    stager.start()
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        states = [engine.state() for _ in range(20)]
        assert time.monotonic() - t0 < 0.4, "state() waited for the stage"
    finally:
        stager.join()
    assert not llm.overlaps, llm.overlaps
    assert all(st["status"] == "updating" and st["weight_version"] == "0" and st["step"] == 0 for st in states)
    engine.commit(1)
    assert engine.state()["status"] == "serving" and engine.state()["weight_version"] == "1"
    llm.version = "default"  # a restart is still noticed once the engine is free
    assert engine.state()["step"] is None


def test_poll_loop_offers_a_refused_step_again_without_a_new_manifest(tmp_path):
    """An engine (or module, or on_update) that refused the held step gets it again from run() although no new step
    is published: a trainer that stopped must not leave a restarted engine on its checkpoint. Offers back off."""
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=9)
    engine = MemoryEngine()
    engine.fail_commit = True
    delivered = []

    def on_update(step: int, tensors: dict) -> None:
        delivered.append(step)
        if len(delivered) < 3:
            raise RuntimeError("consumer not ready")

    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine, on_update=on_update, poll_interval=0.02) as w:
        pub.publish(s0 := t.state(), 0)
        runner = threading.Thread(target=w.run, daemon=True)
        runner.start()
        try:
            deadline = time.monotonic() + 30
            while engine.aborts < 2:  # refused, and offered again with the manifest unchanged
                assert time.monotonic() < deadline, "the poll loop never offered the refused step again"
                time.sleep(0.02)
            t_second = time.monotonic()
            engine.fail_commit = False
            while w.engine_step != 0 or w.delivered_step != 0:
                assert time.monotonic() < deadline, "the engine never got the step once it could take it"
                time.sleep(0.02)
            assert time.monotonic() - t_second > 0.5, "offers did not back off (poll_interval is 0.02 s)"
        finally:
            w.stop()
            runner.join(timeout=30)
    assert engine.step == 0 and same_bits(engine.weights, s0)
    assert delivered == [0, 0, 0] and w.step == 0


def test_a_new_step_does_not_wait_out_a_refused_step_s_backoff(tmp_path, monkeypatch):
    """While the held step's offers back off, a new manifest whose first sync fails before the reader has read it
    (a transient GET error) is synced again at the next poll, not at the held step's next offer."""
    import relay.watcher

    monkeypatch.setattr(relay.watcher, "DELIVERY_RETRY", (30.0, 60.0))  # a watcher that has backed off for a while
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=10)
    calls = []

    def on_update(step: int, tensors: dict) -> None:
        calls.append(step)
        if step == 0:
            raise RuntimeError("consumer not ready for step 0")

    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", on_update=on_update, poll_interval=0.02, report_interval=None) as w:
        pub.publish(t.state(), 0)
        runner = threading.Thread(target=w.run, daemon=True)
        runner.start()
        try:
            deadline = time.monotonic() + 30
            while not calls:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.2)  # refused once: the next offer of step 0 is 30 s away
            assert calls == [0]
            real, failed = w.reader.read_manifest, []

            def flaky():
                if not failed:
                    failed.append(True)
                    raise OSError("transient GET failure")
                return real()

            w.reader.read_manifest = flaky  # type: ignore[method-assign]
            t0 = time.monotonic()
            pub.publish(t.step(), 1)
            while w.step != 1:
                assert time.monotonic() - t0 < 10, "the new step waited for the refused step's backoff"
                time.sleep(0.01)
            assert failed and calls[-1] == 1 and w.delivered_step == 1
        finally:
            w.stop()
            runner.join(timeout=30)


def test_vllm_engine_reports_a_call_that_never_returns_as_stuck(tmp_path):
    """vLLM's engine client has no timeout: a dead engine core holds a stage forever. state() says "updating" at
    first, then "stuck" (naming the call) once it has run for stuck_after seconds, and "serving" again after."""
    llm = OneCallAtATimeLLM(rpc_s=0.0)
    engine = VLLMEngine(llm, stuck_after=0.3)
    engine.stage(Update(0, "r", {}, tmp_path, None))
    engine.commit(0)
    llm.rpc_s = 0.8
    stager = threading.Thread(target=engine.stage, args=(Update(1, "r", {}, tmp_path, frozenset({"a"})),))
    stager.start()
    try:
        time.sleep(0.1)
        assert engine.state()["status"] == "updating"
        time.sleep(0.4)
        st = engine.state()
        assert st["status"] == "stuck" and "deltarelay_stage has run for" in st["last_error"], st
        assert st["weight_version"] == "0" and st["step"] == 0
    finally:
        stager.join()
    st = engine.state()
    assert st["status"] == "serving" and st["last_error"] is None and not llm.overlaps
    with pytest.raises(ValueError, match="stuck_after"):
        VLLMEngine(llm, stuck_after=0)


def test_fleet_ledger_records_a_vllm_engine_s_state(tmp_path):
    """The ledger's engine entry holds scalars only (PROTOCOL §9.1); VLLMEngine's state() nests its last stage, which
    made every report an error ("engine.last_stage: ... got dict") instead of the engine's state. Nested fields
    are flattened to dotted names, and the entry parses back."""
    from relay import fleet

    url = (tmp_path / "store").as_uri()
    engine = VLLMEngine(ScriptedLLM())
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine, host="h1") as w:
        pub.publish(Trainer(seed=12).state(), 0)
        assert w.sync() == 0
        report = w.fleet.snapshot()
        assert report.engine is not None and "error" not in report.engine, report.engine
        assert report.engine["status"] == "serving" and report.engine["weight_version"] == "0"
        assert report.engine["last_stage.tensors"] == 1
        again = fleet.HostReport.parse(report.to_bytes(), "fleet/hosts/h1.json")
        assert again.engine == report.engine


ROOT = Path(__file__).resolve().parents[1]


def watch_once(url: str, dest: Path, persist: str) -> dict:
    """`deltarelay watch --once` in a process of its own; the state file of the version DEST then holds."""
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "watch", url, "--dest", str(dest), "--persist", persist,
                           "--once", "--no-report", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    version = dest_mod.current_version(dest)
    assert version is not None
    state = dest_mod.read_state(version)
    return {"step": state.step, "persist": state.persist, "base": state.base, "journal": len(state.journal)}


def record_of(url: str, step: int) -> Record:
    """The trainer's record of `step`, as published in the store (what the engine's label claims it serves)."""
    store = open_store(url)
    got = store.read_manifest()
    assert got is not None
    ref = Manifest.parse(got.data).step(step).record
    return Record.parse(store.get(ref.key))


def test_engine_serves_the_labelled_step_after_restarts_across_persist_modes(tmp_path):
    """A host ran `deltarelay watch --persist journal` (a process; its DEST holds an older base's safetensors plus
    verified deltas) and is restarted in full mode with an engine, with no new step in the store: the engine
    must get the held step's weights, not the base's under the held step's label, and later partial updates
    (only the changed tensors) must build on that step. Then back to journal mode (a process) and to full mode
    again. After every move the weights the engine serves match the record of the step it reports, bit for bit."""
    url = (tmp_path / "store").as_uri()
    d = tmp_path / "dest"
    t = Trainer(seed=8)
    engine = MemoryEngine()
    states: list[dict[str, torch.Tensor]] = []

    def publish(pub: Publisher, whole: bool = False) -> None:
        nxt = t.state() if not states else t.step()
        if states and not whole:  # a partial step: one tensor moves, the rest keep their bits
            nxt = {**states[-1], "2.weight": nxt["2.weight"]}
        states.append(nxt)
        pub.publish(nxt, len(states) - 1)

    def serves_its_label(w: Watcher) -> int:
        label = engine.state()["step"]
        assert label == w.step == w.engine_step, (label, w.step, w.engine_step)
        bad = mismatches(engine.weights, record_of(url, label).tensors, strong=False)
        assert not bad, f"the engine labelled step {label} serves other weights in {bad[:5]}"
        assert same_bits(engine.weights, states[label])
        return label

    with Publisher(url, background=False, snapshot_every=100) as pub:  # step 0 the only snapshot
        for _ in range(3):
            publish(pub, whole=True)
        assert watch_once(url, d, "journal") == {"step": 2, "persist": "journal", "base": 0, "journal": 2}
        assert not same_bits(states[0], states[2]), "premise: the journal's base is another step"
        # journal -> full with an engine, nothing new in the store
        with Watcher(url, d, engine=engine) as w:
            assert w.sync() == 2 and serves_its_label(w) == 2
            assert dest_mod.read_state(dest_mod.current_version(d)).persist == "full"
            assert same_bits(checkpoint_under_visible_names(d), states[2])  # full mode's readers see it too
            publish(pub)
            assert w.sync() == 3 and engine.loaded[-1] == {"2.weight"} and serves_its_label(w) == 3
        # full -> journal (a process): the held full version is its base; a step later it journals a delta
        publish(pub)
        assert watch_once(url, d, "journal")["step"] == 4
        publish(pub)
        assert watch_once(url, d, "journal") == {"step": 5, "persist": "journal", "base": 4, "journal": 1}
        # journal -> full again, the engine still up (on step 3): it gets step 5 whole, then a partial step 6
        with Watcher(url, d, engine=engine) as w:
            w.redeliver()  # from DEST alone (the store down at start): the same rewrite before the engine
            assert engine.loaded[-1] == set(states[5]) and serves_its_label(w) == 5
            assert w.sync() == 5
            publish(pub)
            assert w.sync() == 6 and engine.loaded[-1] == {"2.weight"} and serves_its_label(w) == 6
        # full -> full: nothing to rewrite, the engine (restarted: no step known) gets the held version whole
        engine.step, engine.weights = None, {}
        version = dest_mod.current_version(d)
        with Watcher(url, d, engine=engine) as w:
            assert w.sync() == 6 and serves_its_label(w) == 6 and dest_mod.current_version(d) == version


def test_a_failed_rewrite_of_a_journal_version_gives_the_engine_nothing_and_is_retried(tmp_path, monkeypatch):
    """journal -> full with an engine, the disk full at the rewrite's .current swap: the engine gets no step (not
    the journal's base under the held step's label), DEST still shows the held step as the journal version did,
    and the next sync, with room again, completes the rewrite and the delivery."""
    url = (tmp_path / "store").as_uri()
    d = tmp_path / "dest"
    t = Trainer(seed=9)
    states = [t.state(), t.step(), t.step()]
    with Publisher(url, background=False, snapshot_every=100) as pub:
        for k, s in enumerate(states):
            pub.publish(s, k)
    assert watch_once(url, d, "journal") == {"step": 2, "persist": "journal", "base": 0, "journal": 2}
    real_symlink = os.symlink

    def no_space_for_the_swap(src, dst, *a, **kw):
        if os.path.basename(os.fspath(dst)).startswith(".current.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(dst))
        return real_symlink(src, dst, *a, **kw)

    engine = MemoryEngine()
    with Watcher(url, d, engine=engine) as w:
        monkeypatch.setattr(os, "symlink", no_space_for_the_swap)
        with pytest.raises(OSError, match="No space"):
            w.sync()
        monkeypatch.setattr(os, "symlink", real_symlink)
        assert engine.step is None and engine.weights == {} and w.engine_step is None
        assert sorted(n for n in os.listdir(d) if not n.startswith(".")) == [dest_mod.STATE_NAME]
        step, held = dest_mod.open_head(d)
        assert step == 2 and same_bits(held, states[2])
        assert w.sync() == 2 and engine.step == w.engine_step == 2 and same_bits(engine.weights, states[2])
        assert dest_mod.read_state(dest_mod.current_version(d)).persist == "full"


def checkpoint_under_visible_names(d: Path) -> dict[str, torch.Tensor]:
    """What a reader of DEST's visible names (a full-mode consumer) loads."""
    from relay import checkpoint

    tensors, _ = checkpoint.load(d)
    return tensors
