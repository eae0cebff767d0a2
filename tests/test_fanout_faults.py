"""The regional relay (relay/fanout.py) in the cases an adversarial review found uncovered (docs/RELIABILITY.md
has each finding, before and after)."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time

import relay
from relay.fanout import Destination, Fanout
from relay.manifest import Manifest
from relay.signing import generate_keypair
from relay.store import LocalStore, open_store

FAST = {"poll_interval": 0.02, "retry_initial": 0.02, "retry_max": 0.2}


def origin_manifest(url: str) -> Manifest:
    return Manifest.parse(open_store(url).read_manifest().data)


class Recording(LocalStore):
    """A local region that remembers the largest object body it ever handed out in one read."""

    def __init__(self, url: str, root: str) -> None:
        super().__init__(url, root)
        self.largest = 0

    def get(self, key: str) -> bytes:
        data = super().get(key)
        self.largest = max(self.largest, len(data))
        return data

    def get_at_most(self, key: str, limit: int) -> bytes:
        data = super().get_at_most(key, limit)
        self.largest = max(self.largest, len(data))
        return data


def test_a_huge_object_planted_at_a_key_the_relay_will_write_is_not_read_whole(trainer, tmp_path):
    """SECURITY.md: 'an object a bucket writer swapped for a huge one costs a reader one byte more than the object
    it wanted'. A regional bucket writer plants a 16 MiB object at the next step's delta key: the relay's create-only
    write collides, and Store.put_immutable (reached through CountingStore) read the whole planted object into
    memory to compare it (memory and bytes moved grew with a size the attacker picks); it reads one byte past ours."""
    origin = f"file://{tmp_path}/origin/run"
    root = tmp_path / "region" / "run"
    root.mkdir(parents=True)
    region = Recording(f"file://{root}", str(root))
    t = trainer(seed=70)
    pub = relay.Publisher(origin, snapshot_every=100, background=False)
    for step in range(3):
        pub.publish(t.step(), step)
    fan = Fanout(origin, [Destination("r", region.url, store=region)], **FAST)
    assert fan.sync_once(timeout=20)
    pub.publish(t.step(), 3)
    ref = origin_manifest(origin).step(3).parts[0].ref
    region.put_new(ref.key, b"\0" * (16 << 20))  # the attacker's object, there before the relay copies
    region.largest = 0
    assert fan.sync_once(timeout=20)
    assert region.get(ref.key) == open_store(origin).get(ref.key)  # replaced, as it should be
    assert region.largest <= max(ref.size + 1, 1 << 16), (
        f"the relay read {region.largest} bytes of a planted object whose reference is {ref.size} bytes")


class Breakable(LocalStore):
    """A local region whose writes start failing when `broken` is set (bucket recreated without the relay's grant,
    a flaky link that only reads get through)."""

    broken = False

    def put_new(self, key: str, data: bytes) -> None:
        if self.broken:
            raise PermissionError(f"{self.url}/{key}: access denied")
        super().put_new(key, data)

    def commit_object(self, key: str, data: bytes, expected_etag: str | None) -> str:
        if self.broken:
            raise PermissionError(f"{self.url}/{key}: access denied")
        return super().commit_object(key, data, expected_etag)


def test_an_emptied_region_that_cannot_be_reseeded_is_not_reported_synced(trainer, tmp_path):
    """The region is emptied while the origin is idle, and its re-seed keeps failing: the region holds nothing,
    yet status() kept `synced: True` (synced_etag was never cleared when the region was found emptied), next to
    head None."""
    origin = f"file://{tmp_path}/origin/run"
    root = tmp_path / "region" / "run"
    root.mkdir(parents=True)
    region = Breakable(f"file://{root}", str(root))
    t = trainer(seed=71)
    pub = relay.Publisher(origin, snapshot_every=2, background=False)
    for step in range(3):
        pub.publish(t.step(), step)
    fan = Fanout(origin, [Destination("r", region.url, store=region)], recheck_interval=0.05, **FAST)
    th = threading.Thread(target=fan.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 20
        while not (fan.status()["regions"]["r"]["synced"] and fan.status()["regions"]["r"]["head"] == 2):
            assert time.monotonic() < deadline, fan.status()["regions"]["r"]
            time.sleep(0.02)
        region.broken = True
        shutil.rmtree(root)
        root.mkdir()
        while fan.status()["regions"]["r"]["failures"] < 2:
            assert time.monotonic() < deadline, fan.status()["regions"]["r"]
            time.sleep(0.02)
        st = fan.status()["regions"]["r"]
    finally:
        fan.stop()
        th.join(10)
    assert open_store(region.url).read_manifest() is None  # the region serves nothing
    assert st["head"] is None
    assert not st["synced"], st


def test_a_refused_origin_manifest_is_not_downloaded_again_every_poll(trainer, tmp_path):
    """With trusted keys, a bucket writer replaces the origin manifest with an unsigned one (up to 64 MiB). The
    relay refused it, but remembered only the etag of the last manifest it accepted, so every poll downloaded the
    refused manifest in full again (and logged the refusal again): origin egress grew with poll count times a
    size the attacker picks. The refused version's etag is remembered now, and its error shown in status()."""
    origin = f"file://{tmp_path}/origin/run"
    _key, pub_key, _kid = generate_keypair(tmp_path / "keys" / "a")
    t = trainer(seed=72)
    with relay.Publisher(origin, snapshot_every=3, background=False, signing_key=_key) as pub:
        for step in range(2):
            pub.publish(t.step(), step)
    fan = Fanout(origin, [Destination("r", f"file://{tmp_path}/eu/run")], trusted_keys=[pub_key], **FAST)
    assert fan.poll_source()
    store = open_store(origin)
    forged = dataclasses.replace(origin_manifest(origin), signatures=()).to_bytes()
    store.commit_manifest(forged, store.read_manifest().etag)
    before = fan.source.read.bytes()["manifests"]
    for _ in range(10):
        assert not fan.poll_source()
    read = fan.source.read.bytes()["manifests"] - before
    assert read <= len(forged), f"{read} bytes read for a {len(forged)}-byte refused manifest over 10 polls"
