"""The regional relay (relay/fanout.py, PROTOCOL §8), the materialiser and its announcements
(relay/regional.py, relay/announce.py, §8.1) in the cases an adversarial review found uncovered
(docs/RELIABILITY.md has each finding, before and after): an object lost for good at the origin or in a
CRR region, a restarted materialiser whose announced snapshots expired, a forged announcement entry far
past the head. Small runs on file:// stores; each takes seconds.
"""

from __future__ import annotations

import json

from relay.announce import Announcement, read_announcement, regional_prefix, update_announcement
from relay.fanout import Destination, Fanout
from relay.manifest import INDEX_NAME, Manifest
from relay.publisher import Publisher
from relay.regional import Materialiser
from relay.store import open_store
from relay.watcher import Reader, SyncError, Watcher

from conftest import same_bits
from test_regional import replicate, start_run

FAST = {"poll_interval": 0.02, "retry_initial": 0.02, "retry_max": 0.2}


# -- the regional relay (relay/fanout.py) ------------------------------------------------------------------
def test_relay_is_not_wedged_by_a_delta_lost_at_the_origin_when_a_newer_snapshot_gives_a_path(tmp_path, trainer):
    """A region mirrored at step 1 (floor snapshot 0). The origin then publishes steps 2-7 (snapshots 3 and 6),
    and deltas/2-0.drd is lost for good there (a PUT acknowledged and never stored; the publisher's reader-side
    promise is that watchers route around it through snapshot 3 or 6). The relay keeps the region's floor at
    its old snapshot 0 (`choose_floor`), so every round tries to copy the lost delta, fails with ObjectMissing
    and backs off: the region stays at head 1 forever (until someone gcs the origin), although a fresh region
    would be seeded from snapshot 6 at once. The relay should move the floor up to a snapshot whose chain to
    the head is complete at the origin when an object below it cannot be read, and reach head 7."""
    origin, region = f"file://{tmp_path}/origin", f"file://{tmp_path}/region"
    t = trainer(seed=3)
    pub = Publisher(origin, snapshot_every=3, snapshot_fraction=100.0, background=False)
    pub.publish(t.state(), 0)
    pub.publish(t.step(), 1)
    fan = Fanout(origin, [Destination("eu", region)], fleet_interval=None, reroute_after=0.5, **FAST)
    try:
        assert fan.sync_once(timeout=30)
        for step in range(2, 8):
            pub.publish(t.step(), step)
        open_store(origin).delete(["deltas/2-0.drd"])  # lost for good
        fan.sync_once(timeout=4)
        got = Manifest.parse(open_store(region).read_manifest().data)
        assert got.head == 7, (f"region wedged at head {got.head} (snapshots {[s.step for s in got.snapshots]}): "
                               f"{fan.status()['regions']['eu'].get('last_error')}")
        assert got.snapshots[0].step == 3  # the nearest snapshot past the lost delta, not the newest
        _, tensors, rec = Reader(open_store(region)).reach(None, None, timeout=30)
        assert rec.step == 7 and same_bits(tensors, t.state())
    finally:
        fan.close()
        pub.close()


def _sync_until(mat: Materialiser, step: int, rounds: int = 3) -> None:
    """Up to `rounds` syncs of 1.5 s (each may time out waiting for the missing object) until it holds `step`."""
    for _ in range(rounds):
        try:
            mat.sync_once(timeout=1.5)
        except SyncError:
            pass
        if mat.step == step:
            return


# -- the materialiser (relay/regional.py) --------------------------------------------------------------------
def test_materialiser_is_not_wedged_by_a_delta_that_crr_never_delivers(tmp_path, trainer):
    """A CRR region without the trainer's snapshots (PROTOCOL §8, "CRR without snapshots"): the materialiser
    holds step 1; the trainer publishes 2-7 (snapshots 3 and 6); replication delivers everything but
    deltas/2-0.drd, which S3 never retries. `_next` re-raises the SyncTimeout of the in-region chain, and never
    takes the bootstrap path (trainer snapshot 3 or 6 from `bootstrap_from`) that only the materialiser has.
    Even once the delta has been missing past the reader's reroute_after, every sync times out at step 1, and
    since the region's readers can only route around through a regional snapshot past step 2, which never gets
    written, the whole region is stuck at step 1. Once the in-region chain has been missing an object for
    reroute_after, the materialiser should bootstrap from the origin's newest snapshot and go on to the head."""
    run = start_run(tmp_path, trainer)
    run.publish(range(2))
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, retry_initial=0.05,
                      retry_max=0.1, reroute_after=0.5) as mat:
        assert mat.sync_once(timeout=30) and mat.step == 1
        for step in range(2, 8):
            run.states[step] = run.trainer.step()
            run.pub.publish(run.states[step], step)
        replicate(run.src, run.dst)
        run.dst.delete(["deltas/2-0.drd"])  # the one replication that failed for good
        _sync_until(mat, 7)
        assert mat.step == 7, f"materialiser stuck at step {mat.step}: {mat.status()['last_error']}"
    run.pub.close()


def _bogus_entry(step: int, like) -> dict:
    """An announcement entry at `step` that parses (keys under regional/snapshots/<step>/), copying the sizes
    and tags of a genuine entry: what a bucket writer can add to the unsigned announcement."""
    prefix = regional_prefix(step)
    return {"step": step,
            "index": {**like.index.to_json(), "key": prefix + INDEX_NAME},
            "files": [{**f.to_json(), "key": prefix + f.key.rsplit("/", 1)[-1]} for f in like.files]}


