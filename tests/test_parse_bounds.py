"""Untrusted JSON costs what its kind of document can legitimately cost, once per version (issue 37.4, 37.5).

A hostile writer of a bucket object must not make a reader build far more objects than an honest document of
that size holds, nor make it download and parse the same refused version at every poll; text it wrote reaches
an operator's terminal escaped."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc

import pytest

from faultproxy import FaultProxy
from relay import cli, fleet
from relay.store import open_store
from relay.watcher import Watcher


def hostile_manifest(size: int) -> bytes:
    """`[{},{},...]`: one object per 3 bytes, under every size cap."""
    n = (size - 2) // 3
    return b"[" + b"{}," * (n - 1) + b"{}]"


def manifest_gets(proxy: FaultProxy) -> list[tuple[int, int]]:
    """(status, body bytes) of each manifest GET the store answered."""
    return [(status, n) for method, path, status, n in list(proxy.served)
            if method == "GET" and path.endswith("/manifest.json")]


def test_a_hostile_manifest_is_downloaded_and_parsed_once_per_version(s3_run, tmp_path):
    proxy = FaultProxy(s3_run.region.endpoint, seed=37).start()
    options = proxy.options(s3_run.options)
    doc = hostile_manifest(8 << 20)
    open_store(s3_run.url, s3_run.options).commit_manifest(doc, None)
    w = Watcher(s3_run.url, tmp_path / "dest", poll_interval=0.1, storage_options=options)
    tracemalloc.start()
    try:
        thread = threading.Thread(target=w.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(manifest_gets(proxy)) < 8:
            time.sleep(0.1)
        w.stop()
        thread.join(60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        w.close()
        proxy.stop()
    bodies = [n for status, n in manifest_gets(proxy) if status == 200]
    assert len(manifest_gets(proxy)) >= 8  # it kept polling
    # one version: read by the poll and by the sync that refuses it, then only conditional reads (304)
    assert len(bodies) <= 2 and all(n == len(doc) for n in bodies), manifest_gets(proxy)
    assert sum(w.failures.values()) == 1, w.failures
    assert "JSON elements" in str(w.last_error) and "manifest.json" in str(w.last_error), w.last_error
    # refused before json.loads built its ~2.8M objects (~200 MiB): copies of the bytes and their text (~60 MB)
    assert peak < 12 * len(doc), peak


def test_status_fleet_escapes_what_a_region_document_says(file_run, capsys):
    store = open_store(file_run.url)
    evil = "\x1b]0;owned\x07\x1b[2J\u202e"
    doc = {"format": fleet.REGION_FORMAT, "version": fleet.VERSION, "region": "eu", "url": "s3://eu" + evil,
           "updated": time.time(), "interval": 15.0, "hosts": [], "truncated": False,
           "bad": [{"where": "fleet/hosts/x.json" + evil, "error": "broken" + evil}]}
    store.commit_object(fleet.region_key("eu"), json.dumps(doc).encode(), None)
    store.commit_object(fleet.host_key("h" + "x"), ("{\"host\": \"" + evil + "\"}").encode(), None)
    assert cli.main(["status", "--fleet", file_run.url, "--hosts"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "bad entry" in text and "broken" in text
    assert "\\x1b]0;owned\\x07" in text  # shown, as its escape
    assert not any(c in text for c in "\x1b\x07\u202e"), repr(text)


def test_wait_for_fleet_reads_a_region_document_once_per_version(s3_run):
    """A region document (up to 64 MiB, anybody's who can write the origin's fleet/regions/) is downloaded and
    parsed once per ETag by a waiting trainer, not at every 2 s poll; a refused one counts as bad each poll."""
    proxy = FaultProxy(s3_run.region.endpoint, seed=38).start()
    store = open_store(s3_run.url, proxy.options(s3_run.options))
    hostile = hostile_manifest(2 << 20)
    store.commit_object(fleet.region_key("eu"), hostile, None)
    good = {"format": fleet.REGION_FORMAT, "version": fleet.VERSION, "region": "us", "url": "s3://us",
            "updated": time.time(), "interval": 15.0, "hosts": [], "bad": [], "truncated": False}
    store.commit_object(fleet.region_key("us"), json.dumps(good).encode(), None)
    try:
        with pytest.raises(fleet.FleetTimeout) as got:
            fleet.wait_for_fleet([store], 1, timeout=3.0, poll_interval=0.2)
    finally:
        proxy.stop()
    gets = {k: [s for m, p, s, _ in proxy.served if m == "GET" and p.endswith(fleet.region_key(k))]
            for k in ("eu", "us")}
    assert len(gets["eu"]) >= 5 and gets["eu"].count(200) == 1, gets  # then 304s
    assert gets["us"].count(200) == 1, gets
    assert "0 of 0 live" in str(got.value)


def test_the_gatherer_keeps_no_entry_swapped_for_a_large_one_after_listing(s3_run):
    """An entry listed small and replaced by a large one before its GET is reported bad, and neither its bytes
    nor its last good report stay in the gatherer's cache."""
    proxy = FaultProxy(s3_run.region.endpoint, seed=39).start()
    region = open_store(s3_run.url + "-eu", proxy.options(s3_run.options))
    origin = open_store(s3_run.url, s3_run.options)
    entry = fleet.host_key("h1")
    region.commit_object(entry, b"{}", None)
    gatherer = fleet.RegionGatherer(origin, {"eu": region}, 15.0)
    direct = open_store(s3_run.url + "-eu", s3_run.options)
    proxy.add("delay", methods=("GET",), key=entry + "$", seconds=6.0, times=1)
    big = b" " * (8 << 20) + b"{}"

    def swap() -> None:  # while the GET is held, after the listing
        while not proxy.injected("delay"):
            time.sleep(0.02)
        got = direct.read_object(entry)
        direct.commit_object(entry, big, got.etag)
        swapped.set()

    swapped = threading.Event()
    swapper = threading.Thread(target=swap)
    swapper.start()
    try:
        gatherer.gather("eu")
        swapper.join(30)
        assert swapped.is_set()  # the swap landed while the GET was held
    finally:
        proxy.stop()
    doc = json.loads(origin.read_object(fleet.region_key("eu")).data)
    assert len(doc["bad"]) == 1 and f"{len(big)} bytes, over the {fleet.MAX_ENTRY_BYTES}" in doc["bad"][0]["error"]
    # what the gatherer keeps for its next conditional read: not the 8 MiB entry (8.75 MB before the fix), nor
    # the small report it replaced. Measured on the cache itself: process-wide traced memory also counts the
    # in-process moto server's and the proxy's buffers (3-10 MB seen under load).
    kept = gatherer._cache["eu"]
    assert entry not in kept and sum(len(data) for _, data in kept.values()) < fleet.MAX_ENTRY_BYTES, kept.keys()


