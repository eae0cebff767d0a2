"""Faults on the wire during the streamed transfers of large objects (tests/faultproxy.py between s3fs and moto).

A multipart upload must survive transient failures of its parts and of its completion, refuse a part the
store holds torn (nothing becomes visible, no upload stays open), and a ranged download must re-fetch a
body cut mid-range and never deliver a short or mixed object."""

from __future__ import annotations

import logging
import random

import pytest

from faultproxy import FaultProxy
from relay.store import ObjectChanged, ObjectExists, ObjectMissing, S3Store, Transfer, content_tag, open_store

CFG = {"retries": {"total_max_attempts": 2, "mode": "legacy"}, "connect_timeout": 2, "read_timeout": 2}
# parts of S3's minimum 5 MiB (moto enforces it), ranges of the same size, reads in 256 KiB pieces
SMALL = Transfer(multipart_threshold=1 << 20, part_size=5 << 20, threads=3, chunk_size=1 << 18)
DATA = random.Random(16).randbytes((15 << 20) + 4321)  # four parts
KEY = "snapshots/8/model-00001-of-00001.safetensors"


@pytest.fixture
def origin(moto_regions):
    region = moto_regions("us-east-1")
    bucket = region.new_bucket("stream")
    proxies: list[FaultProxy] = []

    def through_proxy(seed: int = 0, transfer: Transfer = SMALL, **config: object) -> tuple[FaultProxy, S3Store]:
        p = FaultProxy(region.endpoint, seed=seed).start()
        proxies.append(p)
        store = open_store(f"s3://{bucket}/run", p.options(region.options, **{**CFG, **config}), transfer=transfer)
        assert isinstance(store, S3Store)
        store.capabilities()  # the store's probe (relay.s3probe) before any rule: the rules count the upload's requests
        return p, store

    direct = open_store(f"s3://{bucket}/run", region.options, transfer=SMALL)
    yield through_proxy, direct, region, bucket
    for p in proxies:
        p.stop()


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.INFO, logger="relay")
    return caplog


def chunks(data: bytes = DATA, step: int = 1 << 20):
    return (data[i:i + step] for i in range(0, len(data), step))


def open_uploads(store: S3Store) -> list:
    return store.fs.call_s3("list_multipart_uploads", Bucket=store.bucket).get("Uploads", [])


def test_multipart_upload_survives_transient_faults(origin, logs):
    """500s and resets on part uploads (before and after the store took the part) and a completion whose
    answer is lost (the store applied it): the object is created once, exactly, and no upload stays open."""
    through_proxy, direct, _, _ = origin
    proxy, store = through_proxy(seed=1)
    proxy.add("error", methods=("PUT",), status=500, code="InternalError", times=3)
    proxy.add("reset", methods=("PUT",), times=1)  # rules fire in order: each sees the requests the ones
    proxy.add("reset_after", methods=("PUT",), times=1)  # before it let through
    proxy.add("error", methods=("PUT",), status=503, code="SlowDown", times=1)
    proxy.add("error_after", methods=("POST",), after=1, status=500, code="InternalError", times=1)  # the completion
    store.put_immutable_stream(KEY, chunks, len(DATA), content_tag(DATA))
    assert direct.get(KEY) == DATA
    assert {i.action for i in proxy.log} == {"error", "reset", "reset_after", "error_after"}
    assert open_uploads(direct) == []


def test_completion_that_landed_before_its_refused_retry_is_recognised(origin, logs):
    """S3 answers the retry of a completion that had landed with 412 (the key now exists): the store knows its
    own object by the multipart ETag (MD5 of the parts' MD5s) and reports success, not ObjectExists."""
    through_proxy, direct, _, _ = origin
    proxy, store = through_proxy(seed=2)
    proxy.add("error_after", methods=("POST",), after=1, status=412, code="PreconditionFailed", times=1)
    store.put_new_stream(KEY, chunks(), len(DATA))
    assert proxy.injected("error_after")
    assert direct.get(KEY) == DATA and "had landed" in logs.text
    direct.delete([KEY])
    proxy.add("error", methods=("POST",), after=1, status=412, code="PreconditionFailed", times=1)
    with pytest.raises(OSError, match="no object exists: nothing was created") as refused:
        store.put_new_stream(KEY, chunks(), len(DATA))  # a 412 with nothing under the key: not ObjectExists
    assert not isinstance(refused.value, ObjectExists)
    assert open_uploads(direct) == []
    direct.put_new(KEY, b"another writer's object")
    proxy.add("error", methods=("POST",), after=1, status=412, code="PreconditionFailed", times=1)
    with pytest.raises(ObjectExists):  # a 412 for an object that is not this upload's: refused as such
        store.put_new_stream(KEY, chunks(), len(DATA))
    assert open_uploads(direct) == []


