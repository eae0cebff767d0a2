"""The engine side (relay/engines, the watcher's delivery to engines and modules) in the cases an adversarial
review found uncovered (docs/RELIABILITY.md has each finding, before and after). vLLM is not needed: its driver
runs against stand-ins (a scripted LLM with two workers, a `vllm serve` over real HTTP).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from relay.engines import EngineError, Update
from relay.engines.vllm import VLLMEngine, VLLMServer
from relay.publisher import Publisher
from relay.watcher import HotLoadError, Watcher

from conftest import Trainer, same_bits
from fake_engine import FakeEngine
from test_engine_hook import MemoryEngine, ScriptedLLM


def _read_dir(files: Path, names: set[str] | None) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for p in sorted(Path(files).glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys() if names is None or k in names})
    return got


# -- 1. tensor parallelism: the driver reads only the first worker's answer ------------------------------------
class TwoWorkerLLM(ScriptedLLM):
    """What VLLMEngine calls on a vllm.LLM with tensor_parallel_size=2: collective_rpc answers one result per
    worker (vLLM's LLM.collective_rpc and `vllm serve`'s /collective_rpc both return the list)."""

    def __init__(self) -> None:
        super().__init__()
        self.commit_results: list | str | None = None

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        spec = json.loads(args[0]) if args else {}
        if method == "deltarelay_commit":
            if self.commit_results is not None:
                return self.commit_results
            return [{"step": spec["step"], "tensors": 1, "apply_s": 0.0}] * 2
        return [{"step": spec.get("step"), "tensors": 1}] * 2


@pytest.mark.parametrize("results", [
    pytest.param([{"step": 1, "tensors": 1, "apply_s": 0.0},
                  {"step": 1, "error": "OutOfMemoryError: rank 1", "rolled_back_to": "previous", "apply_s": 0.0}],
                 id="rank0-applied-rank1-rolled-back"),
    pytest.param([{"step": 1, "error": "OutOfMemoryError: rank 0", "rolled_back_to": "previous", "apply_s": 0.0},
                  {"step": 1, "tensors": 1, "apply_s": 0.0}],
                 id="rank0-rolled-back-rank1-applied"),
    pytest.param([], id="no-worker-answered"),
])
def test_vllm_commit_checks_every_workers_result(tmp_path, results):
    """With tensor parallelism each worker applies (or rolls back) its own shard: when the workers disagree the
    engine serves a mix of two steps, so the driver must not report either step (nor one no worker confirmed)."""
    llm = TwoWorkerLLM()
    engine = VLLMEngine(llm)
    engine.stage(Update(0, "r", {}, tmp_path / "0", None))
    engine.commit(0)
    assert engine.state()["step"] == 0
    engine.stage(Update(1, "r", {}, tmp_path / "1", frozenset({"a"}), tmp_path / "0"))
    llm.commit_results = results
    try:
        engine.commit(1)
        raised = None
    except EngineError as exc:
        raised = exc
    st = engine.state()
    assert raised is not None and st["step"] is None, (
        f"workers answered {results}: the engine holds a mix of steps 0 and 1 (or nothing confirmed), yet the "
        f"driver reports step {st['step']} ({st['status']}, weight version {st['weight_version']!r}), commit "
        f"{'raised ' + repr(raised) if raised else 'succeeded'}")


# -- 2. a restart while the version probe failed: a partial update lands on the checkpoint ---------------------
class FakeVLLMServe:
    """A `vllm serve` stand-in (VLLM_SERVER_DEV_MODE endpoints) whose worker loads what it is told from the
    version directory, like relay.engines.vllm.WorkerExtension: changed names only, else everything."""

    def __init__(self, checkpoint: dict[str, torch.Tensor]) -> None:
        self.checkpoint = {k: v.clone() for k, v in checkpoint.items()}
        self.weights = {k: v.clone() for k, v in checkpoint.items()}
        self.version = "default"
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self.failing_probes = 0
        me = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _send(self, code: int, body: object) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path.startswith("/weight_info"):
                    if me.failing_probes:
                        me.failing_probes -= 1
                        return self._send(503, {"error": "engine starting"})
                    return self._send(200, {"weight_version": me.version})
                self._send(404, {})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null") if n else None
                path = self.path.split("?")[0]
                if path == "/collective_rpc":
                    return self._send(200, {"results": [me.rpc(body["method"], *body.get("args", []))]})
                if path == "/update_weight_version":
                    me.version = body["new_version"]
                    return self._send(200, {})
                if path == "/reset_prefix_cache":
                    return self._send(200, {"success": True})
                if path in ("/pause", "/resume"):
                    return self._send(200, {})
                self._send(404, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def rpc(self, method: str, *args: str) -> object:
        if method == "deltarelay_stage":
            spec = json.loads(args[0])
            names = None if spec["changed"] is None else set(spec["changed"])
            self.staged = (spec["step"], _read_dir(Path(spec["files"]), names))
            return {"step": spec["step"], "tensors": len(self.staged[1])}
        if method == "deltarelay_commit":
            step = json.loads(args[0])["step"]
            assert self.staged is not None and self.staged[0] == step
            self.weights.update(self.staged[1])
            self.staged = None
            return {"step": step, "tensors": 1, "apply_s": 0.0}
        if method == "deltarelay_abort":
            self.staged = None
            return None
        raise AssertionError(method)

    def restart(self, failing_probes: int) -> None:
        """The server restarts: back on its checkpoint, weight version "default", nothing staged; its first
        `failing_probes` /weight_info calls fail (the engine was still coming up)."""
        self.weights = {k: v.clone() for k, v in self.checkpoint.items()}
        self.version, self.staged, self.failing_probes = "default", None, failing_probes

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_engine_restart_seen_as_unreachable_never_gets_a_partial_update(tmp_path):
    """A `vllm serve` that restarted while the driver's version probe failed ("unreachable" keeps the step last
    known) must not be given a partial update: applied over the checkpoint it leaves the engine serving a mix of
    the checkpoint and the new step, labelled as the new step, for good (nothing ever re-pushes it whole)."""
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=21)
    server = FakeVLLMServe(Trainer(seed=99).state())  # the engine's own checkpoint: other weights
    engine = VLLMServer(server.url, control_timeout=5.0, timeout=30.0)
    try:
        with Publisher(url, background=False, snapshot_every=100) as pub, \
                Watcher(url, tmp_path / "dest", engine=engine, report_interval=None) as w:
            pub.publish(t.state(), 0)
            assert w.sync() == 0 and server.version == "0"
            s1 = t.step()
            pub.publish(s1, 1)
            assert w.sync() == 1 and same_bits(server.weights, s1) and server.version == "1"
            server.restart(failing_probes=1)
            s2 = {**t.step(), "0.weight": s1["0.weight"]}  # one tensor keeps its bits: not in `changed`
            pub.publish(s2, 2)
            try:
                w.sync()
            except EngineError:
                pass  # refusing the step would be fine
            w.sync()  # and a later sync, with the engine answering again
            st = engine.state()
            mixed = not same_bits(server.weights, s2)
            assert not (mixed and st["step"] == 2), (
                f"the engine serves a mix (0.weight is its checkpoint's, the rest step 2) while the driver "
                f"reports step {st['step']} ({st['status']}, weight version {st['weight_version']!r}) and the "
                f"watcher engine_step {w.engine_step}")
    finally:
        server.close()


# -- 3. memory: one undo log per step while the module refuses -------------------------------------------------
def test_module_that_keeps_refusing_does_not_grow_memory_per_step(tmp_path):
    """A module that took a step and then refuses every later one (here: a buffer added to it, e.g. an adapter)
    made every in-place sync append its UndoLog (about 6 bytes per changed element: dense SGD changes nearly
    all) to _module_logs, never dropped while the module refused: memory grew with the number of steps. Past a
    copy of the model they are dropped, and a hot-load keeps a copy of what it replaces instead."""
    url = (tmp_path / "store").as_uri()
    state = Trainer(seed=22).state()
    module = Trainer(seed=23).model
    model_bytes = sum(v.numel() * v.element_size() for v in state.values())
    steps = 8
    g = torch.Generator().manual_seed(5)

    def dense_step(s: dict) -> dict:  # an update that moves (nearly) every element, as full fine-tuning does
        return {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in s.items()}

    with Publisher(url, background=False, snapshot_every=1000) as pub, \
            Watcher(url, tmp_path / "dest", module=module, report_interval=None) as w:
        pub.publish(state, 0)
        assert w.sync() == 0 and w.module_step == 0
        module.register_buffer("extra", torch.zeros(4))  # from now on every hot-load is refused
        for k in range(1, steps + 1):
            state = dense_step(state)
            pub.publish(state, k)
            with pytest.raises(HotLoadError):
                w.sync()
        assert w.step == steps and w.module_step == 0
        logs = w._module_logs or []
        held = sum(u.nbytes for u in logs)
        assert held <= 2 * model_bytes, (
            f"{len(logs)} undo logs holding {held} bytes ({held / model_bytes:.1f}x the model) after "
            f"{steps} refused steps: grows by about {held / steps / model_bytes:.1f}x the model per step")
        # and without its logs the module is still never left between two steps: a copy that fails midway is
        # undone from what the hot-load kept of the module's step
        del module._buffers["extra"]
        before = {k: v.clone() for k, v in module.state_dict().items()}
        names = list(before)
        real_copy = torch.Tensor.copy_
        calls = {"n": 0}

        def failing_copy(self, src, *a, **kw):
            calls["n"] += 1
            if calls["n"] == len(names):  # the last tensor's copy fails
                raise RuntimeError("device lost")
            return real_copy(self, src, *a, **kw)

        torch.Tensor.copy_ = failing_copy  # type: ignore[method-assign]
        try:
            with pytest.raises(HotLoadError, match="restored"):
                w.redeliver()
        finally:
            torch.Tensor.copy_ = real_copy  # type: ignore[method-assign]
        assert same_bits(module.state_dict(), before) and w.module_step == 0
        w.redeliver()
        assert w.module_step == steps and same_bits(module.state_dict(), state)


# -- 4. a store outage stops delivery of the held step ---------------------------------------------------------
def test_engine_restarted_during_a_store_outage_gets_the_held_step(tmp_path):
    """The held step is verified and on disk: an engine that restarts (back on its checkpoint) must get it back
    whether or not the store answers. run() read the manifest first and skipped every delivery when that
    failed, so the engine served its checkpoint for as long as the store was down."""
    url = (tmp_path / "store").as_uri()
    engine = FakeEngine()
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine, poll_interval=0.05, report_interval=None) as w:
        pub.publish(Trainer(seed=24).state(), 0)
        assert w.sync() == 0 and engine.step == 0

        def down(*a, **kw):
            raise OSError("store unreachable")

        w.store.read_manifest = down  # type: ignore[method-assign]
        engine.step = None  # the engine restarted: it serves its checkpoint
        runner = threading.Thread(target=w.run, daemon=True)
        runner.start()
        try:
            deadline = time.monotonic() + 5  # DELIVERY_RETRY starts at 1 s: several offers fit
            while engine.step != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            w.stop()
            runner.join(timeout=30)
        assert engine.step == 0, (f"the engine stayed on its checkpoint for 5 s of store outage although DEST holds "
                                  f"step {w.step}; failures {w.failure_counts()}")


# -- 5. the watcher's engine_step after a commit whose outcome is unknown ---------------------------------------
class UnknownCommitLLM(TwoWorkerLLM):
    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "deltarelay_commit" and self.commit_results == "raise":
            raise RuntimeError("engine core connection reset mid-commit")
        return super().collective_rpc(method, args)[:1]


def test_watcher_engine_step_after_a_commit_with_an_unknown_outcome(tmp_path):
    """VLLMEngine raises EngineError for a commit whose outcome is unknown (weights may be step 0, 1 or a mix); the
    watcher took every EngineError as "the engine stays on its previous step" and kept engine_step at 0. It
    reads what the engine says it serves after a failure."""
    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=25)
    llm = UnknownCommitLLM()
    engine = VLLMEngine(llm)
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine, report_interval=None) as w:
        pub.publish(t.state(), 0)
        assert w.sync() == 0 and w.engine_step == 0
        pub.publish(t.step(), 1)
        llm.commit_results = "raise"
        with pytest.raises(EngineError, match="unknown"):
            w.sync()
        assert engine.state()["step"] is None  # premise: the adapter knows it does not know
        assert w.engine_step == engine.state()["step"], (
            f"watcher reports the engine on step {w.engine_step}; the engine's state: {engine.state()}")


def test_an_engine_that_reports_a_lost_step_after_every_reload_is_backed_off(tmp_path):
    """An engine whose state() no longer reports the step right after each whole reload (a flapping engine, or
    an adapter that loses its version) was handed the whole model again at every poll (poll_interval 0.02 s:
    dozens of full reloads a second, for a 1 TB policy a pause that never ends). Re-pushes after a loss back
    off like refused offers; a real restart is still answered at once."""
    class Flapping(MemoryEngine):
        def state(self) -> dict:
            out = super().state()
            out["step"] = None  # forgets at once what it took
            return out

    url = (tmp_path / "store").as_uri()
    t = Trainer(seed=12)
    engine = Flapping()
    with Publisher(url, background=False, snapshot_every=100) as pub, \
            Watcher(url, tmp_path / "dest", engine=engine, poll_interval=0.02) as w:
        pub.publish(t.state(), 0)
        assert w.sync() == 0 and len(engine.loaded) == 1
        runner = threading.Thread(target=w.run, daemon=True)
        runner.start()
        try:
            time.sleep(1.5)
        finally:
            w.stop()
            runner.join(timeout=30)
    assert 2 <= len(engine.loaded) <= 3, f"{len(engine.loaded)} whole reloads in 1.5 s"
