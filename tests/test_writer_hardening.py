"""Writers under attack and in a split brain (#13 findings 1, 2, 4, 11 and the background-snapshot
suspicion): a keyed writer never signs what it did not verify, a resumed publisher fences the one it
replaces instead of deleting its objects, and a stale publisher is never told it owns the head."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading

import pytest
import torch

from relay import ops
from relay.cli import main as cli_main
from relay.manifest import Manifest, ObjRef, Record, Snapshot, Step, record_key, tensor_infos
from relay.publisher import Publisher, snapshot_files
from relay.signing import SignatureError, TrustedKeys, generate_keypair
from relay.store import ConflictError, LocalStore, open_store
from relay.verify import verify
from relay.watcher import Watcher

from conftest import publish_steps, same_bits


@pytest.fixture
def keys(tmp_path):
    return {name: generate_keypair(tmp_path / "keys" / name) for name in ("a", "b")}


def plant_step(store, m: Manifest, step: int, tensors: dict) -> Manifest:
    """What a bucket writer without the key does: their own record and snapshot for `step`, with correct
    SHA-256s, named by the manifest with its signatures dropped (returned, and committed unsigned)."""
    rec = Record(m.run, step, tensor_infos(tensors), {k: "model-00001-of-00001.safetensors" for k in tensors})
    data = rec.to_bytes()
    store.put_new(record_key(step), data)
    objects = {key: b"".join(f.chunks()) for key, f in snapshot_files(step, tensors, rec.weight_map).items()}
    for key, body in objects.items():
        store.put_new(key, body)
    refs = {k: ObjRef.of(k, v, strong=True) for k, v in objects.items()}
    index = refs.pop(f"snapshots/{step}/model.safetensors.index.json")
    forged = dataclasses.replace(m, head=step, steps=[*m.steps, Step(step, ObjRef.of(record_key(step), data, True))],
                                 snapshots=[*m.snapshots, Snapshot(step, index, tuple(refs.values()))], signatures=())
    store.commit_manifest(forged.to_bytes(), store.read_manifest().etag)
    return forged


# -- finding 1: keyed writers sign whatever unsigned manifest they find ----------------------------
@pytest.mark.parametrize("writer", ["gc", "rebase", "publish-resume"])
def test_keyed_writers_refuse_a_stripped_manifest(run_store, trainer, keys, tmp_path, writer):
    """A bucket writer strips the signatures and plants step 1000; the operator's routine command with the
    key refuses (exit 1, the reason on stderr), nothing is signed, and watchers that trust the key keep
    their genuine step."""
    url, opts = run_store.url, run_store.options
    states = publish_steps(url, trainer, 4, opts, signing_key=keys["a"][0])
    w = Watcher(url, tmp_path / "dest", storage_options=opts, trusted_keys=[keys["a"][1]])
    assert w.sync(timeout=30) == 3
    store = open_store(url, opts)
    m = Manifest.parse(store.read_manifest().data)
    evil = {k: torch.full_like(v, 7.0) for k, v in states[3].items()}
    plant_step(store, m, 1000, evil)
    stripped = store.read_manifest().data
    ckpt = tmp_path / "ckpt.safetensors"
    from safetensors.torch import save_file

    save_file(states[3], str(ckpt))
    args = {"gc": ["gc", url, "--keep-snapshots", "1"], "rebase": ["rebase", url],
            "publish-resume": ["publish", url, str(ckpt), "--step", "1001", "--resume"]}[writer]
    common = ["--signing-key", str(keys["a"][0])] + (["--storage-options", json.dumps(opts)] if opts else [])
    assert cli_main(args + common) == 1
    assert store.read_manifest().data == stripped  # nothing signed, nothing changed
    with pytest.raises(SignatureError, match="unsigned"):
        w.sync(timeout=5)
    assert w.step == 3 and same_bits(w.tensors, states[3])
    fresh = Watcher(url, tmp_path / "fresh", storage_options=opts, trusted_keys=[keys["a"][1]])
    with pytest.raises(SignatureError):
        fresh.sync(timeout=5)
    assert fresh.step is None


def test_adopting_an_unsigned_run_is_explicit_and_loud(file_run, trainer, keys, tmp_path, caplog):
    """The same commands on a genuinely unsigned run: refused without --adopt-unsigned, signed with it."""
    publish_steps(file_run.url, trainer, 4)
    store = open_store(file_run.url)
    before = store.read_manifest().data
    key = ["--signing-key", str(keys["a"][0])]
    assert cli_main(["gc", file_run.url, "--keep-snapshots", "1", *key]) == 1
    assert store.read_manifest().data == before
    with caplog.at_level(logging.WARNING):
        assert cli_main(["gc", file_run.url, "--keep-snapshots", "1", *key, "--adopt-unsigned"]) == 0
    assert "ADOPTING AN UNSIGNED MANIFEST" in caplog.text
    m = Manifest.parse(store.read_manifest().data)
    assert TrustedKeys(keys["a"][1]).verify(m).key_id == keys["a"][2]
    w = Watcher(file_run.url, tmp_path / "dest", trusted_keys=[keys["a"][1]])
    assert w.sync(timeout=10) == 3


def test_rotation_writer_accepts_a_trusted_old_key(file_run, trainer, keys):
    """gc signing with the new key accepts a manifest signed by the old one only when told to trust it."""
    publish_steps(file_run.url, trainer, 4, signing_key=keys["a"][0])
    with pytest.raises(SignatureError, match="none of them trusted"):
        ops.gc(file_run.url, 1, signing_key=keys["b"][0])
    ops.gc(file_run.url, 1, signing_key=keys["b"][0], trusted_keys=[keys["a"][1]])
    TrustedKeys(keys["b"][1]).verify(Manifest.parse(open_store(file_run.url).read_manifest().data))


# -- finding 2: the background snapshot commit --------------------------------------------------------
class _Interleave:
    """Runs `action` once, the first time the publisher's store creates an object under `prefix`: the
    moment another party acts while a background snapshot uploads."""

    def __init__(self, monkeypatch, prefix, action):
        self.fired = threading.Event()
        real = LocalStore.put_new_stream  # snapshot files are streamed (put_immutable_stream)

        def put_new_stream(store, key, chunks, size, **kw):
            if key.startswith(prefix) and not self.fired.is_set():
                self.fired.set()
                action()
            return real(store, key, chunks, size, **kw)

        monkeypatch.setattr(LocalStore, "put_new_stream", put_new_stream)


@pytest.mark.parametrize("attack", ["stripped", "replayed-older"])
def test_background_snapshot_commit_verifies_and_checks_the_head(file_run, trainer, keys, monkeypatch, attack):
    """While a background snapshot uploads, someone rewrites the manifest: stripped of its signatures with
    a planted step 1000, or replaced by an older genuine signed manifest. The snapshot commit refuses
    (reported by flush), and what the bucket shows is never signed by our key with that content."""
    store = open_store(file_run.url)
    t = trainer(seed=4)
    pub = Publisher(file_run.url, snapshot_every=3, signing_key=keys["a"][0])
    for step in range(3):
        pub.publish(t.step(), step)
    pub.flush()
    older = store.read_manifest().data
    genuine = Manifest.parse(older)

    shapes = {k: torch.zeros_like(v) for k, v in t.state().items()}

    def act():
        if attack == "stripped":
            plant_step(store, Manifest.parse(store.read_manifest().data), 1000, shapes)
        else:
            store.commit_manifest(older, store.read_manifest().etag)

    _Interleave(monkeypatch, "snapshots/3/", act)
    pub.publish(t.step(), 3)  # a delta committed now, the snapshot of step 3 in the background
    with pytest.raises((SignatureError, ConflictError)):
        pub.flush()
    pub.close()
    assert pub.snapshot_failures == 1 and "snapshot 3" in pub.last_snapshot_error
    m = Manifest.parse(store.read_manifest().data)
    if attack == "stripped":
        assert not m.signatures and m.head == 1000  # left as the attacker wrote it: unsigned, refused by watchers
    else:
        assert store.read_manifest().data == older and m.head == genuine.head == 2  # not re-signed with a snapshot


# -- finding 4: resume no longer deletes a live publisher's objects ---------------------------------
def test_resume_fences_a_live_publisher_instead_of_deleting_its_objects(every_store, trainer, tmp_path):
    """A restarted trainer resumes while the old one is between uploading step 3 and committing it. The old
    one's commit is refused (it is fenced), no manifest ever names a missing object, and the new one then
    publishes its own step 3, replacing the old one's uncommitted objects."""
    url, opts = every_store.url, every_store.options
    old_t, new_t = trainer(seed=6), trainer(seed=7)
    old = Publisher(url, storage_options=opts, snapshot_every=100, background=False)
    for step in range(3):
        old.publish(old_t.step(), step)
    resumed: list[Publisher] = []
    real_commit = old.store.commit_manifest

    def commit_after_takeover(data, etag):
        if not resumed:  # the old publisher has uploaded step 3's record and delta: now the restart happens
            resumed.append(Publisher(url, storage_options=opts, snapshot_every=100, background=False, resume=True))
        return real_commit(data, etag)

    old.store.commit_manifest = commit_after_takeover
    with pytest.raises(ConflictError, match="took the run over"):
        old.publish(old_t.step(), 3)
    with pytest.raises(ConflictError, match="fenced"):
        old.publish(old_t.step(), 4)
    report = verify(url, opts)
    assert report.problems == [] and report.head == 2
    new = resumed[0]
    state = new_t.step()
    new.publish(state, 3)  # its record and delta collide with the old one's leftovers: replaced under the fence
    new.close()
    w = Watcher(url, tmp_path / "dest", storage_options=opts)
    assert w.sync(timeout=30) == 3 and same_bits(w.tensors, state)
    assert verify(url, opts, deep=True).problems == []


