"""One conformance suite over every kind of store (#14): memory:// and another fsspec filesystem through the
generic FsspecStore path, file:// (LocalStore) and S3 (S3Store) on a moto server and on Ceph RGW 16 (a real S3
implementation whose conditional writes differ from AWS's: docs/STORES.md). Every store keeps the
contract of relay.store.Store; the publisher, watcher and relay rely on nothing else."""

from __future__ import annotations

import os
import random
import threading
import uuid
from collections.abc import Iterator

import pytest

from relay.store import (NOT_MODIFIED, Buffer, ConflictError, FsspecStore, LocalStore, ObjectExists, ObjectMissing,
                         S3Store, Store, Transfer, content_tag, open_store)

KINDS = {"memory": FsspecStore, "dir": FsspecStore, "file": LocalStore, "s3": S3Store, "rgw": S3Store}


def make_store(request, tmp_path, kind: str) -> Store:
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


@pytest.fixture(params=sorted(KINDS))
def store(request, tmp_path) -> Store:
    return make_store(request, tmp_path, request.param)


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


@pytest.mark.parametrize("key", ["regional/snapshots.json", "fleet/hosts/host-a.json"])
def test_mutable_objects_are_compare_and_swap(store, key):
    """Any key (not only the manifest) can be kept by compare-and-swap, apart from the manifest's own."""
    assert store.read_object(key) is None
    tag1 = store.commit_object(key, b'{"v": 1}', None)
    with pytest.raises(ConflictError, match=key):
        store.commit_object(key, b'{"v": 1, "fork": true}', None)
    tag2 = store.commit_object(key, b'{"v": 2}', tag1)
    with pytest.raises(ConflictError):
        store.commit_object(key, b'{"v": 3}', tag1)
    got = store.read_object(key)
    assert got.data == b'{"v": 2}' and got.etag == tag2
    assert store.read_object(key, if_none_match=tag2) is NOT_MODIFIED
    assert store.get(key) == b'{"v": 2}'
    assert store.read_manifest() is None  # the manifest is another object
    assert key in store.list(key.rpartition("/")[0] + "/")
    store.delete([key])
    assert store.read_object(key) is None
    with pytest.raises(ConflictError):
        store.commit_object(key, b'{"v": 4}', tag2)  # If-Match on a removed object
    assert store.read_object(key) is None


def test_an_oversized_mutable_object_is_read_only_up_to_the_cap(store, monkeypatch):
    """read_object reads at most MAX_MUTABLE_BYTES + 1 bytes: a larger object (a bucket writer's 300 MB
    announcement) comes back cut there, which every parser refuses by its size, without the whole object
    in memory; compare-and-swap over it still works (an operator or a materialiser replaces it)."""
    import relay.store

    monkeypatch.setattr(relay.store, "MAX_MUTABLE_BYTES", 1000)
    key = "regional/snapshots.json"
    big = bytes(range(256)) * 40  # 10,240 bytes
    store.put_new(key, big)
    got = store.read_object(key)
    assert got.data == big[:1001]
    assert store.get(key) == big  # immutable reads are whole
    tag = store.commit_object(key, b'{"v": 1}', got.etag)  # replaced by compare-and-swap
    assert store.read_object(key).data == b'{"v": 1}' and store.read_object(key).etag == tag
    small = b"x" * 1000  # at the cap: whole
    store.commit_object(key, small, tag)
    assert store.read_object(key).data == small


def test_get_at_most_reads_no_further_than_asked(store):
    """get_at_most(key, n): the whole object when it has at most n bytes, else its first n (what a reader that
    knows an object's size asks, size + 1, so that a huge object a bucket writer put under the key costs it one
    byte more than the object it wanted). Only what it returns is checked here; that the backends read no further
    is their implementation's (a bounded body read on S3, bounded chunked reads elsewhere)."""
    big = bytes(range(256)) * 4096  # 1 MiB
    store.put_new("deltas/7-0.drd", big)
    store.put_new("deltas/7-1.drd", b"")
    assert store.get_at_most("deltas/7-0.drd", len(big) + 1) == big
    assert store.get_at_most("deltas/7-0.drd", len(big)) == big
    assert store.get_at_most("deltas/7-0.drd", 1001) == big[:1001]
    assert store.get_at_most("deltas/7-1.drd", 1) == b""
    with pytest.raises(ObjectMissing):
        store.get_at_most("deltas/8-0.drd", 10)


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


