"""The store layer (relay/store.py, relay/retry.py, relay/traffic.py) in the cases an adversarial review found
uncovered (docs/RELIABILITY.md has each finding, before and after): a refused multipart completion with no
object, a mutable object replaced mid-read, a store at the filesystem root, get_at_most's bound, Backoff's
overflow, what CountingStore counts for a create that did not happen."""

from __future__ import annotations

import random
import uuid

import pytest

from relay.retry import Backoff
from relay.store import (FsspecStore, ObjectChanged, ObjectMissing, S3Store, Transfer, content_tag, open_store)
from relay.traffic import CountingStore


def memory_store(transfer: Transfer | None = None) -> FsspecStore:
    s = open_store(f"memory://store-faults-{uuid.uuid4().hex}/run", transfer=transfer)
    assert isinstance(s, FsspecStore)
    return s


# -- S3: a refused multipart completion reported as a success --------------------------------------------------

def test_refused_multipart_completion_without_an_object_is_not_reported_as_created(s3_run, monkeypatch):
    """S3Store._complete treats a 409/412 on CompleteMultipartUpload as "our own completion had landed" when
    `self._etag(key) == _multipart_etag(part etags)`. When the part ETags are not plain MD5s (SSE-KMS/SSE-C,
    or an S3-compatible store; `_multipart_etag` then returns None, as its docstring says) and the key does
    not exist (a 409 ConditionalRequestConflict: a concurrent request, retry), this is `None == None`. The
    upload is then reported as created although it created nothing, and the upload is never aborted.
    put_new_stream returns, the publisher's manifest names an object that does not exist, and every watcher
    waits for it.

    Expected: an error (or a retried completion that really creates the object). Never a successful return
    with no object under the key. Fix: accept only when the expected multipart ETag is not None and equals
    the HEAD's ETag (or compare size plus the declared xxh3 by reading back). Otherwise raise ObjectExists
    only when HEAD shows an object, and a transient error when it does not."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    small = Transfer(multipart_threshold=1 << 20, part_size=5 << 20, threads=2, chunk_size=1 << 16)
    base = open_store(s3_run.url, s3_run.options)
    store = S3Store(base.url, base.fs, base.root, transfer=small)
    data = random.Random(3).randbytes((5 << 20) + 1234)  # two parts
    key = "snapshots/4/model-00001-of-00001.safetensors"
    real = store.fs.call_s3

    def opaque(etag: str) -> str:  # a part ETag that is not an MD5 (what SSE-KMS and other stores give)
        return f'"{etag.strip(chr(34))}:opaque"'

    def call_s3(method, *args, **kw):
        if method == "complete_multipart_upload":  # a concurrent request on the key: 409, retry
            raise translate_boto_error(ClientError(
                {"Error": {"Code": "ConditionalRequestConflict", "Message": "conflicting operation"},
                 "ResponseMetadata": {"HTTPStatusCode": 409}}, "CompleteMultipartUpload"))
        out = real(method, *args, **kw)
        if method == "upload_part":
            out = {**out, "ETag": opaque(out["ETag"])}
        elif method == "list_parts":
            out = {**out, "Parts": [{**p, "ETag": opaque(p["ETag"])} for p in out.get("Parts", [])]}
        return out

    monkeypatch.setattr(store.fs, "call_s3", call_s3)
    try:
        store.put_new_stream(key, [data], len(data), xxh3=content_tag(data))
    except Exception:  # noqa: BLE001 - refusing is correct: nothing was created
        created = False
    else:
        created = True
    monkeypatch.undo()
    if created:
        try:
            got = base.get(key)
        except ObjectMissing:
            pytest.fail("put_new_stream returned success after a refused completion, and no object exists")
        assert got == data


# -- memory:// and other fsspec stores ---------------------------------------------------------------------------

def test_fsspec_read_of_an_object_replaced_mid_read_never_mixes_two_versions():
    """FsspecStore.iter_chunks (and so read_object, get_at_most and content_tag_of, which read through it)
    takes the size from the first info() and then issues independent ranged cat_file calls. When a mutable
    object (the manifest, the region's announcement, a fleet entry) is replaced by compare-and-swap between
    two ranges with one that is as long or longer, the ranges come from different versions and no check sees
    it. Only a short range is checked. read_object then returns bytes that were never stored, together with
    a content tag of those bytes as the ETag. That breaks the contract "a reader sees a whole object or none"
    and iter_chunks' "never a short object ... an error".

    Expected: one version whole, or ObjectChanged. Fix: read a mutable object with one cat_file capped at
    the limit (memory:// holds it whole anyway). For ranged reads, pin a version (compare the info()
    size/etag/mtime/generation before and after, or keep one open file handle) and raise ObjectChanged when
    it moved."""
    s = memory_store(Transfer(chunk_size=4096))
    key = "regional/snapshots.json"
    v1, v2 = b"a" * 10_000, b"b" * 12_000
    tag = s.commit_object(key, v1, None)
    real = s.fs.cat_file
    calls = []

    def cat_file(path, start=None, end=None, **kw):
        out = real(path, start=start, end=end, **kw)
        calls.append(path)
        if len(calls) == 1:  # another writer's compare-and-swap lands between our first and second range
            s.commit_object(key, v2, tag)
        return out

    s.fs.cat_file = cat_file
    try:
        got = s.read_object(key)
    except ObjectChanged:
        return
    finally:
        del s.fs.cat_file
    assert got is not None
    assert got.data in (v1, v2), (f"read_object returned {len(got.data)} bytes that no writer stored: "
                                  f"{got.data[:3]!r}...{got.data[-3:]!r}")


def test_fsspec_store_at_the_filesystem_root_lists_its_keys_whole():
    """FsspecStore.list strips `self.root.strip("/") + "/"` from every path. For a store at the root of its
    filesystem (`memory://`, root ""), that prefix is "/", which is one character although nothing is
    there to strip. Every listed key loses its first letter: 'deltas/1-0.drd' is listed as 'eltas/1-0.drd'.
    list_run, gc (relay.ops), require_no_leftovers, the fleet and announcement readers then see keys that do
    not exist. gc "deletes" absent keys and frees nothing. A fleet reader drops every host entry.

    Expected: the keys as written. Fix: `root = self.root.strip("/"); skip = len(root) + 1 if root else 0`."""
    s = open_store("memory://")
    assert isinstance(s, FsspecStore)
    key = f"deltas/{uuid.uuid4().int % 10**12}-0.drd"
    s.put_new(key, b"x")
    try:
        assert key in s.list("deltas/"), s.list("deltas/")
    finally:
        s.delete([key])


def test_fsspec_get_at_most_reads_no_more_than_its_limit():
    """Store.get_at_most promises that "a store that holds a huge object under the key costs it `limit`
    bytes, not the object". FsspecStore inherits _read_capped, which pulls whole iter_chunks pieces
    (transfer.chunk_size, 8 MiB by default) and cuts them afterwards. A reader asking for a 1 KiB record's
    size + 1 reads a whole chunk of the huge object a bucket writer put there, 8192 times more than asked.
    With the default Transfer that is 8 MiB per object per try. LocalStore and S3Store read no further
    than the limit.

    Expected: no more than `limit` bytes fetched. Fix: FsspecStore.get_at_most = `_chunks(key,
    min(self._size(key), limit))` (and the same cap for read_object)."""
    s = memory_store(Transfer(chunk_size=1 << 20))
    key = "records/5.json"
    s.put_new(key, bytes(4 << 20))  # a 4 MiB object where a 1 KiB record was expected
    real = s.fs.cat_file
    fetched = []

    def cat_file(path, start=None, end=None, **kw):
        out = real(path, start=start, end=end, **kw)
        fetched.append(len(out))
        return out

    s.fs.cat_file = cat_file
    try:
        got = s.get_at_most(key, 1025)
    finally:
        del s.fs.cat_file
    assert len(got) == 1025
    assert sum(fetched) <= 1025, f"fetched {sum(fetched)} bytes from the store to return 1025"


def test_get_at_most_with_a_negative_limit_returns_nothing():
    """Store._read_capped cuts each chunk with `memoryview(chunk)[: limit - len(out)]`. For a negative
    limit, that is a slice from the end: get_at_most(key, -1) on memory:// (and on any Store that inherits
    it) returns the first chunk minus its last byte. LocalStore and S3Store return b"" for the same call.
    The backends disagree, and a caller's bound ("at most -1 bytes") turns into "almost a whole chunk".

    Expected: b"" (as LocalStore and S3Store return) or ValueError on every backend. Fix: clamp with
    `max(limit, 0)` or refuse a negative limit in Store.get_at_most."""
    s = memory_store()
    s.put_new("deltas/3-0.drd", b"0123456789")
    try:
        got = s.get_at_most("deltas/3-0.drd", -1)
    except ValueError:
        return
    assert got == b"", f"get_at_most(key, -1) returned {got!r}"


# -- retry.py ----------------------------------------------------------------------------------------------------

def test_backoff_delay_stays_finite_after_many_failures_for_any_factor():
    """Backoff.delay caps the exponent at 1000 "before it can overflow: a region that has failed for days
    keeps a finite wait". But `float ** 999` overflows for any factor above about 2.03, so
    Backoff(1.0, 60.0, 3.0).delay(1000) raises OverflowError instead of returning 60. The relay's retry loop
    (fanout's per-region backoff, the watcher's waits) would then crash after a long outage instead of
    waiting `maximum`. __post_init__ accepts any factor >= 1.

    Expected: `maximum` once the wait has reached it. Fix: return `maximum` once
    `failures - 1 >= log(maximum / initial, factor)` (or cap the exponent there), or compute with
    math.pow inside try/except OverflowError."""
    b = Backoff(1.0, 60.0, 3.0)
    assert b.delay(10) == 60.0
    assert b.delay(1000) == 60.0


# -- traffic.py --------------------------------------------------------------------------------------------------

def test_counting_store_counts_an_idempotent_streamed_create_as_what_moved():
    """CountingStore.put_immutable_stream delegates to the inner store and then counts `size` bytes written,
    whatever happened. When the object is already there with the same bytes (an idempotent retry, a second
    writer of a deterministic snapshot, the regional relay), nothing was written. The inner store instead
    read the whole object back (content_tag_of on the inner store, which is not counted). The traffic split
    (docs: "only a count by kind, taken where the bytes really move") then reports a snapshot's size as
    uploaded and nothing read. put_immutable (not streamed) counts the same case correctly: 0 written and
    the read-back as read.

    Expected: an existing identical object adds nothing to `written` (and its read-back is counted as read),
    as put_immutable does. Fix: implement put_immutable_stream in CountingStore through the inherited
    Store.put_immutable_stream, so that it calls the counted put_new_stream and content_tag_of/iter_chunks.
    Or count only on a create that happened."""
    inner = memory_store()
    data = random.Random(5).randbytes(100_000)
    key = "snapshots/3/model-00001-of-00001.safetensors"
    inner.put_new(key, data)  # already there: a retry of a write that landed

    plain = CountingStore(inner)
    plain.put_immutable(key, data)  # the non-streamed path counts this correctly
    assert plain.written.bytes()["snapshots"] == 0

    counted = CountingStore(inner)
    counted.put_immutable_stream(key, lambda: [data], len(data), content_tag(data))
    assert counted.written.bytes()["snapshots"] == 0, (
        f"{counted.written.bytes()['snapshots']} bytes counted as written; nothing was written")
