"""Regional relay hardening (adversarial review): the relay never commits a regional manifest naming bytes it has
not checked against it (a new run at the origin prefix), it repairs a regional manifest that does not verify under
its trusted keys, and with keys it does not switch a region to another run unless told to."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import pytest

import relay
from relay.cli import main as cli_main
from relay.fanout import Destination, Fanout
from relay.manifest import Manifest, ObjRef, Step, delta_key, record_key
from relay.publisher import Publisher
from relay.signing import Signer, generate_keypair
from relay.store import open_store
from relay.verify import verify

from conftest import same_bits

FAST = {"poll_interval": 0.02, "retry_initial": 0.02, "retry_max": 0.2}


@pytest.fixture
def keys(tmp_path):
    """Two key pairs, 'a' (the trainer's) and 'b' (an attacker's): {name: (key path, pub path, key id)}."""
    return {name: generate_keypair(tmp_path / "keys" / name) for name in ("a", "b")}


def publish_run(url: str, trainer, seed: int, steps: int, options: dict | None = None, **kw) -> dict:
    """A fresh run of `steps` steps at `url`; returns the head's state."""
    t = trainer(seed=seed)
    state = None
    with Publisher(url, storage_options=options, snapshot_every=3, background=False, **kw) as pub:
        for step in range(steps):
            state = t.step()
            pub.publish(state, step)
    return state


def wipe(url: str) -> None:
    shutil.rmtree(Path(url.removeprefix("file://")))


def manifest_of(url: str, options: dict | None = None) -> Manifest:
    return Manifest.parse(open_store(url, options).read_manifest().data)


def assert_region_is(url: str, state: dict, head: int, tmp: Path, options: dict | None = None, **keys) -> None:
    """What a fresh host sees: the exact head, and a store `verify` finds nothing wrong with."""
    w = relay.Watcher(url, tmp, storage_options=options, retry_max=0.2, **keys)
    assert w.sync(timeout=20) == head
    assert same_bits(w.tensors, state)
    report = verify(url, options, trusted_keys=keys.get("trusted_keys"))
    assert report.ok, report.problems


# -- finding 3: a new run at the origin prefix ------------------------------------------------------------
@pytest.mark.parametrize("restart", [False, True], ids=["same-relay", "restarted-relay"])
def test_new_run_at_the_origin_replaces_the_regional_run_bit_exact(trainer, tmp_path, restart):
    """Records and same-architecture shards have equal sizes across runs: before the fix a size match counted
    as present (restarted relay) and the source cache answered by key (same relay), so run B's manifest went
    out naming run A's bytes and fresh watchers failed."""
    origin = f"file://{tmp_path}/origin/run"
    dest = Destination("eu", f"file://{tmp_path}/eu/run")
    publish_run(origin, trainer, seed=1, steps=5)
    fan = Fanout(origin, [dest], **FAST)
    assert fan.sync_once(timeout=20)
    run_a = manifest_of(dest.url).run

    wipe(origin)
    state_b = publish_run(origin, trainer, seed=2, steps=5)
    run_b = manifest_of(origin).run
    assert run_b != run_a
    if restart:
        fan = Fanout(origin, [dest], **FAST)
    assert fan.sync_once(timeout=20)
    assert manifest_of(dest.url).run == run_b
    assert_region_is(dest.url, state_b, 4, tmp_path / "w")


def test_new_run_reaches_an_s3_region_bit_exact(moto_regions, trainer, tmp_path):
    """The same over S3 (listing sizes from a real ListObjectsV2, create-only PUTs on collision)."""
    west = moto_regions("eu-west-1")
    origin = f"file://{tmp_path}/origin/run"
    url = f"s3://{west.new_bucket('west')}/run"
    publish_run(origin, trainer, seed=3, steps=4)
    assert Fanout(origin, [Destination("w", url, west.options)], **FAST).sync_once(timeout=30)
    wipe(origin)
    state_b = publish_run(origin, trainer, seed=4, steps=4)
    fan = Fanout(origin, [Destination("w", url, west.options)], **FAST)
    assert fan.sync_once(timeout=30)
    assert manifest_of(url, west.options).run == manifest_of(origin).run
    assert_region_is(url, state_b, 3, tmp_path / "w", west.options)


def test_damaged_regional_object_of_the_right_size_is_replaced_on_restart(trainer, tmp_path):
    """A listed object of the right size is read back (in region) and checked once; a mismatching one is
    replaced from the origin rather than trusted for its size."""
    origin = f"file://{tmp_path}/origin/run"
    dest = Destination("eu", f"file://{tmp_path}/eu/run")
    state = publish_run(origin, trainer, seed=5, steps=4)
    assert Fanout(origin, [dest], **FAST).sync_once(timeout=20)
    m = manifest_of(dest.url)
    shard = tmp_path / "eu/run" / m.snapshots[-1].files[0].key
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # same size, other bytes
    fan = Fanout(origin, [dest], **FAST)
    assert fan.sync_once(timeout=20)
    assert shard.read_bytes() == good
    assert fan.status()["regions"]["eu"]["objects_copied"] == 1  # only the damaged one crossed again
    assert_region_is(dest.url, state, 3, tmp_path / "w")


