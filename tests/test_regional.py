"""Regional snapshots (#16): a region's materialiser builds its own snapshots from the chain it holds, so
after the bootstrap no snapshot crosses into the region; watchers there start from them, bit-exact, and
refuse any that does not match the trainer's record (BLAKE3 in signed runs), taking another path.

Regions here are filled as S3 Cross-Region Replication with a `snapshots/` prefix filter fills them:
every object but the trainer's snapshots, then the manifest (`replicate`).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load as st_load

import relay.checkpoint
import relay.manifest
from relay import ops
from relay.announce import ANNOUNCE_KEY, Announcement, read_announcement, regional_prefix, update_announcement
from relay.checkpoint import index_bytes_of, safetensors_stream
from relay.manifest import Manifest, ObjRef, Record, with_blake3
from relay.publisher import Publisher
from relay.regional import Materialiser, write_snapshot
from relay.signing import generate_keypair
from relay.store import LocalStore, Store, open_store
from relay.verify import verify
from relay.watcher import Reader, SyncError, SyncTimeout, Watcher


def replicate(src: Store, dst: Store) -> None:
    """Copy every object of the run but the trainer's snapshots, then the manifest (a CRR rule that skips
    snapshots/, with the objects arriving before the manifest)."""
    for key in sorted(src.list_run()):
        if not key.startswith("snapshots/"):
            dst.put_immutable(key, src.get(key))
    got, cur = src.read_manifest(), dst.read_manifest()
    if cur is None or cur.data != got.data:
        dst.commit_manifest(got.data, None if cur is None else cur.etag)


@dataclasses.dataclass
class Run:
    origin: str
    region: str
    states: dict
    src: Store
    dst: Store
    pub: Publisher
    trainer: object
    options: dict | None = None

    def publish(self, steps: range) -> None:
        for step in steps:
            self.states[step] = self.trainer.state() if step == 0 else self.trainer.step()
            self.pub.publish(self.states[step], step)
        replicate(self.src, self.dst)

    def record(self, step: int) -> Record:
        m = Manifest.parse(self.dst.read_manifest().data)
        return Record.parse(self.dst.get(m.step(step).record.key))


def start_run(tmp_path, trainer, name: str = "r", options: dict | None = None, origin: str | None = None,
              region: str | None = None, region_options: dict | None = None, **kw) -> Run:
    origin = origin or f"file://{tmp_path}/{name}-origin"
    region = region or f"file://{tmp_path}/{name}-region"
    pub = Publisher(origin, storage_options=options, snapshot_every=3, snapshot_fraction=100.0, background=False,
                    **kw)
    return Run(origin, region, {}, open_store(origin, options), open_store(region, region_options), pub,
               trainer(seed=21))


@pytest.fixture
def materialised(tmp_path, trainer):
    """An unsigned run of steps 0-9 (trainer snapshots at 0, 3, 6, 9) in a region that received no snapshot,
    whose materialiser bootstrapped at step 3 and then built regional snapshots 6 and 9 (keep 2)."""
    run = start_run(tmp_path, trainer)
    run.publish(range(5))
    mat = Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, keep=2)
    assert mat.sync_once(timeout=60)
    first = mat.status()
    run.publish(range(5, 10))
    assert mat.sync_once(timeout=60)
    run.pub.close()
    yield run, mat, first
    mat.close()


def test_materialiser_bootstraps_once_then_builds_the_region_s_snapshots(materialised, tmp_path, bits_equal):
    run, mat, first = materialised
    origin = Manifest.parse(run.src.read_manifest().data)
    assert [s.step for s in origin.snapshots] == [0, 3, 6, 9]
    # the bootstrap read the origin's newest snapshot then (step 3), and only it
    assert first["step"] == 4 and first["bootstraps"] == 1 and first["regional_snapshots"] == [3]
    assert first["bootstrap_bytes"] == origin.snapshot(3).bytes
    st = mat.status()
    assert st["step"] == 9 and st["head"] == 9 and st["regional_snapshots"] == [6, 9]
    assert st["bootstrap_bytes"] == first["bootstrap_bytes"]  # nothing crossed after the bootstrap
    assert st["snapshots_written"] == 3 and st["errors"] == 0
    assert not any(k.startswith("snapshots/") for k in run.dst.list_run())
    assert not run.dst.list("regional/snapshots/3/")  # left the announcement (keep 2), objects deleted
    ann, _ = read_announcement(run.dst)
    assert ann.run == origin.run and [s.step for s in ann.snapshots] == [6, 9]
    # deterministic serialization: the region's snapshot is the trainer's, byte for byte
    for f in origin.snapshot(9).files:
        assert run.dst.get("regional/" + f.key) == run.src.get(f.key)

    with Watcher(run.region, tmp_path / "dest") as w:  # a fresh host in the region
        assert w.sync(timeout=30) == 9
        assert bits_equal(w.tensors, run.states[9])
        regional9 = ann.snapshot(9)
        assert w.bytes_downloaded == regional9.bytes + origin.step(9).record.size
    assert verify(run.region, deep=True).ok


def test_a_restarted_materialiser_starts_from_the_region_s_own_snapshot(materialised, tmp_path, bits_equal):
    run, mat, _ = materialised
    mat.close()
    with Materialiser(run.region, tmp_path / "work2", bootstrap_from=run.origin) as again:
        assert again.sync_once(timeout=30)
        st = again.status()
        assert again.step == 9 and st["bootstraps"] == 0 and st["bootstrap_bytes"] == 0
        assert st["snapshots_written"] == 0  # 9 is announced already
        assert bits_equal(again.tensors, run.states[9])


def _forge(run: Run, step: int, how: str) -> None:
    """Replace the region's snapshot of `step` as a bucket writer could, and announce the forgery with
    tags that match its bytes (so only the check against the record can catch it)."""
    ann, _ = read_announcement(run.dst)
    snap = ann.snapshot(step)
    rec = run.record(step)
    if how == "tampered":  # one element of one tensor changed in the file
        f = snap.files[0]
        tensors = st_load(run.dst.get(f.key))
        name = sorted(tensors)[0]
        tensors[name].view(-1)[0] += 1
        data = b"".join(bytes(c) for c in safetensors_stream(tensors, {"step": str(step)}).chunks())
        run.dst.delete([f.key])
        run.dst.put_new(f.key, data)
        snap = dataclasses.replace(snap, files=(ObjRef.of(f.key, data), *snap.files[1:]))
    elif how == "wrong_state":  # a consistent snapshot, of the step before
        snap = write_snapshot(run.dst, step, run.states[step - 1], rec)
    elif how == "wrong_index":  # the index of another step
        data = index_bytes_of(rec.tensors, rec.weight_map, step=step - 3)
        run.dst.delete([snap.index.key])
        run.dst.put_new(snap.index.key, data)
        snap = dataclasses.replace(snap, index=ObjRef.of(snap.index.key, data))
    else:
        raise AssertionError(how)
    forged = Announcement(ann.run, tuple(snap if s.step == step else s for s in ann.snapshots))
    update_announcement(run.dst, lambda cur: forged)


@pytest.mark.parametrize("how", ["tampered", "wrong_state", "wrong_index"])
def test_a_forged_regional_snapshot_is_refused_and_the_watcher_takes_another_path(materialised, tmp_path,
                                                                                  bits_equal, how, caplog):
    run, _, _ = materialised
    _forge(run, 9, how)
    caplog.set_level(logging.WARNING, logger="relay.watcher")
    with Watcher(run.region, tmp_path / "dest") as w:
        assert w.sync(timeout=60) == 9  # from regional snapshot 6 and the chain 7-9
        assert bits_equal(w.tensors, run.states[9])
        assert "regional/snapshots/9/" in w.reader._failures  # refused, and its step backed off, whatever the refs
        assert w.reader.verify_failures == 1  # not refetched: the unsigned announcement chose the reference
    assert "verification failed again" in caplog.text
    assert not verify(run.region, deep=True).ok  # and verify says so


def test_an_announcement_of_garbage_or_another_run_is_ignored(materialised, tmp_path, bits_equal):
    run, _, _ = materialised
    ann, etag = read_announcement(run.dst)
    run.dst.commit_object(ANNOUNCE_KEY, b'{"format": "deltarelay.regional-snapshots", "version": 7}', etag)
    assert read_announcement(run.dst)[0] is None
    with Watcher(run.region, tmp_path / "dest", retry_initial=0.05, retry_max=0.1) as w:
        # no announcement to go by: the trainer's snapshots are waited for (a CRR region without them: in vain)
        with pytest.raises(SyncTimeout):
            w.sync(timeout=1.5)
        assert w.step is None
    other = Announcement("f" * 32, ann.snapshots)
    update_announcement(run.dst, lambda cur: other)
    with Watcher(run.region, tmp_path / "dest2", retry_initial=0.05, retry_max=0.1) as w:
        with pytest.raises(SyncTimeout):
            w.sync(timeout=1.5)


def test_signed_run_with_a_keyless_materialiser(tmp_path, trainer, bits_equal, monkeypatch, caplog):
    key, pub, _ = generate_keypair(tmp_path / "trainer")
    run = start_run(tmp_path, trainer, "s", signing_key=key)
    run.publish(range(5))
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, trusted_keys=[pub]) as mat:
        assert mat.sync_once(timeout=60)
        run.publish(range(5, 7))
        assert mat.sync_once(timeout=60)
        assert mat.status()["regional_snapshots"] == [3, 6]
    for s in Manifest.parse(run.src.read_manifest().data).steps:  # records of a signed run carry BLAKE3
        rec = Record.parse(run.src.get(s.record.key))
        assert all(info.blake3 is not None for info in rec.tensors.values())
        assert all(with_blake3(info, run.states[s.step][n]) == info for n, info in rec.tensors.items())
    run.pub.close()
    with Watcher(run.region, tmp_path / "dest", trusted_keys=[pub]) as w:
        assert w.sync(timeout=30) == 6 and bits_equal(w.tensors, run.states[6])
        record6 = Manifest.parse(run.dst.read_manifest().data).step(6).record
        assert w.bytes_downloaded == read_announcement(run.dst)[0].snapshot(6).bytes + record6.size

    # A forger who can find xxh3 collisions: regional snapshot 6 with a changed tensor whose xxh3 digest is
    # the record's (simulated: the digest of that tensor is reported as the record's). Only BLAKE3 catches it.
    _forge(run, 6, "tampered")
    name = sorted(st_load(run.dst.get(read_announcement(run.dst)[0].snapshot(6).files[0].key)))[0]
    real = relay.manifest.tensor_infos

    def colliding(tensors, like=None, strong=False):
        out = real(tensors, like, strong)
        if like is not None and name in out and name in like:
            out[name] = dataclasses.replace(out[name], digest=like[name].digest)
        return out

    monkeypatch.setattr(relay.manifest, "tensor_infos", colliding)
    caplog.set_level(logging.WARNING, logger="relay.watcher")
    with Watcher(run.region, tmp_path / "dest2", trusted_keys=[pub]) as w:
        assert w.sync(timeout=60) == 6  # from regional snapshot 3 and the chain
        assert bits_equal(w.tensors, run.states[6])
    assert "does not match its record" in caplog.text

    # The streamed path (no spool: a keyed rebase or a resuming publisher, which sign what they load) checks
    # BLAKE3 too. Its digests are made while streaming, so the collision is simulated there as well.
    real_stream = relay.checkpoint.stream_into

    def colliding_stream(chunks, size, where, feed, **options):
        got, meta, digests = real_stream(chunks, size, where, feed, **options)
        if name in digests and where.startswith("regional/"):
            digests[name] = bytes.fromhex(run.record(6).tensors[name].digest)
        return got, meta, digests

    monkeypatch.setattr(relay.checkpoint, "stream_into", colliding_stream)
    caplog.clear()
    _, streamed, rec = Reader(run.dst, trusted_keys=[pub]).reach(None, None, timeout=60)
    assert rec.step == 6 and bits_equal(streamed, run.states[6])
    assert "does not match its record" in caplog.text


def test_regional_gc(materialised):
    run, _, _ = materialised
    run.dst.put_new("regional/snapshots/7/leftover.safetensors", b"x")  # below the newest: collected
    run.dst.put_new("regional/snapshots/12/model-00001-of-00001.safetensors", b"y")  # being written: spared
    held, announced = run.dst.list("regional/"), read_announcement(run.dst)[0]
    dry = ops.gc(run.region, 1, regional_only=True, dry_run=True)  # names what it would delete, changes nothing
    assert run.dst.list("regional/") == held and read_announcement(run.dst)[0] == announced
    out = ops.gc(run.region, 1, regional_only=True)
    assert dry["doomed"] == {k: held[k] for k in set(held) - set(run.dst.list("regional/"))} and dry["doomed"]
    assert out["regional_snapshots"] == [9] and out["snapshots"] is None
    left = set(run.dst.list("regional/"))
    assert not any(k.startswith(("regional/snapshots/6/", "regional/snapshots/7/")) for k in left)
    assert "regional/snapshots/12/model-00001-of-00001.safetensors" in left
    assert [s.step for s in read_announcement(run.dst)[0].snapshots] == [9]
    full = ops.gc(run.region, 1)  # an unsigned region: the manifest is trimmed as well
    assert full["snapshots"] == [9] and full["regional_snapshots"] == [9]


def test_end_to_end_on_s3(moto_regions, tmp_path, trainer, bits_equal):
    east, west = moto_regions("us-east-1"), moto_regions("eu-west-1")
    origin, region = f"s3://{east.new_bucket('origin')}/run", f"s3://{west.new_bucket('region')}/run"
    run = start_run(tmp_path, trainer, options=east.options, origin=origin, region=region,
                    region_options=west.options)
    run.publish(range(8))
    with Materialiser(region, tmp_path / "work", bootstrap_from=origin, storage_options=west.options,
                      bootstrap_options=east.options, every=2) as mat:
        assert mat.sync_once(timeout=60)
        st = mat.status()
        run.publish(range(8, 12))
        assert mat.sync_once(timeout=60)
        end = mat.status()
    run.pub.close()
    origin_m = Manifest.parse(run.src.read_manifest().data)
    assert st["bootstrap_bytes"] == origin_m.snapshot(6).bytes and end["bootstrap_bytes"] == st["bootstrap_bytes"]
    # 6 (the bootstrap), 8 (every 2), 9 (the trainer's), 11 (every 2); the newest 2 kept
    assert end["regional_snapshots"] == [9, 11] and end["snapshots_written"] == 4
    with Watcher(region, tmp_path / "dest", storage_options=west.options) as w:
        assert w.sync(timeout=30) == 11 and bits_equal(w.tensors, run.states[11])
    doc = json.loads(run.dst.get(ANNOUNCE_KEY))
    assert doc["format"] == "deltarelay.regional-snapshots" and doc["origin_snapshots"] is True  # a constant


def test_signed_records_without_blake3_give_no_regional_snapshot_to_a_trusting_reader(tmp_path, trainer, bits_equal,
                                                                                     monkeypatch):
    """A signed run published before records carried BLAKE3: the region's snapshot cannot be authenticated,
    so a watcher with trusted keys refuses it (a watcher without keys checks xxh3 only, and takes it)."""
    import relay.publisher

    real = relay.publisher.tensor_infos
    monkeypatch.setattr(relay.publisher, "tensor_infos", lambda t, like=None, strong=False: real(t, like))
    monkeypatch.setattr(Publisher, "_blake3_of", lambda self, target, found: {})
    key, pub, _ = generate_keypair(tmp_path / "trainer")
    run = start_run(tmp_path, trainer, "old", signing_key=key)
    run.publish(range(4))
    run.pub.close()
    assert all(i.blake3 is None for i in run.record(3).tensors.values())
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, trusted_keys=[pub]) as mat:
        assert mat.sync_once(timeout=60) and mat.status()["regional_snapshots"] == [3]
    with Watcher(run.region, tmp_path / "trusting", trusted_keys=[pub], retry_initial=0.05, retry_max=0.2) as w:
        # refused and backed off; then only the trainer's snapshot is left, which this region lacks: waited for
        with pytest.raises(SyncError, match="no verified path|snapshots/3/"):
            w.sync(timeout=5)
        assert w.step is None
        own = read_announcement(run.dst)[0].snapshot(3)
        assert regional_prefix(own.step) in w.reader._failures  # its step backed off, whatever the refs
    with Watcher(run.region, tmp_path / "keyless") as w:
        assert w.sync(timeout=30) == 3 and bits_equal(w.tensors, run.states[3])


def test_materialise_command(tmp_path, trainer, capsys):
    from relay.cli import main

    run = start_run(tmp_path, trainer, "cli")
    run.publish(range(4))
    run.pub.close()
    assert main(["materialise", run.region, "--workdir", str(tmp_path / "work"), "--bootstrap-from", run.origin,
                 "--once", "--timeout", "60"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["step"] == 3 and st["regional_snapshots"] == [3] and st["bootstraps"] == 1
    assert main(["gc", run.region, "--keep-snapshots", "1", "--regional-only"]) == 0
    assert "regional snapshots [3]" in capsys.readouterr().out


def _regional_snapshot_of(run: Run, step: int, tensors: dict, metadata: dict) -> None:
    """Announce, as a bucket writer could, a regional snapshot of `step` holding `tensors` in files whose
    safetensors header carries `metadata`."""
    rec = run.record(step)
    files = []
    for shard in sorted(set(rec.weight_map.values())):
        part = {k: tensors[k] for k, s in rec.weight_map.items() if s == shard}
        data = b"".join(bytes(c) for c in safetensors_stream(part, metadata).chunks())
        key = f"regional/snapshots/{step}/{shard}"
        run.dst.put_new(key, data)
        files.append(ObjRef.of(key, data))
    index = index_bytes_of(rec.tensors, rec.weight_map, step=step)
    run.dst.put_new(f"regional/snapshots/{step}/model.safetensors.index.json", index)
    snap = relay.manifest.Snapshot(step, ObjRef.of(f"regional/snapshots/{step}/model.safetensors.index.json", index),
                                   tuple(files))
    m = Manifest.parse(run.dst.read_manifest().data)
    run.dst.commit_object(ANNOUNCE_KEY, Announcement(m.run, (snap,)).to_bytes(), None)


def test_a_regional_snapshots_headers_do_not_reach_dest_in_a_signed_run(tmp_path, trainer, bits_equal):
    """Its tensors are verified (record, BLAKE3), but its files' headers are a bucket writer's bytes: a
    watcher with trusted keys writes DEST's files from the verified tensors instead of moving them in."""
    key, pub, _ = generate_keypair(tmp_path / "trainer")
    run = start_run(tmp_path, trainer, "h", signing_key=key)
    run.publish(range(5))
    run.pub.close()
    _regional_snapshot_of(run, 4, run.states[4], {"format": "tf", "note": "written by a bucket writer"})
    with Watcher(run.region, tmp_path / "dest", trusted_keys=[pub]) as w:
        assert w.sync(timeout=60) == 4 and bits_equal(w.tensors, run.states[4])
        assert w.bytes_downloaded > 0
    files = sorted((tmp_path / "dest").glob("*.safetensors"))
    assert files
    for f in files:
        raw = f.read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        assert "note" not in header.get("__metadata__", {}), f.name


