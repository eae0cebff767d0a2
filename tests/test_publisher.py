"""The publisher at scale (#15): streamed snapshot files byte-identical to safetensors, one delta part per
snapshot file, copy-on-write under a slow background snapshot with a memory budget, inputs the codec cannot
read in place, and peak memory measured in a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import relay
from codec.tensors import DTYPES
from relay.checkpoint import safetensors_stream
from relay.manifest import Manifest, ObjRef, Record
from relay.store import open_store

from conftest import same_bits

ROOT = Path(__file__).resolve().parents[1]


def manifest_of(url: str) -> Manifest:
    return Manifest.parse(open_store(url).read_manifest().data)


# -- streamed safetensors ------------------------------------------------------------------------------
def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for dt in DTYPES:
        if dt.name == "C128":
            continue
        for shape in [(3, 5), (0,), (), (2, 0, 3), (7,)]:
            n = torch.Size(shape).numel()
            raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
            t = (raw % 2).bool() if dt.torch == torch.bool else raw.view(dt.torch)
            out[f"{dt.name}.{'x'.join(map(str, shape))}"] = t.reshape(shape)
    return out


@pytest.mark.parametrize("metadata", [{"step": "12"}, None])
def test_streamed_shard_is_safetensors_bytes(metadata):
    """Every dtype both know, empty and 0-d tensors, names needing JSON escapes or UTF-8, any chunk size:
    the stream is exactly what safetensors.torch.save writes (PROTOCOL §3.3's determinism rests on it)."""
    tensors = _every_dtype()
    tensors['odd "name"\\\n\x01 é中'] = torch.arange(6, dtype=torch.float32)
    tensors["b.first-by-name"] = torch.ones(4, dtype=torch.bfloat16)
    expected = st_save(tensors, metadata=metadata)
    f = safetensors_stream(tensors, metadata)
    assert f.size == len(expected)
    for chunk in (7, 1 << 20):
        assert b"".join(f.chunks(chunk)) == expected
    assert ObjRef.of_chunks("snapshots/1/x.safetensors", f.chunks(5), strong=True) == \
        ObjRef.of("snapshots/1/x.safetensors", expected, strong=True)


def test_streamed_shard_of_views_and_tied_weights():
    """Strided views, a tensor and its alias (tied weights), an expanded view: written as the contiguous
    copies safetensors needs, bytes equal to saving those copies."""
    base = torch.randn(6, 8).to(torch.bfloat16)
    tensors = {"t": base.t(), "slice": base[:, 2:5], "tied.a": base, "tied.b": base,
               "expanded": torch.ones(1, 3).expand(4, 3)}
    expected = st_save({k: v.contiguous().clone() for k, v in tensors.items()}, metadata={"step": "1"})
    assert b"".join(safetensors_stream(tensors, {"step": "1"}).chunks(16)) == expected


def test_streamed_shard_refuses_what_safetensors_cannot_store():
    with pytest.raises(ValueError, match=r"'z'.*C128"):
        safetensors_stream({"ok": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)})


# -- stores that hold a snapshot back ------------------------------------------------------------------
class HeldSnapshots:
    """Wraps a store: streamed puts of snapshot files (every snapshot but the first) wait for `release`,
    then fail if `fail` is set, so a background snapshot stays in flight while later steps publish."""

    def __init__(self, store, fail: bool = False) -> None:
        self.inner = store
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail = fail
        self.held = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_immutable_stream(self, key, chunks, size, xxh3):
        if key.startswith("snapshots/") and not key.startswith("snapshots/0/"):
            self.held += 1
            self.entered.set()
            assert self.release.wait(30), "never released"
            if self.fail:
                raise OSError(f"{key}: injected failure")
        return self.inner.put_immutable_stream(key, chunks, size, xxh3)


