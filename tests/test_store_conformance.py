"""One conformance suite over every kind of store (#14): memory:// and another fsspec filesystem through the
generic FsspecStore path, file:// (LocalStore) and S3 on a moto server (S3Store). Every store keeps the
contract of relay.store.Store; the publisher, watcher and relay rely on nothing else."""

from __future__ import annotations

import threading
import uuid

import pytest

from relay.store import (NOT_MODIFIED, ConflictError, FsspecStore, LocalStore, ObjectExists, ObjectMissing, S3Store,
                         Store, open_store)

KINDS = {"memory": FsspecStore, "dir": FsspecStore, "file": LocalStore, "s3": S3Store}


@pytest.fixture(params=sorted(KINDS))
def store(request, tmp_path) -> Store:
    kind = request.param
    if kind == "memory":
        s = open_store(f"memory://conformance-{uuid.uuid4().hex}/run")
    elif kind == "dir":  # fsspec's DirFileSystem over a local directory: a filesystem that needs its parents made
        (tmp_path / "dirfs").mkdir()
        s = open_store("dir://run", {"path": str(tmp_path / "dirfs"), "target_protocol": "file"})
    else:
        run = request.getfixturevalue(f"{kind}_run")
        s = open_store(run.url, run.options)
    assert type(s) is KINDS[kind]
    return s


def test_store_is_an_abstract_interface():
    with pytest.raises(TypeError):
        Store()  # type: ignore[abstract]

    class Half(Store):
        def get(self, key):
            return b""

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]


def test_missing_objects(store):
    with pytest.raises(ObjectMissing) as info:
        store.get("deltas/5-0.drd")
    assert info.value.key == "deltas/5-0.drd" and "deltas/5-0.drd" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert store.list("deltas/") == {} and store.list("snapshots/") == {}
    store.delete(["deltas/9-0.drd", "snapshots/3/x.safetensors"])  # absent keys are not an error


def test_create_only_objects_round_trip_exactly(store):
    blobs = {"records/4.json": b'{"a": 1}', "deltas/4-0.drd": bytes(range(256)) * 4096, "deltas/4-1.drd": b"",
             "snapshots/4/model-00001-of-00001.safetensors": b"\x00\xff" * 1000}
    for key, data in blobs.items():
        store.put_new(key, data)
    for key, data in blobs.items():
        assert store.get(key) == data
    with pytest.raises(ObjectExists):
        store.put_new("deltas/4-0.drd", b"other")
    assert store.get("deltas/4-0.drd") == blobs["deltas/4-0.drd"]  # the loser changed nothing
    store.put_immutable("deltas/4-0.drd", blobs["deltas/4-0.drd"])  # the same bytes again: an idempotent retry
    with pytest.raises(ConflictError, match="deltas/4-0.drd"):
        store.put_immutable("deltas/4-0.drd", b"other")
    assert store.list("deltas/") == {"deltas/4-0.drd": len(blobs["deltas/4-0.drd"]), "deltas/4-1.drd": 0}
    assert store.list("snapshots/") == {"snapshots/4/model-00001-of-00001.safetensors": 2000}
    assert set(store.list("records/")) == {"records/4.json"}


def test_list_and_delete_are_never_stale(store):
    store.put_new("snapshots/1/a.safetensors", b"a")
    assert set(store.list("snapshots/")) == {"snapshots/1/a.safetensors"}
    store.put_new("snapshots/2/b.safetensors", b"bb")
    assert store.list("snapshots/") == {"snapshots/1/a.safetensors": 1, "snapshots/2/b.safetensors": 2}
    store.delete(["snapshots/1/a.safetensors"])
    assert store.list("snapshots/") == {"snapshots/2/b.safetensors": 2}
    with pytest.raises(ObjectMissing):
        store.get("snapshots/1/a.safetensors")
    store.put_new("snapshots/1/a.safetensors", b"again")  # a deleted key can be created anew
    assert store.get("snapshots/1/a.safetensors") == b"again"
    assert "manifest.json" not in store.list("")


def test_manifest_commit_is_compare_and_swap(store):
    assert store.read_manifest() is None
    tag1 = store.commit_manifest(b'{"v": 1}', None)
    with pytest.raises(ConflictError):
        store.commit_manifest(b'{"v": 1, "fork": true}', None)  # If-None-Match: * on an existing manifest
    tag2 = store.commit_manifest(b'{"v": 2}', tag1)
    assert tag2 != tag1
    with pytest.raises(ConflictError):
        store.commit_manifest(b'{"v": 3}', tag1)  # stale If-Match
    got = store.read_manifest()
    assert got.data == b'{"v": 2}' and got.etag == tag2  # the losers changed nothing
    assert store.read_manifest(if_none_match=tag2) is NOT_MODIFIED
    assert store.read_manifest(if_none_match=tag1).data == b'{"v": 2}'
    assert store.get("manifest.json") == b'{"v": 2}'


def test_racing_commits_have_one_winner(store):
    """Eight writers commit from the same version at once: exactly one wins, the manifest is the winner's."""
    base = store.commit_manifest(b"base", None)
    gate = threading.Barrier(8)
    won: list[int] = []
    lost: list[int] = []

    def go(i: int) -> None:
        gate.wait()
        try:
            store.commit_manifest(f"writer {i}".encode(), base)
            won.append(i)
        except ConflictError:
            lost.append(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(won) == 1 and len(lost) == 7, (won, lost)
    assert store.read_manifest().data == f"writer {won[0]}".encode()


def test_racing_creates_have_one_winner(store):
    gate = threading.Barrier(6)
    won: list[int] = []

    def go(i: int) -> None:
        gate.wait()
        try:
            store.put_new("records/7.json", f"writer {i}".encode())
            won.append(i)
        except ObjectExists:
            pass

    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert len(won) == 1 and store.get("records/7.json") == f"writer {won[0]}".encode()