def test_spooled_files_of_references_with_one_name_do_not_share_a_path(tmp_path, trainer):
    """Snapshots of different steps (and a region's own) name their files alike; each reference spools to a
    path of its own, so a verified file is never overwritten by another reference's bytes behind its back."""
    run = start_run(tmp_path, trainer, "p")
    run.publish(range(7))  # trainer snapshots 0, 3, 6: the same file names
    run.pub.close()
    m = Manifest.parse(run.src.read_manifest().data)  # the origin: replication leaves snapshots out
    ref3, ref6 = m.snapshot(3).files[0], m.snapshot(6).files[0]
    assert ref3.key.rsplit("/", 1)[-1] == ref6.key.rsplit("/", 1)[-1]
    reader = Reader(run.src)
    spool = tmp_path / "spool"
    spool.mkdir()
    p3 = reader._spool_one(ref3, spool)
    p6 = reader._spool_one(ref6, spool)
    assert p3 != p6 and p3.name == p6.name  # the name a version's file keeps
    again = reader._spool_one(ref3, spool)
    assert again == p3 and ref3.matches(again.read_bytes()) is None and ref6.matches(p6.read_bytes()) is None


def test_a_streamed_snapshot_may_not_declare_more_than_its_record(tmp_path, trainer):
    """Without a spool (rebase, a resuming publisher) a snapshot file streams into tensors allocated from its
    header: an unsigned reference claiming 1 TiB, with a header to match, is refused before any allocation,
    as a verification failure (no MemoryError escapes), and the reader gives up cleanly."""
    key, pub, _ = generate_keypair(tmp_path / "trainer")
    run = start_run(tmp_path, trainer, "b", signing_key=key)
    run.publish(range(5))
    run.pub.close()
    m = Manifest.parse(run.dst.read_manifest().data)
    run.dst.delete([r.key for s in m.snapshots for r in (s.index, *s.files)])  # a bucket writer may delete
    rec = run.record(4)
    size = 1 << 40
    body = json.dumps({"x": {"dtype": "U8", "shape": [size - 4096], "data_offsets": [0, size - 4096]}}).encode()
    body += b" " * (4096 - 8 - len(body))
    data = len(body).to_bytes(8, "little") + body + b"\0" * 8192
    shard = sorted(set(rec.weight_map.values()))[0]
    run.dst.put_new(f"regional/snapshots/4/{shard}", data)
    index = index_bytes_of(rec.tensors, rec.weight_map, step=4)
    run.dst.put_new("regional/snapshots/4/model.safetensors.index.json", index)
    snap = relay.manifest.Snapshot(4, ObjRef.of("regional/snapshots/4/model.safetensors.index.json", index),
                                   (ObjRef(f"regional/snapshots/4/{shard}", size, "0" * 32, None),))
    run.dst.commit_object(ANNOUNCE_KEY, Announcement(m.run, (snap,)).to_bytes(), None)
    with pytest.raises(SyncError):
        Reader(run.dst, trusted_keys=[pub]).reach(None, None, timeout=3)