# -- finding 9: a forged regional manifest ---------------------------------------------------------------
def forged_ahead(store, m: Manifest, head: int) -> Manifest:
    """`m` claiming step `head` (the real head's record and delta copied under step `head`'s keys in `store`):
    parses, but is not the publisher's."""
    delta = next(s for s in reversed(m.steps) if s.parts)

    def renumbered(ref: ObjRef, key: str) -> ObjRef:
        store.put_new(key, store.get(ref.key))
        return dataclasses.replace(ref, key=key)

    record = renumbered(delta.record, record_key(head))
    parts = tuple(dataclasses.replace(p, ref=renumbered(p.ref, delta_key(head, i))) for i, p in enumerate(delta.parts))
    return dataclasses.replace(m, head=head, steps=[*m.steps, Step(head, record, m.head, parts)], signatures=())


@pytest.mark.parametrize("forgery", ["other-key", "unsigned", "garbage"])
def test_forged_regional_manifest_is_repaired_with_keys(trainer, keys, tmp_path, caplog, forgery):
    """Before the fix the relay never verified the regional manifest: one claiming head 1000 was 'ahead of the
    origin' and left in place while sync_once reported success, freezing every keyed watcher of the region."""
    origin = f"file://{tmp_path}/origin/run"
    dest = Destination("eu", f"file://{tmp_path}/eu/run")
    trusted = [keys["a"][1]]
    publish_run(origin, trainer, seed=6, steps=4, signing_key=keys["a"][0])
    assert Fanout(origin, [dest], trusted_keys=trusted, **FAST).sync_once(timeout=20)
    region = open_store(dest.url)
    fake = forged_ahead(region, manifest_of(dest.url), 1000)
    data = {"other-key": fake.to_bytes(signer=Signer(keys["b"][0])), "unsigned": fake.to_bytes(),
            "garbage": b'{"format": "deltarelay.manifest", "head": 10'}[forgery]
    region.commit_manifest(data, region.read_manifest().etag)

    t = trainer(seed=6)
    for _ in range(4):
        t.step()
    with Publisher(origin, snapshot_every=3, background=False, resume=True, signing_key=keys["a"][0]) as pub:
        state = t.step()
        pub.publish(state, 4)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="relay.fanout"):
        assert Fanout(origin, [dest], trusted_keys=trusted, **FAST).sync_once(timeout=20)
    assert region.read_manifest().data == open_store(origin).read_manifest().data
    assert "replacing it" in caplog.text
    assert "ahead of the origin" not in caplog.text
    assert_region_is(dest.url, state, 4, tmp_path / "w", trusted_keys=trusted)


def test_genuine_regional_manifest_ahead_of_a_replayed_origin_is_kept(trainer, keys, tmp_path, caplog):
    """The other side of the repair: a regional manifest that verifies is never moved back by a replayed older
    origin manifest (the rollback rule), keys or not."""
    origin = f"file://{tmp_path}/origin/run"
    dest = Destination("eu", f"file://{tmp_path}/eu/run")
    trusted = [keys["a"][1]]
    publish_run(origin, trainer, seed=7, steps=2, signing_key=keys["a"][0])
    store = open_store(origin)
    old = store.read_manifest().data
    t = trainer(seed=7)
    for _ in range(2):
        t.step()
    with Publisher(origin, snapshot_every=3, background=False, resume=True, signing_key=keys["a"][0]) as pub:
        for step in range(2, 4):
            pub.publish(t.step(), step)
    assert Fanout(origin, [dest], trusted_keys=trusted, **FAST).sync_once(timeout=20)
    held = open_store(dest.url).read_manifest().data
    store.commit_manifest(old, store.read_manifest().etag)
    with caplog.at_level(logging.WARNING, logger="relay.fanout"):
        assert Fanout(origin, [dest], trusted_keys=trusted, **FAST).sync_once(timeout=20)
    assert open_store(dest.url).read_manifest().data == held
    assert "ahead of the origin" in caplog.text


# -- replayed genuine manifest of another run ----------------------------------------------------------
def replay_setup(trainer, keys, tmp_path) -> tuple[str, Destination, bytes, dict]:
    """Region on signed run B; then the origin shows a genuine signed manifest (and objects) of older run A."""
    origin = f"file://{tmp_path}/origin/run"
    dest = Destination("eu", f"file://{tmp_path}/eu/run")
    publish_run(origin, trainer, seed=8, steps=4, signing_key=keys["a"][0])
    saved = tmp_path / "run-a"
    shutil.copytree(tmp_path / "origin/run", saved)
    wipe(origin)
    state_b = publish_run(origin, trainer, seed=9, steps=3, signing_key=keys["a"][0])
    assert Fanout(origin, [dest], trusted_keys=[keys["a"][1]], replace_runs=True, **FAST).sync_once(timeout=20)
    held = open_store(dest.url).read_manifest().data
    wipe(origin)
    shutil.copytree(saved, tmp_path / "origin/run")  # the attacker restores run A, manifest and objects
    return origin, dest, held, state_b


