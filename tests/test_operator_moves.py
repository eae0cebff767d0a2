"""Operator moves on a live run (issue 45): a one-off `materialise` on a plain relay's region, a repair flag
left in a unit file, and gc / rebase after an old manifest is copied back. Real file:// stores and, where the
move is a command, real `deltarelay` processes; nothing of relay is mocked. docs/RELIABILITY.md has each
finding, before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relay import checkpoint
from relay.announce import ANNOUNCE_KEY
from relay.manifest import Manifest
from relay.publisher import Publisher
from relay.signing import generate_keypair
from relay.store import open_store
from relay.verify import verify
from relay.watcher import Watcher

ROOT = Path(__file__).resolve().parents[1]


def deltarelay(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`deltarelay ARGS` in its own process (this checkout's code); asserts the exit status `ok` implies."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "relay.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert (proc.returncode == 0) == ok, (args, proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def publish(pub: Publisher, t, states: dict, steps: range) -> None:
    for step in steps:
        states[step] = t.state() if step == 0 else t.step()
        pub.publish(states[step], step)


def test_a_one_off_materialise_does_not_make_a_plain_relays_region_ignore_the_snapshots_it_holds(
        tmp_path, trainer, bits_equal):
    """Issue 45, move 1. A region fed by a plain `relay` (which copies the trainer's snapshots) gets one
    `deltarelay materialise --once` (a try-out). Its announcement used to say `origin_snapshots: false`, and
    from then on the region's readers ignored the trainer snapshots the relay kept copying in: once the origin's
    `gc --keep-snapshots 1` trimmed the chain past that one regional snapshot, a lagging watcher and a fresh host
    failed every sync ("says this store keeps none of the trainer's 1 snapshots"). Readers now use every
    snapshot the region holds."""
    origin, region = f"file://{tmp_path}/origin/run", f"file://{tmp_path}/region/run"
    t, states = trainer(seed=45), {}
    pub = Publisher(origin, snapshot_every=3, snapshot_fraction=100.0, background=False)
    publish(pub, t, states, range(5))  # trainer snapshots 0, 3
    relay = ("relay", "--source", origin, "--dest", region, "--once", "--timeout", "120", "--no-fleet")
    deltarelay(*relay)
    lagging, fresh = tmp_path / "lagging", tmp_path / "fresh"
    watch = ("--once", "--timeout", "60", "--no-report", "--no-progress")
    assert "step 4" in deltarelay("watch", region, "--dest", str(lagging), *watch).stdout
    deltarelay("materialise", region, "--workdir", str(tmp_path / "work"), "--once", "--timeout", "120")
    assert json.loads(open_store(region).get(ANNOUNCE_KEY))["snapshots"]  # premise: the region announces one
    publish(pub, t, states, range(5, 14))  # trainer snapshots 6, 9, 12
    pub.close()
    deltarelay("gc", origin, "--keep-snapshots", "1")
    deltarelay(*relay)
    regional = open_store(region)
    m = Manifest.parse(regional.read_manifest().data)
    ann = json.loads(regional.get(ANNOUNCE_KEY))
    assert m.head == 13 and [s.step for s in m.snapshots] == [12]  # premise: the chain is trimmed past it
    assert all(m.step(s["step"]) is None for s in ann["snapshots"])  # premise: its own snapshot is unusable
    assert {r.key for r in (m.snapshots[0].index, *m.snapshots[0].files)} <= set(regional.list("snapshots/"))

    for dest in (lagging, fresh):
        assert "step 13" in deltarelay("watch", region, "--dest", str(dest), *watch).stdout
        assert bits_equal(checkpoint.load(dest)[0], states[13])
    report = verify(region)
    assert report.ok, report.problems


def test_accept_older_head_is_spent_by_the_first_sync_on_a_healthy_store(tmp_path, trainer, bits_equal):
    """Issue 45, move 2. `accept_older_head` used to stay armed until a move back happened: a watcher started
    with it on a healthy store (the flag left in a unit file after a repair) later took a validly signed old
    manifest a bucket writer copied back, from step 9 to step 4, trusted keys on, with only a warning. It names
    the step now and is spent by the first sync, whether that moved back or not."""
    key, pub_key, _ = generate_keypair(tmp_path / "keys" / "trainer")
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    t, states = trainer(seed=46), {}
    with Publisher(url, snapshot_every=3, snapshot_fraction=100.0, background=False, signing_key=key) as pub:
        publish(pub, t, states, range(5))
        old = store.read_manifest().data  # head 4, signed by the trainer
        publish(pub, t, states, range(5, 10))
    with Watcher(url, tmp_path / "dest", trusted_keys=[pub_key], accept_older_head=4, report_interval=None) as w:
        assert w.sync(timeout=60) == 9  # healthy: nothing to repair, and the flag is spent
        store.commit_manifest(old, store.read_manifest().etag)  # a bucket writer replays a signed manifest
        assert w.sync(timeout=60) == 9 and bits_equal(w.tensors, states[9])
        assert w.accept_older_head is None
    assert bits_equal(checkpoint.load(tmp_path / "dest")[0], states[9])


def test_watch_accept_older_head_names_a_step_and_refuses_the_bare_flag(tmp_path, trainer, bits_equal):
    """The command line: `--accept-older-head` alone (the old boolean spelling) is refused, naming the new form;
    `--accept-older-head STEP` takes a store's older head only when it is that step."""
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    t, states = trainer(seed=47), {}
    with Publisher(url, snapshot_every=3, snapshot_fraction=100.0, background=False) as pub:
        publish(pub, t, states, range(5))
        old = store.read_manifest().data
        publish(pub, t, states, range(5, 8))
    dest = str(tmp_path / "dest")
    watch = ("watch", url, "--dest", dest, "--once", "--timeout", "60", "--no-report", "--no-progress")
    assert "step 7" in deltarelay(*watch).stdout
    store.commit_manifest(old, store.read_manifest().etag)  # the store's head is 4 now
    bare = deltarelay(*watch, "--accept-older-head", ok=False)
    assert "--accept-older-head STEP" in bare.stderr, bare.stderr
    assert "step 7" in deltarelay(*watch, "--accept-older-head", "3").stdout  # not the step named: kept
    assert "step 4" in deltarelay(*watch, "--accept-older-head", "4").stdout
    assert bits_equal(checkpoint.load(dest)[0], states[4])


def test_keyed_gc_and_rebase_refuse_a_replayed_manifest(tmp_path, trainer, bits_equal):
    """Issue 45, move 3. After a bucket writer copies back an old, validly signed manifest (head 4 of a run at
    9), keyed `gc --keep-snapshots 1` and `rebase` used to act on it and re-sign it: gc deleted objects the real
    manifest still names, so `verify` failed once the real one was restored. Both refuse it now, naming the
    replay, and change nothing."""
    key, pub_key, _ = generate_keypair(tmp_path / "keys" / "trainer")
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    t, states = trainer(seed=48), {}
    with Publisher(url, snapshot_every=3, snapshot_fraction=100.0, background=False, signing_key=key) as pub:
        publish(pub, t, states, range(5))
        old = store.read_manifest().data  # head 4, snapshots 0 and 3
        publish(pub, t, states, range(5, 10))
    real = store.read_manifest().data
    held = store.list_run()
    store.commit_manifest(old, store.read_manifest().etag)
    keys = ("--signing-key", str(key), "--trusted-key", str(pub_key))
    for move in (("gc", url, "--keep-snapshots", "1", *keys), ("rebase", url, "--timeout", "60", *keys)):
        proc = deltarelay(*move, ok=False)
        assert "replay" in proc.stderr and "head is step 4" in proc.stderr, proc.stderr
        assert store.read_manifest().data == old and store.list_run() == held  # nothing changed
    store.commit_manifest(real, store.read_manifest().etag)  # the operator restores the real manifest
    report = verify(url, deep=True, trusted_keys=[pub_key])
    assert report.ok, report.problems
    # the moves that held still hold: on the real manifest both act
    deltarelay("gc", url, "--keep-snapshots", "1", *keys)
    assert "base is now step 9" in deltarelay("rebase", url, *keys).stdout
    with Watcher(url, tmp_path / "dest", trusted_keys=[pub_key], report_interval=None) as w:
        assert w.sync(timeout=60) == 9 and bits_equal(w.tensors, states[9])


def test_accept_older_head_is_spent_by_a_first_sync_that_found_another_head(tmp_path, trainer, bits_equal):
    """Review of issue 45, move 2. The permission was spent only by a *successful* sync: a watcher restarted
    with `accept_older_head=4` still in its unit file whose first sync found head 10 but failed (an object of
    step 10 missing: a bucket writer deleted it) stayed armed, and the bucket writer's later copy-back of the
    signed head-4 manifest rolled it from step 9 to step 4, trusted keys on. The permission is for the head
    found at start: once the watcher has read any other head it is gone."""
    key, pub_key, _ = generate_keypair(tmp_path / "keys" / "trainer")
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    t, states = trainer(seed=47), {}
    with Publisher(url, snapshot_every=3, snapshot_fraction=100.0, background=False, signing_key=key) as pub:
        publish(pub, t, states, range(5))
        old = store.read_manifest().data  # head 4, signed by the trainer
        publish(pub, t, states, range(5, 10))
        with Watcher(url, tmp_path / "dest", trusted_keys=[pub_key], report_interval=None) as w:
            assert w.sync(timeout=60) == 9
        publish(pub, t, states, range(10, 11))
    m = Manifest.parse(store.read_manifest().data, "manifest")
    store.delete([p.ref.key for p in m.step(10).delta_parts])  # the bucket writer makes the first sync fail
    with Watcher(url, tmp_path / "dest", trusted_keys=[pub_key], accept_older_head=4, report_interval=None) as w:
        try:
            w.sync(timeout=3)
        except Exception as exc:  # noqa: BLE001 - the sync must fail: step 10's delta is gone
            assert "10" in str(exc), exc
        else:
            raise AssertionError("the sync reached step 10 without its delta")
        store.commit_manifest(old, store.read_manifest().etag)  # then replays the signed head-4 manifest
        assert w.sync(timeout=60) == 9 and bits_equal(w.tensors, states[9])
    assert bits_equal(checkpoint.load(tmp_path / "dest")[0], states[9])


def test_a_resume_refuses_a_replayed_manifest(tmp_path, trainer, bits_equal):
    """Review of issue 45, move 3: keyed gc and rebase refuse a replayed manifest, `publish --resume` did not.
    After a bucket writer copies back an old, validly signed manifest (head 4 of a run at 9), a resume took the
    run over at step 4 and re-signed it; the trainer's next steps (5..9, from its checkpoint) then replaced
    the objects of those steps that the real manifest names (records/8.json among them), so `verify` failed
    once the real manifest was restored, and hosts holding step 9 kept it under a step the run had rewritten.
    The resume refuses it now, before reading the model back, and changes nothing."""
    key, pub_key, _ = generate_keypair(tmp_path / "keys" / "trainer")
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    t, states = trainer(seed=49), {}
    with Publisher(url, snapshot_every=3, snapshot_fraction=100.0, background=False, signing_key=key) as pub:
        publish(pub, t, states, range(5))
        old = store.read_manifest().data  # head 4, signed by the trainer
        publish(pub, t, states, range(5, 10))
    real = store.read_manifest().data
    held = {k: store.read_object(k).data for k in store.list_run() if not k.startswith("snapshots/")}
    store.commit_manifest(old, store.read_manifest().etag)
    try:
        with Publisher(url, resume=True, background=False, signing_key=key, resume_timeout=60) as pub:
            pub.publish(t.step(), 8)  # the trainer, from its checkpoint at step 7
    except ValueError as exc:
        assert "replay" in str(exc) and "head is step 4" in str(exc), exc
    else:
        raise AssertionError("a resume took over a replayed manifest")
    assert store.read_manifest().data == old  # not re-signed, no writer fenced
    assert {k: store.read_object(k).data for k in held} == held  # no object of the real run replaced
    store.commit_manifest(real, store.read_manifest().etag)  # the operator restores the real manifest
    assert verify(url, deep=True, trusted_keys=[pub_key]).ok
    with Publisher(url, resume=True, background=False, signing_key=key, resume_timeout=60) as pub:
        states[10] = t.step()
        pub.publish(states[10], 10)
    with Watcher(url, tmp_path / "dest", trusted_keys=[pub_key], report_interval=None) as w:
        assert w.sync(timeout=60) == 10 and bits_equal(w.tensors, states[10])