def test_an_announcement_saying_the_store_keeps_no_trainer_snapshots_hides_none(tmp_path, trainer, bits_equal):
    """An unsigned announcement that says a store keeps none of the trainer's snapshots (`origin_snapshots:
    false`, as an earlier materialiser wrote it, or a bucket writer's 150 bytes) and announces none of its own
    used to leave a fresh host no path. The field decides nothing now: readers use the snapshots the store
    holds."""
    key, pub, _ = generate_keypair(tmp_path / "trainer")
    run = start_run(tmp_path, trainer, "a", signing_key=key)
    run.publish(range(5))
    run.pub.close()
    m = Manifest.parse(run.src.read_manifest().data)
    doc = {"format": "deltarelay.regional-snapshots", "version": 1, "run": m.run, "origin_snapshots": False,
           "snapshots": []}
    run.src.commit_object(ANNOUNCE_KEY, json.dumps(doc).encode(), None)
    assert read_announcement(run.src)[0] is not None  # premise: read, not ignored as unreadable
    with Watcher(run.origin, tmp_path / "dest", trusted_keys=[pub]) as w:
        assert w.sync(timeout=30) == 4 and bits_equal(w.tensors, run.states[4])


def test_snapshot_files_declaring_far_more_than_their_record_are_not_downloaded(tmp_path, trainer, bits_equal,
                                                                                 monkeypatch):
    """A region's announcement (unsigned) may name any object: files declaring more than the record's tensors
    plus a header each are refused before a byte is downloaded. (The header allowance is lowered here so
    that a 4 MiB object is already far too large.)"""
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
    trainers = {r.key: run.src.get(r.key) for t in m.snapshots for r in (t.index, *t.files)}
    run.src.delete(sorted(trainers))  # a bucket writer may delete: the announced one is the only start
    run.src.commit_object(ANNOUNCE_KEY, Announcement(m.run, (snap,)).to_bytes(), None)
    with Watcher(run.origin, tmp_path / "dest", trusted_keys=[pub], retry_initial=0.05, retry_max=0.2) as w:
        with pytest.raises(SyncError):
            w.sync(timeout=10)
        assert w.bytes_downloaded < 1 << 20
        assert regional_prefix(4) in w.reader._failures  # refused unread, and its step backed off
    for k, data in trainers.items():  # repaired: the trainer's snapshots again
        run.src.put_new(k, data)
    with Watcher(run.origin, tmp_path / "dest", trusted_keys=[pub]) as w:
        assert w.sync(timeout=60) == 4 and bits_equal(w.tensors, run.states[4])


