"""The operator commands (relay/ops.py, relay/verify.py, relay/announce.py) in the cases an adversarial review
found uncovered (docs/RELIABILITY.md has each finding, before and after). Each test states what PROTOCOL.md /
SECURITY.md promise and drives the real command into the case.
"""

from __future__ import annotations

import relay.checkpoint
import relay.manifest
from relay import ops
from relay.announce import ANNOUNCE_KEY, Announcement
from relay.checkpoint import index_bytes_of
from relay.manifest import Manifest, ObjRef
from relay.publisher import Publisher
from relay.regional import Materialiser
from relay.signing import generate_keypair
from relay.store import open_store
from relay.verify import verify
from relay.watcher import Reader, SyncError, Watcher

import pytest

from test_regional import start_run


# -- 1. gc trims to a snapshot whose *record* never arrived ----------------------------------------------------
def test_gc_does_not_trim_to_a_snapshot_whose_record_never_arrived(tmp_path, trainer, bits_equal):
    """A CRR region where the newest snapshot's files arrived but its step's record did not (S3 does not retry a
    failed replication). A reader there starts from snapshot 3 and the chain (intermediate records are never
    downloaded), so the region serves the head. servable_floor() counts snapshot 6 as a start because its index
    and files are present, without its record, which a start from 6 needs: gc --keep-snapshots 1 trims to 6 and
    deleted snapshot 3 and the chain from it, and the region had no path to the head any more. A start
    needs its record (and its chain's objects) present too."""
    run = start_run(tmp_path, trainer, "rec")
    run.publish(range(8))  # trainer snapshots 0, 3, 6; head 7
    run.pub.close()
    lost = "records/6.json"
    for key in sorted(run.src.list_run()):
        if key != lost:
            run.dst.put_immutable(key, run.src.get(key))
    run.dst.delete([lost])  # run.publish() replicated it: take it out again, it never arrived
    run.dst.commit_manifest(run.src.read_manifest().data, run.dst.read_manifest().etag)
    assert lost not in run.dst.list_run()
    _, got, rec = Reader(run.dst, reroute_after=0.5).reach(None, None, timeout=30)
    assert rec.step == 7 and bits_equal(got, run.states[7])  # premise: the region serves the head before gc

    ops.gc(run.region, 1)
    _, got, rec = Reader(run.dst, reroute_after=0.5).reach(None, None, timeout=10)
    assert rec.step == 7 and bits_equal(got, run.states[7])


# -- 2. verify --trusted-key calls a region sound that no trusting reader can start in ---------------------------
def test_verify_with_trusted_keys_flags_regional_snapshots_a_trusting_reader_refuses(tmp_path, trainer,
                                                                                     monkeypatch):
    """A signed run whose records carry no BLAKE3 (published before it existed), in a region that keeps only its
    own snapshots. A watcher with trusted keys refuses every regional snapshot (PROTOCOL §6 item 5: every tensor
    it takes needs a `blake3` in the record) and has no path at all; `verify --deep --trusted-key`, the check an
    operator runs as such a reader, reported the region sound (mismatches() skips tensors without blake3)."""
    import relay.publisher

    real = relay.publisher.tensor_infos
    monkeypatch.setattr(relay.publisher, "tensor_infos", lambda t, like=None, strong=False: real(t, like))
    monkeypatch.setattr(Publisher, "_blake3_of", lambda self, target, found: {})
    key, pub, _ = generate_keypair(tmp_path / "trainer")
    run = start_run(tmp_path, trainer, "old", signing_key=key)
    run.publish(range(4))
    run.pub.close()
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, trusted_keys=[pub]) as mat:
        assert mat.sync_once(timeout=60) and mat.status()["regional_snapshots"] == [3]
    with Watcher(run.region, tmp_path / "trusting", trusted_keys=[pub], retry_initial=0.05, retry_max=0.2) as w:
        # premise: a trusting reader has no path in this region (the regional snapshot refused, the trainer's
        # absent: waited for, in vain)
        with pytest.raises(SyncError, match="no verified path|snapshots/3/"):
            w.sync(timeout=5)
    report = verify(run.region, deep=True, trusted_keys=[pub])
    assert not report.ok, report.text()


