"""End to end: a BF16 trainer publishes 30+ steps; watchers join fresh, mid-chain, after rebase and gc."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch

import relay
from relay import checkpoint
from relay.manifest import Manifest
from relay.store import open_store
from relay.watcher import STATE_NAME


def visible(dest: Path) -> dict[str, bytes]:
    """What a reader of DIR sees: non-dot names, symlinks followed."""
    return {p.name: p.read_bytes() for p in dest.iterdir() if not p.name.startswith(".")}


def assert_holds(dest: Path, step: int, expected: dict[str, torch.Tensor], bits_equal) -> None:
    files = visible(dest)
    state = json.loads(files[STATE_NAME])
    assert state["step"] == step
    index = json.loads(files[checkpoint.INDEX_NAME])
    assert set(files) == {STATE_NAME, checkpoint.INDEX_NAME, *index["weight_map"].values()}
    tensors, _ = checkpoint.load(dest)
    assert bits_equal(tensors, expected)


def manifest_of(run) -> Manifest:
    return Manifest.parse(open_store(run.url, run.options).read_manifest().data)


def test_trainer_loop_watchers_rebase_gc(run_store, trainer, bits_equal, tmp_path):
    run = run_store
    t = trainer(seed=1)
    states = {}
    fresh_cost = {}

    def watcher(name: str) -> relay.Watcher:
        return relay.Watcher(run.url, tmp_path / name, storage_options=run.options, retry_initial=0.01, retry_max=0.05)

    early, mid = watcher("early"), watcher("mid")
    with relay.Publisher(run.url, snapshot_every=10, snapshot_fraction=100.0, storage_options=run.options) as pub:
        for step in range(1, 33):
            states[step] = t.step()
            pub.publish(t.model, step)
            if step == 5:
                assert early.sync() == 5
            if step == 13:
                pub.flush()
                assert mid.sync() == 13
                assert_holds(mid.dest, 13, states[13], bits_equal)
    m = manifest_of(run)
    assert (m.head, [s.step for s in m.snapshots]) == (32, [1, 11, 21, 31])
    assert m.step(1).parts is None and all(m.step(s).parent == s - 1 for s in range(2, 33))

    fresh = watcher("fresh")
    assert fresh.sync() == 32
    assert_holds(fresh.dest, 32, states[32], bits_equal)
    fresh_cost["before_rebase"] = fresh.bytes_downloaded
    snap31 = m.snapshot(31).bytes
    assert fresh.bytes_downloaded < snap31 + 2 * m.step(32).delta_bytes + 4096  # snapshot 31 + one delta

    before = mid.bytes_downloaded
    assert mid.sync() == 32
    assert_holds(mid.dest, 32, states[32], bits_equal)
    assert mid.bytes_downloaded - before <= fresh.bytes_downloaded  # never worse than starting over

    info = relay.status(run.url, run.options)
    assert (info["head"], info["base"], info["chain_length"]) == (32, 31, 1)
    assert info["chain_bytes"] == m.step(32).delta_bytes

    assert relay.rebase(run.url, run.options) == 32
    m = manifest_of(run)
    assert m.base == 32 and [s.step for s in m.snapshots] == [1, 11, 21, 31, 32]
    after_rebase = watcher("after-rebase")
    assert after_rebase.sync() == 32
    assert after_rebase.bytes_downloaded == m.snapshot(32).bytes + m.step(32).record.size
    assert_holds(after_rebase.dest, 32, states[32], bits_equal)

    out = relay.gc(run.url, keep_snapshots=2, storage_options=run.options)
    assert out["snapshots"] == [31, 32] and out["deleted"] > 0
    store = open_store(run.url, run.options)
    left = {**store.list("deltas/"), **store.list("records/"), **store.list("snapshots/")}
    assert left.keys() == manifest_of(run).referenced()

    # the trainer carries on after gc; watchers inside the window follow the chain, others fall back
    with relay.Publisher(run.url, snapshot_every=10, snapshot_fraction=100.0, storage_options=run.options,
                         resume=True) as pub:
        assert pub.step == 32
        for step in range(33, 37):
            states[step] = t.step()
            pub.publish(t.model, step)
    m = manifest_of(run)
    chain_bytes = sum(m.step(s).delta_bytes for s in range(33, 37)) + m.step(36).record.size
    before = fresh.bytes_downloaded
    assert fresh.sync() == 36
    assert fresh.bytes_downloaded - before == chain_bytes  # held 32: only the chain 33..36
    assert early.sync() == 36  # held 5, long collected: starts from snapshot 32
    after_gc = watcher("after-gc")
    assert after_gc.sync() == 36
    for w in (fresh, early, after_gc):
        assert_holds(w.dest, 36, states[36], bits_equal)


def test_memory_store_roundtrip(trainer, bits_equal, tmp_path):
    url = f"memory://relay-{uuid.uuid4().hex}/run"
    t = trainer(seed=2)
    with relay.Publisher(url, snapshot_every=4) as pub:
        for step in range(10):
            pub.publish(t.step(), step)
    w = relay.Watcher(url, tmp_path / "dest")
    assert w.sync() == 9
    assert bits_equal(w.tensors, t.state())
    a = relay.Publisher(url, resume=True, background=False)
    b = relay.Publisher(url, resume=True, background=False)  # the last to resume owns the run (PROTOCOL §4.3)
    with pytest.raises(relay.ConflictError, match="another publisher"):
        a.publish(t.step(), 10)  # a is fenced
    b.publish(t.step(), 10)
    assert relay.Watcher(url, tmp_path / "dest2").sync() == 10


def test_snapshot_policy_and_shape_change(file_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=3)
    pub = relay.Publisher(file_run.url, snapshot_every=5, snapshot_fraction=100.0, background=False)
    for step in range(1, 13):
        pub.publish(t.step(), step)
    m = manifest_of(file_run)
    assert [s.step for s in m.snapshots] == [1, 6, 11]
    w = relay.Watcher(file_run.url, tmp_path / "w")
    assert w.sync() == 12

    grown = {**t.state(), "extra.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}
    pub.publish(grown, 13)  # tensor set changed: no delta possible, the step is a snapshot only
    m = manifest_of(file_run)
    assert m.step(13).parts is None and m.base == 13
    assert w.sync() == 13
    assert_holds(w.dest, 13, grown, bits_equal)
    pub.close()

    small = relay.Publisher(f"{file_run.url}-fraction", snapshot_every=1000, snapshot_fraction=0.01, background=False)
    for step in range(1, 5):
        small.publish(t.step(), step)
    m = Manifest.parse(open_store(f"{file_run.url}-fraction").read_manifest().data)
    steps = [s.step for s in m.snapshots]
    assert steps == [1, 2, 3, 4]  # every delta is over 1% of a snapshot


def test_publisher_rules(file_run, trainer):
    t = trainer(seed=4)
    with relay.Publisher(file_run.url) as pub:
        pub.publish(t.step(), 7)
        with pytest.raises(ValueError, match="does not increase"):
            pub.publish(t.step(), 7)
        with pytest.raises(TypeError):
            pub.publish([1, 2], 8)
    with pytest.raises(ValueError, match="resume=True"):
        relay.Publisher(file_run.url)


def test_resume_and_leftovers(s3_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=5)
    with relay.Publisher(s3_run.url, storage_options=s3_run.options) as pub:
        for step in range(3):
            pub.publish(t.step(), step)
    # a publisher that crashed between its objects and its manifest commit left step 3 behind
    store = open_store(s3_run.url, s3_run.options)
    store.put_new("deltas/3-0.drd", b"left by a crashed publisher")
    store.put_new("records/3.json", b"{}")
    pub = relay.Publisher(s3_run.url, storage_options=s3_run.options, resume=True)
    assert pub.step == 2
    assert "deltas/3-0.drd" in store.list("deltas/")  # not deleted at resume: it could be a live publisher's
    pub.publish(t.step(), 3)  # replaced once the take-over has fenced whoever wrote it
    pub.close()
    m = manifest_of(s3_run)
    assert m.step(3).parent == 2
    w = relay.Watcher(s3_run.url, tmp_path / "w", storage_options=s3_run.options)
    assert w.sync() == 3 and bits_equal(w.tensors, t.state())


def test_publish_function_and_live_module(file_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=6)
    for step in range(4):
        relay.publish(t.model, step, url=file_run.url, snapshot_every=2)
    relay.close_publishers()
    live = trainer(seed=99).model
    seen = []
    w = relay.Watcher(file_run.url, tmp_path / "w", module=live, on_update=lambda s, tensors: seen.append(s))
    assert w.sync() == 3 and seen == [3]
    assert bits_equal({k: v for k, v in live.state_dict().items()}, t.state())


def test_watcher_never_moves_back(file_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=7)
    with relay.Publisher(file_run.url, snapshot_every=3) as pub:
        for step in range(6):
            pub.publish(t.step(), step)
    w = relay.Watcher(file_run.url, tmp_path / "w")
    assert w.sync() == 5
    store = open_store(file_run.url)
    got = store.read_manifest()
    m = Manifest.parse(got.data)
    m.steps = [s for s in m.steps if s.step <= 3]
    m.snapshots = [s for s in m.snapshots if s.step <= 3]
    m.head = 3
    store.commit_manifest(m.to_bytes(), got.etag)  # an operator rolled the run back
    assert w.sync() == 5
    assert_holds(w.dest, 5, t.state(), bits_equal)


def test_crash_during_persist_keeps_last_step(file_run, trainer, bits_equal, tmp_path, monkeypatch):
    t = trainer(seed=8)
    pub = relay.Publisher(file_run.url, background=False)
    pub.publish(t.step(), 0)
    first = t.state()
    dest = tmp_path / "w"
    assert relay.Watcher(file_run.url, dest).sync() == 0
    pub.publish(t.step(), 1)

    real_replace = os.replace

    def crash_at_swap(src, dst, *a, **kw):
        if str(dst).endswith(".current"):
            raise KeyboardInterrupt("power cut")  # not an Exception: nothing may catch and continue
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", crash_at_swap)
    crashed = relay.Watcher(file_run.url, dest)
    with pytest.raises(KeyboardInterrupt):
        crashed.sync()
    crashed.close()  # the crashed process is gone: its lock with it
    monkeypatch.setattr(os, "replace", real_replace)
    assert_holds(dest, 0, first, bits_equal)  # the half-written step 1 is invisible
    assert any(p.name.startswith(".current.tmp-") for p in dest.iterdir()) or (dest / ".versions").exists()

    again = relay.Watcher(file_run.url, dest)  # restart: recovers step 0 and tidies up
    assert again.step == 0 and len(list((dest / ".versions").iterdir())) == 1
    assert again.sync() == 1
    assert_holds(dest, 1, t.state(), bits_equal)
    assert not [p for p in dest.iterdir() if p.name.startswith(".current.tmp-")]


def test_step_made_of_several_parts(s3_run, trainer, bits_equal, tmp_path):
    """A step may be published as one delta per trainer shard; a reader applies them all."""
    import codec
    from relay.manifest import ObjRef, Part, Record, Step, delta_key, record_key, tensor_infos
    from relay.store import content_tag

    t = trainer(seed=9)
    before = t.step()
    with relay.Publisher(s3_run.url, storage_options=s3_run.options) as pub:
        pub.publish(before, 0)
        run_id = pub.run
    w = relay.Watcher(s3_run.url, tmp_path / "w", storage_options=s3_run.options)
    assert w.sync() == 0
    after = t.step()
    names = list(after)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]  # two trainer shards
    store = open_store(s3_run.url, s3_run.options)
    parts = []
    for i, shard in enumerate(shards):
        payload = codec.encode({k: before[k] for k in shard}, {k: after[k] for k in shard})
        store.put_immutable(delta_key(1, i), payload)
        parts.append(Part(ObjRef(delta_key(1, i), len(payload), content_tag(payload)), tuple(shard)))
    rec = Record(run_id, 1, tensor_infos(after), {k: "model-00001-of-00001.safetensors" for k in names}).to_bytes()
    store.put_immutable(record_key(1), rec)
    got = store.read_manifest()
    m = Manifest.parse(got.data)
    m.steps.append(Step(1, ObjRef(record_key(1), len(rec), content_tag(rec)), 0, tuple(parts)))
    m.head = 1
    store.commit_manifest(m.to_bytes(), got.etag)
    assert w.sync() == 1
    assert_holds(w.dest, 1, after, bits_equal)

    m.steps[-1] = Step(1, m.steps[-1].record, 0, tuple(parts[:1]))  # a manifest that forgot one part
    store.commit_manifest(m.to_bytes(), store.read_manifest().etag)
    w0 = relay.Watcher(s3_run.url, tmp_path / "w0", storage_options=s3_run.options)
    with pytest.raises(relay.SyncError, match="no verified path"):
        w0.sync()  # half the tensors would go unverified: refused
    assert w0.step is None and not visible(w0.dest)


def test_publisher_keeps_manifest_small(file_run, trainer, bits_equal, tmp_path):
    t = trainer(seed=15)
    with relay.Publisher(file_run.url, snapshot_every=3, keep_snapshots=2) as pub:
        for step in range(12):
            pub.publish(t.step(), step)
    m = manifest_of(file_run)
    assert [s.step for s in m.snapshots] == [6, 9] and m.steps[0].step == 6 and m.steps[0].parts is None
    assert len(m.steps) == 6
    out = relay.gc(file_run.url, keep_snapshots=2)
    assert out["snapshots"] == [6, 9] and out["deleted"] > 0  # the objects the publisher stopped naming
    store = open_store(file_run.url)
    assert {**store.list("deltas/"), **store.list("records/"), **store.list("snapshots/")}.keys() == m.referenced()
    w = relay.Watcher(file_run.url, tmp_path / "w")
    assert w.sync() == 11 and bits_equal(w.tensors, t.state())