def test_resume_after_a_crash_replaces_leftovers(file_run, trainer, tmp_path):
    """A publisher that crashed after uploading step 3's objects: the resumed one publishes another step 3."""
    t = trainer(seed=8)
    publish_steps(file_run.url, trainer, 3, seed=8)
    store = open_store(file_run.url)
    store.put_new("records/3.json", b'{"left": "by a crashed publisher"}')
    store.put_new("deltas/3-0.drd", b"torn")
    for _ in range(3):
        t.step()
    with Publisher(file_run.url, background=False, resume=True) as pub:
        state = t.step()
        pub.publish(state, 3)
    w = Watcher(file_run.url, tmp_path / "dest")
    assert w.sync(timeout=10) == 3 and same_bits(w.tensors, state)


# -- finding 11: a stale publisher is never told it owns the head -----------------------------------
def test_stale_publisher_is_not_told_it_owns_the_head(run_store, trainer):
    """B resumes, then A resumes (fencing B) and publishes step 3; B publishing identical content as step 3
    used to succeed ("our earlier write landed"); that shortcut now needs an unanswered write of B's own."""
    url, opts = run_store.url, run_store.options
    t = trainer(seed=9)
    publish_steps(url, trainer, 3, opts, seed=9)
    b = Publisher(url, storage_options=opts, background=False, resume=True)
    a = Publisher(url, storage_options=opts, background=False, resume=True)
    for _ in range(3):
        t.step()
    state = t.step()
    a.publish(state, 3)
    with pytest.raises(ConflictError, match="another publisher"):
        b.publish(state, 3)
    m = Manifest.parse(open_store(url, opts).read_manifest().data)
    assert m.head == 3 and m.writer == a.writer
    a.close()
    b.close()