# -- large objects, streamed ------------------------------------------------------------------------
# Tiny thresholds so that small objects take every path: one PutObject up to 1 MiB, multipart above
# it in parts of S3's minimum of 5 MiB (moto, like S3, refuses smaller parts but the last), three
# parts in flight, reads in 64 KiB pieces.
SMALL = Transfer(multipart_threshold=1 << 20, part_size=5 << 20, threads=3, chunk_size=1 << 16)
SIZES = {"empty": 0, "small": 1000, "threshold": 1 << 20, "threshold+1": (1 << 20) + 1,
         "three-parts": (10 << 20) + 12345}
DATA = random.Random(15).randbytes(max(SIZES.values()))


def with_transfer(store: Store, transfer: Transfer) -> Store:
    """The same store with other transfer settings."""
    if isinstance(store, S3Store):
        return S3Store(store.url, store.fs, store.root, transfer=transfer)
    if isinstance(store, LocalStore):
        return LocalStore(store.url, str(store.root), transfer=transfer)
    assert isinstance(store, FsspecStore)
    return FsspecStore(store.url, store.fs, store.root, transfer=transfer)


@pytest.fixture
def big(store) -> Store:
    """The same store with SMALL transfer settings."""
    return with_transfer(store, SMALL)


def pieces(data: bytes, step: int = 777_777) -> Iterator[Buffer]:
    """`data` as chunks of mixed buffer types and sizes that never line up with parts or read pieces."""
    for n, i in enumerate(range(0, len(data), step)):
        piece = data[i:i + step]
        yield (piece, bytearray(piece), memoryview(piece))[n % 3]


def leftovers(store: Store) -> list[str]:
    """What a failed write may have left behind: S3's open multipart uploads, dot-named temporaries."""
    if isinstance(store, S3Store):
        return [u["Key"] for u in store.fs.call_s3("list_multipart_uploads", Bucket=store.bucket).get("Uploads", [])]
    if isinstance(store, LocalStore):
        return [str(p) for p in store.root.rglob(".*") if p.name != ".manifest.lock"] if store.root.exists() else []
    assert isinstance(store, FsspecStore)
    try:
        return [p for p in store.fs.find(store.root) if p.rpartition("/")[2].startswith(".")]
    except FileNotFoundError:
        return []


def downloaded(store: Store, key: str, tmp_path, size: int | None) -> bytes:
    with open(tmp_path / "download", "w+b") as f:
        n = store.download(key, f.fileno(), size)
        f.seek(0)
        data = f.read()
    assert n == len(data)
    return data


@pytest.mark.parametrize("name", sorted(SIZES))
def test_streamed_objects_round_trip(big, tmp_path, name):
    data = DATA[:SIZES[name]]
    key = f"snapshots/3/{name}.safetensors"
    big.put_new_stream(key, pieces(data), len(data), xxh3=content_tag(data))
    assert big.get(key) == data
    chunks = list(big.iter_chunks(key))
    assert b"".join(chunks) == data and all(len(c) <= SMALL.chunk_size for c in chunks)
    assert big.content_tag_of(key) == (len(data), content_tag(data))
    assert downloaded(big, key, tmp_path, len(data)) == data
    assert downloaded(big, key, tmp_path, None) == data
    assert big.list("snapshots/") == {key: len(data)}
    assert leftovers(big) == []