def test_gc_keeps_what_a_lagging_regions_own_snapshots_need(tmp_path, trainer, bits_equal):
    """A region that keeps only its own snapshots, its materialiser one trainer snapshot behind (announced 9,
    the trainer's newest 12): gc --keep-snapshots 1 must keep the record and deltas from 9 on, not trim to
    the trainer's 12, which the region does not hold (that left it no path at all)."""
    run = start_run(tmp_path, trainer, "g")
    run.publish(range(10))  # trainer snapshots 0, 3, 6, 9
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin, keep=2) as mat:
        assert mat.sync_once(timeout=60)
    run.publish(range(10, 13))  # trainer snapshot 12; no materialiser round since
    run.pub.close()
    assert [s.step for s in read_announcement(run.dst)[0].snapshots][-1] == 9
    out = ops.gc(run.region, 1)
    assert out["snapshots"][0] == 9 and out["regional_snapshots"][-1] == 9
    assert {"records/9.json", "deltas/10-0.drd", "deltas/12-0.drd"} <= set(run.dst.list_run())
    _, got, rec = Reader(run.dst).reach(None, None, timeout=30)
    assert rec.step == 12 and bits_equal(got, run.states[12])
    assert verify(run.region, deep=True).ok


def test_gc_does_not_trim_to_a_snapshot_whose_files_never_arrived(tmp_path, trainer, bits_equal):
    """A replicated region (CRR) whose newest snapshot's files have not arrived, and may never: gc keeps the
    newest snapshot present instead, with its chain, so readers keep the path they had."""
    run = start_run(tmp_path, trainer, "c")
    run.publish(range(8))  # snapshots 0, 3, 6
    run.pub.close()
    m = Manifest.parse(run.src.read_manifest().data)
    lost = [r.key for r in (m.snapshots[-1].index, *m.snapshots[-1].files)]
    for key in run.src.list_run():
        if key not in lost:
            run.dst.put_immutable(key, run.src.get(key))
    run.dst.commit_manifest(run.src.read_manifest().data, run.dst.read_manifest().etag)
    out = ops.gc(run.region, 1)
    assert out["snapshots"][0] == 3
    _, got, rec = Reader(run.dst, reroute_after=0.5).reach(None, None, timeout=30)
    assert rec.step == 7 and bits_equal(got, run.states[7])


