"""Objects the manifest names but the store lacks (replication lag, removal) and objects that fail
verification: the watcher waits, never skips, never applies part of a chain, then converges."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import relay
from relay.manifest import Manifest
from relay.store import open_store


def replicate(src_region, src_bucket, dst_region, dst_bucket, keys):
    """What S3 replication does, one object at a time, in the order given (it guarantees none)."""
    src, dst = src_region.client(), dst_region.client()
    for key in keys:
        body = src.get_object(Bucket=src_bucket, Key=key)["Body"].read()
        dst.put_object(Bucket=dst_bucket, Key=key, Body=body)


def all_keys(region, bucket):
    out = []
    for page in region.client().get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def test_cross_region_manifest_arrives_before_its_objects(moto_regions, trainer, bits_equal, tmp_path):
    east, west = moto_regions("us-east-1"), moto_regions("eu-west-1")
    src, dst = east.new_bucket("train"), west.new_bucket("serve")
    t = trainer(seed=20)
    pub = relay.Publisher(f"s3://{src}/run", storage_options=east.options, snapshot_every=100)
    for step in range(4):
        pub.publish(t.step(), step)
    replicate(east, src, west, dst, all_keys(east, src))
    w = relay.Watcher(f"s3://{dst}/run", tmp_path / "w", storage_options=west.options,
                      retry_initial=0.02, retry_max=0.1)
    assert w.sync() == 3

    for step in range(4, 7):
        pub.publish(t.step(), step)
    pub.close()
    replicated = set(all_keys(west, dst))
    lagging = [k for k in all_keys(east, src) if k not in replicated and k != "run/manifest.json"]
    assert len(lagging) == 6  # deltas and records of steps 4..6
    replicate(east, src, west, dst, ["run/manifest.json", *lagging[:2]])  # the manifest overtakes its objects

    with pytest.raises(relay.SyncTimeout, match="still missing|waiting for"):
        w.sync(timeout=0.3)
    assert w.step == 3 and (tmp_path / "w" / "relay-state.json").read_text().count('"step": 3') == 1

    done = {}
    th = threading.Thread(target=lambda: done.setdefault("step", w.sync(timeout=30)))
    th.start()
    time.sleep(0.3)
    assert th.is_alive() and w.step == 3  # waiting, not skipping
    replicate(east, src, west, dst, lagging[2:])
    th.join(30)
    assert done["step"] == 6
    assert bits_equal(w.tensors, t.state())


def test_removed_object_is_waited_for_then_used(s3_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=21)
    with relay.Publisher(s3_run.url, storage_options=s3_run.options, snapshot_every=100) as pub:
        for step in range(3):
            pub.publish(t.step(), step)
        w = relay.Watcher(s3_run.url, tmp_path / "w", storage_options=s3_run.options, retry_initial=0.02,
                          retry_max=0.1)
        assert w.sync() == 2
        for step in range(3, 6):
            pub.publish(t.step(), step)
    store = open_store(s3_run.url, s3_run.options)
    kept = store.get("deltas/4-0.drd")
    store.delete(["deltas/4-0.drd"])
    with pytest.raises(relay.SyncTimeout, match="deltas/4-0.drd"):
        w.sync(timeout=0.3)
    assert w.step == 2  # steps 3 was available, but a partial chain is never applied
    store.put_new("deltas/4-0.drd", kept)
    assert w.sync(timeout=10) == 5
    assert bits_equal(w.tensors, t.state())


def test_corrupt_delta_is_refetched_then_routed_around(file_run, trainer, bits_equal, tmp_path, caplog):
    t = trainer(seed=22)
    with relay.Publisher(file_run.url, snapshot_every=3, background=False) as pub:
        for step in range(2):
            pub.publish(t.step(), step)
        w = relay.Watcher(file_run.url, tmp_path / "w")
        assert w.sync() == 1
        for step in range(2, 6):
            pub.publish(t.step(), step)
    root = file_run.url.removeprefix("file://")
    path = f"{root}/deltas/2-0.drd"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    caplog.set_level(logging.WARNING, logger="relay")
    assert w.sync() == 5  # snapshot 3 plus deltas 4, 5
    assert bits_equal(w.tensors, t.state())
    text = caplog.text
    assert "discarding and refetching" in text and "snapshot fallback" in text and "deltas/2-0.drd" in text


def test_no_verified_path_keeps_last_good_step(file_run, trainer, tmp_path):
    t = trainer(seed=23)
    with relay.Publisher(file_run.url, snapshot_every=100, background=False) as pub:
        pub.publish(t.step(), 0)
        w = relay.Watcher(file_run.url, tmp_path / "w")
        assert w.sync() == 0
        pub.publish(t.step(), 1)
    root = file_run.url.removeprefix("file://")
    open(f"{root}/deltas/1-0.drd", "wb").write(b"garbage")
    with pytest.raises(relay.SyncError, match="no verified path"):
        w.sync()
    assert w.step == 0
    w.close()  # one watcher per DEST: restart it to read what it holds
    assert relay.Watcher(file_run.url, tmp_path / "w").step == 0


def test_run_loop_polls_and_follows(s3_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=24)
    pub = relay.Publisher(s3_run.url, storage_options=s3_run.options)
    pub.publish(t.step(), 0)
    seen = []
    reached = threading.Event()

    def on_update(step, tensors):
        seen.append(step)
        if step == 3:
            reached.set()

    w = relay.Watcher(s3_run.url, tmp_path / "w", storage_options=s3_run.options, poll_interval=0.02,
                      on_update=on_update)
    th = threading.Thread(target=w.run, daemon=True)
    th.start()
    for step in range(1, 4):
        time.sleep(0.05)
        pub.publish(t.step(), step)
    pub.close()
    assert reached.wait(20)
    w.stop()
    th.join(5)
    assert seen[0] >= 0 and seen[-1] == 3 and seen == sorted(seen)
    assert bits_equal(w.tensors, t.state())


def test_manifest_poll_is_conditional(s3_run, trainer):
    t = trainer(seed=25)
    with relay.Publisher(s3_run.url, storage_options=s3_run.options) as pub:
        pub.publish(t.step(), 0)
    store = open_store(s3_run.url, s3_run.options)
    got = store.read_manifest()
    assert got.etag.strip('"') and Manifest.parse(got.data).head == 0
    from relay.store import NOT_MODIFIED

    assert store.read_manifest(if_none_match=got.etag) is NOT_MODIFIED  # a 304, no body


def _held_at_1_with_delta_2_lost(file_run, t, tmp_path, reroute_after: float):
    """A watcher holding step 1 of a run published to step 4 (snapshots 0 and 3) whose delta 2 is gone for
    good (a replication that failed): (the trainer, the watcher)."""
    with relay.Publisher(file_run.url, snapshot_every=3, background=False) as pub:
        for step in range(2):
            pub.publish(t.step(), step)
        w = relay.Watcher(file_run.url, tmp_path / "w", retry_initial=0.02, retry_max=0.05,
                          reroute_after=reroute_after)
        assert w.sync() == 1
        for step in range(2, 5):
            pub.publish(t.step(), step)
    open_store(file_run.url).delete(["deltas/2-0.drd"])
    return t, w


def test_long_missing_object_reroutes_through_a_snapshot(file_run, trainer, bits_equal, tmp_path, caplog):
    t, w = _held_at_1_with_delta_2_lost(file_run, trainer(seed=26), tmp_path, reroute_after=0.2)
    caplog.set_level(logging.WARNING, logger="relay")
    assert w.sync(timeout=10) == 4  # snapshot 3 and delta 4, after waiting reroute_after for step 2
    assert bits_equal(w.tensors, t.state())
    assert "looking for another complete path" in caplog.text


def test_short_syncs_still_reroute_once_an_object_has_been_missing_long_enough(file_run, trainer, bits_equal,
                                                                                tmp_path):
    """A host that syncs with a timeout shorter than reroute_after (between rollouts, say) counts the
    time an object has been missing across its calls: it must not wait for it forever."""
    t, w = _held_at_1_with_delta_2_lost(file_run, trainer(seed=27), tmp_path, reroute_after=0.4)
    timeouts = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            assert w.sync(timeout=0.15) == 4
            break
        except relay.SyncTimeout:
            timeouts += 1
            assert w.step == 1
    assert w.step == 4 and timeouts >= 2  # it did time out before reroute_after, then rerouted
    assert bits_equal(w.tensors, t.state())