def test_one_chunk_for_the_whole_object(big, tmp_path):
    """A chunk larger than a part (a tensor's buffer, typed): sliced into parts without a copy of its own."""
    data = DATA[:SIZES["three-parts"] - 1]
    typed = memoryview(bytearray(data)).cast("H")  # two-byte elements, as a BF16 tensor's buffer comes
    big.put_new_stream("snapshots/3/one.safetensors", [typed], len(data))
    assert downloaded(big, "snapshots/3/one.safetensors", tmp_path, len(data)) == data


@pytest.mark.parametrize("name", ["small", "three-parts"])
def test_streamed_create_is_create_only(big, name):
    key = "snapshots/3/model.safetensors"
    first, other = DATA[:SIZES[name]], bytes(SIZES[name])
    big.put_new_stream(key, pieces(first), len(first))
    with pytest.raises(ObjectExists, match=key):
        big.put_new_stream(key, pieces(other), len(other))
    with pytest.raises(ObjectExists):
        big.put_new(key, b"other")
    assert big.get(key) == first  # the losers changed nothing
    assert leftovers(big) == []


@pytest.mark.parametrize("name", ["small", "three-parts"])
def test_put_immutable_stream_is_idempotent_and_refuses_other_content(big, name):
    key = "snapshots/3/model.safetensors"
    data = DATA[:SIZES[name]]
    calls = []

    def source(payload: bytes = data) -> Iterator[Buffer]:
        calls.append(len(payload))
        return pieces(payload)

    big.put_immutable_stream(key, source, len(data), content_tag(data))
    big.put_immutable_stream(key, source, len(data), content_tag(data))  # a retry of the same bytes: accepted
    assert len(calls) == 2
    other = bytes(len(data))
    with pytest.raises(ConflictError, match=key):
        big.put_immutable_stream(key, lambda: pieces(other), len(other), content_tag(other))
    with pytest.raises(ConflictError, match=key):
        big.put_immutable_stream(key, lambda: pieces(data + b"x"), len(data) + 1, content_tag(data + b"x"))
    assert big.get(key) == data
    assert leftovers(big) == []


@pytest.mark.parametrize("name", ["small", "three-parts"])
def test_stream_that_is_not_what_was_declared_creates_nothing(big, name):
    """A stream shorter or longer than `size`, or whose bytes hash to another tag than the declared one (a
    source that changed while it was read): ValueError naming the key, and no object, no leftover."""
    data = DATA[:SIZES[name]]
    key = "snapshots/3/model.safetensors"
    with pytest.raises(ValueError, match=f"{key}.*gave {len(data) - 1} bytes, declared {len(data)}"):
        big.put_new_stream(key, pieces(data[:-1]), len(data))
    with pytest.raises(ValueError, match=f"{key}.*more than the declared {len(data) - 1} bytes"):
        big.put_new_stream(key, pieces(data), len(data) - 1)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    with pytest.raises(ValueError, match=f"{key}.*hash to .*declared {content_tag(data)}"):
        big.put_immutable_stream(key, lambda: pieces(bytes(flipped)), len(data), content_tag(data))
    with pytest.raises(ObjectMissing):
        big.get(key)
    assert big.list("snapshots/") == {} and leftovers(big) == []


