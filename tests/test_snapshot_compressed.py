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
