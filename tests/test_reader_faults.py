"""The reader's planning (relay/watcher.py Reader, partial replicas, regional snapshots) in the cases an
adversarial review found uncovered (docs/RELIABILITY.md has each finding, before and after); real file://
stores, nothing of relay mocked.
"""

from __future__ import annotations

import logging

import pytest

from relay.announce import ANNOUNCE_KEY, Announcement, read_announcement, regional_prefix
from relay.manifest import INDEX_NAME, MAX_RECORD_BYTES, Manifest, ObjRef, Snapshot
from relay.regional import Materialiser
from relay.watcher import Reader, SyncError, SyncTimeout

from conftest import same_bits
from test_regional import start_run


def _region_with_both_snapshots(tmp_path, trainer):
    """Steps 0-9, trainer snapshots at 0, 3, 6, 9; a region that keeps the trainer's snapshots too and
    announces its own, materialised at the same steps (6 and 9)."""
    run = start_run(tmp_path, trainer, "both")
    run.publish(range(10))
    for key in sorted(run.src.list_run()):
        if key.startswith("snapshots/"):
            run.dst.put_immutable(key, run.src.get(key))
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin) as mat:
        assert mat.sync_once(timeout=60)
    run.pub.close()
    ann, _ = read_announcement(run.dst)
    m = Manifest.parse(run.dst.read_manifest().data)
    assert ann.snapshot(9) is not None and m.snapshot(9) is not None  # premise
    return run, ann, m


def test_partial_replica_uses_the_regional_snapshot_it_planned(tmp_path, trainer):
    """A region that keeps the trainer's snapshots and has its own at the same step 9. The trainer's
    snapshot 9 has not replicated yet (its file is missing); the region's own snapshot 9 is complete.

    A full reader starts from the regional snapshot at once. A partial replica must too (PROTOCOL §6.2:
    it follows §6, only downloading less). Reader._snapshot_files keyed the files it needs by *step*, so the
    trainer's snapshot (sorted after the region's at one step) overwrote the region's entry and plan_path
    gave the regional snapshot the trainer's file list: the replica waited for the trainer's missing file,
    for reroute_after (300 s by default), although a complete path existed. They are keyed by index now."""
    run, ann, m = _region_with_both_snapshots(tmp_path, trainer)
    run.dst.delete([f.key for f in m.snapshot(9).files])  # the trainer's snapshot 9: still replicating
    name = sorted(run.states[9])[0]

    _, full, rec = Reader(run.dst, retry_initial=0.05, retry_max=0.1).reach(None, None, timeout=5)
    assert rec.step == 9 and same_bits(full, run.states[9])  # premise: the regional snapshot is complete

    partial = Reader(run.dst, tensors=[name], retry_initial=0.05, retry_max=0.1)
    try:
        _, got, rec = partial.reach(None, None, timeout=5)
    except SyncTimeout as exc:
        pytest.fail(f"partial replica waited for the trainer's snapshot file instead of using the complete "
                    f"regional snapshot 9: {exc}")
    assert rec.step == 9 and same_bits(got, {name: run.states[9][name]})


def test_partial_replica_planning_does_not_download_an_unplanned_oversized_index(tmp_path, trainer):
    """A bucket writer of the region (the announcement is unsigned) announces a regional snapshot whose index
    object is larger than any index parser accepts (MAX_RECORD_BYTES + 1 MiB). A full reader never downloads
    it (its cost rules it out). A partial replica's planning (Reader._snapshot_files) downloaded the index of
    every snapshot in the view, whatever its size, before parsing refused it, and again at every reach (the
    failure was neither cached nor backed off). An index over the cap is refused unread and backed off.
    SECURITY.md: garbage costs bounded egress; reads are bounded by the run, not by what a writer claims."""
    run = start_run(tmp_path, trainer, "big")
    run.publish(range(4))
    for key in sorted(run.src.list_run()):
        if key.startswith("snapshots/"):
            run.dst.put_immutable(key, run.src.get(key))
    run.pub.close()
    m = Manifest.parse(run.dst.read_manifest().data)
    step = 2  # a listed step with no snapshot: the announced one would be a candidate only by its (huge) cost
    junk = b"{" + b" " * (MAX_RECORD_BYTES + (1 << 20))
    index = ObjRef.of(regional_prefix(step) + INDEX_NAME, junk)
    real = m.snapshot(3).files[0]
    fdata = run.dst.get(real.key)
    fref = ObjRef.of(regional_prefix(step) + real.key.rsplit("/", 1)[1], fdata)
    run.dst.put_new(index.key, junk)
    run.dst.put_new(fref.key, fdata)
    run.dst.commit_object(ANNOUNCE_KEY, Announcement(m.run, (Snapshot(step, index, (fref,)),)).to_bytes(),
                          None)
    name = sorted(run.states[3])[0]
    needed = m.snapshot(3).bytes + m.step(3).record.size

    full = Reader(run.dst)
    assert full.reach(None, None, timeout=10)[2].step == 3
    assert full.bytes_downloaded <= needed  # premise: the full reader never touches the junk

    partial = Reader(run.dst, tensors=[name])
    for _ in range(3):
        _, got, rec = partial.reach(None, None, timeout=10)
        assert rec.step == 3 and same_bits(got, {name: run.states[3][name]})
    assert partial.bytes_downloaded <= 3 * needed + (1 << 16), (  # each reach from nothing: the snapshot, again
        f"a partial replica downloaded {partial.bytes_downloaded} bytes over 3 reaches of a "
        f"{needed}-byte snapshot: the {len(junk)}-byte announced index, unplanned, at every reach")
    assert partial.verify_failures == 0


