"""The relay in regional-snapshot mode on local stores (fast; the moto scenario is tests/test_crossregion.py):
no origin snapshot ever enters a region, the first regional manifest is committed only once the region
announces a snapshot its chain starts from, the manifest stays short as regional snapshots move on, and a
restarted relay resumes without a second bootstrap. Also relay.traffic's counts and the CLI's flags."""

from __future__ import annotations

import os

import pytest

import relay
from conftest import publish_steps, same_bits
from relay import cli
from relay.announce import read_announcement
from relay.fanout import Destination, Fanout
from relay.manifest import Manifest
from relay.store import LocalStore, open_store
from relay.traffic import CountingStore, kind_of, split

FAST = {"poll_interval": 0.02, "retry_initial": 0.02, "retry_max": 0.2}


class Watching(LocalStore):
    """A local region that records, at every manifest commit, whether the region could serve it then."""

    def __init__(self, url: str, root: str) -> None:
        super().__init__(url, root)
        self.unservable: list[int] = []
        self.commits = 0

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        if key == "manifest.json":
            from relay.fanout import servable_from

            self.commits += 1
            m = Manifest.parse(data)
            ann, _ = read_announcement(self)
            if not servable_from(m, ann):
                self.unservable.append(m.head)
        return super().commit_object(key, data, expected_etag)


def test_regional_mode_copies_no_snapshot_and_commits_only_servable_manifests(tmp_path, trainer):
    origin = f"file://{tmp_path}/origin/run"
    states = publish_steps(origin, trainer, 8)  # snapshots every 3 steps: 0, 3, 6
    root = tmp_path / "eu" / "run"
    os.makedirs(root)
    region = Watching(f"file://{root}", str(root))
    fan = Fanout(origin, [Destination("eu", region.url, store=region)], regional_snapshots=True,
                 workdir=tmp_path / "mat", **FAST)
    assert fan.sync_once(timeout=60)
    assert region.commits >= 1 and region.unservable == []  # never a manifest its readers cannot start from
    assert not region.list("snapshots/")
    ann, _ = read_announcement(region)
    assert ann is not None and [s.step for s in ann.snapshots] == [6]
    m = Manifest.parse(region.read_manifest().data)
    assert m.head == 7 and m.snapshots[0].step == 6  # trimmed to the regional snapshot
    st = fan.status()["regions"]["eu"]
    assert st["bytes_by_kind"]["snapshots"] == 0 and st["bootstrap_bytes_by_kind"]["snapshots"] > 0
    assert st["materialised_bytes_by_kind"]["regional_snapshots"] > 0 and st["materialiser"]["bootstraps"] == 1
    _, tensors, rec = relay.Reader(open_store(region.url)).reach(None, None, timeout=30)
    assert rec.step == 7 and same_bits(tensors, states[7])

    # The run goes on; a restarted relay (a new process: nothing held) resumes from the region's own snapshot.
    t = trainer(seed=3)
    for _ in range(8):
        t.step()
    with relay.Publisher(origin, snapshot_every=3, background=False, resume=True) as pub:
        for step in range(8, 14):
            states.append(t.step())
            pub.publish(states[step], step)
    again = Fanout(origin, [Destination("eu", region.url, store=region)], regional_snapshots=True,
                   workdir=tmp_path / "mat2", materialise_keep=2, **FAST)
    assert again.sync_once(timeout=60)
    st = again.status()["regions"]["eu"]
    assert st["bootstrap_bytes_by_kind"]["total"] == 0 and st["bytes_by_kind"]["snapshots"] == 0
    ann, _ = read_announcement(region)
    steps = [s.step for s in ann.snapshots]
    assert len(steps) == 2 and steps[-1] == Manifest.parse(open_store(origin).read_manifest().data).base
    m = Manifest.parse(region.read_manifest().data)
    assert m.snapshots[0].step <= steps[0] and region.unservable == []
    _, tensors, rec = relay.Reader(open_store(region.url)).reach(None, None, timeout=30)
    assert rec.step == 13 and same_bits(tensors, states[13])


def test_counting_store_splits_by_kind(tmp_path):
    store = CountingStore(open_store(f"file://{tmp_path}/run"))
    store.put_new("deltas/1-0.drd", b"d" * 10)
    store.put_new_stream("snapshots/0/model.safetensors", iter([b"s" * 5, b"s" * 5]), 10)
    store.commit_object("regional/snapshots.json", b"{}", None)
    store.commit_manifest(b"m" * 3, None)
    assert store.get("deltas/1-0.drd") == b"d" * 10
    assert b"".join(store.iter_chunks("snapshots/0/model.safetensors")) == b"s" * 10
    assert store.read_object("manifest.json") is not None
    got = store.read_manifest(if_none_match=store.read_manifest().etag)  # not modified: nothing counted
    assert got is not None and not hasattr(got, "data")
    w, r = split(store.written.bytes()), split(store.read.bytes())
    assert (w["deltas"], w["snapshots"], w["manifests"], w["total"]) == (10, 10, 5, 25)
    assert (r["deltas"], r["snapshots"], r["manifests"], r["chain"]) == (10, 10, 6, 10)
    assert [kind_of(k) for k in ("records/3.json", "regional/snapshots/4/a.safetensors", "regional/snapshots.json",
                                 "manifest.json")] == ["records", "regional_snapshots", "manifests", "manifests"]


def test_relay_cli_regional_snapshots_needs_a_workdir(tmp_path, capsys):
    rc = cli.main(["relay", "--source", f"file://{tmp_path}/o", "--dest", f"file://{tmp_path}/d", "--once",
                   "--regional-snapshots"])
    assert rc != 0 and "--workdir" in capsys.readouterr().err


def test_fanout_regional_snapshots_needs_a_workdir(tmp_path):
    with pytest.raises(ValueError, match="workdir"):
        Fanout(f"file://{tmp_path}/o", [Destination("d", f"file://{tmp_path}/d")], regional_snapshots=True)