def test_a_forged_announced_step_past_the_head_does_not_stop_the_materialiser_for_good(tmp_path, trainer):
    """A bucket writer adds to regional/snapshots.json one entry at step 1000000, far past the head (it parses:
    its keys are under regional/snapshots/1000000/). Readers ignore it (the manifest does not list that step),
    but the materialiser takes it for the region's newest snapshot: `_due` returns False for every lower step
    ("a newer one serves every reader") and `add` refuses to announce under it, forever, even after the
    attacker is gone; the region gets no new snapshot again (and once the origin trims the manifest past the
    last real one, the relay in regional-snapshot mode has nothing servable and stops committing). The
    materialiser should disregard announced steps its manifest does not list above its head (they stay
    announced: see the replayed-manifest test below), and announce its snapshot of step 9."""
    run = start_run(tmp_path, trainer)
    run.publish(range(5))  # trainer snapshots 0, 3
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, keep=2) as mat:
        assert mat.sync_once(timeout=30)
        ann, _ = read_announcement(run.dst)
        assert [s.step for s in ann.snapshots] == [3]
        doc = json.loads(ann.to_bytes())
        doc["snapshots"].append(_bogus_entry(1_000_000, ann.snapshots[-1]))
        forged = Announcement.parse(json.dumps(doc).encode())
        update_announcement(run.dst, lambda cur: forged)
        run.publish(range(5, 10))  # trainer snapshots 6, 9
        mat.sync_once(timeout=30)
        assert mat.step == 9
        steps = [s.step for s in read_announcement(run.dst)[0].snapshots]
        assert 9 in steps, f"step 9 was never announced (announcement: {steps})"
    run.pub.close()


def test_a_restarted_materialiser_whose_announced_snapshots_expired_bootstraps_again(tmp_path, trainer):
    """The materialiser stopped for a while; the lifecycle rule on regional/snapshots/ (PROTOCOL §8.1: the
    backstop for a materialiser that stopped) expired the snapshots it had announced, 6 and 9, while the
    announcement (never expired) still names them. On restart, `_start` tries the newest announced snapshot;
    its objects are missing, so the reader waits for them and raises SyncTimeout, which `_start` re-raises
    instead of falling back to the bootstrap. Even past reroute_after there is no other in-region path, so
    every sync times out and the region never gets a snapshot again (fresh readers there find none). After
    the announced snapshot has been missing for reroute_after, the materialiser should bootstrap from the
    origin (`bootstrap_from`) as it does when none verifies, and write a new regional snapshot."""
    run = start_run(tmp_path, trainer)
    run.publish(range(10))  # trainer snapshots 0, 3, 6, 9
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, keep=2) as mat:
        assert mat.sync_once(timeout=30)
    assert [s.step for s in read_announcement(run.dst)[0].snapshots] == [9]
    run.dst.delete(sorted(run.dst.list("regional/snapshots/")))  # expired by the lifecycle rule
    run.publish(range(10, 12))
    with Materialiser(run.region, tmp_path / "work2", bootstrap_from=run.origin, keep=2, retry_initial=0.05,
                      retry_max=0.1, reroute_after=0.5) as again:
        _sync_until(again, 11)
        assert again.step == 11, f"restarted materialiser holds {again.step}: {again.status()['last_error']}"
    run.pub.close()




def test_a_replayed_older_manifest_does_not_take_a_genuine_snapshot_out_of_the_announcement(tmp_path, trainer,
                                                                                            bits_equal):
    """Issue 37 (suspected, confirmed here): a bucket writer puts back the region's manifest of head 4 (a genuine,
    older one: a keyless materialiser and a trusting one both accept it) while the region announces its own
    snapshot 6. A materialiser that starts then (a restart: nothing held) bootstraps at step 3 and materialises
    it; its swap took every announced step past the head it read for a forgery and dropped it, so the region's
    genuine snapshot 6 left the announcement (its files kept, readers no longer told of it) until written again.
    Entries past the head should stay announced as they are (they count for nothing there: not newer, no place
    among the `keep`), and the region's readers start from 6 again once the real manifest is back."""
    run = start_run(tmp_path, trainer)
    run.publish(range(5))  # trainer snapshots 0, 3; head 4
    older = run.dst.read_manifest().data
    run.publish(range(5, 8))  # trainer snapshot 6; head 7
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, keep=1) as mat:
        assert mat.sync_once(timeout=30) and mat.step == 7
    genuine = read_announcement(run.dst)[0]
    assert [s.step for s in genuine.snapshots] == [6]

    run.dst.commit_manifest(older, run.dst.read_manifest().etag)  # the replay
    with Materialiser(run.region, tmp_path / "work2", bootstrap_from=run.origin, keep=1) as again:
        assert again.sync_once(timeout=30) and again.step == 4
    ann = read_announcement(run.dst)[0]
    assert [s.step for s in ann.snapshots] == [3, 6], "the genuine snapshot 6 left the announcement"
    assert ann.snapshot(6) == genuine.snapshot(6)  # untouched, and the keep (1) counted only step 3

    run.publish(range(8, 9))  # the real manifest is back (head 8)
    with Watcher(run.region, tmp_path / "dest") as w:  # a fresh host in the region (it holds no trainer snapshot)
        assert w.sync(timeout=30) == 8
        assert bits_equal(w.tensors, run.states[8])
        m = Manifest.parse(run.dst.read_manifest().data)
        chain = sum(m.step(s).record.size + sum(p.ref.size for p in m.step(s).parts) for s in (7, 8))
        assert w.bytes_downloaded == genuine.snapshot(6).bytes + chain  # from the region's snapshot 6, not 3
    run.pub.close()