def _as_safetensors(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header


@pytest.mark.parametrize("kind", ["announcement", "snapshot index", "safetensors file", "region document"])
def test_each_untrusted_document_is_refused_before_its_objects_are_built(kind, tmp_path):
    """Every reader of a bucket document refuses `[{},{},...]` with the reason, at the cost of its bytes."""
    from relay import announce, checkpoint, shards
    from relay.manifest import ManifestError, ObjRef, Snapshot

    doc = hostile_manifest(4 << 20)
    tracemalloc.start()
    try:
        if kind == "announcement":
            with pytest.raises(ManifestError, match="JSON elements"):
                announce.Announcement.parse(doc)
        elif kind == "snapshot index":
            snap = Snapshot(3, ObjRef("snapshots/3/model.safetensors.index.json", len(doc), "0" * 32), ())
            with pytest.raises(ManifestError, match="JSON elements"):
                shards.index_files(doc, snap)
        elif kind == "safetensors file":
            path = tmp_path / "model.safetensors"
            path.write_bytes(_as_safetensors(doc))
            with pytest.raises(checkpoint.SafetensorsError, match="JSON elements"):
                checkpoint.read_file_into(path)
        else:
            store = open_store(f"file://{tmp_path}/store/run")
            store.commit_object(fleet.region_key("eu"), doc, None)
            problems = fleet.read_fleet([store]).problems
            assert any("JSON elements" in p and "fleet/regions/eu.json" in p for p in problems), problems
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(doc), peak  # json.loads would build ~1.4M objects (~100 MiB)


def _announce_regional_file(store, step: int, data: bytes) -> str:
    """As a bucket writer could: announce a regional snapshot of `step` whose index is the one its record implies
    and whose every file is `data` (the announcement is unsigned, so its references match). Returns a file key."""
    from relay.announce import ANNOUNCE_KEY, Announcement
    from relay.checkpoint import index_bytes_of
    from relay.manifest import INDEX_NAME, Manifest, ObjRef, Record, Snapshot

    m = Manifest.parse(store.read_manifest().data)
    rec = Record.parse(store.get(m.step(step).record.key))
    prefix = f"regional/snapshots/{step}/"
    files = []
    for shard in sorted(set(rec.weight_map.values())):
        store.put_new(prefix + shard, data)
        files.append(ObjRef.of(prefix + shard, data))
    index = index_bytes_of(rec.tensors, rec.weight_map, step=step)
    store.put_new(prefix + INDEX_NAME, index)
    snap = Snapshot(step, ObjRef.of(prefix + INDEX_NAME, index), tuple(files))
    store.commit_object(ANNOUNCE_KEY, Announcement(m.run, (snap,)).to_bytes(), None)
    return files[0].key


@pytest.mark.parametrize("spooled", [True, False])
def test_a_regional_snapshot_file_header_is_bounded_by_its_record(spooled, file_run, trainer, tmp_path, caplog):
    """A regional snapshot (unsigned) of a 6-tensor step whose file has a 16 KB header of short strings (one
    element per 7 bytes, so under the bytes-per-element rule; small enough that the plan picks it over the
    chain): only the record says no file of this step has a header that long. The reader refuses it naming the
    file and the reason, before reading the header, and reaches the head from the trainer's snapshot bit-exact;
    streamed (no spool) or spooled alike."""
    import logging

    from conftest import publish_steps, same_bits
    from relay.watcher import Reader

    states = publish_steps(file_run.url, trainer, 5)  # snapshots 0 and 3, head 4
    header = b'{"h":[' + b'"abcd",' * ((16 << 10) // 7) + b'"e"]}'
    header += b" " * (-len(header) % 8)
    key = _announce_regional_file(open_store(file_run.url), 4, _as_safetensors(header))
    reader = Reader(open_store(file_run.url))
    caplog.set_level(logging.WARNING)
    m, tensors, _ = reader.reach(None, None, spool=str(tmp_path) if spooled else None)
    assert m.head == 4 and tensors is not None and same_bits(tensors, states[4])
    said = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert any(f"{key}: header of {len(header)} bytes, more than the" in s and "its step's record may have" in s
               for s in said), said


@pytest.mark.parametrize("streamed", [True, False])
def test_a_100_mib_class_header_costs_its_bytes_not_its_objects(streamed, tmp_path):
    """The worst header the 100 MiB cap and the bytes-per-element rule let through (short strings, one element
    per 7 bytes: ~14M objects, ~1 GB) against a 10-tensor record: refused naming the file before the header is
    read (streamed) or parsed, at a peak of traced memory under the header's bytes."""
    from relay import checkpoint

    header = b'{"h":[' + b'"abcd",' * ((96 << 20) // 7) + b'"e"]}'
    header += b" " * (-len(header) % 8)
    data = _as_safetensors(header)
    path = tmp_path / "model-00001-of-00002.safetensors"
    path.write_bytes(data)
    del data
    bound = checkpoint.header_bound([f"layers.{i}.weight" for i in range(10)])
    tracemalloc.start()
    try:
        with pytest.raises(checkpoint.SafetensorsError, match=f"{path.name}: header of {len(header)} bytes, more"):
            if streamed:
                with open(path, "rb") as f:
                    checkpoint.stream_into(iter(lambda: f.read(8 << 20), b""), len(header) + 8, path.name,
                                           lambda view: None, bound=bound)
            else:
                checkpoint.read_snapshot_file(path, path.name, bound=bound)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(header) // 4, peak


def test_an_honest_snapshot_of_many_tensors_is_within_its_bound(tmp_path):
    """The bound fits every honest header: 5,000 tensors with long names, 32 dimensions at the most and large
    offsets, in one file or spread over shards (each a subset of the record), with a sharded trainer's rows."""
    from relay import checkpoint, shards
    from relay.manifest import ObjRef

    names = [f"model.layers.{i}.self_attn.q_proj.weight_{'x' * 150}" for i in range(5000)]
    bound = checkpoint.header_bound(names)
    header: dict = {"__metadata__": {"step": "123456789",
                                     shards.ROWS_KEY: json.dumps({n: [10 ** 12, 10 ** 12 + 1] for n in names},
                                                                 separators=(",", ":"))}}
    offset = 0
    for i, n in enumerate(names):
        shape = [1] * (checkpoint.MAX_DIMS - 1) + [i % 3]
        header[n] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + 2 * (i % 3)]}
        offset += 2 * (i % 3)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "model.safetensors"
    path.write_bytes(_as_safetensors(raw) + b"\0" * offset)
    assert len(raw) <= bound.nbytes
    tensors, meta = checkpoint.read_file_into(path, bound=bound)
    assert len(tensors) == 5000 and shards.metadata_rows(meta, ObjRef("f", 1, "0" * 32))
    part = {n: header[n] for n in names[:2500]}  # a shard: a subset, under the record's one bound
    raw = json.dumps({"__metadata__": {"step": "1"}, **part}, separators=(",", ":")).encode()
    assert len(shards.file_names(_as_safetensors(raw), ObjRef("f", 1, "0" * 32), bound)) == 2500


def test_the_bound_covers_names_that_escape_long(tmp_path):
    """Names whose escaped forms are longest (quotes, backslashes, characters outside the BMP, `,[{`) in one
    honest sharded file with rows metadata: within the bound of a record of just those names."""
    from relay import checkpoint, shards
    from relay.manifest import ObjRef

    names = ['a"\\' * 40, "\U0001F600" * 60, ",[{" * 60, "plain"]
    header = {"__metadata__": {"step": "7", shards.ROWS_KEY: json.dumps({n: [0, 1] for n in names})}}
    for i, n in enumerate(names):
        header[n] = {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "rank-00000-of-00001-00001.safetensors"
    path.write_bytes(_as_safetensors(raw) + b"\0" * 16)
    tensors, meta = checkpoint.read_file_into(path, bound=checkpoint.header_bound(names))
    assert set(tensors) == set(names) and set(shards.metadata_rows(meta, ObjRef("f", 1, "0" * 32))) == set(names)


def test_a_reader_loads_an_honest_snapshot_of_5000_tensors(file_run, tmp_path):
    """The bound is per record: a published snapshot of 5,000 tensors in several shards (each a subset of the
    record's tensors) is reached bit-exact, streamed and spooled."""
    import torch

    from conftest import same_bits
    from relay.publisher import Publisher
    from relay.watcher import Reader

    g = torch.Generator().manual_seed(5)
    state = {f"model.layers.{i // 10}.mlp.experts.{i % 10}.w": torch.randn(3, 2, generator=g).to(torch.bfloat16)
             for i in range(5000)}
    with Publisher(file_run.url, background=False, max_shard_bytes=16 << 10) as pub:
        pub.publish(state, 0)
    reader = Reader(open_store(file_run.url))
    for spool in (None, str(tmp_path)):
        m, tensors, _ = reader.reach(None, None, spool=spool)
        assert m.head == 0 and tensors is not None and same_bits(tensors, state)
    assert reader.verify_failures == 0


def test_a_manifest_damaged_in_flight_is_read_again_after_the_backoff(s3_run, trainer):
    """A refused version is remembered for the reader's failure backoff, not until the publisher's next commit:
    bytes flipped on the way fail under the stored version's ETag too, and that version is genuine. Within the
    backoff the refusal comes from memory (one conditional read, no body); after it, the version is read again."""
    from relay import Publisher
    from relay.manifest import ManifestError
    from relay.watcher import Reader

    t = trainer(seed=5)
    with Publisher(s3_run.url, storage_options=s3_run.options, background=False) as pub:
        for step in range(2):
            pub.publish(t.step(), step)
    proxy = FaultProxy(s3_run.region.endpoint, seed=41).start()
    try:
        for _ in range(20):  # a flip may also land where the document still parses: try again until one is refused
            reader = Reader(open_store(s3_run.url, proxy.options(s3_run.options)), failure_backoff_initial=1.0,
                            failure_backoff_max=1.0)
            proxy.add("flip", methods=("GET",), key=r"/manifest\.json$", times=1)
            try:
                reader.read_manifest()
            except ManifestError:
                break  # the damaged bytes: refused
            finally:
                proxy.clear()
        else:
            pytest.fail("20 single-bit flips of the manifest all parsed")
        with pytest.raises(ManifestError, match="was refused already"):
            reader.read_manifest()  # within the backoff: from memory
        assert [status for status, _ in manifest_gets(proxy)][-1] == 304
        time.sleep(1.2)
        m = reader.read_manifest()  # the backoff over: the genuine version, with no new commit
        assert m is not None and m.head == 1
    finally:
        proxy.stop()