def test_a_verification_failure_that_blames_nothing_does_not_spin_past_the_timeout(tmp_path, trainer):
    """An unsigned run whose manifest (a bucket writer's, or a buggy writer's) lists snapshot 0 with no files
    (`"files": []` parses). The reader's layout check refused it with a _VerifyError blaming `snap.files`:
    nobody. _reach then neither refetched nor excluded anything and re-planned the same path at once, with no
    sleep and no deadline check: reach(timeout=2) never returned. A snapshot is blamed with its index now.
    PROTOCOL §6: a reader with no remaining candidate raises SyncError, held step unchanged."""
    from relay.store import open_store

    run = start_run(tmp_path, trainer, "empty")
    run.publish(range(3))
    run.pub.close()
    store = open_store(run.origin)
    m = Manifest.parse(store.read_manifest().data)
    m.snapshots[0] = Snapshot(m.snapshots[0].step, m.snapshots[0].index, ())
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)
    assert Manifest.parse(store.read_manifest().data).snapshots[0].files == ()  # premise: it parses

    reader = Reader(open_store(run.origin), retry_initial=0.05, retry_max=0.1)
    spinning, outcome = _spins(reader)
    assert not spinning, (f"reach(timeout=2) still running after 10 s: {reader.verify_failures} verification "
                          f"failures of the same plan, none excluded")
    assert isinstance(outcome[0], SyncError)


def _spins(reader: Reader, timeout: float = 2.0, wait: float = 10.0) -> tuple[bool, list]:
    """Run reader.reach(None, None, timeout) in a thread; (still running after `wait` s, outcome). A spinning
    reach is stopped by making its next manifest read raise."""
    import threading

    outcome: list = []

    def reach() -> None:
        try:
            outcome.append(reader.reach(None, None, timeout=timeout))
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    logger = logging.getLogger("relay.watcher")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        thread = threading.Thread(target=reach, daemon=True)
        thread.start()
        thread.join(wait)
        spinning = thread.is_alive()
        if spinning:
            def stop(*a, **k):
                raise RuntimeError("test over")
            reader.store.read_manifest = stop  # type: ignore[method-assign]
            thread.join(wait)
    finally:
        logger.setLevel(old)
    return spinning, outcome


def test_a_partial_replica_whose_snapshot_plan_fetches_no_file_does_not_spin(tmp_path, trainer):
    """Unsigned run; the trainer's snapshot 0 index (rewritten, the manifest's reference with it) maps the
    replica's tensor nowhere. _snapshot_files then plans snapshot 0 with no file at all; the load found the
    tensor missing and blamed the snapshot's files, but plan_path only checks the files the plan fetches
    (none) against what is excluded, so the same plan was chosen again at once, forever, ignoring the timeout."""
    import json

    from relay.store import open_store

    run = start_run(tmp_path, trainer, "noidx")
    run.publish(range(3))
    run.pub.close()
    store = open_store(run.origin)
    m = Manifest.parse(store.read_manifest().data)
    snap = m.snapshots[0]
    name = sorted(run.states[0])[0]
    doc = json.loads(store.get(snap.index.key))
    del doc["weight_map"][name]
    data = json.dumps(doc).encode()
    store.delete([snap.index.key])
    store.put_new(snap.index.key, data)
    m.snapshots[0] = Snapshot(snap.step, ObjRef.of(snap.index.key, data), snap.files)
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)

    reader = Reader(open_store(run.origin), tensors=[name], retry_initial=0.05, retry_max=0.1)
    spinning, outcome = _spins(reader)
    assert not spinning, (f"reach(timeout=2) still running after 10 s: {reader.verify_failures} verification "
                          f"failures of one plan that fetches no file")
    assert isinstance(outcome[0], SyncError)