def test_verify_reports_a_region_with_no_start_and_a_delta_with_the_wrong_parent(tmp_path, trainer):
    """Two broken runs `verify --deep` used to call sound: a region that keeps only its own snapshots and
    announces none the manifest lists (every reader fails), and a step whose delta names a parent other
    than the step listed before it (a reader holding that step cannot apply it)."""
    run = start_run(tmp_path, trainer, "v")
    run.publish(range(6))
    run.pub.close()
    m = Manifest.parse(run.dst.read_manifest().data)
    run.dst.commit_object(ANNOUNCE_KEY, Announcement(m.run, ()).to_bytes(), None)
    report = verify(run.region, deep=True)
    assert not report.ok and any("no snapshot a reader of this store can start from" in p for p in report.problems)

    m = Manifest.parse(run.src.read_manifest().data)
    assert m.steps[-1].parent == 4
    m.steps[-1] = dataclasses.replace(m.steps[-1], parent=3)
    run.src.commit_manifest(m.to_bytes(), run.src.read_manifest().etag)
    report = verify(run.origin, deep=True)
    assert not report.ok and any("step 5: its delta's parent is step 3" in p for p in report.problems)


def test_verify_deep_rebuilds_every_snapshot_of_a_step(tmp_path, trainer):
    """A region that keeps the trainer's snapshots and announces its own at the same step: a reader starts from
    either, so `verify --deep` rebuilds both (it used to rebuild only the regional one, and called a wrong trainer
    snapshot sound)."""
    run = start_run(tmp_path, trainer, "both")
    run.publish(range(10))
    for key in sorted(run.src.list_run()):  # the trainer's snapshots cross too
        if key.startswith("snapshots/"):
            run.dst.put_immutable(key, run.src.get(key))
    with Materialiser(run.region, tmp_path / "work", bootstrap_from=run.origin) as mat:
        assert mat.sync_once(timeout=60)
    run.pub.close()
    ann, _ = read_announcement(run.dst)
    m = Manifest.parse(run.dst.read_manifest().data)
    assert 9 in {s.step for s in ann.snapshots} and m.snapshot(9) is not None  # premise
    assert verify(run.region, deep=True).ok
    # the trainer's snapshot 9 in the region replaced by step 8's tensors, the unsigned manifest rewritten to match
    snap = m.snapshot(9)
    f = snap.files[0]
    held = st_load(run.dst.get(f.key))
    wrong = {k: run.states[8][k].clone() for k in held}
    assert any(not torch.equal(wrong[k], held[k]) for k in held)  # premise: step 8 differs there
    data = b"".join(bytes(c) for c in safetensors_stream(wrong, {"step": "9"}).chunks())
    run.dst.delete([f.key])
    run.dst.put_new(f.key, data)
    forged = dataclasses.replace(snap, files=(ObjRef.of(f.key, data), *snap.files[1:]))
    m.snapshots = [forged if s is snap else s for s in m.snapshots]
    run.dst.commit_manifest(m.to_bytes(), run.dst.read_manifest().etag)
    report = verify(run.region, deep=True)
    assert not report.ok and any("step 9: the snapshot does not match the trainer's record" in p
                                 for p in report.problems), report.problems
    assert report.steps_rebuilt == len(Manifest.parse(run.dst.read_manifest().data).steps)  # the region's path holds


