"""`deltarelay verify` (the store's fsck): a healthy run passes; a missing object, a corrupted object,
a forged manifest and a record that lies about the weights are each found and listed, on file://
and on S3 (moto)."""

from __future__ import annotations

import dataclasses
import json


from relay.cli import main as cli_main
from relay.manifest import Manifest, Record, TensorInfo
from relay.publisher import Publisher
from relay.signing import Signer, generate_keypair
from relay.store import open_store
from relay.verify import verify


def publish(run, trainer, steps=6, **kw):
    t = trainer(seed=11)
    with Publisher(run.url, storage_options=run.options, snapshot_every=3, background=False, **kw) as pub:
        for step in range(steps):
            pub.publish(t.state() if step == 0 else t.step(), step)
    store = open_store(run.url, run.options)
    return store, Manifest.parse(store.read_manifest().data)


def replace(store, key: str, data: bytes) -> None:
    store.delete([key])
    store.put_new(key, data)


def commit(store, m: Manifest, **kw) -> None:
    store.commit_manifest(m.to_bytes(**kw), store.read_manifest().etag)


def test_healthy_run(run_store, trainer):
    store, m = publish(run_store, trainer)
    report = verify(run_store.url, run_store.options, deep=True)
    assert report.ok, report.text()
    assert report.objects_checked >= len(m.referenced()) and report.bytes_checked > 0
    assert report.steps_rebuilt == len(m.steps) == 6 and report.signature == "unsigned"
    assert report.unreferenced == 0
    assert "no problems found" in report.text()