def test_first_resumer_is_fenced_by_the_second(file_run, trainer):
    """Two restarts of one trainer: the later one owns the run, the earlier one can commit nothing."""
    t = trainer(seed=10)
    publish_steps(file_run.url, trainer, 2, seed=10)
    first = Publisher(file_run.url, background=False, resume=True)
    second = Publisher(file_run.url, background=False, resume=True)
    with pytest.raises(ConflictError, match="fenced"):
        first.publish(t.step(), 5)
    second.publish(t.step(), 5)
    assert Manifest.parse(open_store(file_run.url).read_manifest().data).head == 5


# -- background snapshots: retried, reported, re-armed ----------------------------------------------
def test_failed_background_snapshot_is_retried_and_reported(file_run, trainer, monkeypatch, caplog, tmp_path):
    """A snapshot whose upload fails every attempt no longer makes the next publish() raise, nor suppresses
    snapshots for snapshot_every steps: it is logged, counted, and the next step is snapshotted."""
    failing = {"on": True}
    real = LocalStore.put_new_stream  # snapshot files are streamed (put_immutable_stream)

    def put_new_stream(store, key, data, size, **kw):
        if failing["on"] and key.startswith("snapshots/") and not key.startswith("snapshots/0/"):
            raise OSError(5, "injected I/O error")
        return real(store, key, data, size, **kw)

    monkeypatch.setattr(LocalStore, "put_new_stream", put_new_stream)
    t = trainer(seed=11)
    pub = Publisher(file_run.url, snapshot_every=2, snapshot_attempts=2)
    pub.publish(t.step(), 0)
    pub.publish(t.step(), 1)
    with caplog.at_level(logging.ERROR):
        pub.publish(t.step(), 2)  # due: a background snapshot that fails both attempts
        pub._wait_background()
    assert pub.snapshot_failures == 1 and "injected I/O error" in pub.last_snapshot_error
    assert "background snapshot of step 2 failed" in caplog.text
    failing["on"] = False
    pub.publish(t.step(), 3)  # no exception; the failed snapshot is retried with this step
    pub._wait_background()
    m = Manifest.parse(open_store(file_run.url).read_manifest().data)
    assert [s.step for s in m.snapshots] == [0, 3]
    with pytest.raises(OSError, match="injected"):
        pub.flush()  # an explicit flush still hands over what went wrong
    pub.close()