def test_replayed_signed_manifest_of_another_run_does_not_switch_the_region(trainer, keys, tmp_path, caplog):
    """Before the fix the relay replaced the region's run B with the replayed run A and reported success."""
    origin, dest, held, state_b = replay_setup(trainer, keys, tmp_path)
    fan = Fanout(origin, [dest], trusted_keys=[keys["a"][1]], **FAST)
    with caplog.at_level(logging.ERROR, logger="relay.fanout"):
        assert not fan.sync_once(timeout=20)
    assert open_store(dest.url).read_manifest().data == held
    st = fan.status()["regions"]["eu"]
    assert st["errors"] >= 1 and "another run" in st["last_error"] and not st["synced"]
    assert "another run" in caplog.text and "--replace-run" in caplog.text
    assert_region_is(dest.url, state_b, 2, tmp_path / "w", trusted_keys=[keys["a"][1]])


def test_run_switch_with_keys_when_told_to(trainer, keys, tmp_path):
    origin, dest, held, _ = replay_setup(trainer, keys, tmp_path)
    assert Fanout(origin, [dest], trusted_keys=[keys["a"][1]], replace_runs=True, **FAST).sync_once(timeout=20)
    assert open_store(dest.url).read_manifest().data == open_store(origin).read_manifest().data != held


def test_run_switch_cli_flag(trainer, keys, tmp_path, capsys):
    origin, dest, held, _ = replay_setup(trainer, keys, tmp_path)
    base = ["relay", "--source", origin, "--dest", dest.url, "--once", "--poll-interval", "0.02", "--timeout", "20",
            "--trusted-key", str(keys["a"][1])]
    assert cli_main(base) == 2
    assert "another run" in capsys.readouterr().out
    assert open_store(dest.url).read_manifest().data == held
    assert cli_main(base + ["--replace-run"]) == 0
    assert open_store(dest.url).read_manifest().data == open_store(origin).read_manifest().data


def test_without_keys_a_new_run_replaces_the_region_by_default(trainer, tmp_path):
    """No keys, no way to tell a replay from a new run: the origin is authoritative (finding 3's case)."""
    origin = f"file://{tmp_path}/origin/run"
    dest = Destination("eu", f"file://{tmp_path}/eu/run")
    publish_run(origin, trainer, seed=10, steps=2)
    assert Fanout(origin, [dest], **FAST).sync_once(timeout=20)
    wipe(origin)
    state = publish_run(origin, trainer, seed=11, steps=3)
    assert Fanout(origin, [dest], **FAST).sync_once(timeout=20)
    assert_region_is(dest.url, state, 2, tmp_path / "w")


def test_a_refused_region_waits_for_the_next_origin_version_instead_of_spinning(trainer, keys, tmp_path):
    """In `run()`, a refusal is counted once per origin version (and recheck), not retried every poll."""
    import threading
    import time

    origin, dest, held, _ = replay_setup(trainer, keys, tmp_path)
    fan = Fanout(origin, [dest], trusted_keys=[keys["a"][1]], recheck_interval=30, **FAST)
    th = threading.Thread(target=fan.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 10
        while fan.status()["regions"]["eu"]["errors"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # 25 polls
        st = fan.status()["regions"]["eu"]
    finally:
        fan.stop()
        th.join(10)
    assert st["errors"] == 1 and st["run_refused"] and not st["synced"]
    assert open_store(dest.url).read_manifest().data == held


# -- cost ------------------------------------------------------------------------------------------------
def test_a_run_that_becomes_signed_is_checked_in_region_not_copied_again(trainer, keys, tmp_path):
    """The first signed commit adds a SHA-256 to every reference: what the region holds is read back in the region
    and checked against it, and only the new step's objects cross from the origin."""
    origin = f"file://{tmp_path}/origin/run"
    dest = Destination("eu", f"file://{tmp_path}/eu/run")
    t = trainer(seed=12)
    with Publisher(origin, snapshot_every=100, background=False) as pub:
        for step in range(3):
            pub.publish(t.step(), step)
    fan = Fanout(origin, [dest], **FAST)
    assert fan.sync_once(timeout=20)
    before = fan.status()["regions"]["eu"]
    with Publisher(origin, snapshot_every=100, background=False, resume=True, signing_key=keys["a"][0],
                   adopt_unsigned=True) as pub:
        state = t.step()
        pub.publish(state, 3)
    assert fan.sync_once(timeout=20)
    after = fan.status()["regions"]["eu"]
    m = manifest_of(origin)
    assert after["objects_copied"] - before["objects_copied"] == 1 + len(m.step(3).parts)  # record and delta(s)
    assert after["bytes_read_back"] - before["bytes_read_back"] == sum(
        r.size for r in m.refs() if not r.key.startswith(("records/3.", "deltas/3-")))
    assert open_store(dest.url).read_manifest().data == open_store(origin).read_manifest().data
    assert_region_is(dest.url, state, 3, tmp_path / "w", trusted_keys=[keys["a"][1]])
