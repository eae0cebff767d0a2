"""A run whose snapshots are compressed objects (Publisher(snapshot_format="compressed")): the files
in the store are codec snapshot objects, the index says so, a watcher's DEST holds plain safetensors
bit for bit, `relay.verify` checks them deeply, and a damaged compressed file is refused by name."""

from __future__ import annotations

import json

import pytest

import codec
import relay
from relay import checkpoint
from relay.manifest import Manifest
from relay.store import open_store
from relay.verify import verify


def test_compressed_snapshots_end_to_end(file_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=5)
    with relay.Publisher(file_run.url, snapshot_every=3, snapshot_fraction=100.0,
                         snapshot_format="compressed") as pub:
        states = {}
        for step in range(1, 6):
            states[step] = {k: v.clone() for k, v in t.step().items()}
            pub.publish(states[step], step)
    store = open_store(file_run.url)
    m = Manifest.parse(store.read_manifest().data)
    assert [s.step for s in m.snapshots] == [1, 4]
    raw = sum(v.numel() * v.element_size() for v in states[4].values())
    for snap in m.snapshots:
        index = json.loads(store.get(snap.index.key))
        assert index["metadata"]["snapshot_format"] == "compressed"
        for f in snap.files:
            data = store.get(f.key)
            assert data[:4] == codec.SNAPSHOT_MAGIC and len(data) < 0.8 * raw
    w = relay.Watcher(file_run.url, tmp_path / "w")
    assert w.sync() == 5
    tensors, _ = checkpoint.load(tmp_path / "w")
    assert bits_equal(tensors, states[5])
    for shard in json.loads((tmp_path / "w" / checkpoint.INDEX_NAME).read_text())["weight_map"].values():
        assert checkpoint.snapshot_file_format((tmp_path / "w" / shard).resolve()) == "safetensors"
    report = verify(file_run.url, deep=True)
    assert report.ok, report.problems


def test_damaged_compressed_snapshot_is_refused_by_name(file_run, trainer, tmp_path):
    t = trainer(seed=6)
    with relay.Publisher(file_run.url, snapshot_every=100, snapshot_format="compressed") as pub:
        pub.publish(t.step(), 1)
    store = open_store(file_run.url)
    m = Manifest.parse(store.read_manifest().data)
    (f,) = m.snapshots[0].files
    data = bytearray(store.get(f.key))
    data[len(data) // 2] ^= 0x10
    # a forged file that keeps the manifest's tag cannot exist; show the reader's refusal on the file itself
    bad = tmp_path / "bad.drsn"
    bad.write_bytes(bytes(data))
    with pytest.raises(checkpoint.SafetensorsError, match=f.key):
        checkpoint.read_snapshot_file(bad, f.key)


def test_snapshot_format_is_checked():
    with pytest.raises(ValueError, match="snapshot_format"):
        relay.Publisher("memory://nowhere", snapshot_format="zip")


def test_cli_publish_writes_compressed_snapshots(file_run, trainer, bits_equal, tmp_path):
    from relay.cli import main

    state = trainer(seed=8).step()
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(state, path)
    assert main(["publish", file_run.url, str(path), "--step", "1", "--snapshot-format", "compressed"]) == 0
    store = open_store(file_run.url)
    (snap,) = Manifest.parse(store.read_manifest().data).snapshots
    assert all(store.get(f.key)[:4] == codec.SNAPSHOT_MAGIC for f in snap.files)
    assert main(["watch", file_run.url, "--dest", str(tmp_path / "w"), "--once"]) == 0
    assert bits_equal(checkpoint.load(tmp_path / "w")[0], state)


def test_resume_from_a_compressed_snapshot(file_run, trainer, bits_equal, tmp_path):
    """A publisher resuming reads the head's snapshot without a spool (streamed into tensors); compressed
    files decode from a temporary spool instead, and the run goes on bit-exact."""
    t = trainer(seed=7)
    with relay.Publisher(file_run.url, snapshot_every=2, snapshot_fraction=100.0, background=False,
                         snapshot_format="compressed") as pub:
        for step in range(1, 4):
            pub.publish(t.step(), step)
    with relay.Publisher(file_run.url, resume=True, snapshot_every=2, snapshot_format="compressed") as pub:
        assert pub.step == 3
        last = {k: v.clone() for k, v in t.step().items()}
        pub.publish(last, 4)
    w = relay.Watcher(file_run.url, tmp_path / "w")
    assert w.sync() == 4
    tensors, _ = checkpoint.load(tmp_path / "w")
    assert bits_equal(tensors, last)


def test_rebase_keeps_the_runs_snapshot_format_and_races_a_publisher_without_a_conflict(file_run, trainer):
    """A compressed-format publisher uploads a due snapshot right after committing its step; a rebase of that
    head landing in between used to write safetensors under the same keys, and the publisher's create-only
    upload then raised ConflictError to the trainer (the error of a fenced publisher). Rebase writes the run's
    own format: the same bytes, so neither side conflicts."""
    from relay import ops

    t = trainer(seed=5)
    pub = relay.Publisher(file_run.url, snapshot_every=3, background=False, snapshot_format="compressed")
    store_type = type(pub.store)
    original = store_type.commit_manifest
    armed = {"step": None}

    def commit_then_rebase(self, data, etag):
        tag = original(self, data, etag)
        m = Manifest.parse(data)
        if armed["step"] is not None and m.head == armed["step"] and m.snapshot(m.head) is None:
            armed["step"] = None
            assert ops.rebase(file_run.url) == m.head
        return tag

    store_type.commit_manifest = commit_then_rebase
    try:
        for step in range(6):
            armed["step"] = 3 if step == 3 else None
            pub.publish(t.state() if step == 0 else t.step(), step)  # raised ConflictError at step 3
    finally:
        store_type.commit_manifest = original
        pub.close()
    store = open_store(file_run.url)
    m = Manifest.parse(store.read_manifest().data)
    assert m.head == 5 and 3 in [s.step for s in m.snapshots]
    assert json.loads(store.get(m.snapshot(3).index.key))["metadata"]["snapshot_format"] == "compressed"
    assert verify(file_run.url, deep=True).ok