def test_transient_background_snapshot_failure_is_retried(file_run, trainer, monkeypatch):
    calls = {"n": 0}
    real = LocalStore.put_new_stream  # snapshot files are streamed (put_immutable_stream)

    def put_new_stream(store, key, data, size, **kw):
        if key.startswith("snapshots/2/") and calls["n"] == 0:
            calls["n"] += 1
            raise OSError(5, "injected once")
        return real(store, key, data, size, **kw)

    monkeypatch.setattr(LocalStore, "put_new_stream", put_new_stream)
    t = trainer(seed=12)
    with Publisher(file_run.url, snapshot_every=2) as pub:
        for step in range(3):
            pub.publish(t.step(), step)
    assert pub.snapshot_failures == 0 and calls["n"] == 1
    assert [s.step for s in Manifest.parse(open_store(file_run.url).read_manifest().data).snapshots] == [0, 2]


def test_a_fresh_publisher_refuses_a_prefix_holding_a_dead_first_attempts_objects(tmp_path, trainer):
    """A publisher killed inside its first manifest commit leaves records/0.json (and snapshot files) and no
    manifest. A new run there used to fail at step 0 on every retry, blaming "another publisher owns the run
    (writer None, head None)": only a manifest proves a leftover replaceable. It is refused at construction,
    the leftovers named; once they are removed, a run starts."""
    url = f"file://{tmp_path}/run"
    dead = Publisher(url, background=False)
    dead.store.commit_manifest = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())  # killed mid-commit
    with pytest.raises(KeyboardInterrupt):
        dead.publish(trainer(seed=71).state(), 0)
    store = open_store(url)
    assert store.read_manifest() is None and "records/0.json" in store.list_run()
    with pytest.raises(ConflictError, match=r"records/0\.json.*died before its first commit"):
        Publisher(url, background=False)
    store.delete(sorted(store.list_run()))
    t = trainer(seed=72)
    with Publisher(url, background=False) as pub:
        pub.publish(t.state(), 0)
    w = Watcher(url, tmp_path / "w")
    assert w.sync() == 0 and same_bits(w.tensors, t.state())