def test_missing_and_corrupted_objects(run_store, trainer):
    store, m = publish(run_store, trainer)
    delta = m.step(2).parts[0].ref.key
    shard = m.snapshot(3).files[0].key
    store.delete([delta])
    data = bytearray(store.get(shard))
    data[len(data) // 2] ^= 0x10  # one bit flip in the middle of the weights
    replace(store, shard, bytes(data))
    report = verify(run_store.url, run_store.options, deep=True)
    assert not report.ok
    text = "\n".join(report.problems)
    assert f"{delta}: missing" in text
    assert f"{shard}: corrupt (xxh3" in text
    assert len(report.problems) == 2, report.problems
    # step 2 and step 3 (its delta from 2 is fine, but 2 cannot be built, and its snapshot is bad) are lost;
    # steps 4-5 come from nowhere either: deltas from 3, which is unbuilt
    assert report.steps_rebuilt == 2 and "2-5" in " ".join(report.notes)


def test_record_that_lies_is_found_only_by_deep(run_store, trainer):
    """A record whose digests were altered (tags recomputed in an unsigned manifest) passes the shallow check:
    every object matches the manifest; the deep check rebuilds the step and finds the weights disagree."""
    store, m = publish(run_store, trainer)
    head = m.step(m.head)
    rec = Record.parse(store.get(head.record.key))
    name = next(iter(rec.tensors))
    info = rec.tensors[name]
    rec.tensors[name] = TensorInfo(info.dtype, info.shape, "0" * 32)
    data = rec.to_bytes()
    replace(store, head.record.key, data)
    from relay.manifest import ObjRef, Step

    m.steps[-1] = Step(head.step, ObjRef.of(head.record.key, data), head.parent, head.parts)
    commit(store, m)
    assert verify(run_store.url, run_store.options).ok
    report = verify(run_store.url, run_store.options, deep=True)
    assert not report.ok and f"step {m.head}: the state rebuilt through its delta does not match" in report.problems[0]


def test_forged_manifest(run_store, trainer, tmp_path):
    good_key, good_pub, _ = generate_keypair(tmp_path / "good")
    evil_key, _, evil_id = generate_keypair(tmp_path / "evil")
    store, m = publish(run_store, trainer, signing_key=good_key)
    report = verify(run_store.url, run_store.options, trusted_keys=[good_pub], deep=True)
    assert report.ok and report.signature.startswith("valid"), report.text()
    commit(store, m, signer=Signer(evil_key))
    report = verify(run_store.url, run_store.options, trusted_keys=[good_pub])
    assert not report.ok and report.signature == "INVALID" and report.signed_by == [evil_id]
    assert "none of them trusted" in report.problems[0]
    report = verify(run_store.url, run_store.options)  # without keys: says so, does not pretend
    assert report.ok and report.signature.startswith("present, not checked")


def test_unparsable_or_absent_manifest(file_run, trainer):
    assert verify(file_run.url).problems == [f"{file_run.url}/manifest.json: missing (no run here)"]
    store, m = publish(file_run, trainer, steps=2)
    store.commit_manifest(b'{"format": "deltarelay.manifest", "version": 1}', store.read_manifest().etag)
    report = verify(file_run.url)
    assert not report.ok and "missing field" in report.problems[0]


def test_cli_exit_status_and_listing(run_store, trainer, capsys):
    store, m = publish(run_store, trainer, steps=4)
    opts = ["--storage-options", json.dumps(run_store.options)] if run_store.options else []
    assert cli_main(["verify", run_store.url, "--deep", *opts]) == 0
    assert "no problems found" in capsys.readouterr().out
    gone = [m.step(1).record.key, m.step(2).parts[0].ref.key]
    store.delete(gone)
    assert cli_main(["verify", run_store.url, "--json", *opts]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and sorted(out["problems"]) == sorted(f"{k}: missing" for k in gone)


def test_index_that_maps_tensors_to_the_wrong_file_is_found_by_deep(run_store, trainer, tmp_path):
    """A snapshot index (tags recomputed in an unsigned manifest) that swaps two tensors between the snapshot's
    files: every file is sound and the snapshot rebuilds, but a partial replica fetches only the files its tensors
    map to, so it cannot start there (it takes another path, or none). The deep check compares each file's
    tensors with what the index maps to it."""
    from relay.manifest import ObjRef

    store, m = publish(run_store, trainer, max_shard_bytes=20_000)
    snap = m.snapshot(3)
    assert len(snap.files) >= 2  # premise: tensors spread over several files
    doc = json.loads(store.get(snap.index.key))
    by_file: dict[str, list[str]] = {}
    for name, file in doc["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    (fa, na), (fb, nb) = [(f, ns[0]) for f, ns in sorted(by_file.items())[:2]]
    doc["weight_map"][na], doc["weight_map"][nb] = fb, fa
    data = json.dumps(doc, indent=1).encode()
    replace(store, snap.index.key, data)
    m.snapshots = [dataclasses.replace(s, index=ObjRef.of(s.index.key, data)) if s is snap else s
                   for s in m.snapshots]
    commit(store, m)
    assert verify(run_store.url, run_store.options).ok  # shallow: every object matches the manifest
    report = verify(run_store.url, run_store.options, deep=True)
    assert not report.ok
    text = "\n".join(report.problems)
    assert f"maps ['{na}'] to {snap.index.key.rsplit('/', 1)[0]}/{fb}, which lacks them" in text, text


class _Live(bytes):
    """Bytes of a snapshot file handed to verify, counted while anything holds them."""

    live = 0
    peak = 0

    def __new__(cls, data: bytes) -> "_Live":
        out = super().__new__(cls, data)
        cls.live += 1
        cls.peak = max(cls.peak, cls.live)
        return out

    def __del__(self) -> None:
        type(self).live -= 1


def test_verify_never_holds_a_whole_snapshot_of_serialized_bytes(file_run, trainer, monkeypatch):
    """A shallow check hashes snapshot files as they stream (a 1 TB policy's shards are gigabytes each, four
    workers at a time); a deep one reads a snapshot one file at a time, letting each file's bytes go once its
    tensors are read."""
    import relay.verify as verify_mod

    store, m = publish(file_run, trainer, max_shard_bytes=4096)
    files = [f.key for s in m.snapshots for f in s.files]
    assert len(m.snapshots[0].files) >= 3, "the test needs snapshots of several files"
    whole: list[str] = []
    real_open = verify_mod.open_store

    def opened(url, options=None):
        s = real_open(url, options)
        real_get = s.get_at_most

        def get_at_most(key, limit):
            data = real_get(key, limit)
            if key in files:
                whole.append(key)
                return _Live(data)
            return data

        s.get_at_most = get_at_most
        return s

    monkeypatch.setattr(verify_mod, "open_store", opened)
    shallow = verify(file_run.url, file_run.options)
    assert shallow.ok, shallow.text()
    assert whole == [] and shallow.bytes_checked >= sum(f.size for s in m.snapshots for f in s.files)
    _Live.live = _Live.peak = 0
    deep = verify(file_run.url, file_run.options, deep=True)
    assert deep.ok and deep.steps_rebuilt == 6, deep.text()
    assert sorted(set(whole)) == sorted(files)  # deep read every file ...
    assert _Live.peak == 1  # ... one at a time


def test_streamed_snapshot_check_finds_a_longer_or_shorter_file(file_run, trainer):
    store, m = publish(file_run, trainer, max_shard_bytes=4096)
    longer, shorter = m.snapshot(3).files[0].key, m.snapshot(3).files[1].key
    replace(store, longer, store.get(longer) + b"\0" * 64)
    replace(store, shorter, store.get(shorter)[:-1])
    report = verify(file_run.url, file_run.options)
    text = "\n".join(report.problems)
    assert f"{longer}: corrupt (more than the manifest's" in text
    assert f"{shorter}: corrupt (" in text and "bytes, manifest says" in text