def test_torn_part_is_refused_before_completion(origin, logs):
    """A part cut on the way by a path without checksums is stored short: ListParts shows it, the upload is
    aborted before anything is visible, and a new attempt creates the object whole."""
    through_proxy, direct, _, _ = origin
    proxy, store = through_proxy(seed=3)
    proxy.add("truncate_request", methods=("PUT",), after=1, times=1, fraction=0.5)
    with pytest.raises(OSError, match=rf"{KEY}: multipart part \d is stored as \(\d+, .*torn on the way"):
        store.put_immutable_stream(KEY, chunks, len(DATA), content_tag(DATA))
    assert proxy.injected("truncate_request")
    with pytest.raises(ObjectMissing):
        direct.get(KEY)
    assert open_uploads(direct) == []
    store.put_immutable_stream(KEY, chunks, len(DATA), content_tag(DATA))
    assert direct.get(KEY) == DATA


def test_part_that_fails_for_good_aborts_the_upload(origin, logs):
    """Every upload of one part refused: the error reaches the caller, the upload is aborted, nothing is
    visible, and the part was sent no more than PART_ATTEMPTS times over s3fs's and botocore's retries."""
    through_proxy, direct, _, _ = origin
    proxy, store = through_proxy(seed=4)
    proxy.add("error", methods=("PUT",), status=403, code="AccessDenied")
    with pytest.raises(PermissionError):
        store.put_new_stream(KEY, chunks(), len(DATA))
    with pytest.raises(ObjectMissing):
        direct.get(KEY)
    assert open_uploads(direct) == []
    assert len(proxy.injected("error")) <= SMALL.threads + 1  # refusals are not retried


@pytest.mark.parametrize("read", ["download", "iter_chunks"])
def test_body_cut_mid_range_is_fetched_again(origin, tmp_path, logs, read):
    """Response bodies cut mid-range (the full Content-Length declared, then the connection closed) and 503s:
    each range is fetched again from where it broke, and what arrives is exact, never short."""
    through_proxy, direct, _, _ = origin
    direct.put_new_stream(KEY, chunks(), len(DATA))
    proxy, store = through_proxy(seed=5)
    proxy.add("truncate", methods=("GET",), times=3, fraction=0.4)
    proxy.add("error", methods=("GET",), status=503, code="SlowDown", after=3, times=1)
    if read == "download":
        with open(tmp_path / "out", "w+b") as f:
            assert store.download(KEY, f.fileno(), len(DATA)) == len(DATA)
            f.seek(0)
            got = f.read()
    else:
        got = b"".join(store.iter_chunks(KEY))
    assert got == DATA
    assert len(proxy.injected("truncate")) == 3 and "broke off" in logs.text


@pytest.mark.parametrize("read", ["download", "iter_chunks"])
def test_body_that_always_breaks_is_an_error_not_a_short_object(origin, tmp_path, read):
    through_proxy, direct, _, _ = origin
    direct.put_new_stream(KEY, chunks(), len(DATA))
    proxy, store = through_proxy(seed=6)
    proxy.add("truncate", methods=("GET",), key=KEY, fraction=0.3)
    with pytest.raises(OSError, match=rf"{KEY}: bytes \d+-\d+ of {len(DATA)}: the body broke off 5 times"):
        if read == "download":
            with open(tmp_path / "out", "w+b") as f:
                store.download(KEY, f.fileno(), len(DATA))
        else:
            for _ in store.iter_chunks(KEY):
                pass


def test_object_replaced_between_ranges_is_an_error(origin, tmp_path):
    """Someone overwrites the key while a download is between ranges: the later ranges are asked If-Match the
    first answer's ETag, so the download fails (ObjectChanged) instead of stitching two versions."""
    through_proxy, direct, region, bucket = origin
    direct.put_new_stream(KEY, chunks(), len(DATA))
    one_thread = Transfer(multipart_threshold=1 << 20, part_size=5 << 20, threads=1, chunk_size=1 << 18)
    proxy, store = through_proxy(seed=7, transfer=one_thread, read_timeout=5)
    real_ranged = store._ranged
    replaced = []

    def ranged(*args, **kw):  # the overwrite lands after the first answer, before any later range: no timing
        if not replaced:
            region.client().put_object(Bucket=bucket, Key=f"run/{KEY}", Body=bytes(len(DATA)))
            replaced.append(True)
        return real_ranged(*args, **kw)

    store._ranged = ranged
    with open(tmp_path / "out", "w+b") as f, pytest.raises(ObjectChanged, match=f"{KEY}: replaced while read"):
        store.download(KEY, f.fileno(), len(DATA))
    assert replaced