def _bumped(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The trainer's step, in place: a few elements of every tensor move one ULP."""
    for i, t in enumerate(state.values()):
        flat = t.view(-1).view(torch.int16)
        flat[(step * 7 + i) % 5::37] += 1
    return state


def _model(n: int = 6, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"w{i}": (torch.randn(rows, 96, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}


def _snapshot_tensors(url: str, step: int) -> dict[str, torch.Tensor]:
    m = manifest_of(url)
    snap = m.snapshot(step)
    assert snap is not None, f"no snapshot of step {step}: {[s.step for s in m.snapshots]}"
    store = open_store(url)
    out: dict[str, torch.Tensor] = {}
    for f in snap.files:
        out.update(st_load(store.get(f.key)))
    return out


def test_copy_on_write_under_a_slow_snapshot(file_run, tmp_path):
    """The snapshot of step 3 is held in the store while steps 4 and 5 publish (every tensor changes each
    step): the tensors it has not written are handed to it, not overwritten, so it lands bit-exact to step
    3, and the delta chain stays bit-exact to every step."""
    state = _model()
    states = {}
    pub = relay.Publisher(file_run.url, snapshot_every=3, snapshot_fraction=1e9, snapshot_budget=1.0,
                          max_shard_bytes=30_000)
    held = pub.store = HeldSnapshots(pub.store)
    w = relay.Watcher(file_run.url, tmp_path / "dest")
    try:
        for step in range(6):
            if step:
                _bumped(state, step)
            states[step] = {k: v.clone() for k, v in state.items()}
            pub.publish(state, step)
            if step >= 3:
                assert held.entered.wait(10)
            assert w.sync(timeout=30) == step and same_bits(w.tensors, states[step])
        assert [s.step for s in manifest_of(file_run.url).snapshots] == [0]  # step 3's is still held
        assert 0 < pub._cow.held <= sum(t.numel() * 2 for t in state.values())
        held.release.set()
        pub.flush()
    finally:
        held.release.set()
        pub.close()
    assert pub._cow.held == 0 and not pub._cow.jobs
    assert 0 < pub.snapshot_held_peak <= sum(t.numel() * 2 for t in state.values())  # the high-water mark stays
    snaps = [s.step for s in manifest_of(file_run.url).snapshots]
    assert snaps == [0, 3]
    for s in snaps:
        assert same_bits(_snapshot_tensors(file_run.url, s), states[s])
    fresh = relay.Watcher(file_run.url, tmp_path / "fresh")
    assert fresh.sync(timeout=30) == 5 and same_bits(fresh.tensors, states[5])


@pytest.mark.parametrize("fail", [False, True], ids=["snapshot-lands", "snapshot-fails"])
def test_budget_makes_publish_wait(file_run, tmp_path, fail):
    """With no memory for superseded tensors (budget 0), the step after a snapshot waits until the snapshot
    has written the tensors it changes; it goes on when the snapshot lands and also when it fails (no
    deadlock), and a failed snapshot is retried at the next step."""
    state = _model()
    pub = relay.Publisher(file_run.url, snapshot_every=2, snapshot_fraction=1e9, snapshot_budget=0.0,
                          snapshot_attempts=1, max_shard_bytes=30_000)
    held = pub.store = HeldSnapshots(pub.store, fail=fail)
    states = {}
    try:
        for step in range(3):
            if step:
                _bumped(state, step)
            states[step] = {k: v.clone() for k, v in state.items()}
            pub.publish(state, step)
        assert held.entered.wait(10)
        _bumped(state, 3)
        states[3] = {k: v.clone() for k, v in state.items()}
        done = threading.Event()
        errors: list[BaseException] = []

        def third() -> None:
            try:
                pub.publish(state, 3)
            except BaseException as exc:  # noqa: BLE001 - handed to the test below
                errors.append(exc)
            done.set()

        thread = threading.Thread(target=third)
        thread.start()
        assert not done.wait(1.0), "publish went on although the snapshot still needs the tensors it changes"
        assert pub._cow.held == 0 and pub.snapshot_held_peak == 0  # (budget 0: never held anything)
        held.release.set()
        assert done.wait(30), "publish never resumed"
        thread.join()
        assert not errors, errors
        if fail:
            with pytest.raises(OSError, match="injected failure"):
                pub.flush()
            assert pub.snapshot_failures == 1
            _bumped(state, 4)
            states[4] = {k: v.clone() for k, v in state.items()}
            held.fail = False
            pub.publish(state, 4)  # the failed snapshot is taken again, of this step
        pub.flush()
    finally:
        held.release.set()
        pub.close()
    assert pub._cow.held == 0 and not pub._cow.jobs
    m = manifest_of(file_run.url)
    assert [s.step for s in m.snapshots] == ([0, 4] if fail else [0, 2])
    for s in m.snapshots:
        assert same_bits(_snapshot_tensors(file_run.url, s.step), states[s.step])
    w = relay.Watcher(file_run.url, tmp_path / "dest")
    assert w.sync(timeout=30) == m.head and same_bits(w.tensors, states[m.head])


# -- delta parts ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("advance", ["copy", "apply"])
def test_one_delta_part_per_snapshot_file(run_store, trainer, tmp_path, advance):
    """Each step's delta has one part per file of the record's weight_map, covering exactly its tensors;
    watchers (one following every step, one starting late) reach every step bit-exact."""
    url, opts = run_store.url, run_store.options
    t = trainer(seed=4)
    w = relay.Watcher(url, tmp_path / "follow", storage_options=opts)
    states = {}
    with relay.Publisher(url, storage_options=opts, snapshot_every=3, max_shard_bytes=12_000, advance=advance,
                         workers=2) as pub:
        for step in range(7):
            states[step] = t.state() if step == 0 else t.step()
            pub.publish(t.model, step)
            assert w.sync(timeout=30) == step and same_bits(w.tensors, states[step])
    store = open_store(url, opts)
    m = Manifest.parse(store.read_manifest().data)
    for s in m.steps[1:]:
        rec = Record.parse(store.get(s.record.key))
        files = sorted(set(rec.weight_map.values()))
        assert len(files) >= 3 and s.parts is not None and len(s.parts) == len(files)
        for i, (part, f) in enumerate(zip(s.parts, files)):
            assert part.ref.key == f"deltas/{s.step}-{i}.drd"
            assert list(part.tensors) == [k for k in rec.tensors if rec.weight_map[k] == f]
    late = relay.Watcher(url, tmp_path / "late", storage_options=opts)
    assert late.sync(timeout=30) == 6 and same_bits(late.tensors, states[6])


def test_one_file_one_part_covering_everything(file_run, trainer):
    t = trainer(seed=6)
    with relay.Publisher(file_run.url, background=False) as pub:
        for step in range(3):
            pub.publish(t.step(), step)
    m = manifest_of(file_run.url)
    assert all(len(s.parts) == 1 and s.parts[0].tensors is None for s in m.steps[1:])


@pytest.mark.parametrize("advance", ["copy", "apply"])
def test_inputs_the_codec_cannot_read_in_place(file_run, tmp_path, advance):
    """Transposed and sliced views and tied weights (two names, one storage) publish bit-exact, and the
    publisher's base never aliases the trainer's tensors."""
    g = torch.Generator().manual_seed(8)
    big = (torch.randn(40, 64, generator=g) * 0.02).to(torch.bfloat16)
    emb = (torch.randn(50, 32, generator=g) * 0.02).to(torch.bfloat16)
    state = {"t": big.t(), "slice": big[:, 8:40], "emb": emb, "lm_head": emb, "norm": torch.ones(32)}
    w = relay.Watcher(file_run.url, tmp_path / "dest")
    with relay.Publisher(file_run.url, snapshot_every=2, advance=advance, max_shard_bytes=4000) as pub:
        for step in range(5):
            if step:
                big.view(-1).view(torch.int16)[step::23] += 1
                emb.view(-1).view(torch.int16)[step::17] -= 1
                state["norm"][step % 32] += 0.5
            pub.publish(state, step)
            want = {k: v.contiguous().clone() for k, v in state.items()}
            assert w.sync(timeout=30) == step and same_bits(w.tensors, want)
            ptrs = {v.untyped_storage().data_ptr() for v in state.values()}
            assert not ptrs & {v.untyped_storage().data_ptr() for v in pub.prev.values()}
            assert pub.prev["emb"].data_ptr() != pub.prev["lm_head"].data_ptr()
    assert [s.step for s in manifest_of(file_run.url).snapshots] == [0, 2, 4]


class FailingCommits:
    """Wraps a store: the next `fail` manifest commits raise before writing anything."""

    def __init__(self, store) -> None:
        self.inner = store
        self.fail = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def commit_manifest(self, data, expected_etag):
        if self.fail:
            self.fail -= 1
            raise PermissionError("manifest.json: injected refusal")
        return self.inner.commit_manifest(data, expected_etag)


@pytest.mark.parametrize("advance", ["copy", "apply"])
def test_a_failed_commit_keeps_the_base_right(file_run, tmp_path, advance):
    """A step whose commit fails leaves the next step correct: with "copy" the base never moved (the retry is
    a delta from the last committed step); with "apply" it had (the retry is a snapshot step)."""
    state = _model(3)
    pub = relay.Publisher(file_run.url, background=False, advance=advance)
    store = pub.store = FailingCommits(pub.store)
    with pub:
        pub.publish(state, 0)
        pub.publish(_bumped(state, 1), 1)
        _bumped(state, 2)
        store.fail = 1
        with pytest.raises(PermissionError, match="injected"):
            pub.publish(state, 2)
        pub.publish(state, 2)  # the trainer's retry
        pub.publish(_bumped(state, 3), 3)
    m = manifest_of(file_run.url)
    assert (m.step(2).parts is None) == (advance == "apply")
    assert m.step(3).parts is not None
    w = relay.Watcher(file_run.url, tmp_path / "dest")
    assert w.sync(timeout=30) == 3 and same_bits(w.tensors, state)


# -- memory, measured --------------------------------------------------------------------------------------
def test_peak_memory_stays_near_one_model(tmp_path):
    """A real process publishes a 256 MiB BF16 model (4 tensors, 2 delta parts) for several steps, with a
    background snapshot and its copy-on-write: the publisher's peak RSS (VmHWM, beyond the trainer's own
    copy and the loaded kernels) stays under 1.35x the model, plus what the copy-on-write held (a 64 MiB
    tensor, 0.25, where the snapshot's upload lags behind the next step: on a loaded machine), which stays
    within `snapshot_budget`. (Beyond what copy-on-write held, measured: 1.25-1.27 alone, 1.26-1.29 with
    both cores busy, 1.316 once in a full CI run; 1.3 was too tight a bound for a loaded machine.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_publish.py"), "--tensors", "4", "--mib", "64",
                          "--steps", "4", "--snapshot-every", "2", "--shard-mib", "128", "--dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["model_bytes"] == 256 << 20
    held = got["snapshot_held_peak_over_model"]
    assert held <= 0.25, got  # the default snapshot_budget
    assert got["publisher_peak_over_model"] <= 1.35 + held, got
    assert len(got["delta_steps_s"]) == 4


@pytest.mark.parametrize("fail", [False, True], ids=["snapshot-lands", "snapshot-fails"])
def test_close_waits_for_a_held_snapshot_and_ends(file_run, fail):
    """close() while a background snapshot is held in the store waits for it, and returns once the store
    answers (raising the snapshot's failure, if it failed), with every tensor the snapshot held let go."""
    state = _model(3)
    pub = relay.Publisher(file_run.url, snapshot_every=1, snapshot_fraction=1e9, snapshot_budget=1.0,
                          snapshot_attempts=1)
    held = pub.store = HeldSnapshots(pub.store, fail=fail)
    pub.publish(state, 0)
    pub.publish(_bumped(state, 1), 1)
    assert held.entered.wait(10)
    pub.publish(_bumped(state, 2), 2)  # supersedes what snapshot 1 holds
    assert pub._cow.held > 0
    errors: list[BaseException] = []

    def close() -> None:
        try:
            pub.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            errors.append(exc)

    thread = threading.Thread(target=close)
    thread.start()
    thread.join(1.0)
    assert thread.is_alive(), "close returned while a snapshot was still uploading"
    held.release.set()
    thread.join(60)
    assert not thread.is_alive(), "close never returned"
    assert [type(e) for e in errors] == ([OSError] if fail else [])
    assert pub._cow.held == 0 and not pub._cow.jobs
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(state, 3)
    snaps = [s.step for s in manifest_of(file_run.url).snapshots]
    assert snaps == ([0] if fail else [0, 1, 2])


def test_payload_digests_are_the_states_digests():
    """codec.digests reads the trainer's digests out of a payload: the same a record computes by hashing."""
    import codec
    from relay.manifest import tensor_infos

    a = _model(3)
    b = _bumped({k: v.clone() for k, v in a.items()}, 1)
    b["same"] = a["same"] = torch.arange(5, dtype=torch.int32)
    got = codec.digests(codec.encode(a, b))
    assert list(got) == list(b)
    want_a, want_b = tensor_infos(a), tensor_infos(b)
    for k, d in got.items():
        assert (d.dtype, d.shape, d.base, d.target) == (want_b[k].dtype, want_b[k].shape, want_a[k].digest,
                                                       want_b[k].digest)
    with pytest.raises(codec.DeltaError):
        codec.digests(b"not a payload")


def test_known_base_digests_give_the_same_payload_unhashed(monkeypatch):
    """codec.encode(base_digests=...) skips hashing those bases and writes the given digests: the payload is
    byte for byte the one it makes hashing them (BF16 batches and other dtypes alike), and a malformed
    digest is refused, naming the tensor."""
    import codec
    from codec import api

    a = _model(3)
    b = _bumped({k: v.clone() for k, v in a.items()}, 1)
    b["same"] = a["same"] = torch.arange(5, dtype=torch.int32)
    hashed = codec.encode(a, b)
    known = {k: d.base for k, d in codec.digests(hashed).items()}
    scanned = []
    real = api._Batched.__init__

    def spy(self, method, names, base, target, scratch, known_, version):
        scanned.append(dict(known_))
        real(self, method, names, base, target, scratch, known_, version)

    monkeypatch.setattr(api._Batched, "__init__", spy)
    for workers in (1, 2):
        assert codec.encode(a, b, base_digests=known, workers=workers) == hashed
    assert scanned and all(set(k) for k in scanned)  # the BF16 batches were given digests
    with pytest.raises(ValueError, match="'same'"):
        codec.encode(a, b, base_digests={"same": "00ff"})


def test_publisher_hands_the_encoder_its_bases_digests(file_run, monkeypatch):
    """After a snapshot or a delta, the publisher knows every tensor of its base by digest (the record's):
    each delta's encode gets them all, and the chain still verifies at a watcher."""
    import codec

    given = []
    real = codec.encode

    def spy(base, target, **kw):
        given.append(dict(kw.get("base_digests") or {}))
        return real(base, target, **kw)

    monkeypatch.setattr(codec, "encode", spy)
    state = _model(3)
    with relay.Publisher(file_run.url, background=False) as pub:
        pub.publish(state, 0)
        for step in (1, 2, 3):
            pub.publish(_bumped(state, step), step)
    m = manifest_of(file_run.url)
    store = open_store(file_run.url)
    for step, digests in zip((1, 2, 3), given):
        previous = Record.parse(store.get(m.step(step - 1).record.key))
        assert digests == {k: v.digest for k, v in previous.tensors.items()}, step


def test_publisher_writes_the_payload_version_it_is_given(file_run, tmp_path):
    """Publisher(format_version=4) writes v4 deltas (column votes), which a watcher follows bit-exact; an
    unknown version is refused before anything is written."""
    import codec

    with pytest.raises(ValueError, match="format_version"):
        relay.Publisher(file_run.url, format_version=9)
    state = _model(3)
    w = relay.Watcher(file_run.url, tmp_path / "w")
    with relay.Publisher(file_run.url, background=False, format_version=4) as pub:
        for step in range(4):
            pub.publish(state if step == 0 else _bumped(state, step), step)
            assert w.sync(timeout=30) == step and same_bits(w.tensors, state)
    w.close()
    store = open_store(file_run.url)
    m = manifest_of(file_run.url)
    assert {codec.describe(store.get(s.parts[0].ref.key))["format_version"] for s in m.steps[1:]} == {4}


# -- cold start -----------------------------------------------------------------------------------------
class _Compiling:
    """A warm-up that has not finished (a fresh host whose encoder is still compiling) until `finish`."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def finish(self) -> None:
        self.finished = True


def test_deltas_while_the_encoder_compiles_need_no_kernel(file_run, trainer, tmp_path, monkeypatch):
    """Until the encoder's warm-up is done, deltas are coded without compiled kernels (sparse-split records:
    larger, the same format); watchers reach every step bit-exact, and once the kernels are ready the
    publisher codes with them again."""
    import codec
    from codec import container
    from codec.methods import conditional, sparse

    warm = _Compiling()
    monkeypatch.setattr(codec, "warm_up", lambda paths=None, **kw: warm)
    calls = []
    real = codec.encode
    monkeypatch.setattr(codec, "encode", lambda *a, **kw: calls.append(kw.get("compiled", True)) or real(*a, **kw))
    t = trainer(seed=8)
    w = relay.Watcher(file_run.url, tmp_path / "w")
    store = open_store(file_run.url)
    with relay.Publisher(file_run.url, background=False) as pub:
        for step in range(5):
            if step == 3:
                warm.finish()
            state = t.state() if step == 0 else t.step()
            pub.publish(t.model, step)
            assert w.sync(timeout=30) == step and same_bits(w.tensors, state)
    assert calls == [False, False, True, True]
    m = manifest_of(file_run.url)
    methods = {s.step: {e.method for e in container.unpack(store.get(s.parts[0].ref.key)).entries
                        if e.changes} for s in m.steps[1:]}
    assert methods[1] == methods[2] == {sparse.ID} and methods[3] == methods[4] == {conditional.ID}


# -- resume ---------------------------------------------------------------------------------------------
def test_resume_streams_the_head_into_memory(file_run, trainer, tmp_path, monkeypatch, caplog):
    """A resuming publisher reads the head's snapshot from the store straight into its tensors (no file is
    spooled or written), every byte checked against the manifest: a snapshot file whose bytes were
    replaced (same size) is refused, and the head is rebuilt from the older snapshot and its chain; the
    resumed run's next step reaches a watcher bit-exact."""
    from relay.watcher import Reader

    t = trainer(seed=9)
    states = {}
    with relay.Publisher(file_run.url, background=False, snapshot_every=3) as pub:
        for step in range(5):
            states[step] = t.state() if step == 0 else t.step()
            pub.publish(t.model, step)
    m = manifest_of(file_run.url)
    assert [s.step for s in m.snapshots] == [0, 3]
    victim = Path(file_run.url.removeprefix("file://")) / m.snapshots[-1].files[0].key
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x01  # a tensor's last byte: the header still parses, the hash does not match
    victim.write_bytes(bytes(raw))
    with monkeypatch.context() as mp:
        mp.setattr(Reader, "_spool_one", lambda *a: pytest.fail("a resume spooled a snapshot file"))
        with relay.Publisher(file_run.url, background=False, resume=True, resume_timeout=30) as pub:
            assert pub.step == 4 and same_bits(pub.prev, states[4])
            assert f"{m.snapshots[-1].files[0].key}: xxh3" in caplog.text  # refused, then planned around
            states[5] = t.step()
            pub.publish(t.model, 5)
    w = relay.Watcher(file_run.url, tmp_path / "w")
    assert w.sync(timeout=30) == 5 and same_bits(w.tensors, states[5])


def test_publish_returns_what_it_did(file_run):
    """`publish` returns its bytes, changed fraction and timings (a trainer's logger has them): each figure is
    checked against the store and the state, at a snapshot step, a delta step, and a delta step that snapshots."""
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(64, 64, generator=g).bfloat16(), "b": torch.randn(1000, generator=g).bfloat16()}
    store = open_store(file_run.url)

    def sizes(*prefixes: str) -> int:
        return sum(n for k, n in store.list_run().items() if k.startswith(prefixes))

    with relay.Publisher(file_run.url, background=False, snapshot_every=2) as pub:
        first = pub.publish(state, 0)
        assert isinstance(first, relay.Published) and (first.step, first.kind) == (0, "snapshot")
        assert first.snapshot_bytes == sizes("snapshots/0/") == manifest_of(file_run.url).snapshots[-1].bytes
        assert first.bytes_written == first.snapshot_bytes + sizes("records/0")
        assert first.changed_fraction is None and first.snapshot_started
        state = {k: v.clone() for k, v in state.items()}
        state["a"].view(-1)[:100] += 1.0  # some of the 5096 elements change
        changed = int((state["a"] != pub.prev["a"]).sum())
        second = pub.publish(state, 1)
        assert (second.step, second.kind, second.snapshot_bytes, second.snapshot_started) == (1, "delta", 0, False)
        assert second.delta_bytes == sizes("deltas/1-") > 0
        assert second.bytes_written == second.delta_bytes + sizes("records/1")
        assert second.changed_fraction == changed / (64 * 64 + 1000)
        state = {k: v.clone() for k, v in state.items()}
        state["b"][:10] += 1.0
        third = pub.publish(state, 2)  # two steps past the snapshot: one now (background=False)
        assert third.kind == "delta" and third.snapshot_started and third.snapshot_bytes == sizes("snapshots/2/") > 0
        assert third.bytes_written == third.delta_bytes + sizes("records/2") + third.snapshot_bytes
    for r in (first, second, third):
        assert min(r.encode_s, r.upload_s, r.commit_s) >= 0 and r.seconds >= r.encode_s + r.upload_s + r.commit_s
        assert f"step {r.step}: {r.kind}, {r.bytes_written} bytes written" in r.line()