@pytest.mark.parametrize("name", ["small", "three-parts"])
def test_stream_that_fails_midway_creates_nothing(big, name):
    data = DATA[:SIZES[name]]
    key = "snapshots/3/model.safetensors"

    def broken() -> Iterator[Buffer]:
        yield data[:len(data) // 2 + 1]
        raise RuntimeError("the trainer died")

    with pytest.raises(RuntimeError, match="the trainer died"):
        big.put_new_stream(key, broken(), len(data))
    with pytest.raises(ObjectMissing):
        big.get(key)
    assert big.list("snapshots/") == {} and leftovers(big) == []
    big.put_new_stream(key, pieces(data), len(data))  # nothing stands in the way of the next attempt
    assert big.get(key) == data


@pytest.mark.parametrize("name", ["empty", "small", "three-parts"])
def test_download_of_the_wrong_size_writes_nothing(big, tmp_path, name):
    data = DATA[:SIZES[name]]
    key = "snapshots/3/model.safetensors"
    big.put_new_stream(key, pieces(data), len(data))
    for wrong in (len(data) + 1, max(len(data) - 1, 0) if data else 7):
        with open(tmp_path / "download", "w+b") as f:
            with pytest.raises(ValueError, match=f"{key}: {len(data)} bytes, expected {wrong}"):
                big.download(key, f.fileno(), wrong)
            assert os.fstat(f.fileno()).st_size == 0  # refused from the object's size, before any write


def test_streamed_reads_of_a_missing_object(big, tmp_path):
    key = "snapshots/3/absent.safetensors"
    with pytest.raises(ObjectMissing) as info:
        next(iter(big.iter_chunks(key)))
    assert info.value.key == key
    with pytest.raises(ObjectMissing, match=key), open(tmp_path / "download", "w+b") as f:
        big.download(key, f.fileno(), 10)
    with pytest.raises(ObjectMissing, match=key):
        big.content_tag_of(key)


@pytest.mark.parametrize("name", ["small", "three-parts"])
def test_stream_overtaken_by_another_writer(big, name):
    """Another writer creates the key while this one streams (after any early check it made): the
    conditional create at the end (link(2); S3's If-None-Match: * on PutObject or on the multipart
    completion) refuses this one with ObjectExists, the other's object stays, nothing is left open."""
    key = "snapshots/3/model.safetensors"
    mine, theirs = DATA[:SIZES[name]], bytes(SIZES[name])

    def overtaken() -> Iterator[Buffer]:
        yield from pieces(mine)
        big.put_new_stream(key, pieces(theirs), len(theirs))

    with pytest.raises(ObjectExists, match=key):
        big.put_new_stream(key, overtaken(), len(mine))
    assert big.get(key) == theirs
    assert leftovers(big) == []


@pytest.mark.parametrize("kind", sorted(set(KINDS) - {"s3"}))
def test_racing_streamed_creates_have_one_winner(request, tmp_path, kind):
    """Four writers stream different multipart objects to one key at once: one wins whole, the others get
    ObjectExists, and no upload is left open. Not on moto: its check of If-None-Match on a completion is
    not atomic with the completion (S3's is), so concurrent completions all pass there; S3 is held to the
    overtaken case above, where the completions do not overlap. On RGW, whose completions are not
    create-only at all, the store creates such objects by one create-only PutObject (docs/STORES.md)."""
    big = with_transfer(make_store(request, tmp_path, kind), SMALL)
    key = "snapshots/3/model.safetensors"
    size = SIZES["three-parts"]
    gate = threading.Barrier(4)
    won: list[int] = []
    errors: list[BaseException] = []

    def go(i: int) -> None:
        payload = bytes([i]) * size
        gate.wait()
        try:
            big.put_new_stream(key, pieces(payload), size)
            won.append(i)
        except ObjectExists:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors and len(won) == 1, (won, errors)
    assert big.get(key) == bytes([won[0]]) * size
    assert leftovers(big) == []


def test_transfer_options_are_checked():
    assert Transfer.from_options({"part_size": 8 << 20}).part_size == 8 << 20
    for bad, field in [({"part_size": 1 << 20}, "part_size"), ({"threads": 0}, "threads"),
                       ({"multipart_threshold": True}, "multipart_threshold"), ({"chunk": 1}, "unknown")]:
        with pytest.raises(ValueError, match=field):
            Transfer.from_options(bad)
    assert Transfer().part_size_for(64 << 20) == 64 << 20
    assert Transfer().part_size_for(1 << 40) * 10_000 >= 1 << 40  # a 1 TiB object still fits in 10,000 parts
    with pytest.raises(ValueError, match="largest object"):
        Transfer().part_size_for(6 << 40)
    s = open_store("memory://transfer-options/run", {"transfer": {"chunk_size": 1 << 16}})
    assert s.transfer.chunk_size == 1 << 16