# -- 3. rebase writes the newest snapshot's format, not the live publisher's ----------------------------------
def test_rebase_racing_a_publisher_that_changed_snapshot_format_does_not_break_it(file_run, trainer):
    """rebase picks its snapshot format from the run's newest snapshot so that a publisher snapshotting the same
    step "writes the same bytes under the same keys, and neither sees a conflict" (ops.rebase). A publisher
    resumed with --snapshot-format compressed on a run whose snapshots so far are safetensors: its first due
    snapshot is compressed, the newest committed one safetensors. A rebase landing between that step's commit
    and its snapshot upload writes safetensors under snapshots/3/, and the trainer's publish() raised
    ConflictError (create-only collision at a step <= its head). The rebase's snapshot is kept instead."""
    url = file_run.url
    t = trainer(seed=5)
    with Publisher(url, snapshot_every=3, snapshot_fraction=100.0, background=False) as pub:
        for step in range(3):
            pub.publish(t.state() if step == 0 else t.step(), step)
    pub = Publisher(url, snapshot_every=3, snapshot_fraction=100.0, background=False, resume=True,
                    snapshot_format="compressed")
    store_type = type(pub.store)
    original = store_type.commit_manifest
    armed = {"on": True}

    def commit_then_rebase(self, data, etag):
        tag = original(self, data, etag)
        m = Manifest.parse(data)
        if armed["on"] and m.head == 3 and m.snapshot(3) is None:
            armed["on"] = False
            assert ops.rebase(url) == 3
        return tag

    store_type.commit_manifest = commit_then_rebase
    try:
        pub.publish(t.step(), 3)  # the rebase's safetensors file holds the key: its snapshot is kept
        pub.publish(t.step(), 4)
    finally:
        store_type.commit_manifest = original
        pub.close()
    m = Manifest.parse(open_store(url).read_manifest().data)
    assert m.head == 4 and m.snapshot(3) is not None


# -- 4. verify reads whatever an unsigned announcement names, in full --------------------------------------------
def test_verify_does_not_download_announced_files_far_larger_than_their_record(tmp_path, trainer, monkeypatch):
    """In a signed run, the announcement is the one thing a bucket writer can change without breaking a signature.
    Readers refuse an announced snapshot whose files declare more than the record's tensors plus a header each
    before downloading a byte (SECURITY.md "Nothing is read past the size it should have"). verify (shallow and
    deep, with trusted keys) read every announced file whole into memory, so a planted object of any size was
    downloaded and held (4 workers at once); it applies the readers' bound. The header allowance is lowered so
    4 MiB is already far too much."""
    monkeypatch.setattr(relay.checkpoint, "MAX_HEADER_BYTES", 4096)
    key, pub, _ = generate_keypair(tmp_path / "trainer")
    run = start_run(tmp_path, trainer, "d", signing_key=key)
    run.publish(range(5))
    run.pub.close()
    rec = run.record(4)
    index = index_bytes_of(rec.tensors, rec.weight_map, step=4)
    run.src.put_new("regional/snapshots/4/model.safetensors.index.json", index)
    shard = sorted(set(rec.weight_map.values()))[0]
    junk = b"\0" * (4 << 20)
    run.src.put_new(f"regional/snapshots/4/{shard}", junk)
    snap = relay.manifest.Snapshot(4, ObjRef.of("regional/snapshots/4/model.safetensors.index.json", index),
                                   (ObjRef.of(f"regional/snapshots/4/{shard}", junk),))
    m = Manifest.parse(run.src.read_manifest().data)
    run.src.commit_object(ANNOUNCE_KEY, Announcement(m.run, (snap,)).to_bytes(), None)
    report = verify(run.origin, deep=True, trusted_keys=[pub])
    assert not report.ok  # the forged snapshot is reported either way
    assert report.bytes_checked < 1 << 20, f"verify downloaded {report.bytes_checked} bytes"