class _AfterFirstFile(LocalStore):
    """A real local store that runs `hook` once, right after the first object under `prefix` is written."""

    def __init__(self, url: str, root: str, prefix: str, hook) -> None:
        super().__init__(url, root)
        self.prefix, self.hook = prefix, hook

    def put_new_stream(self, key, chunks, size, *, xxh3=None) -> None:  # type: ignore[no-untyped-def]
        super().put_new_stream(key, chunks, size, xxh3=xxh3)
        if key.startswith(self.prefix) and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()


def test_a_lagging_materialiser_never_announces_a_snapshot_a_collect_deleted(tmp_path, trainer, bits_equal):
    """Two materialisers on one region and an operator's gc. The lagging one writes its snapshot of step 6;
    meanwhile the other announces 9 and gc (keep 1) deletes every regional object no announced snapshot names
    at or below 9, the lagging one's files among them. It must not announce 6 then: the announcement would
    name objects the region lacks. Its leftovers are collected, and readers start from 9."""
    run = start_run(tmp_path, trainer, "two")
    run.publish(range(4))  # trainer snapshots 0, 3
    lead = Materialiser(run.region, tmp_path / "lead", bootstrap_from=run.origin, keep=2)

    def overtaken() -> None:
        run.publish(range(7, 10))  # trainer snapshot 9
        assert lead.sync_once(timeout=60)
        assert [s.step for s in read_announcement(run.dst)[0].snapshots][-1] == 9
        ops.gc(run.region, 1, regional_only=True)

    root = tmp_path / "two-region"
    lagging = Materialiser(_AfterFirstFile(run.region, str(root), "regional/snapshots/6/", overtaken),
                           tmp_path / "lag", bootstrap_from=run.origin, keep=2)
    assert lagging.sync_once(timeout=60)  # bootstraps at 3 and announces it
    run.publish(range(4, 7))  # trainer snapshot 6; the lead materialises only once overtaken() runs
    lagging.sync_once(timeout=60)  # reaches 6, writes its snapshot; overtaken meanwhile; then reaches 9
    ann = read_announcement(run.dst)[0]
    held = run.dst.list("regional/")
    for snap in ann.snapshots:
        for ref in (snap.index, *snap.files):
            assert held.get(ref.key) == ref.size, f"announced {snap.step} names {ref.key}, the region lacks it"
    assert 6 not in [s.step for s in ann.snapshots] and ann.snapshots[-1].step == 9
    ops.gc(run.region, 1, regional_only=True)
    assert not run.dst.list("regional/snapshots/6/")  # the leftovers of the refused announcement
    assert verify(run.region, deep=True).ok
    with Watcher(run.region, tmp_path / "dest") as w:
        assert w.sync(timeout=30) == 9 and bits_equal(w.tensors, run.states[9])
    lead.close()
    lagging.close()
